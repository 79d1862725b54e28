//! A hostile review of the idle engine (issue 33 item 1): a backlog the
//! sink put off (an edge device offline, its broker down for an hour) is
//! not work due, so the relay sleeps until it is, however long the backlog.
//! Its own binary: the relay thread's wakeups are counted by name in
//! `/proc/self/task`, and no other test's engine may share the process.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use postroom::{
    handler_fn, sink_fn, Failure, Message, OutboxMessage, Outgoing, Postroom, SendResult, Tx,
};

/// One test at a time: threads are counted by name.
static ALONE: Mutex<()> = Mutex::new(());

/// Context switches of this process's threads named `name`.
fn switches(name: &str) -> u64 {
    let mut total = 0;
    for entry in std::fs::read_dir("/proc/self/task").unwrap() {
        let entry = entry.unwrap();
        let Ok(comm) = std::fs::read_to_string(entry.path().join("comm")) else {
            continue;
        };
        // The kernel keeps 15 bytes of a thread's name.
        if comm.trim() != &name[..name.len().min(15)] {
            continue;
        }
        let Ok(status) = std::fs::read_to_string(entry.path().join("status")) else {
            continue;
        };
        total += status
            .lines()
            .filter(|l| {
                l.starts_with("voluntary_ctxt_switches:")
                    || l.starts_with("nonvoluntary_ctxt_switches:")
            })
            .map(|l| l.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap())
            .sum::<u64>();
    }
    total
}

/// 1,500 outbox rows (more than `store::due::SCAN`), the sink down for an
/// hour: the relay used to look again every second (its read of the next
/// due time stopped at 1,000 rows and was not trusted).
#[test]
fn a_backlog_the_sink_put_off_does_not_wake_the_relay() {
    let _alone = ALONE.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let tried = Arc::new(AtomicU64::new(0));
    let sink_tried = Arc::clone(&tried);
    let room = Postroom::builder()
        .sink(sink_fn(move |_: &OutboxMessage| {
            sink_tried.fetch_add(1, Ordering::SeqCst);
            SendResult::unavailable("broker down", Duration::from_secs(3600))
        }))
        .open(dir.path().join("app.db"))
        .unwrap();
    room.transaction(|tx| {
        for i in 0..1500 {
            tx.publish(Outgoing::new("t", format!("{i}")))?;
        }
        Ok(())
    })
    .unwrap();
    eventually(60, "every row tried once", || {
        tried.load(Ordering::SeqCst) >= 1500
    });
    // Settled: the last marks committed, the watch saw them.
    std::thread::sleep(Duration::from_secs(4));
    let window = Duration::from_secs(6);
    let before = switches("postroom-relay");
    std::thread::sleep(window);
    let woke = switches("postroom-relay") - before;
    println!("relay, backlog of 1500 put off for an hour: {woke} switches in {window:?}");
    assert_eq!(tried.load(Ordering::SeqCst), 1500, "tried again early");
    // Nothing is due for an hour: a wake or two of slack for a busy
    // machine (a preemption), not one a second.
    assert!(woke <= 2, "the relay woke {woke} times in {window:?}");
    room.shutdown(Duration::from_secs(10)).unwrap();
}

/// 1,500 queued messages (more than `store::due::SCAN`) whose handler
/// asked for a retry in an hour (its database down, say): the dispatcher
/// looks again every second (its read of the next due time stops at 1,000
/// rows and is not trusted).
#[test]
fn a_backlog_put_off_does_not_wake_the_dispatcher() {
    let _alone = ALONE.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let tried = Arc::new(AtomicU64::new(0));
    let handler_tried = Arc::clone(&tried);
    let room = Postroom::builder()
        .consumer(
            "orders",
            handler_fn(move |_: &mut Tx<'_>, _: &Message| {
                handler_tried.fetch_add(1, Ordering::SeqCst);
                Err(Failure::retry_after("db down", Duration::from_secs(3600)))
            }),
        )
        .open(dir.path().join("app.db"))
        .unwrap();
    for i in 0..1500 {
        room.receive("orders", Message::new("shop", format!("{i}"), "x"))
            .unwrap();
    }
    eventually(60, "every message tried once", || {
        tried.load(Ordering::SeqCst) >= 1500
    });
    std::thread::sleep(Duration::from_secs(4));
    let window = Duration::from_secs(6);
    let before = switches("postroom-dispatcher");
    std::thread::sleep(window);
    let woke = switches("postroom-dispatcher") - before;
    println!("dispatcher, backlog of 1500 put off for an hour: {woke} switches in {window:?}");
    assert_eq!(tried.load(Ordering::SeqCst), 1500, "tried again early");
    assert!(woke <= 2, "the dispatcher woke {woke} times in {window:?}");
    room.shutdown(Duration::from_secs(10)).unwrap();
}

/// A `ManualClock` stopped just short of a retry's due time: a due time
/// read against a clock that does not move is never reached, so the
/// dispatcher woke at the rate of the time left (1,240 switches in 3 s at
/// 5 ms short). Now it notices the clock lags and looks at most every
/// 250 ms (the polling rate before issue 33); the retry still runs once the
/// clock is moved on.
#[test]
fn a_manual_clock_stopped_short_of_a_retry() {
    let _alone = ALONE.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let clock = postroom::ManualClock::new(1_800_000_000_000);
    let runs = Arc::new(AtomicU64::new(0));
    let handler_runs = Arc::clone(&runs);
    let room = Postroom::builder()
        .clock(clock.clone())
        .consumer(
            "orders",
            handler_fn(move |_: &mut Tx<'_>, _: &Message| {
                if handler_runs.fetch_add(1, Ordering::SeqCst) == 0 {
                    Err(Failure::retry_after("not yet", Duration::from_secs(10)))
                } else {
                    Ok(())
                }
            }),
        )
        .open(dir.path().join("app.db"))
        .unwrap();
    room.receive("orders", Message::new("shop", "1", "x"))
        .unwrap();
    eventually(30, "tried once", || runs.load(Ordering::SeqCst) == 1);
    clock.advance(Duration::from_millis(9_995));
    std::thread::sleep(Duration::from_secs(2));
    let window = Duration::from_secs(3);
    let before = switches("postroom-dispatcher");
    std::thread::sleep(window);
    let woke = switches("postroom-dispatcher") - before;
    println!("dispatcher, ManualClock 5 ms short of a retry: {woke} switches in {window:?}");
    // About 12 looks of a few switches each; was over 1,000.
    assert!(
        woke <= 100,
        "the dispatcher woke {woke} times in {window:?}"
    );
    clock.advance(Duration::from_millis(10));
    eventually(30, "the retry", || runs.load(Ordering::SeqCst) == 2);
    room.shutdown(Duration::from_secs(10)).unwrap();
}
