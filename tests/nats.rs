//! The NATS JetStream bridge against a real nats-server (Debian's package),
//! one started per test on a free localhost port with JetStream and its
//! store in the test's temp dir (tests/support/nats_server.rs). Device A
//! publishes through its outbox and `NatsSink` into a stream; device B
//! pulls it through `NatsIntake` (a durable consumer) into its inbox. The
//! checks are on B's database: every message applied exactly once, per key
//! in commit order. Without nats-server installed each test says so and
//! passes, unless POSTROOM_REQUIRE_NATS is set (CI sets it).

mod common;
#[path = "support/nats_server.rs"]
mod nats_server;
#[path = "support/server.rs"]
mod server;

use std::collections::HashMap;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use nats_server::NatsServer;
use postroom::nats::{async_nats, ensure_stream, NatsIntake, NatsSink};
use postroom::{handler_fn, Failure, Message, Outgoing, Postroom};

/// Entry point of the child processes (device B). Not a test: it only does
/// something when started by `spawn_child`, and is ignored otherwise.
#[test]
#[ignore = "entry point for child processes of the NATS tests"]
fn child_main() {
    let Some((role, db)) = child_role() else {
        return;
    };
    report("");
    assert_eq!(role, "device-b", "unknown child role");
    let url = std::env::var("POSTROOM_NATS_URL").unwrap();
    let room = device_b(&db);
    let intake = NatsIntake::builder(url, Arc::clone(&room), "b", "HOP", "b")
        .start()
        .unwrap();
    assert!(intake.wait_bound(Duration::from_secs(30)));
    report("READY");
    loop {
        thread::sleep(Duration::from_secs(1));
    }
}

/// Device B: every message it applies adds a row to `effects`, with no
/// uniqueness constraint, so a message applied twice shows as two rows.
fn device_b(db: &Path) -> Arc<Postroom> {
    let room = Postroom::builder()
        .poll_interval(Duration::from_millis(20))
        .backoff(Duration::from_millis(20), Duration::from_millis(200))
        .consumer(
            "b",
            handler_fn(|tx, msg: &Message| {
                tx.execute(
                    "INSERT INTO effects (msg_id, key, n) VALUES (?1, ?2, ?3)",
                    rusqlite::params![
                        msg.id(),
                        msg.ordering_key(),
                        String::from_utf8_lossy(msg.payload()).parse::<i64>().ok()
                    ],
                )?;
                Ok(())
            }),
        )
        .open(db)
        .unwrap();
    room.transaction(|tx| {
        tx.execute_batch(
            "CREATE TABLE IF NOT EXISTS effects (msg_id TEXT NOT NULL, key TEXT, n INTEGER)",
        )?;
        Ok(())
    })
    .unwrap();
    Arc::new(room)
}

/// Device A with a NATS sink publishing `orders` rows as `hop.orders`.
fn device_a(db: &Path, url: &str) -> Postroom {
    Postroom::builder()
        .max_attempts(2) // an outage must not use attempts up
        .relay_poll(Duration::from_millis(20))
        .sink(
            NatsSink::new(url)
                .source("device-a")
                .subject_prefix("hop.")
                .ack_timeout(Duration::from_secs(2))
                .backoff(Duration::from_millis(50), Duration::from_millis(500)),
        )
        .open(db)
        .unwrap()
}

/// A device whose NATS sink names its outbox `source`, publishing as
/// `hop.<topic>`.
fn named_device(url: &str, db: &Path, source: &str) -> Postroom {
    Postroom::builder()
        .relay_poll(Duration::from_millis(20))
        .sink(
            NatsSink::new(url)
                .source(source)
                .subject_prefix("hop.")
                .ack_timeout(Duration::from_secs(2)),
        )
        .open(db)
        .unwrap()
}

/// Publishes `n` rows through A's outbox, keys `k0`..`k4`, payload = the
/// number, `pause` after each; `committed` counts them.
fn publish(a: &Postroom, n: i64, pause: Duration, committed: &AtomicU64) {
    for i in 0..n {
        a.transaction(move |tx| {
            tx.publish(Outgoing::new("orders", i.to_string()).with_key(format!("k{}", i % 5)))?;
            Ok(())
        })
        .unwrap();
        committed.fetch_add(1, Ordering::SeqCst);
        thread::sleep(pause);
    }
}

/// What B's `effects` say: (rows, distinct messages), and every key's
/// numbers in the order applied.
fn effects(db: &Path) -> (i64, i64, HashMap<String, Vec<i64>>) {
    let conn = rusqlite::Connection::open_with_flags(
        db,
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .unwrap();
    conn.busy_timeout(Duration::from_secs(5)).unwrap();
    let (rows, distinct) = conn
        .query_row(
            "SELECT count(*), count(DISTINCT msg_id) FROM effects",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap_or((0, 0));
    let mut order: HashMap<String, Vec<i64>> = HashMap::new();
    if let Ok(mut stmt) = conn.prepare("SELECT key, n FROM effects ORDER BY rowid") {
        let rows = stmt
            .query_map([], |r| {
                Ok((r.get::<_, Option<String>>(0)?, r.get::<_, Option<i64>>(1)?))
            })
            .unwrap();
        for row in rows {
            let (key, n) = row.unwrap();
            if let (Some(key), Some(n)) = (key, n) {
                order.entry(key).or_default().push(n);
            }
        }
    }
    (rows, distinct, order)
}

/// Every one of `n` messages applied exactly once, each key in order.
fn assert_exactly_once_in_order(db: &Path, n: i64) {
    let (rows, distinct, order) = effects(db);
    assert_eq!(distinct, n, "messages applied");
    assert_eq!(rows, n, "effects: a message was applied twice");
    for (key, ns) in order {
        assert!(
            ns.windows(2).all(|w| w[0] < w[1]),
            "key {key} applied out of order: {ns:?}"
        );
    }
}

/// Rows A's relay recorded a failure for (its `last_error`, kept after the
/// row went out), and rows not sent.
fn outbox_failures(db: &Path) -> (i64, i64) {
    let conn = rusqlite::Connection::open(db).unwrap();
    conn.busy_timeout(Duration::from_secs(5)).unwrap();
    conn.query_row(
        "SELECT count(last_error), count(*) FILTER (WHERE status != 'sent')
         FROM postroom_outbox",
        [],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )
    .unwrap()
}

/// Waits (bounded) until B applied `n` and A's outbox has nothing unsent.
fn settle(a_db: &Path, b_db: &Path, n: i64, what: &str, extra: impl Fn() -> String) {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        if effects(b_db).1 == n && outbox_failures(a_db).1 == 0 {
            return;
        }
        if Instant::now() > deadline {
            let (rows, distinct, _) = effects(b_db);
            panic!(
                "{what}: B applied {distinct} of {n} ({rows} effects); A's outbox (rows that \
                 met a failure, rows not sent): {:?}; {}",
                outbox_failures(a_db),
                extra()
            );
        }
        thread::sleep(Duration::from_millis(50));
    }
}

/// A raw message: subject, headers, payload.
type Raw = (String, Vec<(&'static str, String)>, &'static str);

/// A plain NATS client in the test, for what a foreign publisher sends.
fn publish_raw(url: &str, messages: Vec<Raw>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let client = async_nats::connect(url).await.unwrap();
        let js = async_nats::jetstream::new(client);
        for (subject, headers, payload) in messages {
            let mut map = async_nats::HeaderMap::new();
            for (k, v) in headers {
                map.insert(k, v.as_str());
            }
            js.publish_with_headers(subject, map, payload.into())
                .await
                .unwrap()
                .await
                .unwrap();
        }
    });
}

/// Device A's rows go through the stream into device B's inbox: each
/// exactly once, each key in commit order, and the stream holds each once
/// (`Nats-Msg-Id`).
#[test]
fn exactly_once_end_to_end_through_jetstream() {
    let dir = tempfile::tempdir().unwrap();
    let Some(server) = NatsServer::start(&dir.path().join("nats")) else {
        return;
    };
    let url = server.url();
    ensure_stream(&url, "HOP", &["hop.>"]).unwrap();
    let b_db = dir.path().join("b.db");
    let b = device_b(&b_db);
    let intake = NatsIntake::builder(&url, Arc::clone(&b), "b", "HOP", "b")
        .start()
        .unwrap();
    assert!(intake.wait_bound(Duration::from_secs(30)));
    let a_db = dir.path().join("a.db");
    let a = device_a(&a_db, &url);
    const N: i64 = 200;
    publish(&a, N, Duration::ZERO, &AtomicU64::new(0));
    settle(&a_db, &b_db, N, "end to end", || {
        format!("{:?}", intake.stats())
    });
    let stats = intake.stats();
    println!("{N} messages, intake {stats:?}");
    assert_eq!(stats.unwrapped, 0, "{stats:?}");
    assert_eq!(a.stats().unwrap().outbox.dead, 0);
    intake.shutdown(Duration::from_secs(10)).unwrap();
    assert_exactly_once_in_order(&b_db, N);
    // The inbox rows carry the hop contract: source from `postroom-source`,
    // the key, and no NATS header of its own.
    let conn = raw(&b_db);
    assert_eq!(
        count(
            &conn,
            "SELECT count(*) FROM postroom_inbox WHERE source = 'device-a'"
        ),
        N
    );
}

/// Two devices (sources `device-a`, `device-c`) each publish a message
/// with the same application id and their own payload into one stream
/// within its duplicate window: the stream holds both (its dedupe id is
/// source and id together, as the receiving inbox's), and the receiver
/// applies both. Before, `Nats-Msg-Id` was the bare id: the stream dropped
/// device-c's as a duplicate, and both rows were marked Sent.
#[test]
fn two_devices_with_one_message_id_both_reach_the_receiver() {
    let dir = tempfile::tempdir().unwrap();
    let Some(server) = NatsServer::start(&dir.path().join("nats")) else {
        return;
    };
    let url = server.url();
    ensure_stream(&url, "HOP", &["hop.>"]).unwrap();
    let b_db = dir.path().join("b.db");
    let b = device_b(&b_db);
    let intake = NatsIntake::builder(&url, Arc::clone(&b), "b", "HOP", "b")
        .start()
        .unwrap();
    assert!(intake.wait_bound(Duration::from_secs(30)));
    let device = |name: &str| named_device(&url, &dir.path().join(format!("{name}.db")), name);
    let (a, c) = (device("device-a"), device("device-c"));
    for (room, n) in [(&a, 1), (&c, 2)] {
        room.transaction(move |tx| {
            tx.publish(Outgoing::new("orders", n.to_string()).with_id("reading-2024-06-01"))?;
            Ok(())
        })
        .unwrap();
    }
    eventually(30, "both readings applied", || effects(&b_db).0 >= 2);
    let conn = raw(&b_db);
    let applied: Vec<String> = column(
        &conn,
        "SELECT source || '/' || message_id FROM postroom_inbox ORDER BY source",
    );
    assert_eq!(
        applied,
        ["device-a/reading-2024-06-01", "device-c/reading-2024-06-01"]
    );
    let (rows, distinct, _) = effects(&b_db);
    assert_eq!(
        (rows, distinct),
        (2, 1),
        "one id, two messages, each applied once"
    );
    intake.shutdown(Duration::from_secs(10)).unwrap();
}

/// A fleet: two devices publish 100 rows each under the same named ids
/// (`r-0`..`r-99`), keys of their own, while device B's intake is stopped
/// and started again midway. Every message of both devices is applied
/// exactly once, and each key in commit order.
#[test]
fn a_fleet_with_named_ids_and_an_intake_restart_applies_each_once_in_key_order() {
    let dir = tempfile::tempdir().unwrap();
    let Some(server) = NatsServer::start(&dir.path().join("nats")) else {
        return;
    };
    let url = server.url();
    ensure_stream(&url, "HOP", &["hop.>"]).unwrap();
    let b_db = dir.path().join("b.db");
    let b = device_b(&b_db);
    let start = || {
        let intake = NatsIntake::builder(&url, Arc::clone(&b), "b", "HOP", "b")
            .batch(8)
            .start()
            .unwrap();
        assert!(intake.wait_bound(Duration::from_secs(30)));
        intake
    };
    let mut intake = start();
    let device = |name: &str| named_device(&url, &dir.path().join(format!("{name}.db")), name);
    let (a, c) = (device("device-a"), device("device-c"));
    const N: i64 = 100;
    let publish_half = |half: std::ops::Range<i64>| {
        for i in half {
            for (room, name) in [(&a, "a"), (&c, "c")] {
                room.transaction(move |tx| {
                    tx.publish(
                        Outgoing::new("orders", i.to_string())
                            .with_id(format!("r-{i}"))
                            .with_key(format!("{name}-k{}", i % 5)),
                    )?;
                    Ok(())
                })
                .unwrap();
            }
        }
    };
    publish_half(0..N / 2);
    eventually(60, "some applied before the restart", || {
        effects(&b_db).0 >= 10
    });
    intake.shutdown(Duration::from_secs(10)).unwrap();
    publish_half(N / 2..N);
    intake = start();
    eventually(120, "every message of both devices applied", || {
        effects(&b_db).0 >= 2 * N
    });
    std::thread::sleep(Duration::from_millis(500));
    let (rows, _, order) = effects(&b_db);
    assert_eq!(rows, 2 * N, "each applied once");
    let conn = raw(&b_db);
    assert_eq!(
        count(
            &conn,
            "SELECT count(DISTINCT source || '/' || message_id) FROM postroom_inbox
             WHERE status = 'completed'"
        ),
        2 * N
    );
    assert_eq!(order.len(), 10, "{order:?}");
    for (key, ns) in &order {
        let mut sorted = ns.clone();
        sorted.sort();
        assert_eq!(ns, &sorted, "key {key} applied out of order");
        assert_eq!(ns.len() as i64, N / 5, "key {key}");
    }
    intake.shutdown(Duration::from_secs(10)).unwrap();
}

/// A durable consumer an intake must not pull from is refused for good
/// (the thread ends, `wait_bound` is false, `shutdown` names the reason),
/// never used: one whose `max_deliver` would stop redelivering a message a
/// handler keeps failing (it would hold every message behind it), one
/// without explicit acks, and one another database's intake made (two
/// inboxes on one durable consumer each get part of the stream). The
/// owner's own intake binds it again after a restart.
#[test]
fn a_durable_consumer_that_would_lose_or_split_messages_is_refused() {
    use postroom::nats::async_nats::jetstream::consumer;
    let dir = tempfile::tempdir().unwrap();
    let Some(server) = NatsServer::start(&dir.path().join("nats")) else {
        return;
    };
    let url = server.url();
    ensure_stream(&url, "HOP", &["hop.>"]).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let client = async_nats::connect(&url).await.unwrap();
        let stream = async_nats::jetstream::new(client)
            .get_stream("HOP")
            .await
            .unwrap();
        for (name, config) in [
            (
                "max-deliver",
                consumer::pull::Config {
                    max_deliver: 3,
                    ack_policy: consumer::AckPolicy::Explicit,
                    ..Default::default()
                },
            ),
            (
                "ack-none",
                consumer::pull::Config {
                    ack_policy: consumer::AckPolicy::None,
                    ..Default::default()
                },
            ),
        ] {
            stream
                .create_consumer(consumer::pull::Config {
                    durable_name: Some(name.into()),
                    ..config
                })
                .await
                .unwrap();
        }
    });
    let refused = |room: &Arc<Postroom>, durable: &str, word: &str| {
        let intake = NatsIntake::builder(&url, Arc::clone(room), "b", "HOP", durable)
            .start()
            .unwrap();
        assert!(
            !intake.wait_bound(Duration::from_secs(3)),
            "{durable} bound"
        );
        match intake.shutdown(Duration::from_secs(10)) {
            Err(postroom::Error::Stopped { reason, .. }) => {
                assert!(reason.contains(word), "{durable}: {reason}")
            }
            other => panic!("{durable}: {other:?}"),
        }
    };
    let b = device_b(&dir.path().join("b.db"));
    refused(&b, "max-deliver", "max_deliver is 3");
    refused(&b, "ack-none", "ack policy");
    // B's intake makes "shared"; another database's intake is refused it;
    // B's own binds it again.
    let own = NatsIntake::builder(&url, Arc::clone(&b), "b", "HOP", "shared")
        .start()
        .unwrap();
    assert!(own.wait_bound(Duration::from_secs(30)));
    own.shutdown(Duration::from_secs(10)).unwrap();
    let other = device_b(&dir.path().join("other.db"));
    refused(&other, "shared", "another database");
    let own = NatsIntake::builder(&url, Arc::clone(&b), "b", "HOP", "shared")
        .start()
        .unwrap();
    assert!(own.wait_bound(Duration::from_secs(30)));
    own.shutdown(Duration::from_secs(10)).unwrap();
}

/// Two outboxes given one source name publish one id with two payloads:
/// the stream acks the second as a duplicate, the sink looks the stored
/// message up, finds another payload, and makes that row dead with the
/// reason instead of marking it Sent for what the stream does not hold.
#[test]
fn a_duplicate_ack_for_another_payload_is_not_taken_for_sent() {
    let dir = tempfile::tempdir().unwrap();
    let Some(server) = NatsServer::start(&dir.path().join("nats")) else {
        return;
    };
    let url = server.url();
    ensure_stream(&url, "HOP", &["hop.>"]).unwrap();
    let device = |file: &str| named_device(&url, &dir.path().join(file), "device-a");
    let (first, second) = (device("a.db"), device("a-restored.db"));
    for (room, n) in [(&first, 1), (&second, 2)] {
        room.transaction(move |tx| {
            tx.publish(Outgoing::new("orders", n.to_string()).with_id("reading-1"))?;
            Ok(())
        })
        .unwrap();
        eventually(30, "the row settled", || {
            let outbox = room.stats().unwrap().outbox;
            outbox.sent + outbox.dead == 1
        });
    }
    assert_eq!(first.stats().unwrap().outbox.sent, 1);
    let outbox = second.stats().unwrap().outbox;
    assert_eq!((outbox.sent, outbox.dead), (0, 1), "{outbox:?}");
    let reason: String = raw(&dir.path().join("a-restored.db"))
        .query_row("SELECT last_error FROM postroom_outbox", [], |r| r.get(0))
        .unwrap();
    assert!(
        reason.contains("another message under this row's Nats-Msg-Id"),
        "{reason}"
    );
    // The same row sent again by the first outbox is still a plain Sent.
    rusqlite::Connection::open(dir.path().join("a.db"))
        .unwrap()
        .execute(
            "UPDATE postroom_outbox SET status = 'pending', sent_at = NULL, next_attempt_at = 0",
            [],
        )
        .unwrap();
    eventually(30, "the re-send acked as the duplicate it is", || {
        first.stats().unwrap().outbox.sent == 1 && first.stats().unwrap().outbox.pending == 0
    });
    assert_eq!(first.stats().unwrap().outbox.dead, 0);
}

/// Per-key order survives a restart of the intake. Key K: m1 fails inline
/// and is asked back for its 3 s retry delay, m2 of the same key is asked
/// back behind it for 200 ms, by an intake that then stops (the test plays
/// it, on the same durable consumer, so the timing is exact). A new intake
/// binds: JetStream brings m2 back first, and the new intake does not know
/// what the old one asked back; the inbox does (m1 is the key's unfinished
/// head), so m2 waits, and the order applied is [m1, m2]. Before, it was
/// [m2, m1].
#[test]
fn per_key_order_survives_a_restart_of_the_intake() {
    restart_keeps_key_order(false);
}

/// The same through a queued intake, where the inbox does not know m1:
/// the old intake asked it back unstored (its consumer's backlog was
/// full), and m2 behind it. The new intake keeps m2, which comes first,
/// until m1, pending like it below the restart barrier, has come too, and
/// hands both on in stream order. Before, the order applied was [2, 1].
#[test]
fn per_key_order_survives_a_restart_of_a_queued_intake() {
    restart_keeps_key_order(true);
}

fn restart_keeps_key_order(queued: bool) {
    use postroom::nats::async_nats::jetstream::{self, consumer, AckKind};
    let dir = tempfile::tempdir().unwrap();
    let Some(server) = NatsServer::start(&dir.path().join("nats")) else {
        return;
    };
    let url = server.url();
    ensure_stream(&url, "HOP", &["hop.>"]).unwrap();
    let b_db = dir.path().join("b.db");
    let failed_once = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let failed = Arc::clone(&failed_once);
    let b = Postroom::builder()
        .backoff(Duration::from_secs(3), Duration::from_secs(3))
        .consumer(
            "b",
            handler_fn(move |tx, msg: &Message| {
                if msg.payload() == b"1" && !failed.swap(true, Ordering::SeqCst) {
                    return Err(Failure::retry("m1 fails its first attempt"));
                }
                tx.execute(
                    "INSERT INTO effects (msg_id, key, n) VALUES (?1, ?2, ?3)",
                    rusqlite::params![
                        msg.id(),
                        msg.ordering_key(),
                        String::from_utf8_lossy(msg.payload()).parse::<i64>().ok()
                    ],
                )?;
                Ok(())
            }),
        )
        .open(&b_db)
        .unwrap();
    b.transaction(|tx| {
        Ok(tx.execute_batch("CREATE TABLE effects (msg_id TEXT NOT NULL, key TEXT, n INTEGER)")?)
    })
    .unwrap();
    let b = Arc::new(b);
    let a_db = dir.path().join("a.db");
    let a = device_a(&a_db, &url);
    for n in [1, 2] {
        a.transaction(move |tx| {
            tx.publish(Outgoing::new("orders", n.to_string()).with_key("K"))?;
            Ok(())
        })
        .unwrap();
    }
    eventually(30, "both in the stream", || {
        a.stats().unwrap().outbox.sent == 2
    });
    // The old intake: pulls both, delivers m1 (it fails), asks m1 back for
    // its retry delay and m2 for the held-back delay, and stops.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let client = async_nats::connect(&url).await.unwrap();
        let js = jetstream::new(client.clone());
        let stream = js.get_stream("HOP").await.unwrap();
        let pull = stream
            .get_or_create_consumer(
                "b",
                consumer::pull::Config {
                    durable_name: Some("b".into()),
                    ack_policy: consumer::AckPolicy::Explicit,
                    deliver_policy: consumer::DeliverPolicy::All,
                    ack_wait: Duration::from_secs(30),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        let mut batch = pull.fetch().max_messages(2).messages().await.unwrap();
        let mut got = Vec::new();
        while let Some(m) = futures_util::StreamExt::next(&mut batch).await {
            got.push(m.unwrap());
        }
        assert_eq!(got.len(), 2);
        let header = |m: &jetstream::Message, name: &str| {
            m.headers
                .as_ref()
                .and_then(|h| h.get(name))
                .map(|v| v.as_str().to_owned())
                .unwrap()
        };
        let m1 = Message::new(
            header(&got[0], "postroom-source"),
            header(&got[0], "postroom-id"),
            got[0].payload.to_vec(),
        )
        .with_ordering_key("K");
        if !queued {
            let first = b.deliver("b", m1).unwrap();
            assert!(
                matches!(first, postroom::Outcome::Failed { .. }),
                "{first:?}"
            );
        }
        got[0]
            .ack_with(AckKind::Nak(Some(Duration::from_secs(3))))
            .await
            .unwrap();
        got[1]
            .ack_with(AckKind::Nak(Some(Duration::from_millis(200))))
            .await
            .unwrap();
        client.flush().await.unwrap();
    });
    let mut intake = NatsIntake::builder(&url, Arc::clone(&b), "b", "HOP", "b");
    if queued {
        intake = intake.queued();
    }
    let intake = intake.start().unwrap();
    assert!(intake.wait_bound(Duration::from_secs(30)));
    eventually(60, "both applied", || effects(&b_db).0 >= 2);
    let (rows, distinct, order) = effects(&b_db);
    assert_eq!((rows, distinct), (2, 2));
    assert_eq!(order["K"], [1, 2], "applied out of order after the restart");
    intake.shutdown(Duration::from_secs(10)).unwrap();
}

/// The server is SIGKILLed while A publishes and B pulls, and comes back a
/// second later with its store: A's sink keeps the unacknowledged rows
/// pending (no attempt counted, so `max_attempts(2)` kills none), B's
/// intake binds again; every message is applied exactly once, per key in
/// order.
#[test]
fn the_server_killed_and_restarted_mid_stream_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let Some(mut server) = NatsServer::start(&dir.path().join("nats")) else {
        return;
    };
    let url = server.url();
    ensure_stream(&url, "HOP", &["hop.>"]).unwrap();
    let b_db = dir.path().join("b.db");
    let b = device_b(&b_db);
    let intake = NatsIntake::builder(&url, Arc::clone(&b), "b", "HOP", "b")
        .backoff(Duration::from_millis(50), Duration::from_millis(500))
        .start()
        .unwrap();
    assert!(intake.wait_bound(Duration::from_secs(30)));
    let a_db = dir.path().join("a.db");
    let a = device_a(&a_db, &url);
    const N: i64 = 300;
    let committed = AtomicU64::new(0);
    let applied_at_kill = thread::scope(|s| {
        s.spawn(|| publish(&a, N, Duration::from_millis(5), &committed));
        eventually(30, "a third committed before the kill", || {
            committed.load(Ordering::SeqCst) >= N as u64 / 3
        });
        let at_kill = effects(&b_db).1;
        server.restart(Duration::from_secs(1));
        at_kill
    });
    settle(&a_db, &b_db, N, "after the restart", || {
        format!("intake {:?}", intake.stats())
    });
    let stats = intake.stats();
    let (failed_rows, _) = outbox_failures(&a_db);
    println!(
        "{N} messages: {applied_at_kill} applied at the kill, rows that met the outage \
         {failed_rows}, intake {stats:?}"
    );
    assert!(applied_at_kill < N, "the kill came after the run");
    assert!(failed_rows > 0, "no row met the outage");
    assert_eq!(a.stats().unwrap().outbox.dead, 0);
    intake.shutdown(Duration::from_secs(10)).unwrap();
    assert_exactly_once_in_order(&b_db, N);
}

/// The server SIGKILLed after it stored a batch of publishes and before
/// their acks reached the sink: the stream holds them, their rows are not
/// Sent. Played exactly: the rows are sent and applied, the server is
/// SIGKILLed, the rows are made pending again (what the lost acks leave),
/// and the server starts again on its store. Each re-send is acked as the
/// duplicate of the stored message (same payload): the row is Sent, none
/// is dead, the stream holds each once (its duplicate window outlives the
/// restart) and B applies each once, in key order.
#[test]
fn publishes_stored_but_unacknowledged_at_a_server_kill_are_sent_once() {
    let dir = tempfile::tempdir().unwrap();
    let Some(mut server) = NatsServer::start(&dir.path().join("nats")) else {
        return;
    };
    let url = server.url();
    ensure_stream(&url, "HOP", &["hop.>"]).unwrap();
    let b_db = dir.path().join("b.db");
    let b = device_b(&b_db);
    let intake = NatsIntake::builder(&url, Arc::clone(&b), "b", "HOP", "b")
        .backoff(Duration::from_millis(50), Duration::from_millis(500))
        .start()
        .unwrap();
    assert!(intake.wait_bound(Duration::from_secs(30)));
    let a_db = dir.path().join("a.db");
    let a = device_a(&a_db, &url);
    const N: i64 = 20;
    publish(&a, N, Duration::ZERO, &AtomicU64::new(0));
    settle(&a_db, &b_db, N, "before the kill", || {
        format!("intake {:?}", intake.stats())
    });
    server.kill();
    let reset = rusqlite::Connection::open(&a_db)
        .unwrap()
        .execute(
            "UPDATE postroom_outbox SET status = 'pending', sent_at = NULL, next_attempt_at = 0",
            [],
        )
        .unwrap();
    assert_eq!(reset as i64, N);
    server.up();
    eventually(60, "every row re-sent and Sent", || {
        let outbox = a.stats().unwrap().outbox;
        outbox.sent == N as u64 && outbox.pending == 0
    });
    assert_eq!(a.stats().unwrap().outbox.dead, 0);
    let stored = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            let client = async_nats::connect(&url).await.unwrap();
            let js = async_nats::jetstream::new(client);
            let mut stream = js.get_stream("HOP").await.unwrap();
            stream.info().await.unwrap().state.messages
        });
    assert_eq!(stored, N as u64, "the stream stored a re-send again");
    // Nothing new reaches B: a while later, still each once.
    thread::sleep(Duration::from_secs(2));
    intake.shutdown(Duration::from_secs(10)).unwrap();
    assert_exactly_once_in_order(&b_db, N);
}

/// A handler fails one message's first attempt: the intake does not
/// acknowledge it but NAKs it, and JetStream redelivers it; the second
/// attempt applies it. A message with the same `postroom-id` published
/// twice (past the stream's own dedupe: two `Nats-Msg-Id`s), and a plain
/// payload without the contract sent twice, are absorbed by the inbox.
#[test]
fn duplicates_and_redeliveries_are_absorbed() {
    let dir = tempfile::tempdir().unwrap();
    let Some(server) = NatsServer::start(&dir.path().join("nats")) else {
        return;
    };
    let url = server.url();
    ensure_stream(&url, "HOP", &["hop.>"]).unwrap();
    let attempts = Arc::new(AtomicU64::new(0));
    let seen = Arc::clone(&attempts);
    let b_db = dir.path().join("b.db");
    let b = Arc::new(
        Postroom::builder()
            .consumer(
                "b",
                handler_fn(move |tx, msg: &Message| {
                    if msg.id() == "flaky" && seen.fetch_add(1, Ordering::SeqCst) == 0 {
                        return Err(Failure::retry_after(
                            "downstream busy",
                            Duration::from_millis(300),
                        ));
                    }
                    tx.execute(
                        "INSERT INTO effects (msg_id, key, n) VALUES (?1, NULL, NULL)",
                        [msg.id()],
                    )?;
                    Ok(())
                }),
            )
            .open(&b_db)
            .unwrap(),
    );
    b.transaction(|tx| {
        tx.execute_batch("CREATE TABLE effects (msg_id TEXT NOT NULL, key TEXT, n INTEGER)")?;
        Ok(())
    })
    .unwrap();
    let intake = NatsIntake::builder(&url, Arc::clone(&b), "b", "HOP", "b")
        .start()
        .unwrap();
    assert!(intake.wait_bound(Duration::from_secs(30)));
    let hop = |id: &str, nats_id: &str| {
        vec![
            ("postroom-id", id.to_owned()),
            ("postroom-seq", "1".to_owned()),
            ("postroom-source", "pub".to_owned()),
            ("Nats-Msg-Id", nats_id.to_owned()),
        ]
    };
    publish_raw(
        &url,
        vec![
            ("hop.x".into(), hop("once", "n1"), "a"),
            ("hop.x".into(), hop("once", "n2"), "a"), // the same message again
            ("hop.x".into(), hop("flaky", "n3"), "b"),
            ("hop.x".into(), hop("after", "n4"), "c"),
            ("hop.plain".into(), vec![], "plain"),
            ("hop.plain".into(), vec![], "plain"), // a plain repeat
        ],
    );
    eventually(30, "every message applied", || effects(&b_db).1 == 4);
    eventually(30, "every message acknowledged", || {
        let s = intake.stats();
        s.acked == 6 && s.duplicates == 2
    });
    let stats = intake.stats();
    println!("intake {stats:?}");
    assert!(stats.not_acked >= 1, "{stats:?}");
    assert!(stats.redelivered >= 1, "{stats:?}");
    assert_eq!(stats.unwrapped, 2, "{stats:?}");
    assert_eq!(attempts.load(Ordering::SeqCst), 2);
    let (rows, distinct, _) = effects(&b_db);
    assert_eq!((rows, distinct), (4, 4));
    // Order: "after" came behind "flaky" and was held back with it.
    let conn = raw(&b_db);
    let order: Vec<String> = column(&conn, "SELECT msg_id FROM effects ORDER BY rowid");
    let pos = |id: &str| order.iter().position(|x| x == id).unwrap();
    assert!(pos("flaky") < pos("after"), "{order:?}");
    intake.shutdown(Duration::from_secs(10)).unwrap();
}

/// Device B is a real child process, SIGKILLed while it pulls and started
/// again: the durable consumer kept its position, what B had pulled and
/// not acknowledged comes again after the ack wait, and its inbox absorbs
/// what it had applied but not acknowledged.
#[test]
fn device_b_killed_mid_stream_applies_every_message_once() {
    let dir = tempfile::tempdir().unwrap();
    let Some(server) = NatsServer::start(&dir.path().join("nats")) else {
        return;
    };
    let url = server.url();
    ensure_stream(&url, "HOP", &["hop.>"]).unwrap();
    // The consumer is made here by hand with a short ack wait, so what the
    // killed B pulled comes back soon; the child binds to it as it is.
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            use postroom::nats::async_nats::jetstream::consumer;
            let client = async_nats::connect(&url).await.unwrap();
            async_nats::jetstream::new(client)
                .get_stream("HOP")
                .await
                .unwrap()
                .create_consumer(consumer::pull::Config {
                    durable_name: Some("b".into()),
                    ack_policy: consumer::AckPolicy::Explicit,
                    ack_wait: Duration::from_secs(2),
                    ..Default::default()
                })
                .await
                .unwrap();
        });
    let b_db = dir.path().join("b.db");
    let env = [("POSTROOM_NATS_URL", url.clone())];
    let mut child = spawn_child("device-b", &b_db, &env);
    wait_for(&lines_of(&mut child), "READY");
    let a_db = dir.path().join("a.db");
    let a = device_a(&a_db, &url);
    const N: i64 = 400;
    let committed = AtomicU64::new(0);
    let applied_at_kill = thread::scope(|s| {
        s.spawn(|| publish(&a, N, Duration::from_millis(3), &committed));
        eventually(60, "a third applied before the kill", || {
            effects(&b_db).1 >= N / 3
        });
        child.kill().unwrap();
        assert_eq!(child.wait().unwrap().signal(), Some(9));
        let at_kill = effects(&b_db).1;
        thread::sleep(Duration::from_millis(300));
        child = spawn_child("device-b", &b_db, &env);
        wait_for(&lines_of(&mut child), "READY");
        at_kill
    });
    eventually(90, "every message applied", || effects(&b_db).1 == N);
    child.kill().unwrap();
    child.wait().unwrap();
    println!("device B killed with {applied_at_kill} of {N} applied");
    assert!(applied_at_kill < N, "the kill came after the run");
    assert_eq!(a.stats().unwrap().outbox.dead, 0);
    assert_exactly_once_in_order(&b_db, N);
}

/// Per-key order in the sink: the stream refuses a row of key `k` (over
/// its `max_message_size`), so the row behind it of the same key must not
/// be published while the refused one is still pending: it would be in the
/// stream ahead of it. It goes once the refused row is dead
/// (`max_attempts`); a row of another key goes at once.
#[test]
fn a_row_the_stream_refuses_holds_back_the_later_rows_of_its_key() {
    let dir = tempfile::tempdir().unwrap();
    let Some(server) = NatsServer::start(&dir.path().join("nats")) else {
        return;
    };
    let url = server.url();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let js = rt.block_on(async {
        async_nats::jetstream::new(async_nats::connect(url.as_str()).await.unwrap())
    });
    rt.block_on(js.create_stream(async_nats::jetstream::stream::Config {
        name: "ORD".into(),
        subjects: vec!["ord.>".into()],
        max_message_size: 1024,
        ..Default::default()
    }))
    .unwrap();
    let subjects_in_stream = || {
        rt.block_on(async {
            let stream = js.get_stream("ORD").await.unwrap();
            let n = stream.get_info().await.unwrap().state.last_sequence;
            let mut subjects = Vec::new();
            for seq in 1..=n {
                if let Ok(m) = stream.get_raw_message(seq).await {
                    subjects.push(m.subject.to_string());
                }
            }
            subjects
        })
    };
    let a_db = dir.path().join("a.db");
    let a = Postroom::builder()
        .max_attempts(3)
        .backoff(Duration::from_millis(400), Duration::from_millis(400))
        .relay_poll(Duration::from_millis(20))
        .sink(NatsSink::new(&url).subject_with(|m| format!("ord.{}", m.payload.len())))
        .open(&a_db)
        .unwrap();
    a.transaction(|tx| {
        tx.publish(Outgoing::new("orders", vec![b'x'; 2000]).with_key("k"))?;
        tx.publish(Outgoing::new("orders", "k2").with_key("k"))?;
        tx.publish(Outgoing::new("orders", "other").with_key("j"))?;
        Ok(())
    })
    .unwrap();
    let big_status = || {
        let conn = raw(&a_db);
        conn.query_row(
            "SELECT status, attempts FROM postroom_outbox WHERE length(payload) = 2000",
            [],
            |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)),
        )
        .unwrap()
    };
    // While the refused row is pending, its key's later row is not in the
    // stream; the other key's row is.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, attempts) = big_status();
        let subjects = subjects_in_stream();
        if status == "dead" {
            break;
        }
        assert!(
            !subjects.contains(&"ord.2".to_string()),
            "k's second row is in the stream while its first is {status} after {attempts} \
             attempts: {subjects:?}"
        );
        assert!(Instant::now() < deadline, "the refused row never died");
        thread::sleep(Duration::from_millis(50));
    }
    eventually(30, "k's second row sent after the first died", || {
        subjects_in_stream().contains(&"ord.2".to_string())
    });
    let subjects = subjects_in_stream();
    assert_eq!(subjects, vec!["ord.5", "ord.2"], "{subjects:?}");
    let (_, attempts) = big_status();
    assert_eq!(attempts, 3);
}

/// A server that cannot be reached is an outage, not the rows' fault: with
/// `max_attempts(1)` every row stays pending with no attempt counted while
/// the server is down, and all go once it is back.
#[test]
fn an_unreachable_server_counts_no_attempt() {
    let dir = tempfile::tempdir().unwrap();
    let Some(mut server) = NatsServer::start(&dir.path().join("nats")) else {
        return;
    };
    let url = server.url();
    ensure_stream(&url, "HOP", &["hop.>"]).unwrap();
    server.kill();
    let a_db = dir.path().join("a.db");
    let a = Postroom::builder()
        .max_attempts(1)
        .relay_poll(Duration::from_millis(20))
        .sink(
            NatsSink::new(&url)
                .subject_prefix("hop.")
                .ack_timeout(Duration::from_millis(500))
                .backoff(Duration::from_millis(50), Duration::from_millis(200)),
        )
        .open(&a_db)
        .unwrap();
    publish(&a, 20, Duration::ZERO, &AtomicU64::new(0));
    let tried = || {
        let conn = raw(&a_db);
        count(
            &conn,
            "SELECT count(*) FROM postroom_outbox WHERE last_error LIKE '%nats%'",
        )
    };
    eventually(30, "the sink met the outage", || tried() > 0);
    // A few more tries against the dead server.
    thread::sleep(Duration::from_millis(700));
    let conn = raw(&a_db);
    assert_eq!(
        count(
            &conn,
            "SELECT count(*) FROM postroom_outbox WHERE attempts > 0 OR status != 'pending'"
        ),
        0,
        "an outage counted an attempt"
    );
    drop(conn);
    server.up();
    eventually(60, "every row sent once the server is back", || {
        a.stats().is_ok_and(|s| s.outbox.sent == 20)
    });
    assert_eq!(a.stats().unwrap().outbox.dead, 0);
}

/// What could never store a message is refused at `start()`, before any
/// server is asked: an unknown consumer, an empty stream or durable name.
/// (An effectful consumer without `.queued()` is refused by the same
/// engine check as the MQTT intake's, tests/mqtt.rs.)
#[test]
fn an_intake_that_could_never_store_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let b = device_b(&dir.path().join("b.db"));
    let nobody = "nats://127.0.0.1:1"; // start() must not need the server
    let unknown = NatsIntake::builder(nobody, Arc::clone(&b), "nobody", "HOP", "b").start();
    assert!(
        matches!(unknown, Err(postroom::Error::UnknownConsumer { .. })),
        "an unknown consumer: {:?}",
        unknown.err()
    );
    for (stream, durable) in [("", "b"), ("HOP", "")] {
        let empty = NatsIntake::builder(nobody, Arc::clone(&b), "b", stream, durable).start();
        assert!(
            matches!(empty, Err(postroom::Error::InvalidInput { .. })),
            "stream {stream:?}, durable {durable:?}: {:?}",
            empty.err()
        );
    }
    let fine = NatsIntake::builder(nobody, Arc::clone(&b), "b", "HOP", "b")
        .start()
        .expect("a transactional consumer, inline");
    assert!(!fine.wait_bound(Duration::from_millis(200)));
    fine.shutdown(Duration::from_secs(10)).unwrap();
}

/// Brakes through the intake (issue 36 item 4): device B's consumer has a
/// backlog bound, and its effect step waits at a gate until the intake has
/// been answered `Backlogged`; meanwhile the queued intake acknowledges
/// nothing it did not store and holds the stream. B's backlog stays within
/// the bound, and once the gate opens every message is applied exactly
/// once, per key in order.
#[test]
fn a_braked_intake_holds_the_stream_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let Some(server) = NatsServer::start(&dir.path().join("nats")) else {
        return;
    };
    let url = server.url();
    ensure_stream(&url, "HOP", &["hop.>"]).unwrap();
    let limit = 20;
    let gate = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let b_db = dir.path().join("b.db");
    let b = Arc::new(
        Postroom::builder()
            .poll_interval(Duration::from_millis(20))
            .effectful_consumer("b", Gated(Arc::clone(&gate)))
            .backlog_limit("b", limit)
            .open(&b_db)
            .unwrap(),
    );
    b.transaction(|tx| {
        tx.execute_batch("CREATE TABLE effects (msg_id TEXT NOT NULL, key TEXT, n INTEGER)")?;
        Ok(())
    })
    .unwrap();
    let intake = NatsIntake::builder(&url, Arc::clone(&b), "b", "HOP", "b")
        .queued()
        .start()
        .unwrap();
    assert!(intake.wait_bound(Duration::from_secs(30)));
    let a_db = dir.path().join("a.db");
    let a = device_a(&a_db, &url);
    const N: i64 = 200;
    publish(&a, N, Duration::ZERO, &AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(60);
    while intake.stats().not_acked == 0 {
        assert!(
            Instant::now() < deadline,
            "never braked: {:?}",
            intake.stats()
        );
        thread::sleep(Duration::from_millis(20));
    }
    let held = b
        .stats()
        .unwrap()
        .inbox
        .get("b")
        .copied()
        .unwrap_or_default();
    let backlog = held.pending + held.processing + held.failed;
    assert!(
        (limit..=limit + 1).contains(&backlog),
        "backlog {backlog} while braked, bound {limit}"
    );
    assert_eq!(
        intake.stats().acked,
        backlog,
        "acknowledged only what was stored"
    );
    gate.store(true, Ordering::SeqCst);
    settle(&a_db, &b_db, N, "braked", || {
        format!("{:?}", intake.stats())
    });
    let stats = intake.stats();
    println!("{N} messages, backlog {backlog} while braked (bound {limit}), intake {stats:?}");
    intake.shutdown(Duration::from_secs(10)).unwrap();
    assert_exactly_once_in_order(&b_db, N);
}

/// An effect step that waits (bounded) until the gate opens, then an
/// effects row per message.
struct Gated(Arc<std::sync::atomic::AtomicBool>);

impl postroom::EffectHandler for Gated {
    type Output = ();
    fn effect(&self, _: &postroom::EffectContext<'_>, _: &Message) -> Result<(), Failure> {
        let until = Instant::now() + Duration::from_secs(60);
        while !self.0.load(Ordering::SeqCst) && Instant::now() < until {
            thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }
    fn apply(&self, tx: &mut postroom::Tx<'_>, msg: &Message, (): ()) -> Result<(), Failure> {
        tx.execute(
            "INSERT INTO effects (msg_id, key, n) VALUES (?1, ?2, ?3)",
            rusqlite::params![
                msg.id(),
                msg.ordering_key(),
                String::from_utf8_lossy(msg.payload()).parse::<i64>().ok()
            ],
        )?;
        Ok(())
    }
}
