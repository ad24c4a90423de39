//! A SQLite store written before migration 0010 (keys re-ordered by the key, the key index
//! dropped: a table rebuild) keeps every record through the upgrade: a stored answer still
//! replays, a retry's reservation finds it standing (so nothing is forwarded again), and the
//! operator's look-ups by key alone still find it.

use idemproxy::store::{self, codec, KeyState, Reservation, Reserved, ScopedKey};
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
use std::str::FromStr;
use std::time::Duration;

/// The last migration before the rebuild.
const BEFORE: i64 = 9;

fn id(key: &str) -> ScopedKey {
    ScopedKey::new("api", "k1:scope", key)
}

#[tokio::test]
async fn a_store_from_before_the_rebuild_keeps_its_answers() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("old.db").display());
    {
        // The schema as the previous release left it, with a completed key and an unknown one.
        let opts = SqliteConnectOptions::from_str(&url)
            .unwrap()
            .create_if_missing(true);
        let pool = SqlitePoolOptions::new().connect_with(opts).await.unwrap();
        let mut old = sqlx::migrate!("migrations/sqlite");
        old.migrations = old
            .migrations
            .iter()
            .filter(|m| m.version <= BEFORE)
            .cloned()
            .collect::<Vec<_>>()
            .into();
        old.run(&pool).await.unwrap();
        let headers = codec::encode_headers(&[("content-type".into(), "application/json".into())]);
        for (key, state, status) in [("paid", "completed", Some(201)), ("lost", "unknown", None)] {
            sqlx::query(
                "INSERT INTO idem_keys (upstream, scope, key, fingerprint, route, entities, state, \
                 lease_until, epoch, attempts, status, headers, body, created_at, updated_at, expires_at) \
                 VALUES ('api', 'k1:scope', ?1, 'fp', 'charges', '[]', ?2, 0, 3, 1, ?3, ?4, ?5, 1, 1, 9999999999999)",
            )
            .bind(key)
            .bind(state)
            .bind(status)
            .bind(status.map(|_| headers.clone()))
            .bind(status.map(|_| b"{\"id\":\"ch_1\"}".to_vec()))
            .execute(&pool)
            .await
            .unwrap();
        }
        pool.close().await;
    }

    // Opening the store applies 0010.
    let s = store::open(&url, Duration::from_secs(60), false, None)
        .await
        .unwrap()
        .store;
    let paid = s
        .get(&id("paid"))
        .await
        .unwrap()
        .expect("the record survives");
    assert_eq!(paid.state, KeyState::Completed);
    assert_eq!(paid.epoch, 3);
    let answer = paid.answer().unwrap().expect("its answer");
    assert_eq!(answer.status, 201);
    assert_eq!(&answer.body[..], b"{\"id\":\"ch_1\"}");
    assert_eq!(answer.headers.len(), 1);

    // A retry's reservation finds both records standing: neither would be forwarded again.
    for key in ["paid", "lost"] {
        let reserved = s
            .reserve(Reservation {
                id: id(key),
                fingerprint: "fp".into(),
                route: "charges".into(),
                entities: Vec::new(),
                owner: "retry".into(),
                lease: Duration::from_secs(60),
                take_unknown: false,
                call_timeout: std::time::Duration::from_secs(30),
            })
            .await
            .unwrap();
        match reserved {
            Reserved::Existing(r) => assert_eq!(r.epoch, 3, "{key}"),
            Reserved::Owned { .. } => panic!("{key}: an upgraded record was taken as new"),
        }
    }
    // Look-ups by the key alone (keys show, keys release) use the new primary key's prefix.
    assert_eq!(s.find_key("paid").await.unwrap().len(), 1);
    assert_eq!(s.release_key("lost").await.unwrap(), 1);
    let lost = s.get(&id("lost")).await.unwrap().unwrap();
    assert_eq!(lost.state, KeyState::Released);
    s.close().await;
}
