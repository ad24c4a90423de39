//! One store test suite, run against SQLite (a real file in a temp dir) and PostgreSQL (a real
//! server): reservations, fencing, outcomes, operator release, listing, leases.

mod common;

use bytes::Bytes;
use common::pg::PgServer;
use idemproxy::store::{
    self, EntityLease, Finish, KeyFilter, KeyState, Opened, Reservation, Reserved, ScopedKey,
    Store, StoredResponse, Ticket, When,
};
use std::sync::Arc;
use std::time::Duration;

fn id(key: &str) -> ScopedKey {
    ScopedKey::new("api", "s1", key)
}

fn reservation(key: &str, fp: &str, lease: Duration, take_unknown: bool) -> Reservation {
    Reservation {
        id: id(key),
        fingerprint: fp.into(),
        route: "r".into(),
        entities: vec!["customer:1".into(), "customer:2".into()],
        owner: "test-owner".into(),
        lease,
        take_unknown,
        call_timeout: std::time::Duration::from_secs(30),
    }
}

fn answer(n: u8) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![(
            "content-type".into(),
            Bytes::from_static(b"application/json"),
        )],
        body: Bytes::from(vec![b'{', n, b'}']),
    }
}

/// A ticket for `key` at `epoch`, as a reservation of it would make (the store fences on the
/// epoch: a stale one is refused like any other owner's).
fn at(key: &str, epoch: i64) -> Ticket {
    Ticket::new(&reservation(key, "fp", LONG, false), epoch, 1)
}

fn owned(r: Reserved) -> i64 {
    match r {
        Reserved::Owned(ticket) => ticket.epoch(),
        Reserved::Existing(rec) => panic!("expected to own the key, found {:?}", rec.state),
    }
}

/// The action of an owned reservation.
fn action(r: Reserved) -> i64 {
    match r {
        Reserved::Owned(ticket) => ticket.action(),
        Reserved::Existing(rec) => panic!("expected to own the key, found {:?}", rec.state),
    }
}

fn existing(r: Reserved) -> KeyState {
    match r {
        Reserved::Existing(rec) => rec.state,
        Reserved::Owned(ticket) => {
            panic!(
                "expected an existing record, got ownership (epoch {})",
                ticket.epoch()
            )
        }
    }
}

const LONG: Duration = Duration::from_secs(60);

async fn suite(s: Arc<dyn Store>) {
    let far = store::after_ms(Duration::from_secs(3600));

    // One owner per key: the second reservation sees the first.
    let e1 = owned(
        s.reserve(reservation("k1", "fp", LONG, false))
            .await
            .unwrap(),
    );
    assert_eq!(
        existing(
            s.reserve(reservation("k1", "fp", LONG, false))
                .await
                .unwrap()
        ),
        KeyState::InFlight
    );
    // Even with take_unknown: a live in-flight record is never taken over.
    assert_eq!(
        existing(
            s.reserve(reservation("k1", "fp", LONG, true))
                .await
                .unwrap()
        ),
        KeyState::InFlight
    );

    // Completing stores the answer byte for byte; a stale epoch is fenced off.
    assert!(!s
        .finish(
            &at("k1", e1 + 1),
            Finish::Unknown,
            idemproxy::store::When::Durable
        )
        .await
        .unwrap());
    assert!(s.renew(&at("k1", e1), LONG).await.unwrap());
    assert!(s
        .finish(
            &at("k1", e1),
            Finish::Completed {
                response: answer(1).into(),
                expires_at: far,
                effects: Default::default(),
            },
            idemproxy::store::When::Durable
        )
        .await
        .unwrap());
    assert!(
        !s.finish(
            &at("k1", e1),
            Finish::Unknown,
            idemproxy::store::When::Durable
        )
        .await
        .unwrap(),
        "finish twice"
    );
    assert!(
        !s.renew(&at("k1", e1), LONG).await.unwrap(),
        "renew after finish"
    );
    let rec = s.get(&id("k1")).await.unwrap().expect("k1 stored");
    assert_eq!(rec.state, KeyState::Completed);
    assert_eq!(rec.answer().expect("opens"), Some(&answer(1)));
    assert_eq!(rec.entities, vec!["customer:1", "customer:2"]);
    assert_eq!(rec.attempts, 1);
    assert_eq!(
        existing(
            s.reserve(reservation("k1", "fp", LONG, true))
                .await
                .unwrap()
        ),
        KeyState::Completed
    );

    // Released keys are forwardable again, with a new epoch.
    let e2 = owned(
        s.reserve(reservation("k2", "fp", LONG, false))
            .await
            .unwrap(),
    );
    assert!(s
        .finish(
            &at("k2", e2),
            Finish::Released,
            idemproxy::store::When::Durable
        )
        .await
        .unwrap());
    let e2b = owned(
        s.reserve(reservation("k2", "fp", LONG, false))
            .await
            .unwrap(),
    );
    assert!(e2b > e2, "a new reservation bumps the epoch");
    assert!(
        !s.finish(
            &at("k2", e2),
            Finish::Unknown,
            idemproxy::store::When::Durable
        )
        .await
        .unwrap(),
        "the old epoch is fenced"
    );
    assert_eq!(s.get(&id("k2")).await.unwrap().unwrap().attempts, 2);

    // Actions (what a stamped route stamps): a takeover of an unknown outcome continues the
    // action it took over; a reservation of a released or expired key begins a new one.
    let first = s
        .reserve(reservation("k6", "fp", LONG, false))
        .await
        .unwrap();
    let Reserved::Owned(t6) = first else {
        panic!("k6 is new")
    };
    let (e6, a6) = (t6.epoch(), t6.action());
    assert_eq!(a6, Reserved::NEW_ACTION);
    assert!(s
        .finish(
            &at("k6", e6),
            Finish::Unknown,
            idemproxy::store::When::Durable
        )
        .await
        .unwrap());
    let taken = s
        .reserve(reservation("k6", "fp", LONG, true))
        .await
        .unwrap();
    let Reserved::Owned(t6b) = taken else {
        panic!("k6 is unknown: taken over")
    };
    let (e6b, a6b) = (t6b.epoch(), t6b.action());
    assert_eq!(a6b, a6, "a takeover continues the action");
    let done = Finish::Completed {
        response: answer(6).into(),
        // Well past: PostgreSQL compares with its own clock, which this process reads to within
        // some milliseconds (a 1 ms margin failed now and then).
        expires_at: store::now_ms() - 1_000,
        effects: Default::default(),
    };
    assert!(s
        .finish(&at("k6", e6b), done, idemproxy::store::When::Durable)
        .await
        .unwrap());
    let next = action(
        s.reserve(reservation("k6", "fp", LONG, false))
            .await
            .unwrap(),
    );
    assert!(
        next != a6,
        "an expired key's next reservation is a new action"
    );
    let e6c = s.get(&id("k6")).await.unwrap().unwrap().epoch;
    assert!(s
        .finish(
            &at("k6", e6c),
            Finish::Released,
            idemproxy::store::When::Durable
        )
        .await
        .unwrap());
    let after_release = action(
        s.reserve(reservation("k6", "fp", LONG, false))
            .await
            .unwrap(),
    );
    assert!(
        after_release != next && after_release != a6,
        "a released key's next reservation is a new action"
    );

    // Unknown outcomes: only taken over with take_unknown (native idempotency upstreams).
    let e3 = owned(
        s.reserve(reservation("k3", "fp", LONG, false))
            .await
            .unwrap(),
    );
    assert!(s
        .finish(
            &at("k3", e3),
            Finish::Unknown,
            idemproxy::store::When::Durable
        )
        .await
        .unwrap());
    assert_eq!(
        existing(
            s.reserve(reservation("k3", "fp", LONG, false))
                .await
                .unwrap()
        ),
        KeyState::Unknown
    );
    owned(
        s.reserve(reservation("k3", "fp", LONG, true))
            .await
            .unwrap(),
    );

    // An abandoned in-flight record (lease ran out) reads as unknown, and is not retaken
    // without take_unknown. The lease is zero: it is over as soon as it is written.
    let e4 = owned(
        s.reserve(reservation("k4", "fp", Duration::ZERO, false))
            .await
            .unwrap(),
    );
    let rec = s.get(&id("k4")).await.unwrap().unwrap();
    assert_eq!(rec.effective_state(store::now_ms() + 1), KeyState::Unknown);
    assert_eq!(
        rec.call_ms,
        Some(30_000),
        "the timeout its call was sent under, for a retry to wait by"
    );
    let unknown = s
        .list_keys(&KeyFilter {
            state: Some(KeyState::Unknown),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(
        unknown.iter().any(|r| r.id.key == "k4"),
        "an abandoned in-flight key lists as unknown"
    );
    assert_eq!(
        existing(
            s.reserve(reservation("k4", "fp", LONG, false))
                .await
                .unwrap()
        ),
        KeyState::InFlight
    );
    let e4b = owned(
        s.reserve(reservation("k4", "fp", LONG, true))
            .await
            .unwrap(),
    );
    assert!(e4b > e4);

    // Operator release: unknown → released; live in-flight records are left alone.
    assert_eq!(
        s.release_key("k4").await.unwrap(),
        0,
        "k4 is live in flight"
    );
    let e5 = owned(
        s.reserve(reservation("k5", "fp", LONG, false))
            .await
            .unwrap(),
    );
    assert!(s
        .finish(
            &at("k5", e5),
            Finish::Unknown,
            idemproxy::store::When::Durable
        )
        .await
        .unwrap());
    assert_eq!(s.release_key("k5").await.unwrap(), 1);
    assert_eq!(
        s.get(&id("k5")).await.unwrap().unwrap().state,
        KeyState::Released
    );
    owned(
        s.reserve(reservation("k5", "fp", LONG, false))
            .await
            .unwrap(),
    );

    // Scopes are separate records of one key.
    let mut other = reservation("k1", "fp", LONG, false);
    other.id = other.id.with_scope("s2");
    owned(s.reserve(other).await.unwrap());
    assert_eq!(s.find_key("k1").await.unwrap().len(), 2);

    // Listing by state and entity.
    let completed = s
        .list_keys(&KeyFilter {
            state: Some(KeyState::Completed),
            entity: Some("customer:2".into()),
            limit: 10,
            ..KeyFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(
        completed
            .iter()
            .map(|r| r.id.key.as_str())
            .collect::<Vec<_>>(),
        vec!["k1"]
    );
    let none = s
        .list_keys(&KeyFilter {
            entity: Some("customer:9".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(none.is_empty());

    // An operator settles one record, at the epoch they saw, only while its outcome is unknown:
    // never one a retry took over, never an answer stored meanwhile.
    let e = owned(
        s.reserve(reservation("op-1", "fp", LONG, false))
            .await
            .unwrap(),
    );
    let live = || Finish::Completed {
        response: Arc::new(answer(7)),
        expires_at: far,
        effects: Default::default(),
    };
    assert!(
        !s.settle_record(&id("op-1"), e, Finish::Released)
            .await
            .unwrap(),
        "in flight with a live lease"
    );
    assert!(s
        .finish(&at("op-1", e), Finish::Unknown, When::Durable)
        .await
        .unwrap());
    assert!(
        !s.settle_record(&id("op-1"), e + 1, Finish::Released)
            .await
            .unwrap(),
        "another epoch"
    );
    assert!(s.settle_record(&id("op-1"), e, live()).await.unwrap());
    assert!(
        !s.settle_record(&id("op-1"), e, Finish::Released)
            .await
            .unwrap(),
        "completed meanwhile"
    );
    assert!(
        !s.settle_record(&id("op-1"), e, live()).await.unwrap(),
        "settled already"
    );
    let e = owned(
        s.reserve(reservation("op-2", "fp", LONG, false))
            .await
            .unwrap(),
    );
    assert!(s
        .finish(&at("op-2", e), Finish::Unknown, When::Durable)
        .await
        .unwrap());
    assert!(s
        .settle_record(&id("op-2"), e, Finish::Released)
        .await
        .unwrap());
    let rec = s.get(&id("op-2")).await.unwrap().unwrap();
    assert_eq!(rec.state, KeyState::Released);
    let rec = s.get(&id("op-1")).await.unwrap().unwrap();
    assert_eq!(
        rec.answer().unwrap().map(|a| a.body.clone()),
        Some(answer(7).body),
        "the operator's answer stands"
    );
    s.ping().await.unwrap();
    s.close().await;
}

/// The store's entity leases, when it has them (none on SQLite: one process orders it all).
async fn lease(
    o: &Opened,
    ents: &[String],
    owner: &str,
    lease: Duration,
    timeout: Duration,
) -> store::StoreResult<Option<Vec<EntityLease>>> {
    match &o.shared {
        Some(shared) => shared.lock_entities(ents, owner, lease, timeout).await,
        None => Ok(Some(Vec::new())),
    }
}

async fn unlease(o: &Opened, held: &[EntityLease], owner: &str) -> store::StoreResult<()> {
    match &o.shared {
        Some(shared) => shared.unlock_entities(held, owner).await,
        None => Ok(()),
    }
}

/// Versions, claims, the audit trail and retention: effects stand only with a stored 2xx answer
/// and (across replicas) a held lease.
async fn ordered_suite(o: Opened) {
    let s = o.store.clone();
    use idemproxy::store::{AuditRow, Effects};
    let ents = vec!["slot:1".to_string()];
    let leases = lease(&o, &ents, "test-owner", LONG, Duration::ZERO)
        .await
        .unwrap()
        .expect("free");
    let e = owned(
        s.reserve(reservation("b1", "fp", LONG, false))
            .await
            .unwrap(),
    );
    let effects = Effects {
        entities: ents.clone(),
        version: Some(7),
        claim_until: Some(store::after_ms(LONG)),
        release_claim: false,
        leases: leases.clone(),
        owner: "test-owner".into(),
    };
    let far = store::after_ms(LONG);
    assert!(s
        .finish(
            &at("b1", e),
            Finish::Completed {
                response: answer(1).into(),
                expires_at: far,
                effects
            },
            idemproxy::store::When::Durable
        )
        .await
        .unwrap());
    unlease(&o, &leases, "test-owner").await.unwrap();
    let st = s.entity_states(&ents).await.unwrap();
    assert_eq!(st.len(), 1);
    assert_eq!(st[0].version, Some(7));
    assert_eq!(
        st[0].claim.as_ref().map(|c| c.owner.key.as_str()),
        Some("b1")
    );
    assert!(s
        .entity_states(&["slot:none".to_string()])
        .await
        .unwrap()
        .is_empty());

    // A stale holder (its epoch fenced off) cannot lower the version or change the claim.
    let leases = lease(&o, &ents, "test-owner", LONG, Duration::ZERO)
        .await
        .unwrap()
        .unwrap();
    let e2 = owned(
        s.reserve(reservation("b2", "fp", LONG, false))
            .await
            .unwrap(),
    );
    let stale = Effects {
        entities: ents.clone(),
        version: Some(3),
        leases: leases.clone(),
        owner: "test-owner".into(),
        ..Default::default()
    };
    assert!(s
        .finish(
            &at("b2", e2),
            Finish::Completed {
                response: answer(2).into(),
                expires_at: far,
                effects: stale
            },
            idemproxy::store::When::Durable
        )
        .await
        .unwrap());
    assert_eq!(
        s.entity_states(&ents).await.unwrap()[0].version,
        Some(7),
        "versions only grow"
    );
    let release = Effects {
        entities: ents.clone(),
        release_claim: true,
        leases: leases.clone(),
        owner: "test-owner".into(),
        ..Default::default()
    };
    let e3 = owned(
        s.reserve(reservation("b3", "fp", LONG, false))
            .await
            .unwrap(),
    );
    assert!(s
        .finish(
            &at("b3", e3),
            Finish::Completed {
                response: answer(3).into(),
                expires_at: far,
                effects: release
            },
            idemproxy::store::When::Durable
        )
        .await
        .unwrap());
    unlease(&o, &leases, "test-owner").await.unwrap();
    assert!(s.entity_states(&ents).await.unwrap()[0].claim.is_none());
    assert!(
        !s.release_claim("slot:1").await.unwrap(),
        "nothing left to release"
    );

    // Audit rows by entity and by key; purge removes the expired ones only.
    let row = |key: &str, decision: &str, expires_at: i64| AuditRow {
        at: store::now_ms(),
        upstream: "api".into(),
        route: "r".into(),
        entities: ents.clone(),
        key: Some(key.into()),
        fingerprint: Some("fp".into()),
        decision: decision.into(),
        upstream_status: Some(201),
        total_ms: 3,
        lock_wait_ms: 1,
        upstream_ms: Some(2),
        expires_at,
        requests: 1,
        scope: None,
        workflow: None,
        note: None,
    };
    s.append_audit(vec![
        row("b1", "forwarded", far),
        row("b1", "replayed", far),
        row("old", "forwarded", 1),
    ])
    .await
    .unwrap();
    let hist = s.audit_for_entity("slot:1", 10).await.unwrap();
    assert_eq!(hist.len(), 3);
    assert_eq!(hist[0].decision, "forwarded", "newest first");
    assert_eq!(s.audit_for_key("b1", 10).await.unwrap().len(), 2);
    let expired = owned(
        s.reserve(reservation("gone", "fp", LONG, false))
            .await
            .unwrap(),
    );
    assert!(s
        .finish(
            &at("gone", expired),
            Finish::Completed {
                response: answer(4).into(),
                expires_at: 1,
                effects: Default::default()
            },
            idemproxy::store::When::Durable
        )
        .await
        .unwrap());
    // An entity whose only state is a lapsed claim: the purge clears the claim, then the row.
    let lapsed = vec!["slot:lapsed".to_string()];
    let held = lease(&o, &lapsed, "test-owner", LONG, Duration::ZERO)
        .await
        .unwrap()
        .expect("free");
    let e = owned(
        s.reserve(reservation("lapsing", "fp", LONG, false))
            .await
            .unwrap(),
    );
    let claim = Effects {
        entities: lapsed.clone(),
        claim_until: Some(1),
        leases: held.clone(),
        owner: "test-owner".into(),
        ..Default::default()
    };
    let done = Finish::Completed {
        response: answer(5).into(),
        expires_at: far,
        effects: claim,
    };
    assert!(s
        .finish(&at("lapsing", e), done, idemproxy::store::When::Durable)
        .await
        .unwrap());
    unlease(&o, &held, "test-owner").await.unwrap();
    assert_eq!(s.find_entities("slot:lapsed").await.unwrap().len(), 1);
    assert!(s.purge(500, 0).await.unwrap() >= 2);
    assert!(
        s.find_entities("slot:lapsed").await.unwrap().is_empty(),
        "a lapsed claim is cleared, and the empty entity row goes"
    );
    assert!(
        s.get(&id("gone")).await.unwrap().is_none(),
        "expired completed key purged"
    );
    assert!(s.get(&id("b1")).await.unwrap().is_some(), "live key kept");
    assert_eq!(
        s.audit_for_entity("slot:1", 10).await.unwrap().len(),
        2,
        "expired audit row purged"
    );
    assert_eq!(
        s.entity_states(&ents).await.unwrap()[0].version,
        Some(7),
        "versions are state, never purged"
    );
    s.close().await;
}

#[tokio::test]
async fn sqlite_store_passes_the_ordered_suite() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("o.db").display());
    ordered_suite(store::open(&url, LONG, false, None).await.unwrap()).await;
}

#[tokio::test]
async fn postgres_store_passes_the_ordered_suite() {
    let Some(pg) = PgServer::start().await else {
        return;
    };
    ordered_suite(store::open(&pg.url, LONG, false, None).await.unwrap()).await;
}

#[tokio::test]
async fn sqlite_store_passes_the_suite() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("s.db").display());
    let s = store::open(&url, LONG, false, None).await.unwrap().store;
    suite(s).await;
}

#[tokio::test]
async fn postgres_store_passes_the_suite() {
    let Some(pg) = PgServer::start().await else {
        return;
    };
    let s = store::open(&pg.url, LONG, false, None).await.unwrap().store;
    suite(s).await;
}

/// The store's keys, sealing every stored answer (see `tests/encryption.rs` for what lands on
/// disk): the suite must pass unchanged.
fn cipher() -> store::SharedCipher {
    Some(Arc::new(store::seal::Cipher::new([9; 32], &[])))
}

#[tokio::test]
async fn sqlite_store_passes_the_suite_encrypted() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("s.db").display());
    suite(
        store::open(&url, LONG, false, cipher())
            .await
            .unwrap()
            .store,
    )
    .await;
}

#[tokio::test]
async fn postgres_store_passes_the_suite_encrypted() {
    let Some(pg) = PgServer::start().await else {
        return;
    };
    suite(
        store::open(&pg.url, LONG, false, cipher())
            .await
            .unwrap()
            .store,
    )
    .await;
}

#[tokio::test]
async fn postgres_store_passes_the_ordered_suite_encrypted() {
    // Answers with entity effects go through their own transaction on PostgreSQL.
    let Some(pg) = PgServer::start().await else {
        return;
    };
    ordered_suite(store::open(&pg.url, LONG, false, cipher()).await.unwrap()).await;
}

/// Entity leases across two store handles (two replicas): one holder at a time, the waiter
/// woken by the release without polling, an abandoned lease free after it expires, and the
/// fencing epoch keeps a stale holder from releasing the new holder's lease.
/// A replica's entity leases on the server at `url`.
async fn shared(url: &str) -> Arc<dyn idemproxy::store::Shared> {
    let opened = store::open(url, LONG, false, None).await.unwrap();
    opened.shared.expect("postgres shares its leases")
}

#[tokio::test]
async fn postgres_entity_leases_exclude_and_expire() {
    let Some(pg) = PgServer::start().await else {
        return;
    };
    let a = shared(&pg.url).await;
    let b = shared(&pg.url).await;
    let ents = vec!["slot:1".to_string()];
    let held = a
        .lock_entities(&ents, "A", LONG, Duration::ZERO)
        .await
        .unwrap()
        .expect("A takes it");
    assert!(
        b.lock_entities(&ents, "B", LONG, Duration::ZERO)
            .await
            .unwrap()
            .is_none(),
        "B must not"
    );

    // B waits; A's release wakes it. A releases only once B has marked the lease watched — B
    // is then waiting, until the lease or its own timeout runs out (60 s), so only the NOTIFY
    // that the mark asks for wakes it within the liveness bound below.
    let waiter = {
        let (b, ents) = (b.clone(), ents.clone());
        tokio::spawn(async move { b.lock_entities(&ents, "B", LONG, LONG).await })
    };
    pg.until("SELECT watched FROM idem_entity_leases WHERE entity = 'slot:1'")
        .await;
    a.unlock_entities(&held, "A").await.unwrap();
    let b_held = tokio::time::timeout(Duration::from_secs(20), waiter)
        .await
        .expect("B was not woken by A's release")
        .unwrap()
        .unwrap()
        .expect("B takes it after A's release");
    assert!(b_held[0].epoch > held[0].epoch);

    // A stale release (A's old epoch) does not free B's lease.
    a.unlock_entities(&held, "A").await.unwrap();
    assert!(a
        .lock_entities(&ents, "A", LONG, Duration::ZERO)
        .await
        .unwrap()
        .is_none());
    assert_eq!(
        a.renew_entities(&held, "A", LONG).await.unwrap(),
        vec!["slot:1".to_string()],
        "A's lease is lost"
    );
    assert!(b
        .renew_entities(&b_held, "B", LONG)
        .await
        .unwrap()
        .is_empty());
    b.unlock_entities(&b_held, "B").await.unwrap();

    // A holder that stops renewing (a killed replica) loses the lease after it runs out.
    let short = a
        .lock_entities(&ents, "A", Duration::from_millis(300), Duration::ZERO)
        .await
        .unwrap()
        .unwrap();
    let taken = b
        .lock_entities(&ents, "B", LONG, Duration::from_secs(20))
        .await
        .unwrap();
    assert!(taken.is_some_and(|t| t[0].epoch > short[0].epoch));
}

/// The purge leaves alone a lease that is being taken: it picks its rows `FOR UPDATE SKIP
/// LOCKED`, so one a request has locked is skipped, and one picked is re-checked under its
/// lock. The old statement picked the free lease, waited for the taker's lock, and then deleted
/// the lease under its new holder.
#[tokio::test]
async fn postgres_purge_never_deletes_a_lease_being_taken() {
    use sqlx::Connection;
    let Some(pg) = PgServer::start().await else {
        return;
    };
    let o = store::open(&pg.url, LONG, false, None).await.unwrap();
    let (s, leases) = (o.store.clone(), o.shared.clone().expect("postgres leases"));
    let ents = vec!["slot:p".to_string()];
    let held = leases
        .lock_entities(&ents, "A", LONG, Duration::ZERO)
        .await
        .unwrap()
        .unwrap();
    // Released: free, and past its lease — what the purge deletes.
    leases.unlock_entities(&held, "A").await.unwrap();
    // Another replica takes it; its transaction is still open.
    let mut taker = sqlx::PgConnection::connect(&pg.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut taker).await.unwrap();
    sqlx::query(
        "UPDATE idem_entity_leases SET owner = 'B', epoch = epoch + 1, \
         lease_until = 9000000000000000 WHERE entity = 'slot:p'",
    )
    .execute(&mut taker)
    .await
    .unwrap();
    let purge = {
        let s = s.clone();
        tokio::spawn(async move { s.purge(500, 0).await })
    };
    // The purge ends without waiting, or waits for the taker's lock: then the taker commits.
    let db = &sqlx::PgPool::connect(&pg.url).await.unwrap();
    let purge_ref = &purge;
    common::eventually(move || async move {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'",
        )
        .fetch_one(db)
        .await
        .map_err(|e| e.to_string())?;
        if purge_ref.is_finished() || waiting > 0 {
            Ok(())
        } else {
            Err("the purge neither ended nor waited for the taker's lock".into())
        }
    })
    .await;
    sqlx::query("COMMIT").execute(&mut taker).await.unwrap();
    purge.await.unwrap().unwrap();
    let owner: Option<Option<String>> =
        sqlx::query_scalar("SELECT owner FROM idem_entity_leases WHERE entity = 'slot:p'")
            .fetch_optional(db)
            .await
            .unwrap();
    assert_eq!(
        owner.flatten().as_deref(),
        Some("B"),
        "the lease taken meanwhile keeps its row and its holder"
    );
}

/// Lease statements of many requests at once, on two replicas, over overlapping entities (each
/// request three of six, taken in order): an entity has one holder at a time, and no statement
/// fails — two attempts at one entity in one batch (one insert may not touch a row twice) are
/// told apart, and one wins. (That batches of two replicas cannot deadlock, each waiting for
/// rows the other locked, holds by construction: every statement that locks several lease rows
/// locks them in the entity's order. The window is too short for a test to hit at will.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_lease_batches_of_two_replicas_keep_one_holder_and_never_fail() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let Some(pg) = PgServer::start().await else {
        return;
    };
    let a = shared(&pg.url).await;
    let b = shared(&pg.url).await;
    let holders: Arc<Vec<AtomicUsize>> = Arc::new((0..6).map(|_| AtomicUsize::new(0)).collect());
    let mut tasks = Vec::new();
    for i in 0..48usize {
        let store = if i % 2 == 0 { a.clone() } else { b.clone() };
        let holders = holders.clone();
        tasks.push(tokio::spawn(async move {
            let mut picked: Vec<usize> = vec![i % 6, (i / 2 + 1) % 6, (i / 3 + 4) % 6];
            picked.sort();
            picked.dedup();
            let ents: Vec<String> = picked.iter().map(|e| format!("ent:{e}")).collect();
            let owner = format!("owner-{i}");
            for _ in 0..5 {
                let held = store
                    .lock_entities(&ents, &owner, LONG, Duration::from_secs(60))
                    .await
                    .expect("no lease statement fails")
                    .expect("every entity is taken in time");
                for &e in &picked {
                    assert_eq!(holders[e].fetch_add(1, Ordering::SeqCst), 0, "two holders");
                }
                tokio::task::yield_now().await;
                for &e in &picked {
                    holders[e].fetch_sub(1, Ordering::SeqCst);
                }
                store.unlock_entities(&held, &owner).await.unwrap();
            }
        }));
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(120), t)
            .await
            .expect("every request finishes")
            .unwrap();
    }
}

/// Concurrent writes share batches (one statement per kind per batch on SQLite): every key is
/// reserved once, a key asked for five times at once has one owner, and stale epochs stay
/// fenced off within a batch.
async fn concurrent_suite(s: Arc<dyn Store>) {
    let mut tasks = Vec::new();
    for i in 0..100 {
        let s = s.clone();
        let key = if i < 5 {
            "same".to_string()
        } else {
            format!("k{i}")
        };
        tasks.push(tokio::spawn(async move {
            (
                key.clone(),
                s.reserve(reservation(&key, "fp", LONG, false))
                    .await
                    .unwrap(),
            )
        }));
    }
    let mut owned_same = 0;
    let mut epochs = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            (k, Reserved::Owned(ticket)) => {
                owned_same += usize::from(k == "same");
                epochs.push((k, ticket.epoch()));
            }
            (k, Reserved::Existing(rec)) => {
                assert_eq!(k, "same");
                assert_eq!(rec.state, KeyState::InFlight);
            }
        }
    }
    assert_eq!(owned_same, 1, "one owner for a key asked for at once");
    assert_eq!(epochs.len(), 96);
    let far = store::after_ms(LONG);
    let mut tasks = Vec::new();
    for (i, (k, epoch)) in epochs.into_iter().enumerate() {
        let s = s.clone();
        // Every third one uses a stale epoch: it must be fenced off.
        let stale = i % 3 == 0;
        tasks.push(tokio::spawn(async move {
            let e = if stale { epoch + 7 } else { epoch };
            let done = Finish::Completed {
                response: answer(1).into(),
                expires_at: far,
                effects: Default::default(),
            };
            let stored = s
                .finish(&at(&k, e), done, idemproxy::store::When::Durable)
                .await
                .unwrap();
            (k, stale, stored)
        }));
    }
    for t in tasks {
        let (k, stale, stored) = t.await.unwrap();
        assert_eq!(stored, !stale, "{k}");
        let state = s.get(&id(&k)).await.unwrap().unwrap().state;
        assert_eq!(
            state,
            if stale {
                KeyState::InFlight
            } else {
                KeyState::Completed
            },
            "{k}"
        );
    }
    s.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_store_batches_concurrent_writes() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("c.db").display());
    concurrent_suite(store::open(&url, LONG, false, None).await.unwrap().store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_store_handles_concurrent_writes() {
    let Some(pg) = PgServer::start().await else {
        return;
    };
    concurrent_suite(store::open(&pg.url, LONG, false, None).await.unwrap().store).await;
}

/// An outcome and its entity effects are one: when an effect's statement fails (here a trigger
/// makes it), the outcome's row is rolled back with it, so the key is not left completed
/// without its version while its caller is told the answer was not stored. The batch's other
/// jobs are not affected (fails when the effects run outside a savepoint of their own: checked).
#[tokio::test]
async fn sqlite_applies_an_outcome_with_its_effects_whole_or_not_at_all() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("w.db");
    let s = store::open(&format!("sqlite://{}", db.display()), LONG, false, None)
        .await
        .unwrap()
        .store;
    let e = owned(
        s.reserve(reservation("fx", "fp", LONG, false))
            .await
            .unwrap(),
    );
    let other = owned(
        s.reserve(reservation("ok", "fp", LONG, false))
            .await
            .unwrap(),
    );
    let sabotage = rusqlite::Connection::open(&db).unwrap();
    sabotage
        .execute_batch(
            "CREATE TRIGGER no_versions BEFORE INSERT ON idem_entities \
             BEGIN SELECT RAISE(ABORT, 'injected: the entity table refuses writes'); END;",
        )
        .unwrap();
    let effects = store::Effects {
        entities: vec!["customer:1".into()],
        version: Some(5),
        ..Default::default()
    };
    let with_effects = Finish::Completed {
        response: answer(1).into(),
        expires_at: store::after_ms(LONG),
        effects,
    };
    let plain = Finish::Completed {
        response: answer(2).into(),
        expires_at: store::after_ms(LONG),
        effects: Default::default(),
    };
    let (fx, ok) = (at("fx", e), at("ok", other));
    let (failed, fine) = tokio::join!(
        s.finish(&fx, with_effects, idemproxy::store::When::Durable),
        s.finish(&ok, plain, idemproxy::store::When::Durable)
    );
    assert!(failed.is_err(), "the effect failed: {failed:?}");
    assert!(fine.unwrap(), "the other outcome in the batch stands");
    let rec = s.get(&id("fx")).await.unwrap().unwrap();
    assert_eq!(
        rec.state,
        KeyState::InFlight,
        "not completed without its version"
    );
    let states = s.entity_states(&["customer:1".to_string()]).await.unwrap();
    assert_eq!(states.first().and_then(|e| e.version), None);
    assert_eq!(
        s.get(&id("ok")).await.unwrap().unwrap().state,
        KeyState::Completed
    );
    s.close().await;
}

/// The syncer makes durable the WAL SQLite writes: with the configured path a symlink and a
/// stale `-wal` beside the link, it syncs the one beside the link's target (SQLite's), never
/// the stale one (fails when the syncer opens `<configured path>-wal`: checked).
#[cfg(target_os = "linux")]
#[tokio::test]
async fn sqlite_syncs_the_wal_beside_a_symlinked_database_target() {
    let dir = tempfile::tempdir().unwrap();
    let real = dir.path().join("real");
    std::fs::create_dir(&real).unwrap();
    let link = dir.path().join("link.db");
    std::os::unix::fs::symlink(real.join("store.db"), &link).unwrap();
    let stale = dir.path().join("link.db-wal");
    std::fs::write(&stale, b"stale").unwrap();
    let s = store::open(&format!("sqlite://{}", link.display()), LONG, false, None)
        .await
        .unwrap()
        .store;
    owned(
        s.reserve(reservation("k", "fp", LONG, false))
            .await
            .unwrap(),
    );
    let open: Vec<std::path::PathBuf> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .collect();
    assert!(
        !open.contains(&stale),
        "the stale WAL beside the link is open: {open:?}"
    );
    let wal = real.join("store.db-wal");
    assert!(open.contains(&wal), "SQLite's WAL is not open: {open:?}");
    s.close().await;
}

/// An account's rate-limit budget claimed by two replicas: together they are granted no more
/// than the limit in the window, and a claim with no room says how long until one fits.
#[tokio::test]
async fn postgres_replicas_share_a_rate_limit_budget() {
    let Some(pg) = PgServer::start().await else {
        return;
    };
    let (a, b) = (shared(&pg.url).await, shared(&pg.url).await);
    let window = Duration::from_secs(60);
    let claim_of = |scope, want| idemproxy::store::SendClaim {
        upstream: "api",
        scope,
        want,
        limit: 3,
        window,
    };
    let claim = |s: &Arc<dyn idemproxy::store::Shared>, want| {
        let s = s.clone();
        async move { s.claim_sends(claim_of("k1:s", want)).await.unwrap() }
    };
    assert_eq!(claim(&a, 2).await.0, 2);
    assert_eq!(claim(&b, 2).await.0, 1, "one left for the other replica");
    let (none, wait) = claim(&a, 1).await;
    assert_eq!(none, 0);
    assert!(wait > Duration::from_secs(50) && wait <= window, "{wait:?}");
    // Another account has its own budget.
    let other = b.claim_sends(claim_of("k1:t", 3)).await.unwrap();
    assert_eq!(other.0, 3);
}
