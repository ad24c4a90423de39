//! The store's credential-scoped surface, run against SQLite and PostgreSQL alike: entities
//! scoped by credential (operators address them by bare name), the scope secret's id, unkeyed
//! scopes of records stored before scopes were keyed, and the replay cache a serving process
//! keeps beside its store.

mod common;

use bytes::Bytes;
use common::pg::PgServer;
use idemproxy::store::replay::ReplayCache;
use idemproxy::store::{
    self, Effects, Finish, Opened, Reservation, Reserved, ScopedKey, StoredResponse, Ticket,
};
use std::sync::Arc;
use std::time::Duration;

const LONG: Duration = Duration::from_secs(60);

fn id(scope: &str, key: &str) -> ScopedKey {
    ScopedKey::new("api", scope, key)
}

/// Reserves and completes `key` under `scope`, setting `version` on `entities` (under the
/// store's entity leases, when it has them): the ticket and the outcome stored.
async fn write(
    o: &Opened,
    scope: &str,
    key: &str,
    entities: &[&str],
    version: i64,
) -> (Ticket, Finish) {
    let s = &o.store;
    let entities: Vec<String> = entities.iter().map(|e| e.to_string()).collect();
    let leases = match &o.shared {
        Some(shared) => shared
            .lock_entities(&entities, "owner", LONG, Duration::ZERO)
            .await
            .expect("lock")
            .expect("free"),
        None => Vec::new(),
    };
    let reserved = s
        .reserve(Reservation {
            id: id(scope, key),
            fingerprint: "fp".into(),
            route: "r".into(),
            entities: entities.clone(),
            owner: "owner".into(),
            lease: LONG,
            take_unknown: false,
            call_timeout: std::time::Duration::from_secs(30),
        })
        .await
        .expect("reserve");
    let Reserved::Owned(ticket) = reserved else {
        panic!("fresh key {key}")
    };
    let response = StoredResponse {
        status: 200,
        headers: vec![],
        body: Bytes::from_static(b"{}"),
    };
    let effects = Effects {
        entities,
        version: Some(version),
        claim_until: Some(store::after_ms(LONG)),
        release_claim: false,
        leases: leases.clone(),
        owner: "owner".into(),
    };
    let done = Finish::Completed {
        response: Arc::new(response),
        expires_at: store::after_ms(LONG),
        effects,
    };
    let stored = s
        .finish(&ticket, done.clone(), idemproxy::store::When::Durable)
        .await;
    assert!(matches!(stored, Ok(true)), "finish: {stored:?}");
    if let Some(shared) = &o.shared {
        shared
            .unlock_entities(&leases, "owner")
            .await
            .expect("unlock");
    }
    (ticket, done)
}

async fn scoped_suite(o: Opened) {
    let s = o.store.clone();
    // Two tenants' contact 42, and another contact whose name starts the same way.
    write(&o, "k1:a", "a1", &["contact:42@aaaaaaaaaaaaaaaa"], 9).await;
    write(&o, "k1:b", "b1", &["contact:42@bbbbbbbbbbbbbbbb"], 2).await;
    write(&o, "k1:c", "c1", &["contact:420@cccccccccccccccc"], 5).await;
    // A shared entity whose own name has an `@` is not a scope of `contact:42`.
    write(&o, "k1:d", "d1", &["contact:42@example.com"], 3).await;
    let found = s.find_entities("contact:42").await.expect("find");
    let mut names: Vec<&str> = found.iter().map(|e| e.entity.as_str()).collect();
    names.sort();
    assert_eq!(
        names,
        ["contact:42@aaaaaaaaaaaaaaaa", "contact:42@bbbbbbbbbbbbbbbb"],
        "a bare name finds its scopes, not contact:420"
    );
    let one = s
        .find_entities("contact:42@bbbbbbbbbbbbbbbb")
        .await
        .expect("find");
    assert_eq!(one.len(), 1);
    assert_eq!(one[0].version, Some(2));
    let history = s.audit_for_entity("contact:42", 10).await.expect("audit");
    assert!(history.is_empty(), "no audit rows were written here");
    assert!(s.release_claim("contact:42").await.expect("release"));
    assert_eq!(s.reset_version("contact:42").await.expect("reset"), 2);
    let after = s.find_entities("contact:42").await.expect("find");
    assert!(after
        .iter()
        .all(|e| e.version.is_none() && e.claim.is_none()));
    let other = s.find_entities("contact:420").await.expect("find");
    assert_eq!(other[0].version, Some(5), "another entity is untouched");
    let mail = s
        .find_entities("contact:42@example.com")
        .await
        .expect("find");
    assert_eq!(
        mail[0].version,
        Some(3),
        "nor one whose name merely starts the same"
    );

    // The scope secret's id: the first one recorded stays; unkeyed (first-release) scopes
    // are noticed.
    let first = s.scope_secret("id-one").await.expect("secret");
    assert_eq!(first.recorded, "id-one");
    assert!(!first.legacy_keys, "every key so far has a k1: scope");
    write(&o, "0123abcd", "legacy", &["x:1"], 1).await;
    let again = s.scope_secret("id-two").await.expect("secret");
    assert_eq!(
        again.recorded, "id-one",
        "another secret does not replace the first"
    );
    assert!(again.legacy_keys);
    s.close().await;
}

/// A serving process keeps completed answers beside its store: a completed write or read
/// fills the cache, a release forgets the key, and a released record read again stays out.
async fn cache_suite(o: Opened) {
    let replay = ReplayCache::beside(o.store.as_ref());
    let s = o.store.clone();
    let key = id("k1:a", "cached-1");
    assert!(replay.hit(&key).is_none());
    let (ticket, done) = write(&o, "k1:a", "cached-1", &[], 1).await;
    replay.finished(&ticket, &done, None, &Ok(true));
    let hit = replay.hit(&key).expect("stored answers are cached");
    assert_eq!(hit.fingerprint, "fp");
    assert_eq!(s.release_key("cached-1").await.expect("release"), 1);
    replay.forget(Some("cached-1"));
    assert!(replay.hit(&key).is_none(), "a release forgets the key");
    let read = s.get(&key).await.expect("get").expect("a record");
    replay.saw(&read);
    assert!(
        replay.hit(&key).is_none(),
        "a released record is not cached again"
    );
    // A completed record read by another process's request path is cached as it is read.
    let other = id("k1:a", "cached-2");
    write(&o, "k1:a", "cached-2", &[], 1).await;
    assert!(replay.hit(&other).is_none());
    replay.saw(&s.get(&other).await.expect("get").expect("a record"));
    assert!(replay.hit(&other).is_some(), "a completed read is cached");
    s.close().await;
}

#[tokio::test]
async fn sqlite_scoped_entities_and_scope_secret() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("e.db").display());
    scoped_suite(store::open(&url, LONG, false, None).await.expect("open")).await;
}

#[tokio::test]
async fn postgres_scoped_entities_and_scope_secret() {
    let Some(pg) = PgServer::start().await else {
        return;
    };
    scoped_suite(store::open(&pg.url, LONG, false, None).await.expect("open")).await;
}

#[tokio::test]
async fn sqlite_serving_store_caches_replays() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("c.db").display());
    cache_suite(store::open(&url, LONG, true, None).await.expect("open")).await;
}

#[tokio::test]
async fn postgres_serving_store_caches_replays() {
    let Some(pg) = PgServer::start().await else {
        return;
    };
    cache_suite(store::open(&pg.url, LONG, true, None).await.expect("open")).await;
}
