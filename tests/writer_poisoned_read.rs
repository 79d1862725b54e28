//! Regression (review of the leader lock): a panic that escapes a job while the
//! write lock is held (here: the user-supplied `Clock`, called by every job
//! outside any catch_unwind) leaves the lock poisoned and the batch's
//! transaction open. The next `deliver` of a duplicate "leads", reads the inbox
//! row on the write connection -- inside that still-open transaction -- and
//! answers `Duplicate` for a message whose effects never committed. The caller
//! acks; the next batch rolls the transaction back; the effects are lost.

mod common;

use std::sync::atomic::{AtomicI32, Ordering::SeqCst};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::*;
use postroom::{handler_fn, Clock, Message, Postroom};

/// Panics on the COUNTDOWN-th call made on the writer thread after arming.
static COUNTDOWN: AtomicI32 = AtomicI32::new(0);

struct PanickyClock;
impl Clock for PanickyClock {
    fn now_ms(&self) -> i64 {
        if thread::current().name() == Some("postroom-writer")
            && COUNTDOWN.load(SeqCst) > 0
            && COUNTDOWN.fetch_sub(1, SeqCst) == 1
        {
            panic!("user clock failed");
        }
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64
    }
}

#[test]
fn duplicate_is_not_answered_from_an_uncommitted_batch() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    raw(&path).execute_batch(DOMAIN_SQL).unwrap();
    let room = Arc::new(
        Postroom::builder()
            .clock(PanickyClock)
            .workers(0)
            .reaper_interval(Duration::from_secs(3600))
            .consumer("c", handler_fn(apply))
            .open(&path)
            .unwrap(),
    );

    // T1 leads a slow batch, so the next two callers queue for the writer
    // thread, which runs them together as [deliver m1, transaction t3].
    let r = Arc::clone(&room);
    let t1 = thread::spawn(move || {
        r.transaction(|_| {
            thread::sleep(Duration::from_millis(400));
            Ok(())
        })
    });
    thread::sleep(Duration::from_millis(100));
    let r = Arc::clone(&room);
    let t2 = thread::spawn(move || r.deliver("c", Message::new("s", "m1", "x")));
    thread::sleep(Duration::from_millis(100));
    let r = Arc::clone(&room);
    let t3 = thread::spawn(move || {
        r.transaction(|tx| {
            tx.execute(
                "INSERT INTO applied (consumer, message_id) VALUES ('tx', 't3')",
                [],
            )?;
            Ok(())
        })
    });
    thread::sleep(Duration::from_millis(50));
    // m1's job reads the clock first (call 1), t3's job second (call 2: panic).
    COUNTDOWN.store(2, SeqCst);

    t1.join().unwrap().unwrap();
    let first = t2.join().unwrap();
    let third = t3.join().unwrap();
    eprintln!("first delivery of m1: {first:?}; t3: {third:?}");
    assert!(
        first.is_err(),
        "m1's batch never committed; its caller must not be told otherwise"
    );

    // The broker redelivers m1 (it was never acknowledged).
    let again = room.deliver("c", Message::new("s", "m1", "x"));
    let committed_now = applied_count(&raw(&path), "m1");
    eprintln!("redelivery of m1: {again:?}; m1 effects committed: {committed_now}");

    // Any later batch rolls the leftover transaction back.
    let _ = room.transaction(|_| Ok(()));
    let committed_later = applied_count(&raw(&path), "m1");
    let row = inbox_row(&raw(&path), "c", "s", "m1");
    eprintln!("after the next batch: m1 effects {committed_later}, inbox row {row:?}");

    if let Ok(o) = &again {
        assert!(
            !(o.should_ack() && committed_later == 0),
            "G1/G2 violated: redelivery answered {o:?} (ack) but m1's effects never committed \
             (applied rows now: {committed_later}, inbox row: {row:?})"
        );
    }
}
