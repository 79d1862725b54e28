//! G7 (docs/DESIGN.md): bad input and storage faults get a clear, typed error and
//! change nothing; delivery works again once the cause is gone.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use postroom::{handler_fn, Error, Message, Outcome, Postroom, MAX_ID_BYTES, MAX_NAME_BYTES};

fn counting_room(path: &std::path::Path) -> (Postroom, Arc<AtomicU32>) {
    let calls = Arc::new(AtomicU32::new(0));
    let c = Arc::clone(&calls);
    let room = Postroom::builder()
        .workers(0)
        .consumer(
            "c",
            handler_fn(move |tx, msg| {
                c.fetch_add(1, Ordering::SeqCst);
                apply(tx, msg)
            }),
        )
        .open(path)
        .unwrap();
    create_domain(&room);
    (room, calls)
}

/// Everything postroom stores, as one comparable value.
fn snapshot(conn: &rusqlite::Connection) -> (i64, i64, i64, i64) {
    (
        count(conn, "SELECT count(*) FROM postroom_inbox"),
        count(conn, "SELECT count(*) FROM postroom_outbox"),
        count(conn, "SELECT count(*) FROM postroom_conflicts"),
        count(conn, "SELECT count(*) FROM applied"),
    )
}

#[test]
fn invalid_messages_are_refused_before_anything_is_stored() {
    let dir = tempfile::tempdir().unwrap();
    let (room, calls) = counting_room(&dir.path().join("app.db"));
    let conn = raw(room.path());
    room.deliver("c", Message::new("b", "good", "x")).unwrap();
    let before = snapshot(&conn);

    let cases: Vec<(Message, &str)> = vec![
        (Message::new("b", "", "x"), "message id"),
        (
            Message::new("b", "i".repeat(MAX_ID_BYTES + 1), "x"),
            "message id",
        ),
        (Message::new("b", "nul\0id", "x"), "message id"),
        (Message::new("", "id", "x"), "source"),
        (
            Message::new("s".repeat(MAX_NAME_BYTES + 1), "id", "x"),
            "source",
        ),
        (Message::new("line\nbreak", "id", "x"), "source"),
        (
            Message::new("b", "id", vec![0u8; 1024 * 1024 + 1]),
            "payload",
        ),
        (Message::new("b", "id", "x").with_header("", "v"), "headers"),
        (
            Message::new("b", "id", "x").with_header("h", "v".repeat(17 * 1024)),
            "headers",
        ),
        (
            Message::new("b", "id", "x").with_ordering_key(""),
            "ordering key",
        ),
    ];
    for (msg, expected_field) in cases {
        match room.deliver("c", msg) {
            Err(Error::InvalidInput { field, reason }) => {
                assert_eq!(field, expected_field, "{reason}");
                assert!(!reason.is_empty());
            }
            other => panic!("expected InvalidInput({expected_field}), got {other:?}"),
        }
    }
    match room.deliver("nobody", Message::new("b", "id", "x")) {
        Err(Error::UnknownConsumer { consumer }) => assert_eq!(consumer, "nobody"),
        other => panic!("{other:?}"),
    }
    assert_eq!(snapshot(&conn), before, "nothing stored");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    // Limits are inclusive: the largest valid message goes through.
    let biggest = Message::new(
        "s".repeat(MAX_NAME_BYTES),
        "i".repeat(MAX_ID_BYTES),
        vec![7u8; 1024 * 1024],
    );
    assert_eq!(
        room.deliver("c", biggest).unwrap(),
        Outcome::Processed { attempts: 1 }
    );
}

#[test]
fn invalid_configuration_and_consumer_names_are_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let noop = || handler_fn(|_, _| Ok(()));
    let cases: Vec<(postroom::Builder, &str)> = vec![
        (Postroom::builder().max_attempts(0), "max_attempts"),
        (Postroom::builder().max_batch(0), "max_batch"),
        (
            Postroom::builder().backoff(Duration::from_secs(10), Duration::from_secs(1)),
            "backoff",
        ),
        (Postroom::builder().max_payload(usize::MAX), "max_payload"),
        (Postroom::builder().consumer("", noop()), "consumer"),
        (
            Postroom::builder().consumer("x".repeat(129), noop()),
            "consumer",
        ),
        (
            Postroom::builder()
                .consumer("a", noop())
                .consumer("a", noop()),
            "consumer",
        ),
    ];
    for (builder, expected) in cases {
        match builder.open(&path) {
            Err(Error::InvalidInput { field, .. }) => assert_eq!(field, expected),
            other => panic!("expected InvalidInput({expected}), got {other:?}"),
        }
    }
    assert!(!path.exists(), "a refused configuration creates no file");
}

/// Every setting has a documented range, checked at `open`: a value past
/// it (one that would overflow a deadline, SQLite's millisecond count or
/// an allocation) is `InvalidInput` naming the setting, and creates no
/// file, instead of a panic in a background thread or an abort later.
#[test]
fn every_setting_out_of_its_documented_range_is_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let b = Postroom::builder;
    let year = Duration::from_secs(365 * 24 * 3600);
    let cases: Vec<(postroom::Builder, &str)> = vec![
        (b().lease(Duration::MAX), "lease"),
        (b().lease(year + Duration::from_secs(1)), "lease"),
        (b().lease(Duration::from_micros(10)), "lease"),
        (
            b().busy_timeout(Duration::from_millis(1 << 31)),
            "busy_timeout",
        ),
        (b().busy_timeout(Duration::MAX), "busy_timeout"),
        (b().drop_deadline(Duration::MAX), "drop_deadline"),
        (b().max_batch(usize::MAX), "max_batch"),
        (b().max_batch(65_537), "max_batch"),
        (b().read_pool_size(u32::MAX), "read_pool_size"),
        (b().read_pool_size(257), "read_pool_size"),
        (b().workers(64), "workers"),
        (b().poll_interval(Duration::MAX), "poll_interval"),
        (b().poll_interval(Duration::ZERO), "poll_interval"),
        (b().reaper_interval(Duration::MAX), "reaper_interval"),
        (b().relay_poll(Duration::MAX), "relay_poll"),
        (b().relay_batch(usize::MAX), "relay_batch"),
        (b().relay_batch(0), "relay_batch"),
        (b().process_batch(0), "process_batch"),
        (b().process_batch(usize::MAX), "process_batch"),
        (b().backoff(Duration::MAX, Duration::MAX), "backoff"),
        (
            b().backoff(Duration::from_secs(1), Duration::MAX),
            "backoff",
        ),
    ];
    for (builder, expected) in cases {
        let shown = format!("{builder:?}");
        match builder.open(&path) {
            Err(Error::InvalidInput { field, reason }) => {
                assert_eq!(field, expected, "{reason}\n{shown}");
                assert!(
                    reason.contains("at most") || reason.contains("at least"),
                    "{reason}"
                );
            }
            other => panic!("expected InvalidInput({expected}), got {other:?}\n{shown}"),
        }
        assert!(
            std::fs::read_dir(dir.path()).unwrap().next().is_none(),
            "a refused setting ({expected}) created a file"
        );
    }
}

/// The top of every documented range works: the engine takes and
/// processes work, and shuts down (an unbounded `shutdown` deadline waits
/// as long as it takes instead of overflowing an `Instant`). Retention
/// settings have no upper bound: `Duration::MAX` keeps rows for ever.
#[test]
fn settings_at_the_top_of_their_ranges_run_and_shut_down() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let year = Duration::from_secs(365 * 24 * 3600);
    let calls = Arc::new(AtomicU32::new(0));
    let c = Arc::clone(&calls);
    let room = Postroom::builder()
        .lease(year)
        .busy_timeout(Duration::from_millis(i32::MAX as u64))
        .drop_deadline(year)
        .max_batch(65_536)
        .read_pool_size(256)
        .workers(63)
        .poll_interval(year)
        .reaper_interval(year)
        .relay_poll(year)
        .relay_batch(65_536)
        .backoff(year, year)
        .max_attempts(u32::MAX)
        .retention(Duration::MAX)
        .dead_retention(Some(Duration::MAX))
        .conflict_retention(Some(Duration::MAX))
        .checkpoint_wal_bytes(u64::MAX)
        .sink(postroom::sink_fn(|_: &postroom::OutboxMessage| {
            postroom::SendResult::Sent
        }))
        .consumer(
            "c",
            handler_fn(move |tx, msg| {
                c.fetch_add(1, Ordering::SeqCst);
                apply(tx, msg)
            }),
        )
        .open(&path)
        .unwrap();
    create_domain(&room);
    room.receive("c", Message::new("b", "queued", "x")).unwrap();
    assert_eq!(
        room.deliver("c", Message::new("b", "inline", "x")).unwrap(),
        Outcome::Processed { attempts: 1 }
    );
    eventually(30, "the queued message is processed", || {
        calls.load(Ordering::SeqCst) == 2
    });
    room.cleanup().unwrap();
    let report = room.shutdown(Duration::MAX).unwrap();
    assert!(report.is_clean(), "{report:?}");
    let conn = raw(&path);
    assert_eq!(count(&conn, "SELECT count(*) FROM postroom_inbox"), 2);
    integrity_ok(&conn);
}

/// A user clock that panics when the reaper thread calls it.
struct ReaperKillingClock;
impl postroom::Clock for ReaperKillingClock {
    fn now_ms(&self) -> i64 {
        if std::thread::current().name() == Some("postroom-reaper") {
            panic!("user clock failed on the reaper");
        }
        postroom::SystemClock.now_ms()
    }
}

/// A background thread that dies (here the reaper, by a panic from the
/// user's clock) is logged and turns every later intake call into
/// `Error::Stopped` naming it: the engine must not go on accepting work
/// that part of it no longer does (expiring leases, retention; for a dead
/// dispatcher, processing anything received).
#[test]
fn a_background_thread_that_dies_makes_intake_refuse_work() {
    let dir = tempfile::tempdir().unwrap();
    let room = Postroom::builder()
        .clock(ReaperKillingClock)
        .reaper_interval(Duration::from_millis(10))
        .consumer("c", handler_fn(|_, _| Ok(())))
        .open(dir.path().join("app.db"))
        .unwrap();
    let started = std::time::Instant::now();
    let mut n = 0;
    let err = loop {
        n += 1;
        match room.receive("c", Message::new("b", format!("m{n}"), "x")) {
            Ok(_) if started.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Ok(receipt) => panic!(
                "the reaper died 10 s ago and receive still answers {receipt:?} ({n} accepted)"
            ),
            Err(e) => break e,
        }
    };
    match &err {
        Error::Stopped { thread, reason } => {
            assert_eq!(thread, "postroom-reaper");
            assert!(reason.contains("user clock failed"), "{reason}");
        }
        other => panic!("expected Stopped, got {other:?}"),
    }
    assert!(!err.is_retryable());
    assert!(err.to_string().contains("open it again"), "{err}");
    assert!(matches!(
        room.deliver("c", Message::new("b", "inline", "x")),
        Err(Error::Stopped { .. })
    ));
    let report = room.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(report.panicked.len(), 1, "{report:?}");
    assert_eq!(report.panicked[0].0, "postroom-reaper");
}

#[test]
fn a_file_that_is_not_sqlite_is_refused_and_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notes.txt");
    let content = b"These are my notes, not a database. ".repeat(200);
    std::fs::write(&path, &content).unwrap();
    match Postroom::builder().open(&path) {
        Err(e @ Error::NotADatabase { .. }) => {
            assert!(e.to_string().contains("not a SQLite database"))
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(std::fs::read(&path).unwrap(), content);
}

#[test]
fn a_newer_schema_is_refused_without_changes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    drop(Postroom::builder().open(&path).unwrap());
    raw(&path)
        .execute(
            "UPDATE postroom_meta SET value = '99' WHERE key = 'schema_version'",
            [],
        )
        .unwrap();
    match Postroom::builder().open(&path) {
        Err(Error::SchemaTooNew {
            found: 99,
            supported,
        }) => assert_eq!(supported, postroom::SCHEMA_VERSION),
        other => panic!("{other:?}"),
    }
    let v: String = raw(&path)
        .query_row(
            "SELECT value FROM postroom_meta WHERE key = 'schema_version'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(v, "99");
}

#[test]
fn the_applications_user_version_is_left_to_the_application() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    {
        let conn = raw(&path);
        conn.execute_batch("PRAGMA user_version = 42; CREATE TABLE mine (x);")
            .unwrap();
    }
    drop(Postroom::builder().open(&path).unwrap());
    let v: i64 = raw(&path)
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(v, 42);
}

#[test]
fn a_damaged_database_is_refused_with_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    {
        let (room, _) = counting_room(&path);
        for i in 0..300 {
            room.deliver("c", Message::new("b", format!("m{i}"), vec![b'x'; 500]))
                .unwrap();
        }
        room.shutdown(Duration::from_secs(5)).unwrap();
    }
    // Scribble over the middle of the file: b-tree pages, not the header.
    let mut bytes = std::fs::read(&path).unwrap();
    assert!(bytes.len() > 16 * 4096, "{}", bytes.len());
    for b in &mut bytes[8 * 4096..12 * 4096] {
        *b = 0xA5;
    }
    std::fs::write(&path, &bytes).unwrap();
    match Postroom::builder().open(&path) {
        Err(e @ Error::Corrupt { .. }) => assert!(e.to_string().contains("corrupt")),
        other => panic!("{other:?}"),
    }
}

/// Disk full (a page quota via `PRAGMA max_page_count`): a clear error, no
/// acknowledgement, nothing stored, no attempt counted; once space is
/// freed the same message is processed normally.
#[test]
fn disk_full_is_a_clear_error_that_changes_nothing_and_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let (room, _) = counting_room(&dir.path().join("app.db"));
    let conn = raw(room.path());
    room.deliver("c", Message::new("b", "before", "x")).unwrap();
    let before = snapshot(&conn);
    // Room for a few dozen small messages, not for a 200 kB one.
    let pages = tighten_quota(&room);
    assert!(pages > 0);

    let big = Message::new("b", "big", vec![b'p'; 200_000]);
    for _ in 0..3 {
        match room.deliver("c", big.clone()) {
            Err(e @ Error::StorageFull { .. }) => {
                assert!(e.is_retryable());
                assert!(e.to_string().contains("full"), "{e}");
            }
            other => panic!("expected StorageFull, got {other:?}"),
        }
    }
    assert_eq!(snapshot(&conn), before, "nothing stored");
    assert!(inbox_row(&conn, "c", "b", "big").is_none());

    // Concurrent deliveries while the quota bites: a batch that SQLite
    // rolls back fails every job in it. Whatever was acknowledged is applied
    // exactly once; whatever failed left no trace.
    let results: Vec<(String, postroom::Result<Outcome>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|t| {
                let room = &room;
                s.spawn(move || {
                    (0..50)
                        .map(|i| {
                            let id = format!("t{t}-{i}");
                            let r =
                                room.deliver("c", Message::new("b", id.clone(), vec![b'q'; 3000]));
                            (id, r)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    let (mut full, mut acked) = (0, 0);
    for (id, result) in &results {
        match result {
            Ok(outcome) => {
                acked += 1;
                assert!(outcome.should_ack(), "{id}: {outcome:?}");
                assert_eq!(
                    applied_count(&conn, id),
                    1,
                    "{id} acknowledged but not applied once"
                );
            }
            Err(Error::StorageFull { .. }) => {
                full += 1;
                assert_eq!(applied_count(&conn, id), 0, "{id} failed but was applied");
                assert!(
                    inbox_row(&conn, "c", "b", id).is_none(),
                    "{id} failed but stored"
                );
            }
            Err(e) => panic!("{id}: unexpected error {e}"),
        }
    }
    assert!(
        full > 0 && acked > 0,
        "full {full}, acked {acked}: the test proves nothing"
    );

    lift_quota(&room);
    assert_eq!(
        room.deliver("c", big.clone()).unwrap(),
        Outcome::Processed { attempts: 1 }
    );
    assert_eq!(room.deliver("c", big).unwrap(), Outcome::Duplicate);
    assert_eq!(applied_count(&conn, "big"), 1);
    integrity_ok(&conn);
}

/// Another process holding the write lock past the busy timeout: a clear,
/// retryable error; works once the lock is released.
#[test]
fn a_lock_held_elsewhere_past_the_timeout_is_a_retryable_busy_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let room = Postroom::builder()
        .busy_timeout(Duration::from_millis(200))
        .consumer("c", handler_fn(apply))
        .open(&path)
        .unwrap();
    create_domain(&room);
    let other = raw(&path);
    other.execute_batch("BEGIN IMMEDIATE").unwrap();
    let started = std::time::Instant::now();
    match room.deliver("c", Message::new("b", "m", "x")) {
        Err(e @ Error::Busy { .. }) => assert!(e.is_retryable()),
        other => panic!("expected Busy, got {other:?}"),
    }
    assert!(started.elapsed() >= Duration::from_millis(150));
    other.execute_batch("ROLLBACK").unwrap();
    assert_eq!(
        room.deliver("c", Message::new("b", "m", "x")).unwrap(),
        Outcome::Processed { attempts: 1 }
    );
}

#[test]
fn files_are_created_private() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let (room, _) = counting_room(&path);
    room.deliver("c", Message::new("b", "m", "x")).unwrap();
    for suffix in ["", "-wal", "-shm", "-postroom"] {
        let mode = std::fs::metadata(with_suffix(&path, suffix))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600, "{suffix}: {mode:o}");
    }
}

#[test]
fn a_second_engine_on_the_same_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let _first = Postroom::builder().open(&path).unwrap();
    match Postroom::builder().open(&path) {
        Err(e @ Error::AlreadyOpen { .. }) => {
            let Error::AlreadyOpen { path: p } = &e else {
                unreachable!()
            };
            assert_eq!(*p, path);
            // Says what holds it and where to look.
            let text = e.to_string();
            assert!(
                text.contains(&format!("{}-postroom", path.display())) && text.contains("lock"),
                "{text}"
            );
        }
        other => panic!("{other:?}"),
    }
    // A read-only engine file is named as the database's.
    let engine_file = std::path::PathBuf::from("/data/app.db-postroom");
    let text = Error::ReadOnly { path: engine_file }.to_string();
    assert!(
        text.contains("the engine file beside the database /data/app.db"),
        "{text}"
    );
}

/// Sets a page quota with room for a few dozen small rows but not for a
/// 200 kB one; returns the pages in use. (Connection state: user code
/// cannot set it, so the tests go through the engine's test hook.)
fn tighten_quota(room: &Postroom) -> i64 {
    let pages: i64 = room
        .transaction(|tx| Ok(tx.query_row("PRAGMA page_count", [], |r| r.get(0))?))
        .unwrap();
    let quota = u32::try_from(pages + 30).unwrap();
    assert_eq!(
        room.set_max_page_count_for_tests(quota).unwrap(),
        u64::from(quota)
    );
    pages
}

/// Lifts the quota. The call shares a transaction with whatever the writer
/// batches beside it; when a queued handler's insert fills the disk, SQLite
/// rolls back that whole transaction, and a job that cannot run again (this
/// one, once it ran) is answered with that retryable error (CI met
/// `StorageFull { op: "handler" }` here). A caller retries a retryable
/// error, as the API asks of every caller.
fn lift_quota(room: &Postroom) {
    for _ in 0..100 {
        match room.set_max_page_count_for_tests(1_073_741_823) {
            Ok(_) => return,
            Err(e) if e.is_retryable() => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => panic!("lifting the quota: {e}"),
        }
    }
    panic!("lifting the quota failed 100 times over");
}

/// A full disk can make SQLite roll back the whole transaction. A handler
/// that swallows the error and carries on (an audit row, a "best effort"
/// publish) must not get those later writes committed on their own.
#[test]
fn writes_after_sqlite_rolled_back_by_itself_are_not_committed() {
    let dir = tempfile::tempdir().unwrap();
    let room = Postroom::builder()
        .max_attempts(3)
        .consumer(
            "c",
            handler_fn(|tx, msg| {
                let r = tx.execute(
                    "INSERT INTO applied (consumer, message_id, payload) VALUES ('c', ?1, ?2)",
                    rusqlite::params![msg.id(), msg.payload()],
                );
                if let Err(e) = &r {
                    let _ = tx.execute(
                        "INSERT INTO audit VALUES (?1, ?2)",
                        [msg.id(), &e.to_string()],
                    );
                }
                tx.publish(postroom::Outgoing::new(
                    "status",
                    if r.is_ok() { "ok" } else { "err" },
                ))?;
                Ok(())
            }),
        )
        .open(dir.path().join("app.db"))
        .unwrap();
    create_domain(&room);
    room.transaction(|tx| {
        tx.execute_batch("CREATE TABLE audit (id TEXT, err TEXT)")?;
        Ok(())
    })
    .unwrap();
    tighten_quota(&room);
    let big = Message::new("b", "big", vec![b'p'; 200_000]);
    for _ in 0..3 {
        let err = room.deliver("c", big.clone()).unwrap_err();
        assert!(err.is_retryable(), "{err}");
        assert!(
            matches!(err, Error::StorageFull { .. } | Error::RolledBack { .. }),
            "{err}"
        );
    }
    let conn = raw(room.path());
    assert_eq!(
        count(&conn, "SELECT count(*) FROM audit"),
        0,
        "audit rows committed alone"
    );
    assert_eq!(
        count(&conn, "SELECT count(*) FROM postroom_outbox"),
        0,
        "phantom publish"
    );
    assert_eq!(count(&conn, "SELECT count(*) FROM postroom_inbox"), 0);

    lift_quota(&room);
    assert_eq!(
        room.deliver("c", big).unwrap(),
        Outcome::Processed { attempts: 1 }
    );
    assert_eq!(applied_count(&conn, "big"), 1);
    assert_eq!(count(&conn, "SELECT count(*) FROM postroom_outbox"), 1);
}

/// Queued work that a full disk fails is the storage's fault, not the
/// message's: the claim is handed back uncounted, as a failed `deliver`
/// counts no attempt. (Left to expire, each lease counted an attempt, and
/// the message went dead, "lease expired", after `max_attempts` leases.)
/// The lease is long enough that no stall of a loaded machine expires one
/// while a claim is being handed back.
#[test]
fn queued_work_failing_on_a_full_disk_uses_up_no_attempts() {
    let dir = tempfile::tempdir().unwrap();
    let runs = Arc::new(AtomicU32::new(0));
    let r = Arc::clone(&runs);
    let room = Postroom::builder()
        .max_attempts(3)
        .lease(Duration::from_secs(2))
        .reaper_interval(Duration::from_millis(20))
        .poll_interval(Duration::from_millis(10))
        .backoff(Duration::from_millis(5), Duration::from_millis(20))
        .consumer(
            "c",
            handler_fn(move |tx, msg| {
                r.fetch_add(1, Ordering::SeqCst);
                tx.execute(
                    "INSERT INTO applied (consumer, message_id, payload) VALUES ('c', ?1, ?2)",
                    rusqlite::params![msg.id(), vec![0u8; 200_000]],
                )?;
                Ok(())
            }),
        )
        .open(dir.path().join("app.db"))
        .unwrap();
    create_domain(&room);
    tighten_quota(&room);
    // The receive may share its transaction with queued processing (the
    // dispatcher is woken by the receive itself); the handler's insert then
    // fills the disk and SQLite rolls the whole transaction back. The
    // receive runs again on its own, but a caller retries a retryable error
    // all the same, as the API asks.
    let small = Message::new("b", "m", "small");
    let mut received = false;
    for _ in 0..100 {
        match room.receive("c", small.clone()) {
            Ok(_) => {
                received = true;
                break;
            }
            Err(e) if e.is_retryable() => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => panic!("receive: {e}"),
        }
    }
    assert!(received, "the receive failed 100 times over");
    let conn = raw(room.path());
    let row = || -> (String, u32) {
        conn.query_row(
            "SELECT status, attempts FROM postroom_inbox WHERE message_id = 'm'",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap()
    };
    // Several lease spans of a full disk (a dead row ends the wait early).
    eventually(30, "the handler to run 5 times", || {
        runs.load(Ordering::SeqCst) >= 5 || row().0 == "dead"
    });
    std::thread::sleep(Duration::from_millis(600));
    let (status, attempts) = row();
    assert!(
        status != "dead" && attempts <= 1,
        "a full disk used up attempts: {status}, {attempts} attempt(s)"
    );
    lift_quota(&room);
    eventually(30, "the message to complete", || row().0 == "completed");
    assert_eq!(row().1, 1, "only the attempt that succeeded counts");
    assert_eq!(applied_count(&conn, "m"), 1);
}

/// A full disk is the fault of the job whose write met it, not of its
/// batch: when one delivery's 200 kB insert fills the disk and SQLite rolls
/// the whole transaction back, that delivery is answered `StorageFull` and
/// the small deliveries that shared its transaction run again and are
/// processed. (They were answered with the culprit's error, so a caller
/// whose message fitted had to retry; and a rerunnable culprit could run
/// into the full disk until the batch's bound aborted everyone.)
///
/// Each round holds the writer in a handler while the other two callers
/// queue, so their jobs are batched together once it returns.
#[test]
fn a_full_disk_answers_the_job_that_met_it_not_its_whole_batch() {
    let dir = tempfile::tempdir().unwrap();
    let (gate, gate_handler) = WriterGate::new();
    let room = Arc::new(
        Postroom::builder()
            .max_attempts(100)
            .consumer("gate", gate_handler)
            .consumer(
                "big",
                handler_fn(|tx, msg| {
                    tx.execute(
                        "INSERT INTO applied (consumer, message_id, payload) VALUES ('big', ?1, ?2)",
                        rusqlite::params![msg.id(), vec![0u8; 200_000]],
                    )?;
                    Ok(())
                }),
            )
            .consumer("small", handler_fn(apply))
            .open(dir.path().join("app.db"))
            .unwrap(),
    );
    create_domain(&room);
    tighten_quota(&room);
    for round in 0..5 {
        let mut answers = gate
            .batch(
                &room,
                ("gate", format!("g{round}")),
                vec![("big", format!("b{round}")), ("small", format!("s{round}"))],
            )
            .into_iter();
        let (big, small) = (answers.next().unwrap(), answers.next().unwrap());
        match big {
            Err(Error::StorageFull { .. }) => {}
            other => panic!("round {round}: the big delivery: {other:?}"),
        }
        match small {
            Ok(Outcome::Processed { .. }) => {}
            other => panic!("round {round}: the small delivery beside it: {other:?}"),
        }
    }
    let conn = raw(room.path());
    assert_eq!(
        count(
            &conn,
            "SELECT count(*) FROM applied WHERE consumer = 'small'"
        ),
        5
    );
    assert_eq!(
        count(&conn, "SELECT count(*) FROM applied WHERE consumer = 'big'"),
        0
    );
}

/// Storage errors in a `transaction` closure, or in a handler that panics
/// on them, are reported as retryable storage errors, not as bugs.
#[test]
fn storage_errors_stay_retryable_however_user_code_reacts() {
    let dir = tempfile::tempdir().unwrap();
    let room = Postroom::builder()
        .consumer(
            "c",
            handler_fn(|tx, msg| {
                tx.execute(
                    "INSERT INTO applied (consumer, message_id, payload) VALUES ('c', ?1, ?2)",
                    rusqlite::params![msg.id(), msg.payload()],
                )
                .expect("handler unwraps a full disk");
                Ok(())
            }),
        )
        .open(dir.path().join("app.db"))
        .unwrap();
    create_domain(&room);
    tighten_quota(&room);
    let err = room
        .transaction(|tx| {
            tx.execute(
                "INSERT INTO applied (consumer, message_id, payload) VALUES ('t', 'x', ?1)",
                [vec![0u8; 200_000]],
            )?;
            Ok(())
        })
        .unwrap_err();
    assert!(err.is_retryable(), "transaction: {err}");
    let err = room
        .deliver("c", Message::new("b", "big", vec![1u8; 200_000]))
        .unwrap_err();
    assert!(err.is_retryable(), "deliver: {err}");
    let conn = raw(room.path());
    assert_eq!(
        count(&conn, "SELECT count(*) FROM postroom_inbox"),
        0,
        "no attempt counted"
    );
    lift_quota(&room);
    assert!(room
        .deliver("c", Message::new("b", "big", vec![1u8; 200_000]))
        .unwrap()
        .should_ack());
}

/// The inbox key is unique in the database itself, not only in the engine:
/// a hand-written INSERT of a stored key fails, and so does changing a
/// stored row's key or digest. Neither changes anything.
#[test]
fn hand_written_sql_cannot_store_a_key_twice_or_change_a_rows_key() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("p.db");
    let (room, calls) = counting_room(&db);
    room.deliver("c", Message::new("s", "m-1", "one")).unwrap();
    room.deliver("c", Message::new("s", "m-2", "two")).unwrap();
    let conn = raw(&db);
    let dump = |conn: &rusqlite::Connection| -> Vec<String> {
        column(
            conn,
            "SELECT id || message_id || status || hex(payload_hash) FROM postroom_inbox
             UNION ALL
             SELECT inbox_id || message_id || completed || hex(digest) FROM postroom_inbox_keys",
        )
    };
    let before = dump(&conn);

    let err = conn
        .execute(
            "INSERT INTO postroom_inbox (consumer, source, message_id, status, payload_hash,
                 received_at, updated_at)
             VALUES ('c', 's', 'm-1', 'pending', zeroblob(32), 0, 0)",
            [],
        )
        .unwrap_err();
    assert!(err.to_string().contains("UNIQUE"), "{err}");
    for change in [
        "message_id = 'm-3'",
        "message_id = 'm-2'",
        "consumer = 'd'",
        "payload_hash = zeroblob(32)",
        "id = 99",
    ] {
        let err = conn
            .execute(
                &format!("UPDATE postroom_inbox SET {change} WHERE message_id = 'm-1'"),
                [],
            )
            .unwrap_err();
        assert!(err.to_string().contains("never change"), "{change}: {err}");
    }
    assert_eq!(dump(&conn), before);
    assert_eq!(
        room.deliver("c", Message::new("s", "m-1", "one")).unwrap(),
        Outcome::Duplicate
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// Dedupe answers come from the key table, which only the triggers keep
/// up to date: a file missing one is refused at open, and changed nothing.
#[test]
fn a_file_missing_a_key_trigger_is_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("p.db");
    let (room, _) = counting_room(&db);
    room.deliver("c", Message::new("s", "m-1", "one")).unwrap();
    room.shutdown(Duration::from_secs(10)).unwrap();
    raw(&db)
        .execute_batch("DROP TRIGGER postroom_inbox_key_insert")
        .unwrap();
    let Err(err) = Postroom::builder()
        .workers(0)
        .consumer("c", handler_fn(apply))
        .open(&db)
    else {
        panic!("open must fail");
    };
    assert!(matches!(err, Error::InvalidInput { .. }), "{err:?}");
    assert!(
        err.to_string()
            .contains("postroom_inbox_key_insert is missing"),
        "{err}"
    );
    assert_eq!(count(&raw(&db), "SELECT count(*) FROM postroom_inbox"), 1);
}

/// The engine needs every table, index and trigger of its schema: a file
/// at the current version missing one (dropped by hand, a bad restore) is
/// refused at open, naming it, and left as it was; without
/// `postroom_conflicts` every conflict would fail for good, unacknowledged.
#[test]
fn a_file_missing_a_postroom_table_or_index_is_refused_at_open() {
    for (drop_sql, name) in [
        ("DROP TABLE postroom_conflicts", "postroom_conflicts"),
        ("DROP INDEX postroom_outbox_dead", "postroom_outbox_dead"),
        ("DROP TABLE postroom_retired_keys", "postroom_retired_keys"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("p.db");
        let (room, _) = counting_room(&db);
        room.deliver("c", Message::new("s", "m-1", "one")).unwrap();
        room.shutdown(Duration::from_secs(10)).unwrap();
        raw(&db).execute_batch(drop_sql).unwrap();
        let objects =
            |db| column::<Vec<String>>(&raw(db), "SELECT name FROM sqlite_master ORDER BY name");
        let before = objects(&db);
        let Err(err) = Postroom::builder()
            .workers(0)
            .consumer("c", handler_fn(apply))
            .open(&db)
        else {
            panic!("open must fail without {name}");
        };
        assert!(
            matches!(
                err,
                Error::InvalidInput {
                    field: "database",
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(
            err.to_string().contains(&format!("{name} is missing")),
            "{err}"
        );
        assert_eq!(objects(&db), before, "the refused file changed");
    }
}

/// A stored row whose text does not decode (bit rot, a hand edit putting
/// invalid UTF-8 in a key column) is dead-lettered, naming the column, when
/// a claim or the relay reaches it; it must not fail every batch that
/// reaches it, holding up the rows behind it for good.
#[test]
fn a_stored_row_that_does_not_decode_is_dead_lettered_not_retried_forever() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let (sent, handed_over) = crossbeam_channel::unbounded();
    let calls = Arc::new(AtomicU32::new(0));
    let c = Arc::clone(&calls);
    let room = Postroom::builder()
        .workers(1)
        .poll_interval(Duration::from_millis(10))
        .relay_poll(Duration::from_millis(10))
        .consumer(
            "c",
            handler_fn(move |tx, msg| {
                c.fetch_add(1, Ordering::SeqCst);
                apply(tx, msg)
            }),
        )
        .sink(postroom::ChannelSink::new(sent))
        .open(&path)
        .unwrap();
    create_domain(&room);
    let conn = raw(&path);
    // Behind the engine's back: a queued inbox row whose source is not
    // UTF-8, and an outbox row whose topic is not. Payload digests are right.
    conn.execute(
        "INSERT INTO postroom_inbox (consumer, source, message_id, status, payload, payload_hash,
             received_at, updated_at, next_attempt_at, queued)
         VALUES ('c', CAST(x'73ff' AS TEXT), 'rotten', 'pending', x'78', ?1, 1, 1, 1, 1)",
        [blake3::hash(b"x").as_bytes().as_slice()],
    )
    .unwrap();
    // The outbox rows sit between two sound ones (the relay hands over the
    // rows before a damaged one, then dead-letters it alone).
    conn.execute_batch(
        "INSERT INTO postroom_outbox (message_id, topic, payload, status, created_at,
             next_attempt_at)
         VALUES ('before', 'sound', x'78', 'pending', 1, 1),
                ('rotten-out', CAST(x'74ff' AS TEXT), x'78', 'pending', 1, 1)",
    )
    .unwrap();
    room.receive("c", Message::new("s", "fine", "y")).unwrap();

    eventually(20, "the row behind the rotten one processed", || {
        applied_count(&conn, "fine") == 1
    });
    let (status, error): (String, String) = conn
        .query_row(
            "SELECT status, last_error FROM postroom_inbox WHERE message_id = 'rotten'",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!(status, "dead");
    assert!(error.contains("source"), "{error}");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "never handed to the handler"
    );
    // Listed, lossily, where an operator looks for dead letters.
    let dead = room.dead_letters(None, 10).unwrap();
    assert_eq!(dead[0].message.source(), "s\u{fffd}");
    let listed = postroom::admin::inbox_list(&conn, &Default::default()).unwrap();
    assert!(listed.iter().any(|e| e.source == "s\u{fffd}"), "{listed:?}");

    let topics: Vec<String> = (0..2)
        .map(|_| {
            let out: postroom::OutboxMessage =
                handed_over.recv_timeout(Duration::from_secs(20)).unwrap();
            out.topic
        })
        .collect();
    assert_eq!(
        topics,
        ["sound", "applied"],
        "the rotten outbox row is not handed over"
    );
    eventually(20, "the rotten outbox row dead", || {
        room.stats().unwrap().outbox.dead == 1
    });
    let error: String = conn
        .query_row(
            "SELECT last_error FROM postroom_outbox WHERE message_id = 'rotten-out'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert!(error.contains("topic"), "{error}");
    assert!(handed_over.try_recv().is_err(), "nothing else handed over");
    room.shutdown(Duration::from_secs(10)).unwrap();
}
