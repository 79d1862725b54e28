//! Regression (review of the leader lock): once the writer thread has died (a
//! panic escaping a job it ran: here the user `Clock`), callers that find the
//! lock taken are told `Closed` at once (the writer's `alive` channel
//! disconnected), but their job stays in the queue that leaders drain: the next
//! leader runs and commits it. "On Err nothing was stored" no longer holds; a
//! caller that retries a `transaction` applies it twice.

mod common;

use std::sync::atomic::{AtomicI32, Ordering::SeqCst};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::*;
use postroom::{handler_fn, Clock, Postroom};

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

fn slow_leader(room: &Arc<Postroom>) -> thread::JoinHandle<postroom::Result<()>> {
    let r = Arc::clone(room);
    thread::spawn(move || {
        r.transaction(|_| {
            thread::sleep(Duration::from_millis(300));
            Ok(())
        })
    })
}

#[test]
fn a_caller_told_closed_is_not_committed_later() {
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

    // 1. Kill the writer thread: a job queued behind a slow leader panics there.
    let t1 = slow_leader(&room);
    thread::sleep(Duration::from_millis(100));
    COUNTDOWN.store(1, SeqCst);
    let r = Arc::clone(&room);
    let victim = thread::spawn(move || r.transaction(|_| Ok(())));
    t1.join().unwrap().unwrap();
    eprintln!(
        "job the writer thread panicked in: {:?}",
        victim.join().unwrap()
    );

    // 2. A caller that finds the lock taken queues, and is told Closed.
    let t4 = slow_leader(&room);
    thread::sleep(Duration::from_millis(100));
    let started = Instant::now();
    let told = room.transaction(|tx| {
        tx.execute(
            "INSERT INTO applied (consumer, message_id) VALUES ('tx', 'x5')",
            [],
        )?;
        Ok(())
    });
    eprintln!("queued caller told {told:?} after {:?}", started.elapsed());
    t4.join().unwrap().unwrap();

    // 3. The engine still takes work from callers that lead...
    let later = room.transaction(|_| Ok(()));
    eprintln!(
        "next leader: {later:?}; cleanup(): {:?}",
        room.cleanup().map(|_| ())
    );
    let x5 = applied_count(&raw(&path), "x5");
    eprintln!("rows of the transaction that was told {told:?}: {x5}");
    assert!(
        !(told.is_err() && x5 > 0),
        "transaction answered {told:?}, yet its write was committed by a later leader ({x5} row)"
    );
}
