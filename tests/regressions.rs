//! Regression tests for bugs a review found in the queued mode, the relay
//! and the inbox sink (each failed before its fix).
mod common;

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use common::*;
use postroom::{handler_fn, InboxSink, Message, Outgoing, Postroom};

fn fast() -> postroom::Builder {
    Postroom::builder()
        .poll_interval(Duration::from_millis(10))
        .relay_poll(Duration::from_millis(20))
        .backoff(Duration::from_millis(2), Duration::from_millis(20))
}

/// InboxSink (batch mode): one outbox row the target refuses
/// (InvalidInput: payload above the target's max_payload) makes the whole
/// receive_batch fail, every row of the batch is retried, and after
/// max_attempts ALL of them are dead -- healthy, unrelated rows included.
/// Inline mode kills only the bad one.
#[test]
fn an_invalid_message_in_an_inbox_sink_batch_is_dead_alone() {
    let dir = tempfile::tempdir().unwrap();
    let b = Arc::new(
        fast()
            .max_payload(64)
            .workers(0)
            .consumer("in", handler_fn(|_tx, _m| Ok(())))
            .open(dir.path().join("b.db"))
            .unwrap(),
    );
    let a = fast()
        .max_attempts(3)
        .consumer("c", handler_fn(|_tx, _m| Ok(())))
        .sink(InboxSink::new(Arc::clone(&b), "in"))
        .open(dir.path().join("a.db"))
        .unwrap();
    // One transaction: 10 small unkeyed rows and one big one, all in one relay batch.
    a.transaction(|tx| {
        tx.publish(Outgoing::new("t", vec![b'x'; 200]))?;
        for i in 0..10 {
            tx.publish(Outgoing::new("t", format!("small {i}").into_bytes()))?;
        }
        Ok(())
    })
    .unwrap();
    eventually(30, "outbox settled", || {
        let s = a.stats().unwrap();
        s.outbox.pending == 0
    });
    let s = a.stats().unwrap();
    let stored_in_b = count(&raw(b.path()), "SELECT count(*) FROM postroom_inbox");
    assert_eq!(stored_in_b, 10, "the 10 valid messages should reach B");
    assert_eq!(
        s.outbox.dead, 1,
        "only the oversized message should be dead"
    );
}

/// Tx::publish checks the headers BEFORE adding causation-id and
/// correlation-id, so a message with 63..64 headers (or ~16 KiB of them)
/// is accepted and stored with 65..66 headers, which no postroom inbox
/// accepts: forwarded through InboxSink (same default limits on both
/// sides) it is dead at once (inline) -- and in batch mode it would take
/// every other row of its batch with it (test above).
#[test]
fn publish_counts_the_causation_headers_against_the_limits() {
    let dir = tempfile::tempdir().unwrap();
    let b = Arc::new(
        fast()
            .workers(0)
            .consumer("in", handler_fn(|_tx, _m| Ok(())))
            .open(dir.path().join("b.db"))
            .unwrap(),
    );
    let a = fast()
        .max_attempts(3)
        .consumer(
            "c",
            handler_fn(|tx, _m| {
                let mut out = Outgoing::new("t", b"hello".to_vec());
                for i in 0..64 {
                    out = out.with_header(format!("h{i}"), "v");
                }
                tx.publish(out)?; // accepted: 64 headers is within the limit
                Ok(())
            }),
        )
        .sink(InboxSink::new(Arc::clone(&b), "in").inline())
        .open(dir.path().join("a.db"))
        .unwrap();
    assert!(a
        .deliver("c", Message::new("s", "m1", "x"))
        .unwrap()
        .should_ack());
    eventually(30, "outbox settled", || {
        a.stats().unwrap().outbox.pending == 0
    });
    let dead = a.outbox_dead_letters(10).unwrap();
    assert!(
        dead.is_empty(),
        "a message the engine accepted could not be forwarded"
    );
    // The handler's publish was refused up front instead: the message is dead
    // in A with the reason, and nothing half-valid reached the outbox.
    let row = inbox_row(&raw(a.path()), "c", "s", "m1").unwrap();
    assert_eq!(row.0, "dead");
    assert!(row.2.unwrap().contains("headers"));
    let stats = a.stats().unwrap();
    assert_eq!(stats.outbox.pending + stats.outbox.sent, 0);
}

/// A message that failed when delivered inline (row `failed`, queued = 0,
/// so the workers leave it to the broker) and is then redelivered through
/// `receive` -- e.g. after the app moved this consumer from inline to
/// queued intake -- is answered `Duplicate` (ack!), yet no worker ever
/// processes it: acknowledged, never processed, not dead.
#[test]
fn a_receive_takes_over_a_message_an_inline_delivery_left_failed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    {
        let room = fast()
            .workers(0)
            .consumer(
                "c",
                handler_fn(|_tx, _m| Err(postroom::Failure::retry_after("down", Duration::ZERO))),
            )
            .open(&path)
            .unwrap();
        let o = room.deliver("c", Message::new("s", "m", "x")).unwrap();
        assert!(!o.should_ack(), "{o:?}");
        room.shutdown(Duration::from_secs(5)).unwrap();
    }
    // The app now takes this stream through receive(); the broker redelivers m.
    let room = fast()
        .workers(2)
        .consumer("c", handler_fn(apply))
        .open(&path)
        .unwrap();
    create_domain(&room);
    let receipt = room.receive("c", Message::new("s", "m", "x")).unwrap();
    assert!(receipt.should_ack(), "{receipt:?}"); // the broker acks: it will never redeliver
    let conn = raw(&path);
    eventually(10, "the received message processed", || {
        applied_count(&conn, "m") == 1
    });
    assert_eq!(inbox_row(&conn, "c", "s", "m").unwrap().0, "completed");
    assert_eq!(
        applied_count(&conn, "m"),
        1,
        "acknowledged via receive() but never processed"
    );
}

mod redrive_order {
    use super::*;
    use postroom::{EffectContext, EffectHandler, Failure, Tx};
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Mutex;

    struct H {
        running: AtomicUsize,
        max_concurrent: AtomicUsize,
        a_rejects: AtomicBool,
        log: Mutex<Vec<String>>,
    }
    struct W(Arc<H>);
    impl EffectHandler for W {
        type Output = ();
        fn effect(&self, _ctx: &EffectContext<'_>, msg: &Message) -> Result<(), Failure> {
            let s = &self.0;
            if msg.id() == "A" && s.a_rejects.swap(false, Ordering::SeqCst) {
                return Err(Failure::reject("bad"));
            }
            let n = s.running.fetch_add(1, Ordering::SeqCst) + 1;
            s.max_concurrent.fetch_max(n, Ordering::SeqCst);
            s.log.lock().unwrap().push(format!("start {}", msg.id()));
            thread::sleep(Duration::from_millis(if msg.id() == "B" {
                800
            } else {
                50
            }));
            s.log.lock().unwrap().push(format!("end {}", msg.id()));
            s.running.fetch_sub(1, Ordering::SeqCst);
            Ok(())
        }
        fn apply(&self, _tx: &mut Tx<'_>, _msg: &Message, _o: ()) -> Result<(), Failure> {
            Ok(())
        }
    }

    /// Ordering keys promise "one at a time in receive order". Redriving a
    /// dead head while a later row of its key is being processed runs both
    /// at once (and the head after its successor).
    #[test]
    fn a_redriven_head_does_not_run_beside_its_successor() {
        let dir = tempfile::tempdir().unwrap();
        let h = Arc::new(H {
            running: AtomicUsize::new(0),
            max_concurrent: AtomicUsize::new(0),
            a_rejects: AtomicBool::new(true),
            log: Mutex::new(Vec::new()),
        });
        let room = fast()
            .workers(2)
            .effectful_consumer("c", W(Arc::clone(&h)))
            .open(dir.path().join("a.db"))
            .unwrap();
        room.receive_batch(
            "c",
            vec![
                Message::new("s", "A", "a").with_ordering_key("k"),
                Message::new("s", "B", "b").with_ordering_key("k"),
            ],
        )
        .unwrap();
        eventually(10, "B running", || h.running.load(Ordering::SeqCst) == 1);
        let dead = room.dead_letters(Some("c"), 10).unwrap();
        assert_eq!(dead.len(), 1);
        assert!(room.redrive(dead[0].id).unwrap());
        eventually(10, "both done", || {
            h.log
                .lock()
                .unwrap()
                .iter()
                .filter(|l| l.starts_with("end"))
                .count()
                == 2
        });
        eprintln!("{:?}", h.log.lock().unwrap());
        assert_eq!(
            h.max_concurrent.load(Ordering::SeqCst),
            1,
            "two messages of key k ran at once"
        );
    }
}

/// An operator's write (`admin::cleanup`, as `postroom cleanup` runs it)
/// while the application delivers back to back. SQLite's own busy handler
/// tries for the write lock at intervals growing to 100 ms and can miss
/// every moment the engine's writer leaves it free: an outside `BEGIN
/// IMMEDIATE` waited up to 3.3 s that way, and a CLI write in tests/cli.rs
/// timed out in a CI run. With a 2 s busy timeout, every one of 20 writes
/// must get through (1 s was one write short in one clean-clone CI run of
/// 21 Nov 2026: write 16 waited past it, on a machine busy with the rest of
/// the suite; the busy handler's waits, up to 3.3 s, still fail it).
#[test]
fn admin_writes_get_the_lock_while_the_engine_commits_back_to_back() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("busy.db");
    let room = fast().consumer("c", handler_fn(apply)).open(&path).unwrap();
    create_domain(&room);
    let stop = AtomicBool::new(false);
    let delivered = AtomicU64::new(0);
    thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::SeqCst) {
                let n = delivered.load(Ordering::SeqCst);
                let msg = Message::new("load", format!("l-{n}"), "x");
                room.deliver("c", msg).unwrap();
                delivered.fetch_add(1, Ordering::SeqCst);
            }
        });
        let _stop = SetOnDrop(&stop);
        eventually(10, "the load to run", || {
            delivered.load(Ordering::SeqCst) >= 50
        });
        let conn = postroom::admin::open_with_timeout(
            &path,
            postroom::admin::Access::ReadWrite,
            Duration::from_secs(2),
        )
        .unwrap();
        for i in 0..20 {
            let before = delivered.load(Ordering::SeqCst);
            let now = postroom::admin::now_ms();
            if let Err(e) = postroom::admin::cleanup(
                &conn,
                now,
                Duration::from_secs(3600),
                postroom::admin::CleanupMode::Delete,
            ) {
                panic!("write {i} while the engine delivers: {e}");
            }
            // The engine kept delivering: the write shared the lock.
            eventually(10, "the load to go on", || {
                delivered.load(Ordering::SeqCst) > before + 10
            });
        }
    });
    room.shutdown(Duration::from_secs(10)).unwrap();
}
