//! The MQTT bridge against a real broker: mosquitto started per test on a
//! free localhost port when it is on PATH, else rumqttd embedded in this
//! process (tests/support/broker.rs); each test prints which one it used.
//! Device A publishes through its outbox and `MqttSink`; device B takes the
//! messages in through `MqttIntake` into its inbox. The checks are on B's
//! database: every message applied exactly once, per key in commit order.

#[path = "support/broker.rs"]
mod broker;
mod common;
#[path = "support/server.rs"]
mod server;

use std::collections::HashMap;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use broker::Broker;
use common::*;
use postroom::mqtt::rumqttc::{self, Event, MqttOptions, Packet, QoS};
use postroom::mqtt::{Envelope, MqttIntake, MqttSink};
use postroom::{handler_fn, Failure, Message, Outcome, Outgoing, Postroom};

/// Entry point of the child processes (device B). Not a test: it only does
/// something when started by `spawn_child`, and is ignored otherwise.
#[test]
#[ignore = "entry point for child processes of the MQTT tests"]
fn child_main() {
    let Some((role, db)) = child_role() else {
        return;
    };
    report("");
    assert_eq!(role, "device-b", "unknown child role");
    let port: u16 = std::env::var("POSTROOM_MQTT_PORT")
        .unwrap()
        .parse()
        .unwrap();
    let client = std::env::var("POSTROOM_MQTT_CLIENT").unwrap();
    let room = device_b(&db);
    let intake = MqttIntake::builder(options(&client, port), Arc::clone(&room), "b")
        .subscribe(format!("{client}/#"))
        .start()
        .unwrap();
    assert!(intake.wait_subscribed(Duration::from_secs(20)));
    report("READY");
    loop {
        thread::sleep(Duration::from_secs(1));
    }
}

fn options(client_id: &str, port: u16) -> MqttOptions {
    let mut o = MqttOptions::new(client_id, "127.0.0.1", port);
    o.set_keep_alive(Duration::from_secs(5));
    o
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

/// Device A with an MQTT sink publishing `orders` rows as
/// `<topics>/orders` (tests share the embedded broker: each has its own
/// topics).
fn device_a(db: &Path, client_id: &str, port: u16, topics: &str) -> Postroom {
    Postroom::builder()
        .max_attempts(2) // an outage must not use attempts up
        .relay_poll(Duration::from_millis(20))
        .sink(
            MqttSink::new(options(client_id, port))
                .source("device-a")
                .topic_prefix(format!("{topics}/"))
                .backoff(Duration::from_millis(50), Duration::from_millis(500)),
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
    conn.query_row(
        "SELECT count(last_error), count(*) FILTER (WHERE status != 'sent')
         FROM postroom_outbox",
        [],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )
    .unwrap()
}

/// The broker goes down for a second while A publishes 300 messages: A's
/// sink keeps the unacknowledged rows pending (no attempt counted, so
/// `max_attempts(2)` kills none), B's intake reconnects and resubscribes;
/// every message is applied exactly once, per key in order.
#[test]
fn a_broker_restart_mid_run_loses_nothing_and_duplicates_are_absorbed() {
    let dir = tempfile::tempdir().unwrap();
    let mut broker = Broker::start(&dir.path().join("broker"));
    let port = broker.port;
    let b_db = dir.path().join("b.db");
    let b = device_b(&b_db);
    let intake = MqttIntake::builder(options("restart-b", port), Arc::clone(&b), "b")
        .subscribe("restart-b/#")
        .start()
        .unwrap();
    assert!(intake.wait_subscribed(Duration::from_secs(20)));
    let a_db = dir.path().join("a.db");
    let a = device_a(&a_db, "restart-a", port, "restart-b");
    const N: i64 = 300;
    let started = Instant::now();
    let committed = AtomicU64::new(0);
    thread::scope(|s| {
        s.spawn(|| publish(&a, N, Duration::from_millis(5), &committed));
        // Mid-stream on A's side: two thirds are yet to be committed, so
        // they meet the outage however far behind B is.
        eventually(30, "a third committed before the restart", || {
            committed.load(Ordering::SeqCst) >= N as u64 / 3
        });
        broker.restart(Duration::from_secs(1));
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let settled = loop {
        if effects(&b_db).1 == N && outbox_failures(&a_db).1 == 0 {
            break true;
        }
        if Instant::now() > deadline {
            break false;
        }
        thread::sleep(Duration::from_millis(50));
    };
    let (rows, distinct, _) = effects(&b_db);
    assert!(
        settled,
        "B applied {distinct} of {N} ({rows} effects); A's outbox (rows that met a failure, \
         rows not sent): {:?}; intake {:?}",
        outbox_failures(&a_db),
        intake.stats()
    );
    let stats = intake.stats();
    let (failed_rows, _) = outbox_failures(&a_db);
    println!(
        "{N} messages in {:?}: rows that met the outage {failed_rows}, intake {stats:?}",
        started.elapsed()
    );
    // The restart hit the run: B reconnected, and A's sink saw it.
    assert!(stats.connects >= 2, "{stats:?}");
    assert!(failed_rows > 0, "no row met the outage");
    assert_eq!(a.stats().unwrap().outbox.dead, 0);
    intake.shutdown(Duration::from_secs(5)).unwrap();
    assert_exactly_once_in_order(&b_db, N);
}

/// Device B is a real child process, SIGKILLed while it takes messages in
/// and started again with the same client id: its persistent session on the
/// broker kept what came meanwhile and what it had not acknowledged, and
/// its inbox absorbs what it had applied but not acknowledged.
#[test]
fn device_b_killed_mid_run_applies_every_message_once() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(&dir.path().join("broker"));
    let port = broker.port;
    let b_db = dir.path().join("b.db");
    let env = [
        ("POSTROOM_MQTT_PORT", port.to_string()),
        ("POSTROOM_MQTT_CLIENT", "crash-b".to_string()),
    ];
    let mut child = spawn_child("device-b", &b_db, &env);
    wait_for(&lines_of(&mut child), "READY");
    let a_db = dir.path().join("a.db");
    let a = device_a(&a_db, "crash-a", port, "crash-b");
    const N: i64 = 400;
    let committed = AtomicU64::new(0);
    let applied_at_kill = thread::scope(|s| {
        s.spawn(|| publish(&a, N, Duration::from_millis(3), &committed));
        eventually(30, "a third applied before the kill", || {
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
    eventually(60, "every message applied", || effects(&b_db).1 == N);
    child.kill().unwrap();
    child.wait().unwrap();
    println!("device B killed with {applied_at_kill} of {N} applied");
    assert!(applied_at_kill < N, "the kill came after the run");
    assert_eq!(a.stats().unwrap().outbox.dead, 0);
    assert_exactly_once_in_order(&b_db, N);
}

/// The handler fails one message's first attempt: `Outcome::Failed`, so
/// the intake does not acknowledge it. The broker redelivers it (DUP) when
/// the intake reconnects after its `retry_after`; the second attempt
/// applies it. A publisher sending the same envelope twice, and a plain
/// payload twice, is absorbed as duplicates.
#[test]
fn a_message_not_acked_is_redelivered_on_reconnect_and_duplicates_are_absorbed() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(&dir.path().join("broker"));
    let port = broker.port;
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
    let intake = MqttIntake::builder(options("redeliver-b", port), Arc::clone(&b), "b")
        .subscribe("redeliver/#")
        .start()
        .unwrap();
    assert!(intake.wait_subscribed(Duration::from_secs(20)));

    // A plain publisher: envelopes made by hand, a repeat, a plain payload.
    let (client, mut conn) = rumqttc::Client::new(options("redeliver-pub", port), 16);
    let envelope = |id: &str, seq| {
        Envelope::new(id, seq, "raw", format!("payload of {id}"))
            .with_source("raw-publisher")
            .encode()
    };
    let sends: Vec<(&str, Vec<u8>)> = vec![
        ("redeliver/a", envelope("first", 1)),
        ("redeliver/a", envelope("flaky", 2)),
        ("redeliver/a", envelope("first", 1)), // a repeat: a duplicate
        ("redeliver/b", b"no envelope".to_vec()),
        ("redeliver/b", b"no envelope".to_vec()), // the same plain payload again
        ("redeliver/a", envelope("last", 3)),
    ];
    for (topic, payload) in &sends {
        client
            .publish(*topic, QoS::AtLeastOnce, false, payload.clone())
            .unwrap();
    }
    let mut acks = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    while acks < sends.len() && Instant::now() < deadline {
        if let Ok(Ok(Event::Incoming(Packet::PubAck(_)))) =
            conn.recv_timeout(Duration::from_millis(100))
        {
            acks += 1;
        }
    }
    assert_eq!(acks, sends.len(), "the broker acknowledged every publish");

    eventually(30, "the flaky message applied", || {
        effects(&b_db).1 == 4 && intake.stats().acked >= sends.len() as u64
    });
    let stats = intake.stats();
    println!("intake {stats:?}");
    assert_eq!(attempts.load(Ordering::SeqCst), 2, "flaky ran twice");
    assert!(stats.not_acked >= 1, "{stats:?}");
    // Redelivered: more came than was sent (rumqttd does not set the DUP
    // flag on a resumed session's resends; mosquitto does).
    assert!(
        stats.received > sends.len() as u64,
        "no redelivery: {stats:?}"
    );
    assert!(stats.connects >= 2, "no reconnect: {stats:?}");
    assert!(stats.duplicates >= 2, "{stats:?}");
    assert_eq!(stats.unwrapped, 2, "{stats:?}");
    let (rows, distinct, _) = effects(&b_db);
    assert_eq!((rows, distinct), (4, 4));
    // The inbox holds "flaky" under the envelope's source and id.
    let again = Message::new("raw-publisher", "flaky", "payload of flaky");
    assert_eq!(b.deliver("b", again).unwrap(), Outcome::Duplicate);
    intake.shutdown(Duration::from_secs(5)).unwrap();
}

/// What goes on the wire, read by a plain MQTT subscriber: one envelope
/// per row carrying the outbox id, `seq` and source, the payload bytes
/// untouched (newlines and non-UTF-8 included), the topic mapped by the
/// sink. A row whose mapped topic holds a wildcard is dead at once, and the
/// rows of other keys go on.
#[test]
fn the_sink_publishes_envelopes_with_the_outbox_id_and_seq() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(&dir.path().join("broker"));
    let port = broker.port;
    let mut reader = options("wire-reader", port);
    reader.set_max_packet_size(1 << 20, 1 << 20);
    let (client, mut conn) = rumqttc::Client::new(reader, 16);
    client.subscribe("wire/#", QoS::AtLeastOnce).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        assert!(Instant::now() < deadline, "no SUBACK");
        if let Ok(Ok(Event::Incoming(Packet::SubAck(_)))) =
            conn.recv_timeout(Duration::from_millis(100))
        {
            break;
        }
    }
    let a = Postroom::builder()
        .relay_poll(Duration::from_millis(20))
        .sink(
            MqttSink::new(options("wire-a", port))
                .source("device-a")
                .topic_with(|m| format!("wire/{}/{}", m.topic, m.key.as_deref().unwrap_or("-"))),
        )
        .open(dir.path().join("a.db"))
        .unwrap();
    // Past rumqttc's default 10 KiB packet limit, within postroom's 1 MiB.
    let mut binary = b"line one\nline two\n\xff\x00".to_vec();
    binary.resize(300 * 1024, b'x');
    a.transaction({
        let binary = binary.clone();
        move |tx| {
            tx.publish(Outgoing::new("orders", binary).with_key("7"))?;
            tx.publish(Outgoing::new("orders", "bad").with_key("+"))?;
            tx.publish(Outgoing::new("orders", "plain").with_header("trace", "t1"))?;
            Ok(())
        }
    })
    .unwrap();
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while got.len() < 2 && Instant::now() < deadline {
        if let Ok(Ok(Event::Incoming(Packet::Publish(p)))) =
            conn.recv_timeout(Duration::from_millis(100))
        {
            got.push(p);
        }
    }
    assert_eq!(got.len(), 2, "two rows on the wire");
    eventually(10, "the wildcard row dead", || {
        a.stats().unwrap().outbox.dead == 1
    });
    let conn_a = rusqlite::Connection::open(dir.path().join("a.db")).unwrap();
    let rows: Vec<(i64, String, String)> = conn_a
        .prepare("SELECT seq, message_id, status FROM postroom_outbox ORDER BY seq")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(rows[1].2, "dead");
    let first = Envelope::decode(&got[0].payload).expect("an envelope");
    assert_eq!(got[0].topic, "wire/orders/7");
    assert_eq!(
        (first.seq, first.id.as_str()),
        (rows[0].0, rows[0].1.as_str())
    );
    assert_eq!(first.source.as_deref(), Some("device-a"));
    assert_eq!(first.key.as_deref(), Some("7"));
    assert_eq!(first.payload, binary);
    let third = Envelope::decode(&got[1].payload).expect("an envelope");
    assert_eq!(got[1].topic, "wire/orders/-");
    assert_eq!(
        (third.seq, third.id.as_str()),
        (rows[2].0, rows[2].1.as_str())
    );
    assert_eq!(third.headers["trace"], "t1");
    assert_eq!(third.payload, b"plain");
    // The first line is plain JSON any consumer can read.
    let line = got[0].payload.split(|&b| b == b'\n').next().unwrap();
    let json: serde_json::Value = serde_json::from_slice(line).unwrap();
    assert_eq!(json["postroom"], 1);
    assert_eq!(json["id"], rows[0].1.as_str());
    a.shutdown(Duration::from_secs(5)).unwrap();
}

fn options_v5(client_id: &str, port: u16) -> rumqttc::v5::MqttOptions {
    let mut o = rumqttc::v5::MqttOptions::new(client_id, "127.0.0.1", port);
    o.set_keep_alive(Duration::from_secs(5));
    o
}

/// MQTT 5: the sink sends the payload as it is, with the outbox id, `seq`,
/// source, topic and key as user properties and the headers under their
/// own names (read by a plain MQTT 5 subscriber); the MQTT 5 intake builds
/// the inbox message from them. One message's handler fails once: left
/// unacknowledged, it is redelivered after the reconnect (its persistent
/// session needs a session expiry interval in MQTT 5) and applied once; a
/// plain republish of one with the same id is absorbed.
#[test]
fn mqtt5_carries_the_id_and_seq_as_user_properties() {
    use rumqttc::v5::mqttbytes::v5::{Packet as P5, PublishProperties};
    use rumqttc::v5::mqttbytes::QoS as QoS5;
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(&dir.path().join("broker"));
    let port = broker.port_v5;
    let failed_once = Arc::new(AtomicU64::new(0));
    let seen = Arc::clone(&failed_once);
    let b_db = dir.path().join("b.db");
    let b = Arc::new(
        Postroom::builder()
            .consumer(
                "b",
                handler_fn(move |tx, msg: &Message| {
                    let n: i64 = String::from_utf8_lossy(msg.payload()).parse().unwrap_or(-1);
                    if n == 10 && seen.fetch_add(1, Ordering::SeqCst) == 0 {
                        return Err(Failure::retry_after("busy", Duration::from_millis(300)));
                    }
                    assert_eq!(msg.header("trace"), Some("t"), "headers travel");
                    tx.execute(
                        "INSERT INTO effects (msg_id, key, n) VALUES (?1, ?2, ?3)",
                        rusqlite::params![msg.id(), msg.ordering_key(), n],
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
    let intake = MqttIntake::builder_v5(options_v5("v5-b", port), Arc::clone(&b), "b")
        .subscribe("v5/#")
        .start()
        .unwrap();
    assert!(intake.wait_subscribed(Duration::from_secs(20)));
    let (reader, mut reader_conn) = rumqttc::v5::Client::new(options_v5("v5-reader", port), 16);
    reader.subscribe("v5/#", QoS5::AtLeastOnce).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        assert!(Instant::now() < deadline, "no SUBACK");
        if let Ok(Ok(rumqttc::v5::Event::Incoming(P5::SubAck(_)))) =
            reader_conn.recv_timeout(Duration::from_millis(100))
        {
            break;
        }
    }

    let a_db = dir.path().join("a.db");
    let a = Postroom::builder()
        .relay_poll(Duration::from_millis(20))
        .sink(
            MqttSink::v5(options_v5("v5-a", port))
                .source("device-a")
                .topic_prefix("v5/"),
        )
        .open(&a_db)
        .unwrap();
    const N: i64 = 40;
    a.transaction(|tx| {
        for i in 0..N {
            tx.publish(
                Outgoing::new("orders", i.to_string())
                    .with_key(format!("k{}", i % 4))
                    .with_header("trace", "t"),
            )?;
        }
        Ok(())
    })
    .unwrap();

    // The wire, as a plain MQTT 5 subscriber sees it.
    let mut wire = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while wire.len() < N as usize && Instant::now() < deadline {
        if let Ok(Ok(rumqttc::v5::Event::Incoming(P5::Publish(p)))) =
            reader_conn.recv_timeout(Duration::from_millis(100))
        {
            wire.push(p);
        }
    }
    assert_eq!(wire.len(), N as usize);
    let conn_a = rusqlite::Connection::open(&a_db).unwrap();
    let (seq, id): (i64, String) = conn_a
        .query_row(
            "SELECT seq, message_id FROM postroom_outbox ORDER BY seq LIMIT 1",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    let first = &wire[0];
    assert_eq!(&first.payload[..], b"0", "the payload as it is");
    assert_eq!(&first.topic[..], b"v5/orders");
    let props = &first
        .properties
        .as_ref()
        .expect("properties")
        .user_properties;
    let prop = |k: &str| props.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    assert_eq!(prop("postroom-id"), Some(id.as_str()));
    assert_eq!(prop("postroom-seq"), Some(seq.to_string().as_str()));
    assert_eq!(prop("postroom-source"), Some("device-a"));
    assert_eq!(prop("postroom-topic"), Some("orders"));
    assert_eq!(prop("postroom-key"), Some("k0"));
    assert_eq!(prop("trace"), Some("t"));

    eventually(30, "every message applied on B", || effects(&b_db).1 == N);
    // The same id again, from a plain MQTT 5 publisher: a duplicate.
    let again = PublishProperties {
        user_properties: vec![
            ("postroom-id".into(), id.clone()),
            ("postroom-source".into(), "device-a".into()),
            ("trace".into(), "t".into()),
        ],
        ..Default::default()
    };
    reader
        .publish_with_properties("v5/orders", QoS5::AtLeastOnce, false, "0", again)
        .unwrap();
    eventually(20, "the republish absorbed", || {
        // Drive the reader's connection: its publish goes out as it polls.
        let _ = reader_conn.recv_timeout(Duration::from_millis(20));
        intake.stats().duplicates >= 1
    });
    let stats = intake.stats();
    println!("intake {stats:?}");
    assert_eq!(failed_once.load(Ordering::SeqCst), 2, "n=10 ran twice");
    assert!(stats.not_acked >= 1 && stats.connects >= 2, "{stats:?}");
    intake.shutdown(Duration::from_secs(5)).unwrap();
    a.shutdown(Duration::from_secs(5)).unwrap();
    assert_exactly_once_in_order(&b_db, N);
}

/// A careless operator's settings: a zero PUBACK timeout and zero backoff
/// still deliver (kept at their floors); a backoff of `Duration::MAX`
/// against a broker that is not there neither panics (a panicking sink is
/// a retry, which would use the one attempt up) nor dead-letters, and an
/// intake so configured still shuts down at once.
#[test]
fn settings_at_their_extremes_neither_spin_nor_panic_nor_lose() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(&dir.path().join("broker"));
    let a = Postroom::builder()
        .max_attempts(1)
        .relay_poll(Duration::from_millis(20))
        .sink(
            MqttSink::new(options("extreme-a", broker.port))
                .ack_timeout(Duration::ZERO)
                .backoff(Duration::ZERO, Duration::ZERO),
        )
        .open(dir.path().join("a.db"))
        .unwrap();
    a.transaction(|tx| {
        tx.publish(Outgoing::new("t", "x"))?;
        Ok(())
    })
    .unwrap();
    eventually(20, "sent with a zero ack timeout", || {
        a.stats().unwrap().outbox.sent == 1
    });

    let nobody = broker::free_port();
    let down_db = dir.path().join("down.db");
    let down = Postroom::builder()
        .max_attempts(1)
        .relay_poll(Duration::from_millis(20))
        .sink(
            MqttSink::new(options("extreme-down", nobody))
                .backoff(Duration::MAX, Duration::MAX)
                .ack_timeout(Duration::MAX),
        )
        .open(&down_db)
        .unwrap();
    down.transaction(|tx| {
        tx.publish(Outgoing::new("t", "x").with_key("k"))?;
        tx.publish(Outgoing::new("t", "y"))?;
        Ok(())
    })
    .unwrap();
    let conn = rusqlite::Connection::open(&down_db).unwrap();
    let put_off = || -> i64 {
        conn.query_row(
            "SELECT count(*) FROM postroom_outbox
             WHERE status = 'pending' AND attempts = 0 AND last_error IS NOT NULL",
            [],
            |r| r.get(0),
        )
        .unwrap()
    };
    eventually(20, "both rows put off", || put_off() == 2);
    thread::sleep(Duration::from_millis(200));
    assert_eq!(put_off(), 2);
    assert_eq!(down.stats().unwrap().outbox.dead, 0);
    down.shutdown(Duration::from_secs(5)).unwrap();

    let b = Arc::new(
        Postroom::builder()
            .consumer("b", handler_fn(|_, _| Ok(())))
            .open(dir.path().join("b.db"))
            .unwrap(),
    );
    let intake = MqttIntake::builder(options("extreme-b", nobody), Arc::clone(&b), "b")
        .subscribe("x/#")
        .backoff(Duration::MAX, Duration::MAX)
        .start()
        .unwrap();
    thread::sleep(Duration::from_millis(300)); // it has failed to connect
    let stopping = Instant::now();
    intake.shutdown(Duration::from_secs(5)).unwrap();
    assert!(stopping.elapsed() < Duration::from_secs(2));
}

/// A replay after the receiver's retention: with `sequenced()`, B keeps a
/// watermark per sending outbox (its origin and `seq` travel in the
/// envelope), so when A's whole outbox is sent again after B's retention
/// deleted the rows, every message is answered as a duplicate by its
/// number and none is applied twice.
#[test]
fn a_sequenced_intake_absorbs_a_replay_after_its_retention() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(&dir.path().join("broker"));
    let port = broker.port;
    let b_db = dir.path().join("b.db");
    let clock = postroom::ManualClock::new(1_800_000_000_000);
    let b = Arc::new(
        Postroom::builder()
            .clock(clock.clone())
            .retention(Duration::from_secs(3600))
            .consumer(
                "b",
                handler_fn(|tx, msg: &Message| {
                    tx.execute_batch(
                        "CREATE TABLE IF NOT EXISTS effects (msg_id TEXT NOT NULL, key TEXT, n INTEGER)",
                    )?;
                    tx.execute("INSERT INTO effects (msg_id) VALUES (?1)", [msg.id()])?;
                    Ok(())
                }),
            )
            .open(&b_db)
            .unwrap(),
    );
    let intake = MqttIntake::builder(options("replay-b", port), Arc::clone(&b), "b")
        .subscribe("replay-b/#")
        .sequenced()
        .start()
        .unwrap();
    assert!(intake.wait_subscribed(Duration::from_secs(20)));
    let a_db = dir.path().join("a.db");
    let a = device_a(&a_db, "replay-a", port, "replay-b");
    const N: i64 = 40;
    publish(&a, N, Duration::ZERO, &AtomicU64::new(0));
    eventually(30, "B to apply every message", || effects(&b_db).1 == N);
    let first = b.stats().unwrap();
    assert_eq!(first.sequences.len(), 1, "{:?}", first.sequences);
    assert_eq!(
        first.sequences[0].watermark, N as u64,
        "{:?}",
        first.sequences
    );

    // Two hours later retention has deleted B's rows (all but the newest).
    clock.advance(Duration::from_secs(7200));
    b.cleanup().unwrap();
    assert!(b.stats().unwrap().inbox["b"].completed <= 1);

    // A replays its whole outbox.
    rusqlite::Connection::open(&a_db)
        .unwrap()
        .execute(
            "UPDATE postroom_outbox SET status = 'pending', sent_at = NULL, next_attempt_at = 0",
            [],
        )
        .unwrap();
    eventually(30, "the replay to be absorbed", || {
        intake.stats().duplicates >= N as u64
    });
    let (rows, distinct, _) = effects(&b_db);
    assert_eq!(
        (rows, distinct),
        (N, N),
        "a replayed message was applied again"
    );
    assert!(
        b.stats().unwrap().inbox["b"].completed <= 1,
        "replayed rows stored again"
    );
    println!("broker: {:?}; intake {:?}", broker.kind, intake.stats());
    intake.shutdown(Duration::from_secs(5)).unwrap();
}

/// Publishes `payloads` to `topic` at QoS 1 from a plain MQTT 3.1.1 client
/// and waits for the broker's PUBACKs.
fn publish_raw(port: u16, client_id: &str, topic: &str, payloads: Vec<Vec<u8>>) {
    let mut o = options(client_id, port);
    o.set_max_packet_size(1 << 20, 1 << 20);
    let (client, mut conn) = rumqttc::Client::new(o, 64);
    let n = payloads.len();
    for p in payloads {
        client.publish(topic, QoS::AtLeastOnce, false, p).unwrap();
    }
    let mut acked = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    while acked < n {
        assert!(Instant::now() < deadline, "no PUBACKs: {acked} of {n}");
        if let Ok(Ok(Event::Incoming(Packet::PubAck(_)))) =
            conn.recv_timeout(Duration::from_millis(100))
        {
            acked += 1;
        }
    }
    let _ = client.disconnect();
    let _ = conn.recv_timeout(Duration::from_millis(100));
}

/// Device B for the wire-input tests: consumer `b` records what it applies
/// in `effects`, payloads over 100 bytes are refused (`max_payload`), and
/// `e` is an effectful consumer.
fn device_b_small(db: &Path) -> Arc<Postroom> {
    struct Pass;
    impl postroom::EffectHandler for Pass {
        type Output = ();
        fn effect(&self, _: &postroom::EffectContext<'_>, _: &Message) -> Result<(), Failure> {
            Ok(())
        }
        fn apply(&self, _: &mut postroom::Tx<'_>, _: &Message, _: ()) -> Result<(), Failure> {
            Ok(())
        }
    }
    let room = Postroom::builder()
        .max_payload(100)
        .consumer(
            "b",
            handler_fn(|tx, msg: &Message| {
                tx.execute(
                    "INSERT INTO effects (msg_id, key, n) VALUES (?1, ?2, 0)",
                    rusqlite::params![msg.id(), msg.ordering_key()],
                )?;
                Ok(())
            }),
        )
        .effectful_consumer("e", Pass)
        .open(db)
        .unwrap();
    room.transaction(|tx| {
        tx.execute_batch("CREATE TABLE effects (msg_id TEXT NOT NULL, key TEXT, n INTEGER)")?;
        Ok(())
    })
    .unwrap();
    Arc::new(room)
}

/// Issue 31, finding 2: an intake that could never store a message is
/// refused when it starts, with a typed error: an effectful consumer in
/// deliver mode (it takes messages through `receive` only) and a consumer
/// the engine does not have. The same consumers in a mode that works start.
#[test]
fn an_intake_into_a_consumer_it_cannot_feed_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let b = device_b_small(&dir.path().join("b.db"));
    let nobody = broker::free_port(); // start() must not need the broker
    let start = |consumer: &str, queued: bool| {
        let builder = MqttIntake::builder(options("misconf", nobody), Arc::clone(&b), consumer)
            .subscribe("x/#");
        let builder = if queued { builder.queued() } else { builder };
        builder.start().map(|intake| {
            intake.shutdown(Duration::from_secs(5)).unwrap();
        })
    };
    let effectful = start("e", false);
    assert!(
        matches!(effectful, Err(postroom::Error::InvalidInput { .. })),
        "an effectful consumer in deliver mode: {effectful:?}"
    );
    let unknown = start("nobody", true);
    assert!(
        matches!(unknown, Err(postroom::Error::UnknownConsumer { .. })),
        "an unknown consumer: {unknown:?}"
    );
    start("e", true).expect("an effectful consumer, queued");
    start("b", false).expect("a transactional consumer, inline");
    start("b", true).expect("a transactional consumer, queued");
}

/// Issue 31, "never ack what is not stored": a message the engine refuses
/// (a payload over `max_payload`, more than 64 headers, an id over 512
/// bytes, a source with a control character) is acknowledged only once it
/// is a dead letter with its payload and the reason, findable with
/// `postroom dead list`; the messages behind it go on.
#[test]
fn a_message_the_engine_refuses_is_a_dead_letter_before_it_is_acked() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(&dir.path().join("broker"));
    let b_db = dir.path().join("b.db");
    let b = device_b_small(&b_db);
    let intake = MqttIntake::builder(options("refuse-b", broker.port), Arc::clone(&b), "b")
        .subscribe("refuse/#")
        .start()
        .unwrap();
    assert!(intake.wait_subscribed(Duration::from_secs(20)));
    let big = Envelope::new("big", 1, "orders", vec![b'x'; 200]).with_source("dev");
    let mut many = Envelope::new("many", 2, "orders", "m").with_source("dev");
    for i in 0..65 {
        many.headers.insert(format!("h{i}"), "v".into());
    }
    let long_id = Envelope::new("i".repeat(600), 3, "orders", "long id").with_source("dev");
    let bad_source = Envelope::new("badsrc", 4, "orders", "bad source").with_source("de\u{7}v");
    let good = Envelope::new("good", 5, "orders", "fine").with_source("dev");
    publish_raw(
        broker.port,
        "refuse-pub",
        "refuse/orders",
        [&big, &many, &long_id, &bad_source, &good]
            .into_iter()
            .map(Envelope::encode)
            .collect(),
    );
    let many_again = many.clone();
    eventually(20, "the good message applied", || effects(&b_db).1 == 1);
    eventually(20, "every message acknowledged", || {
        intake.stats().acked == 5
    });
    let stats = intake.stats();
    assert_eq!((stats.refused, stats.not_acked), (4, 0), "{stats:?}");
    let dead = b.dead_letters(Some("b"), 10).unwrap();
    assert_eq!(dead.len(), 4, "{dead:#?}");
    let reason = |payload: &[u8]| {
        let d = dead
            .iter()
            .find(|d| d.message.payload() == payload)
            .unwrap_or_else(|| panic!("no dead letter with {payload:?}: {dead:#?}"));
        d.last_error.clone().unwrap_or_default()
    };
    assert!(reason(&[b'x'; 200]).contains("max_payload"));
    assert!(reason(b"m").contains("headers"));
    assert!(reason(b"long id").contains("message id"));
    assert!(reason(b"bad source").contains("source"));
    let many = dead.iter().find(|d| d.message.payload() == b"m").unwrap();
    assert_eq!(many.message.headers().len(), 65, "headers kept");
    // The same messages again (a publisher's resend): duplicates, not a
    // second dead letter each.
    publish_raw(
        broker.port,
        "refuse-pub",
        "refuse/orders",
        [big, many_again, long_id, bad_source, good]
            .iter()
            .map(Envelope::encode)
            .collect(),
    );
    eventually(20, "the resends acknowledged", || {
        intake.stats().acked == 10
    });
    let stats = intake.stats();
    assert_eq!((stats.duplicates, stats.not_acked), (5, 0), "{stats:?}");
    assert_eq!(b.dead_letters(Some("b"), 10).unwrap().len(), 4);
    assert_eq!(effects(&b_db).0, 1);
    intake.shutdown(Duration::from_secs(5)).unwrap();
    let path = b.path().to_path_buf();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_postroom"))
        .arg(&path)
        .args(["dead", "list"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let listed = String::from_utf8_lossy(&out.stdout);
    assert!(listed.contains("max_payload"), "{listed}");
    // The dead letters stored this way break none of the inbox's invariants.
    let check = std::process::Command::new(env!("CARGO_BIN_EXE_postroom"))
        .arg(&path)
        .arg("check")
        .output()
        .unwrap();
    assert!(check.status.success(), "{check:?}");
}

/// A postroom envelope that does not decode (a `seq` that is not an i64:
/// 2^63, "5", 5.0; a future version) is a dead letter with its reason, over
/// MQTT 3.1.1, never taken for a foreign message whose handler would get
/// the envelope line as its payload; the message behind it is applied.
#[test]
fn an_envelope_that_does_not_decode_is_a_dead_letter_not_a_foreign_message() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(&dir.path().join("broker"));
    let b_db = dir.path().join("b.db");
    let b = device_b_small(&b_db);
    let intake = MqttIntake::builder(options("undecodable-b", broker.port), Arc::clone(&b), "b")
        .subscribe("undecodable/#")
        .start()
        .unwrap();
    assert!(intake.wait_subscribed(Duration::from_secs(20)));
    let line = |version: &str, id: &str, seq: &str| {
        format!(
            r#"{{"postroom":{version},"id":"{id}","seq":{seq},"source":"dev","topic":"orders"}}
p"#
        )
        .into_bytes()
    };
    let good = Envelope::new("good", 7, "orders", "fine").with_source("dev");
    publish_raw(
        broker.port,
        "undecodable-pub",
        "undecodable/orders",
        vec![
            line("1", "big", "9223372036854775808"),
            line("1", "text", "\"5\""),
            line("1", "float", "5.0"),
            line("2", "future", "5"),
            good.encode(),
        ],
    );
    eventually(20, "every message acknowledged", || {
        intake.stats().acked == 5
    });
    let (rows, distinct, _) = effects(&b_db);
    let ids: Vec<String> = column(&raw(&b_db), "SELECT msg_id FROM effects");
    assert_eq!(
        (rows, distinct),
        (1, 1),
        "only the good one applied: {ids:?}"
    );
    let applied: String = raw(&b_db)
        .query_row("SELECT msg_id FROM effects", [], |r| r.get(0))
        .unwrap();
    assert_eq!(applied, "good");
    let stats = intake.stats();
    assert_eq!((stats.refused, stats.unwrapped), (4, 0), "{stats:?}");
    let dead = b.dead_letters(Some("b"), 10).unwrap();
    assert_eq!(dead.len(), 4, "{dead:#?}");
    for d in &dead {
        let reason = d.last_error.clone().unwrap_or_default();
        assert!(reason.contains("postroom envelope"), "{reason}");
        assert!(
            d.message.payload().starts_with(b"{\"postroom\""),
            "raw bytes kept"
        );
    }
    assert!(dead
        .iter()
        .any(|d| d.last_error.as_deref().unwrap_or("").contains("version 2")));
    intake.shutdown(Duration::from_secs(5)).unwrap();
}

/// Issue 31, finding 7: numbers from the wire are checked before use. In a
/// `sequenced()` intake an envelope whose `seq` is i64::MAX (past the
/// largest sequence), 0, negative, or whose `unsettled_from` is above its
/// own `seq`, is a dead letter with its reason, acknowledged, and the
/// message behind it is applied: nothing wedges the subscription.
#[test]
fn a_sequence_out_of_range_is_a_dead_letter_and_holds_nothing_up() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(&dir.path().join("broker"));
    let b_db = dir.path().join("b.db");
    let b = device_b_small(&b_db);
    let intake = MqttIntake::builder(options("seq-b", broker.port), Arc::clone(&b), "b")
        .subscribe("seq/#")
        .sequenced()
        .start()
        .unwrap();
    assert!(intake.wait_subscribed(Duration::from_secs(20)));
    let numbered = |id: &str, seq: i64, unsettled_from: Option<i64>| {
        let mut env = Envelope::new(id, seq, "orders", id.as_bytes().to_vec()).with_source("dev");
        env.origin = Some("device-x".into());
        env.unsettled_from = unsettled_from;
        env.encode()
    };
    publish_raw(
        broker.port,
        "seq-pub",
        "seq/orders",
        vec![
            numbered("max", i64::MAX, None),
            numbered("zero", 0, Some(1)),
            numbered("negative", -5, Some(1)),
            numbered("ahead", 3, Some(5)),
            numbered("max-from", 7, Some(i64::MAX)),
            numbered("one", 1, Some(1)),
            // Well numbered, refused for its size: dead with its number,
            // which the stream's watermark passes.
            {
                let mut env = Envelope::new("two", 2, "orders", vec![b'2'; 200]).with_source("dev");
                env.origin = Some("device-x".into());
                env.unsettled_from = Some(1);
                env.encode()
            },
        ],
    );
    eventually(20, "the message behind them applied", || {
        effects(&b_db).1 == 1
    });
    eventually(20, "every message acknowledged", || {
        intake.stats().acked == 7
    });
    let stats = intake.stats();
    assert_eq!((stats.refused, stats.not_acked), (6, 0), "{stats:?}");
    let dead = b.dead_letters(Some("b"), 10).unwrap();
    let mut ids: Vec<&str> = dead.iter().map(|d| d.message.id()).collect();
    ids.sort_unstable();
    assert_eq!(ids, ["ahead", "max", "max-from", "negative", "two", "zero"]);
    for d in dead.iter().filter(|d| d.message.id() != "two") {
        let reason = d.last_error.as_deref().unwrap_or_default();
        assert!(reason.contains("seq"), "{reason}");
        assert_eq!(d.message.payload(), d.message.id().as_bytes());
        assert_eq!(d.message.sequence(), None);
    }
    let two = dead.iter().find(|d| d.message.id() == "two").unwrap();
    assert!(two
        .last_error
        .as_deref()
        .unwrap_or_default()
        .contains("max_payload"));
    assert_eq!(two.message.sequence(), Some(2));
    let sequences = b.stats().unwrap().sequences;
    assert_eq!(sequences.len(), 1, "{sequences:?}");
    assert_eq!(sequences[0].watermark, 2, "{sequences:?}");
    intake.shutdown(Duration::from_secs(5)).unwrap();
}

/// Issue 31, finding 8: an MQTT 5 sink checks what it will send before it
/// sends it. A row whose header value holds `\n`, `\t` or NUL, or whose
/// header name holds a control character, would make mosquitto drop the
/// connection on every try (a malformed UTF-8 string): such a row is dead
/// at once with its reason, the row of its key behind it goes through, and
/// no row is put off by a lost connection.
#[test]
fn an_mqtt5_row_the_broker_would_refuse_is_dead_at_once() {
    use rumqttc::v5::mqttbytes::v5::Packet as P5;
    use rumqttc::v5::mqttbytes::QoS as QoS5;
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(&dir.path().join("broker"));
    let port = broker.port_v5;
    let (reader, mut reader_conn) = rumqttc::v5::Client::new(options_v5("bad-reader", port), 16);
    reader.subscribe("bad/#", QoS5::AtLeastOnce).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        assert!(Instant::now() < deadline, "no SUBACK");
        if let Ok(Ok(rumqttc::v5::Event::Incoming(P5::SubAck(_)))) =
            reader_conn.recv_timeout(Duration::from_millis(100))
        {
            break;
        }
    }
    let a_db = dir.path().join("a.db");
    let a = Postroom::builder()
        .relay_poll(Duration::from_millis(20))
        .sink(
            MqttSink::v5(options_v5("bad-a", port))
                .topic_prefix("bad/")
                .backoff(Duration::from_millis(50), Duration::from_millis(500)),
        )
        .open(&a_db)
        .unwrap();
    a.transaction(|tx| {
        tx.publish(
            Outgoing::new("t", "newline")
                .with_key("k")
                .with_header("note", "a\nb"),
        )?;
        tx.publish(
            Outgoing::new("t", "tab")
                .with_key("k")
                .with_header("note", "a\tb"),
        )?;
        tx.publish(
            Outgoing::new("t", "nul")
                .with_key("k")
                .with_header("note", "a\0b"),
        )?;
        tx.publish(
            Outgoing::new("t", "name")
                .with_key("k")
                .with_header("n\u{1}", "v"),
        )?;
        tx.publish(
            Outgoing::new("t", "fine")
                .with_key("k")
                .with_header("note", "a b é"),
        )?;
        Ok(())
    })
    .unwrap();
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while got.is_empty() && Instant::now() < deadline {
        if let Ok(Ok(rumqttc::v5::Event::Incoming(P5::Publish(p)))) =
            reader_conn.recv_timeout(Duration::from_millis(100))
        {
            got.push(p);
        }
    }
    assert_eq!(got.len(), 1, "the good row reached the broker");
    assert_eq!(&got[0].payload[..], b"fine");
    eventually(10, "the four bad rows dead, the good one sent", || {
        let outbox = a.stats().unwrap().outbox;
        (outbox.dead, outbox.sent) == (4, 1)
    });
    let conn_a = rusqlite::Connection::open(&a_db).unwrap();
    let rows: Vec<(String, String, Option<String>)> = conn_a
        .prepare("SELECT payload, status, last_error FROM postroom_outbox ORDER BY seq")
        .unwrap()
        .query_map([], |r| {
            Ok((
                String::from_utf8_lossy(&r.get::<_, Option<Vec<u8>>>(0)?.unwrap_or_default())
                    .into_owned(),
                r.get(1)?,
                r.get(2)?,
            ))
        })
        .unwrap()
        .map(Result::unwrap)
        .collect();
    for (payload, status, error) in &rows[..4] {
        assert_eq!(status, "dead", "{payload}: {error:?}");
        assert!(
            error.as_deref().unwrap_or_default().contains("header"),
            "{payload}: {error:?}"
        );
    }
    assert_eq!(rows[4].1, "sent");
    assert_eq!(rows[4].2, None, "the good row was never put off: {rows:?}");
    a.shutdown(Duration::from_secs(5)).unwrap();
}

/// Issue 31, "wire input is data, never a wedge", sizes: a broker's
/// Maximum Packet Size (MQTT 5 CONNACK; mosquitto's `max_packet_size`)
/// bounds what a client may send. A row over it can never go through
/// (rumqttc refuses to write it and fails the connection, which read as an
/// outage for ever): it is dead at once with the reason, and the row of
/// its key behind it goes through on the same connection.
#[test]
fn an_mqtt5_row_over_the_brokers_maximum_packet_size_is_dead_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start_with(&dir.path().join("broker"), "max_packet_size 4096");
    if broker.kind != broker::Kind::Mosquitto {
        println!("skipped: the embedded broker has no max_packet_size setting");
        return;
    }
    let a_db = dir.path().join("a.db");
    let a = Postroom::builder()
        .relay_poll(Duration::from_millis(20))
        .sink(
            MqttSink::v5(options_v5("size-a", broker.port_v5))
                .topic_prefix("size/")
                .backoff(Duration::from_millis(50), Duration::from_millis(500)),
        )
        .open(&a_db)
        .unwrap();
    a.transaction(|tx| {
        tx.publish(Outgoing::new("t", vec![b'x'; 10_000]).with_key("k"))?;
        tx.publish(Outgoing::new("t", vec![b'y'; 3_000]).with_key("k"))?;
        Ok(())
    })
    .unwrap();
    eventually(20, "the large row dead, the other sent", || {
        let outbox = a.stats().unwrap().outbox;
        (outbox.dead, outbox.sent) == (1, 1)
    });
    let conn_a = rusqlite::Connection::open(&a_db).unwrap();
    let rows: Vec<(String, Option<String>)> = conn_a
        .prepare("SELECT status, last_error FROM postroom_outbox ORDER BY seq")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(rows[0].0, "dead");
    let why = rows[0].1.as_deref().unwrap_or_default();
    assert!(
        why.contains("Maximum Packet Size") && why.contains("4096"),
        "{why}"
    );
    assert_eq!(rows[1], ("sent".to_owned(), None), "never put off");
    a.shutdown(Duration::from_secs(5)).unwrap();
}
