//! Regressions from a review of the leader lock: a panic while the write
//! lock is held (here from the user's `Clock`, which every job calls) must
//! fail its batch and leave nothing half-done behind for the next holder.

mod common;

use std::sync::atomic::{AtomicI32, Ordering::SeqCst};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::*;
use postroom::{handler_fn, Clock, Message, Postroom};

/// A user clock that panics on the n-th call made on the writer thread
/// once armed (`countdown` set to n).
struct PanickyClock(Arc<AtomicI32>);
impl Clock for PanickyClock {
    fn now_ms(&self) -> i64 {
        if thread::current().name() == Some("postroom-writer")
            && self.0.load(SeqCst) > 0
            && self.0.fetch_sub(1, SeqCst) == 1
        {
            panic!("user clock failed");
        }
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64
    }
}

/// An engine whose clock panics when `countdown` (returned) is armed.
fn open(path: &std::path::Path) -> (Arc<Postroom>, Arc<AtomicI32>) {
    let countdown = Arc::new(AtomicI32::new(0));
    raw(path).execute_batch(DOMAIN_SQL).unwrap();
    let room = Postroom::builder()
        .clock(PanickyClock(Arc::clone(&countdown)))
        .workers(0)
        .reaper_interval(Duration::from_secs(3600))
        .consumer("c", handler_fn(apply))
        .open(path)
        .unwrap();
    (Arc::new(room), countdown)
}

fn slow_leader(room: &Arc<Postroom>) -> thread::JoinHandle<postroom::Result<()>> {
    let r = Arc::clone(room);
    thread::spawn(move || {
        r.transaction(|_| {
            thread::sleep(Duration::from_millis(300));
            Ok(())
        })
    })
}

/// Once the writer thread had died (a
/// panic escaping a job it ran: here the user `Clock`), callers that find the
/// lock taken are told `Closed` at once (the writer's `alive` channel
/// disconnected), but their job stays in the queue that leaders drain: the next
/// leader runs and commits it. "On Err nothing was stored" no longer holds; a
/// caller that retries a `transaction` applies it twice.
#[test]
fn a_caller_told_closed_is_not_committed_later() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let (room, countdown) = open(&path);

    // 1. Kill the writer thread: a job queued behind a slow leader panics there.
    let t1 = slow_leader(&room);
    thread::sleep(Duration::from_millis(100));
    countdown.store(1, SeqCst);
    let r = Arc::clone(&room);
    let victim = thread::spawn(move || r.transaction(|_| Ok(())));
    join_within(t1, 60, "the slow leader").unwrap();
    eprintln!(
        "job the writer thread panicked in: {:?}",
        join_within(victim, 60, "the caller queued behind it")
    );

    // 2. A caller that finds the lock taken queues, and is told Closed.
    let t4 = slow_leader(&room);
    thread::sleep(Duration::from_millis(100));
    let started = Instant::now();
    let r = Arc::clone(&room);
    let told = within(60, "the queued caller", move || {
        r.transaction(|tx| {
            tx.execute(
                "INSERT INTO applied (consumer, message_id) VALUES ('tx', 'x5')",
                [],
            )?;
            Ok(())
        })
    });
    eprintln!("queued caller told {told:?} after {:?}", started.elapsed());
    join_within(t4, 60, "the second slow leader").unwrap();

    // 3. The engine still takes work from callers that lead...
    let r = Arc::clone(&room);
    let (later, cleanup) = within(60, "the next leader and cleanup()", move || {
        (r.transaction(|_| Ok(())), r.cleanup().map(|_| ()))
    });
    eprintln!("next leader: {later:?}; cleanup(): {cleanup:?}");
    let x5 = applied_count(&raw(&path), "x5");
    eprintln!("rows of the transaction that was told {told:?}: {x5}");
    assert!(
        !(told.is_err() && x5 > 0),
        "transaction answered {told:?}, yet its write was committed by a later leader ({x5} row)"
    );
}

/// A panic that escapes a job while the
/// write lock is held (here: the user-supplied `Clock`, called by every job
/// outside any catch_unwind) leaves the lock poisoned and the batch's
/// transaction open. The next `deliver` of a duplicate "leads", reads the inbox
/// row on the write connection -- inside that still-open transaction -- and
/// answers `Duplicate` for a message whose effects never committed. The caller
/// acks; the next batch rolls the transaction back; the effects are lost.
#[test]
fn duplicate_is_not_answered_from_an_uncommitted_batch() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let (room, countdown) = open(&path);

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
    countdown.store(2, SeqCst);

    join_within(t1, 60, "the slow leader").unwrap();
    let first = join_within(t2, 60, "m1's first delivery");
    let third = join_within(t3, 60, "t3");
    eprintln!("first delivery of m1: {first:?}; t3: {third:?}");
    assert!(
        first.is_err(),
        "m1's batch never committed; its caller must not be told otherwise"
    );

    // The broker redelivers m1 (it was never acknowledged).
    let r = Arc::clone(&room);
    let again = within(60, "m1's redelivery", move || {
        r.deliver("c", Message::new("s", "m1", "x"))
    });
    let committed_now = applied_count(&raw(&path), "m1");
    eprintln!("redelivery of m1: {again:?}; m1 effects committed: {committed_now}");

    // Any later batch rolls the leftover transaction back.
    let r = Arc::clone(&room);
    let _ = within(60, "the next batch", move || r.transaction(|_| Ok(())));
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
