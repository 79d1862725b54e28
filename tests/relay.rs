//! The outbox relay: sinks, per-key order under failures, dead rows,
//! service-to-service chains and latency, on real SQLite files.

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use postroom::{
    handler_fn, sink_fn, ChannelSink, InboxSink, Message, NdjsonSink, OutboxMessage, Outgoing,
    Postroom, SendResult,
};

/// The domain write alone (the shared `apply` also publishes).
fn record(tx: &mut postroom::Tx<'_>, msg: &Message) -> Result<(), postroom::Failure> {
    tx.execute(
        "INSERT INTO applied (consumer, message_id, payload) VALUES (?1, ?2, ?3)",
        rusqlite::params![tx.consumer().unwrap_or(""), msg.id(), msg.payload()],
    )?;
    Ok(())
}

fn fast() -> postroom::Builder {
    Postroom::builder()
        .poll_interval(Duration::from_millis(10))
        .relay_poll(Duration::from_millis(20))
        .backoff(Duration::from_millis(2), Duration::from_millis(20))
}

/// A handler that publishes one message per incoming one, keyed by the
/// incoming message's ordering key (or its source).
fn publish_one(tx: &mut postroom::Tx<'_>, msg: &Message) -> Result<(), postroom::Failure> {
    let key = msg.ordering_key().unwrap_or(msg.source()).to_owned();
    tx.publish(Outgoing::new("out", msg.payload().to_vec()).with_key(key))?;
    Ok(())
}

#[test]
fn committed_outbox_rows_reach_the_sink_with_stable_ids_and_are_marked_sent() {
    let dir = tempfile::tempdir().unwrap();
    let (tx, rx) = crossbeam_channel::unbounded();
    let room = fast()
        .consumer("c", handler_fn(publish_one))
        .sink(ChannelSink::new(tx))
        .open(dir.path().join("a.db"))
        .unwrap();
    let mut ids = Vec::new();
    for i in 0..20 {
        room.deliver("c", Message::new("s", format!("m{i}"), format!("p{i}")))
            .unwrap();
    }
    for _ in 0..20 {
        let m: OutboxMessage = rx.recv_timeout(Duration::from_secs(30)).unwrap();
        assert_eq!(m.topic, "out");
        assert_eq!(m.headers["causation-id"], format!("m{}", ids.len()));
        ids.push(m.id);
    }
    assert_eq!(ids.iter().collect::<HashSet<_>>().len(), 20);
    eventually(30, "all marked sent", || {
        room.stats().unwrap().outbox.sent == 20
    });
    // A rows committed by a plain transaction goes out too.
    room.transaction(|tx| {
        tx.publish(Outgoing::new("user.action", "clicked"))?;
        Ok(())
    })
    .unwrap();
    let m = rx.recv_timeout(Duration::from_secs(30)).unwrap();
    assert_eq!(m.topic, "user.action");
    assert_eq!(m.payload, b"clicked");
}

/// 50 keys x 200 messages, a sink that fails at random: per key, the
/// messages go through in commit order, each at least once.
#[test]
fn per_key_order_holds_with_a_randomly_failing_sink() {
    let dir = tempfile::tempdir().unwrap();
    let first_sent: Arc<Mutex<Vec<(String, String)>>> = Default::default();
    let seen: Arc<Mutex<HashSet<String>>> = Default::default();
    let (log, seen2) = (Arc::clone(&first_sent), Arc::clone(&seen));
    let mut rng = Rng::new(seed());
    let room = fast()
        .max_attempts(1000)
        .relay_batch(64)
        .consumer("c", handler_fn(publish_one))
        .sink(sink_fn(move |m: &OutboxMessage| {
            if rng.below(100) < 20 {
                return SendResult::retry("broker unavailable");
            }
            if seen2.lock().unwrap().insert(m.id.clone()) {
                let payload = String::from_utf8(m.payload.clone()).unwrap();
                log.lock().unwrap().push((m.key.clone().unwrap(), payload));
            }
            SendResult::Sent
        }))
        .open(dir.path().join("a.db"))
        .unwrap();
    let (keys, per_key) = (50, 200);
    let mut batch = Vec::new();
    for n in 0..per_key {
        for k in 0..keys {
            batch.push((format!("k{k}"), n));
        }
    }
    // Commit order = delivery order, from two threads for group commits.
    thread::scope(|s| {
        for half in batch.chunks(batch.len() / 2) {
            let room = &room;
            s.spawn(move || {
                for (key, n) in half {
                    let msg = Message::new("s", format!("{key}-{n}"), format!("{n}"))
                        .with_ordering_key(key.clone());
                    assert!(room.deliver("c", msg).unwrap().should_ack());
                }
            });
        }
    });
    eventually(120, "all sent", || {
        room.stats().unwrap().outbox.sent == (keys * per_key) as u64
    });
    // Commit order per key, from the database (seq), versus sink order.
    let conn = raw(room.path());
    let mut committed: HashMap<String, Vec<String>> = HashMap::new();
    let mut stmt = conn
        .prepare("SELECT key, CAST(payload AS TEXT) FROM postroom_outbox ORDER BY seq")
        .unwrap();
    for row in stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).unwrap() {
        let (k, p): (String, String) = row.unwrap();
        committed.entry(k).or_default().push(p);
    }
    let mut delivered: HashMap<String, Vec<String>> = HashMap::new();
    for (k, p) in first_sent.lock().unwrap().iter() {
        delivered.entry(k.clone()).or_default().push(p.clone());
    }
    assert_eq!(delivered.len(), keys);
    for (k, order) in &committed {
        assert_eq!(
            &delivered[k], order,
            "key {k}: sink order differs from commit order"
        );
    }
    let retried = count(
        &conn,
        "SELECT count(*) FROM postroom_outbox WHERE attempts > 1",
    );
    assert!(
        retried > 100,
        "failures were injected: {retried} rows retried"
    );
}

/// A sink that always fails for one key: that key's rows go dead after
/// max_attempts; the other keys keep flowing.
#[test]
fn a_key_that_always_fails_goes_dead_and_does_not_block_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let sent = Arc::new(AtomicU64::new(0));
    let s2 = Arc::clone(&sent);
    let room = fast()
        .max_attempts(3)
        .consumer("c", handler_fn(publish_one))
        .sink(sink_fn(move |m: &OutboxMessage| {
            if m.key.as_deref() == Some("poison") {
                return SendResult::retry("schema registry rejects this key");
            }
            s2.fetch_add(1, Ordering::SeqCst);
            SendResult::Sent
        }))
        .open(dir.path().join("a.db"))
        .unwrap();
    for i in 0..30 {
        let key = if i % 3 == 0 { "poison" } else { "fine" };
        let msg = Message::new("s", format!("m{i}"), "x").with_ordering_key(key);
        room.deliver("c", msg).unwrap();
    }
    eventually(30, "the fine key delivered", || {
        sent.load(Ordering::SeqCst) == 20
    });
    eventually(30, "the poison key dead", || {
        room.stats().unwrap().outbox.dead == 10
    });
    let dead = room.outbox_dead_letters(100).unwrap();
    assert_eq!(dead.len(), 10);
    assert!(dead.iter().all(|m| m.key.as_deref() == Some("poison")));
    assert_eq!(dead[0].attempts, 3);
    assert_eq!(
        dead[0].last_error.as_deref(),
        Some("schema registry rejects this key")
    );
    // Discard one, redrive another (it fails again and dies again).
    assert!(room.discard_outbox(dead[0].seq).unwrap());
    assert!(room.redrive_outbox(dead[1].seq).unwrap());
    eventually(30, "redriven row dead again", || {
        room.outbox_dead_letters(100).unwrap().len() == 9
            && room.stats().unwrap().outbox.pending == 0
    });
}

/// A destination that stays unreachable for many more hand-overs than
/// `max_attempts` allows: `Unavailable` counts no attempt, so no row dies,
/// and once it is back every row goes through, each key in order.
#[test]
fn an_unreachable_destination_never_dead_letters_a_row() {
    let dir = tempfile::tempdir().unwrap();
    let calls = Arc::new(AtomicU64::new(0));
    let got = Arc::new(Mutex::new(Vec::new()));
    let (c2, g2) = (Arc::clone(&calls), Arc::clone(&got));
    let room = fast()
        .max_attempts(2)
        .consumer("c", handler_fn(publish_one))
        .sink(sink_fn(move |m: &OutboxMessage| {
            // Down for the first 40 hand-overs: 20 times max_attempts.
            if c2.fetch_add(1, Ordering::SeqCst) < 40 {
                return SendResult::unavailable("broker down", Duration::from_millis(5));
            }
            g2.lock().unwrap().push(m.payload.clone());
            SendResult::Sent
        }))
        .open(dir.path().join("a.db"))
        .unwrap();
    for i in 0..10 {
        let msg = Message::new("s", format!("m{i}"), vec![i as u8]).with_ordering_key("k");
        room.deliver("c", msg).unwrap();
    }
    eventually(30, "all ten sent", || {
        room.stats().unwrap().outbox.sent == 10
    });
    assert!(calls.load(Ordering::SeqCst) > 40);
    assert_eq!(room.stats().unwrap().outbox.dead, 0);
    let order: Vec<u8> = got.lock().unwrap().iter().map(|p| p[0]).collect();
    assert_eq!(order, (0..10).collect::<Vec<u8>>());
}

/// Service A's handler publishes; the inbox sink delivers into service B;
/// B's handler publishes back into A. Duplicates injected at A's input:
/// every effect happens once in B, and once back in A.
#[test]
fn two_services_chained_through_inbox_sinks_apply_each_effect_once() {
    let dir = tempfile::tempdir().unwrap();
    // B first (A's sink needs it); B's sink points back at A, which does
    // not exist yet: B relays into a channel that a forwarder drains into A.
    let (b_out, b_rx) = crossbeam_channel::unbounded::<OutboxMessage>();
    let b = Arc::new(
        fast()
            .consumer(
                "orders",
                handler_fn(|tx, msg| {
                    record(tx, msg)?;
                    tx.publish(Outgoing::new("order.accepted", msg.payload().to_vec()))?;
                    Ok(())
                }),
            )
            .sink(ChannelSink::new(b_out))
            .open(dir.path().join("b.db"))
            .unwrap(),
    );
    create_domain(&b);
    let a = Arc::new(
        fast()
            .consumer(
                "checkout",
                handler_fn(|tx, msg| {
                    record(tx, msg)?;
                    tx.publish(Outgoing::new("order.placed", msg.payload().to_vec()))?;
                    Ok(())
                }),
            )
            .consumer("acceptances", handler_fn(record))
            .sink(InboxSink::new(Arc::clone(&b), "orders"))
            .open(dir.path().join("a.db"))
            .unwrap(),
    );
    create_domain(&a);
    let all_accepted = Arc::new(AtomicBool::new(false));
    let forward = {
        let a = Arc::clone(&a);
        let all_accepted = Arc::clone(&all_accepted);
        thread::spawn(move || {
            let mut sink = InboxSink::new(a, "acceptances").inline();
            // Until the test has seen every acceptance in A (not until a
            // quiet spell, which a loaded machine can give too early); a
            // relay that never delivers them fails the test rather than
            // hanging it.
            let deadline = std::time::Instant::now() + Duration::from_secs(120);
            while !all_accepted.load(Ordering::SeqCst) {
                assert!(
                    std::time::Instant::now() < deadline,
                    "not every acceptance came through B's relay"
                );
                let Ok(m) = b_rx.recv_timeout(Duration::from_millis(100)) else {
                    continue;
                };
                // Re-send everything twice: at-least-once on this hop too.
                for _ in 0..2 {
                    let r = postroom::Sink::send(&mut sink, std::slice::from_ref(&m));
                    assert_eq!(r, vec![SendResult::Sent]);
                }
            }
        })
    };
    let orders = 100;
    for i in 0..orders {
        for _ in 0..3 {
            let msg = Message::new("web", format!("order-{i}"), format!("order {i}"));
            assert!(a.deliver("checkout", msg).unwrap().should_ack());
        }
    }
    let (a_conn, b_conn) = (raw(a.path()), raw(b.path()));
    eventually(60, "all orders accepted back in A", || {
        count(
            &a_conn,
            "SELECT count(*) FROM applied WHERE consumer = 'acceptances'",
        ) == orders
    });
    all_accepted.store(true, Ordering::SeqCst);
    forward.join().unwrap();
    assert_eq!(
        count(
            &a_conn,
            "SELECT count(*) FROM applied WHERE consumer = 'checkout'"
        ),
        orders
    );
    assert_eq!(count(&b_conn, "SELECT count(*) FROM applied"), orders);
    assert_eq!(
        count(&b_conn, "SELECT count(DISTINCT payload) FROM applied"),
        orders
    );
    assert_eq!(
        count(
            &a_conn,
            "SELECT count(DISTINCT payload) FROM applied WHERE consumer = 'acceptances'"
        ),
        orders
    );
}

/// Time from `deliver` returning to the sink receiving the message, when
/// the relay is not saturated. Prints p50/p99.
#[test]
fn relay_latency_from_commit_to_sink() {
    let dir = tempfile::tempdir().unwrap();
    let (tx, rx) = crossbeam_channel::unbounded::<OutboxMessage>();
    // A relay poll far longer than any latency asserted below: only the
    // commit's wake-up can explain a fast hand-over (a bound near the poll
    // interval would fail on a loaded machine).
    let room = fast()
        .relay_poll(Duration::from_secs(30))
        .consumer("c", handler_fn(publish_one))
        .sink(ChannelSink::new(tx))
        .open(dir.path().join("a.db"))
        .unwrap();
    // Both from deliver() returning (the caller's view: often the relay has
    // already handed the message over by then) and from deliver() being
    // called (commit and wake-up included).
    let (mut after_return, mut after_call) = (Vec::new(), Vec::new());
    for i in 0..300 {
        let called = Instant::now();
        room.deliver("c", Message::new("s", format!("m{i}"), "x"))
            .unwrap();
        let returned = Instant::now();
        rx.recv_timeout(Duration::from_secs(20)).unwrap();
        after_return.push(returned.elapsed());
        after_call.push(called.elapsed());
        thread::sleep(Duration::from_millis(1));
    }
    let show = |l: &mut Vec<Duration>| {
        l.sort();
        let p = |q: f64| l[((l.len() - 1) as f64 * q) as usize];
        format!(
            "p50 {:.2?}, p99 {:.2?}, max {:.2?}",
            p(0.5),
            p(0.99),
            l[l.len() - 1]
        )
    };
    eprintln!(
        "relay latency to the sink: from deliver() returning {}; from deliver() called {}",
        show(&mut after_return),
        show(&mut after_call)
    );
    let latencies = after_return;
    let p = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize];
    // Woken by the commit, not the 30 s poll.
    assert!(p(0.5) < Duration::from_secs(1), "p50 {:?}", p(0.5));
    assert!(p(0.99) < Duration::from_secs(10), "p99 {:?}", p(0.99));
}

#[test]
fn the_ndjson_sink_writes_one_json_object_per_line() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.ndjson");
    let file = std::fs::File::create(&out).unwrap();
    let room = fast()
        .consumer(
            "c",
            handler_fn(|tx, msg| {
                tx.publish(Outgoing::new("t", msg.payload().to_vec()).with_key("k"))?;
                Ok(())
            }),
        )
        .sink(NdjsonSink::new(file))
        .open(dir.path().join("a.db"))
        .unwrap();
    room.deliver("c", Message::new("s", "json", r#"{"n": 1}"#))
        .unwrap();
    room.deliver("c", Message::new("s", "text", "plain words"))
        .unwrap();
    room.deliver("c", Message::new("s", "bin", vec![0xff, 0x00]))
        .unwrap();
    eventually(30, "three sent", || room.stats().unwrap().outbox.sent == 3);
    room.shutdown(Duration::from_secs(5)).unwrap();
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[0]["payload"]["n"], 1);
    assert_eq!(lines[1]["payload"], "plain words");
    assert_eq!(lines[2]["payload_hex"], "ff00");
    assert_eq!(lines[0]["key"], "k");
    assert_eq!(lines[0]["headers"]["causation-id"], "json");
    // The seq and the stream it numbers, for a downstream watermark.
    let seqs: Vec<i64> = lines.iter().map(|l| l["seq"].as_i64().unwrap()).collect();
    assert_eq!(seqs, [1, 2, 3]);
    let origin = lines[0]["origin"].as_str().unwrap();
    assert_eq!(origin.len(), 32);
    assert!(lines.iter().all(|l| l["origin"] == origin));
}

/// Shutdown lets the relay hand over what is due before the writer stops.
#[test]
fn shutdown_flushes_the_outbox() {
    let dir = tempfile::tempdir().unwrap();
    let got: Arc<Mutex<BTreeMap<String, u32>>> = Default::default();
    let g = Arc::clone(&got);
    let room = fast()
        .workers(0)
        .relay_poll(Duration::from_secs(3600))
        .consumer("c", handler_fn(publish_one))
        .sink(sink_fn(move |m: &OutboxMessage| {
            thread::sleep(Duration::from_micros(200));
            *g.lock().unwrap().entry(m.id.clone()).or_default() += 1;
            SendResult::Sent
        }))
        .open(dir.path().join("a.db"))
        .unwrap();
    for i in 0..200 {
        room.deliver("c", Message::new("s", format!("m{i}"), "x"))
            .unwrap();
    }
    let report = room.shutdown(Duration::from_secs(30)).unwrap();
    assert!(report.is_clean(), "{report:?}");
    assert!(report.joined.contains(&"postroom-relay".to_string()));
    assert_eq!(got.lock().unwrap().len(), 200);
    let conn = raw(&dir.path().join("a.db"));
    assert_eq!(
        count(
            &conn,
            "SELECT count(*) FROM postroom_outbox WHERE status = 'sent'"
        ),
        200
    );
}

/// A full channel holds the relay for the sink's timeout once per batch,
/// not once per message: a shutdown with a stuck consumer stays prompt, and
/// nothing is marked sent that did not get into the channel.
#[test]
fn a_full_channel_sink_waits_once_per_batch() {
    let dir = tempfile::tempdir().unwrap();
    let (tx, rx) = crossbeam_channel::bounded::<OutboxMessage>(1);
    let room = fast()
        .workers(0)
        .relay_batch(50)
        .consumer("c", handler_fn(|_, _| Ok(())))
        .sink(ChannelSink::new(tx).timeout(Duration::from_millis(200)))
        .open(dir.path().join("a.db"))
        .unwrap();
    room.transaction(|tx| {
        for i in 0..50 {
            tx.publish(Outgoing::new("t", format!("{i}")))?;
        }
        Ok(())
    })
    .unwrap();
    thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    let report = room.shutdown(Duration::from_secs(5)).unwrap();
    assert!(report.is_clean(), "{report:?}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    let sent = count(
        &raw(&dir.path().join("a.db")),
        "SELECT count(*) FROM postroom_outbox WHERE status = 'sent'",
    );
    assert_eq!(sent, 1, "only what fitted into the channel is marked sent");
    assert_eq!(rx.len(), 1);
}
