//! Idle means asleep (issue 33): an engine with nothing due takes no
//! wakeups beyond one cheap check a second, yet a retry still comes due on
//! time, rows another process made due are still picked up, and shutdown
//! stays prompt.
//!
//! The wakeups are counted as the kernel counts them: the context switches
//! (`voluntary_ctxt_switches` + `nonvoluntary_ctxt_switches` of
//! `/proc/self/task/*/status`) of the engine's threads. A thread blocked on
//! a channel or a timer takes none, however busy the machine, so the
//! budget holds under load. The count runs in a child process of its own
//! (this test binary again), so no other test's threads are counted.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use postroom::{
    handler_fn, sink_fn, EffectContext, EffectHandler, Failure, ManualClock, Message,
    OutboxMessage, Outgoing, Postroom, SendResult, Tx,
};

/// How long the idle engine is watched.
const WINDOW: Duration = Duration::from_secs(5);
/// Wakeups a second the engine may take in all, as the issue sets it: one
/// check a second for another process's commits.
const BUDGET_PER_S: f64 = 1.0;
/// What a busy machine adds: a thread preempted while it did its one
/// check, or yielding in a channel's short spin before it parks (1.17 a
/// second was seen at a load average of 10 on 2 cores, 1.0 when quiet).
const SLACK: u64 = 5;

/// Entry point of the child processes. Not a test: it only does something
/// when started by `spawn_child`, and is ignored otherwise.
#[test]
#[ignore = "entry point for child processes of the idle tests"]
fn child_main() {
    let Some((role, db)) = child_role() else {
        return;
    };
    report("");
    match role.as_str() {
        "idle" => child_idle(&db),
        other => panic!("unknown child role {other}"),
    }
}

/// The threads of this process: id → (name, context switches so far).
fn threads() -> BTreeMap<u32, (String, u64)> {
    threads_counting(&["voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:"])
}

/// The threads of this process: id → (name, the sum of the `status` lines
/// named).
fn threads_counting(lines: &[&str]) -> BTreeMap<u32, (String, u64)> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir("/proc/self/task").unwrap() {
        let entry = entry.unwrap();
        let Ok(tid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        // A thread may end between the listing and the read.
        let Ok(name) = std::fs::read_to_string(entry.path().join("comm")) else {
            continue;
        };
        let Ok(status) = std::fs::read_to_string(entry.path().join("status")) else {
            continue;
        };
        let switches = status
            .lines()
            .filter(|l| lines.iter().any(|name| l.starts_with(name)))
            .map(|l| l.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap())
            .sum();
        out.insert(tid, (name.trim().to_owned(), switches));
    }
    out
}

struct Charge;

impl EffectHandler for Charge {
    type Output = ();

    fn effect(&self, _: &EffectContext<'_>, _: &Message) -> Result<(), Failure> {
        Ok(())
    }

    fn apply(&self, tx: &mut Tx<'_>, msg: &Message, (): ()) -> Result<(), Failure> {
        tx.publish(Outgoing::new("charged", msg.payload().to_vec()))?;
        Ok(())
    }
}

/// An engine with default settings, a consumer of each kind and a sink,
/// all of which have worked; once settled, its threads' switches over
/// [`WINDOW`], one `THREAD <name> <switches>` line each, then `DONE`.
fn child_idle(db: &std::path::Path) {
    let before = threads();
    let room = Postroom::builder()
        .consumer(
            "orders",
            handler_fn(|tx: &mut Tx<'_>, msg: &Message| {
                tx.publish(Outgoing::new("shipped", msg.payload().to_vec()))?;
                Ok(())
            }),
        )
        .effectful_consumer("payments", Charge)
        .sink(sink_fn(|_: &OutboxMessage| SendResult::Sent))
        .open(db)
        .unwrap();
    room.receive("orders", Message::new("shop", "1", "a"))
        .unwrap();
    room.receive("payments", Message::new("shop", "1", "b"))
        .unwrap();
    eventually(30, "both processed and relayed", || {
        let stats = room.stats().unwrap();
        let done = |c: &str| stats.inbox.get(c).is_some_and(|s| s.completed == 1);
        done("orders") && done("payments") && stats.outbox.sent == 2
    });
    // Settled: the last commits' WAL fsync and checkpoint, the reaper's
    // look at the new leases, the first checks of the file.
    std::thread::sleep(Duration::from_secs(3));
    let engine: BTreeMap<u32, String> = threads()
        .into_iter()
        .filter(|(tid, _)| !before.contains_key(tid))
        .map(|(tid, (name, _))| (tid, name))
        .collect();
    // A longer window, for the figures: POSTROOM_IDLE_WINDOW_S=120.
    let window = env_u64("POSTROOM_IDLE_WINDOW_S").map_or(WINDOW, Duration::from_secs);
    let start = threads();
    let start_forced = threads_counting(&["nonvoluntary_ctxt_switches:"]);
    let until = Instant::now() + window;
    while let Some(left) = until.checked_duration_since(Instant::now()) {
        // The parent waits at most a minute for a line (this thread's
        // wakeups are not the engine's).
        std::thread::sleep(left.min(Duration::from_secs(20)));
        report("WAITING");
    }
    let end = threads();
    let end_forced = threads_counting(&["nonvoluntary_ctxt_switches:"]);
    let delta =
        |start: &BTreeMap<u32, (String, u64)>, end: &BTreeMap<u32, (String, u64)>, tid| match (
            start.get(tid),
            end.get(tid),
        ) {
            (Some((_, a)), Some((_, b))) => b - a,
            _ => 0,
        };
    for (tid, name) in &engine {
        // Of the switches, those forced (preempted), for the figures.
        let forced = delta(&start_forced, &end_forced, tid);
        report(&format!(
            "THREAD {name} {} {forced}",
            delta(&start, &end, tid)
        ));
    }
    let started = Instant::now();
    let shutdown = room.shutdown(Duration::from_secs(10)).unwrap();
    report(&format!(
        "SHUTDOWN {} {}",
        started.elapsed().as_millis(),
        shutdown.is_clean()
    ));
    report("DONE");
}

/// (a) An idle engine with default settings (a transactional consumer,
/// an effectful one, a sink, nothing due) takes at most about one wakeup
/// a second across all its threads, and every thread it starts, the read
/// pool's included, is named for it.
#[test]
fn an_idle_engine_wakes_at_most_once_a_second() {
    let dir = tempfile::tempdir().unwrap();
    let window = env_u64("POSTROOM_IDLE_WINDOW_S").map_or(WINDOW, Duration::from_secs);
    let env: Vec<(&str, String)> = std::env::var("POSTROOM_IDLE_WINDOW_S")
        .map(|w| vec![("POSTROOM_IDLE_WINDOW_S", w)])
        .unwrap_or_default();
    let mut child = spawn_child("idle", &dir.path().join("app.db"), &env);
    let lines = lines_of(&mut child);
    let said = wait_for(&lines, "DONE");
    wait_or_kill(&mut child, 30, "the idle child");
    let mut total = 0;
    let mut per_thread = Vec::new();
    for line in &said {
        let mut words = line.split_whitespace();
        match words.next() {
            Some("THREAD") => {
                let name = words.next().unwrap().to_owned();
                let switches: u64 = words.next().unwrap().parse().unwrap();
                let forced: u64 = words.next().unwrap().parse().unwrap();
                assert!(
                    name.starts_with("postroom-"),
                    "the engine started a thread without a name of its own: {name:?} ({said:?})"
                );
                total += switches;
                per_thread.push((name, switches, forced));
            }
            Some("SHUTDOWN") => {
                let ms: u64 = words.next().unwrap().parse().unwrap();
                assert_eq!(words.next(), Some("true"), "{said:?}");
                assert!(ms < 10_000, "shutdown took {ms} ms");
            }
            _ => {}
        }
    }
    println!(
        "idle engine, {} s: {total} switches; per thread (name, switches, of which \
         forced): {per_thread:?}",
        window.as_secs()
    );
    assert!(per_thread.len() >= 6, "{said:?}");
    let budget = (window.as_secs_f64() * BUDGET_PER_S) as u64 + SLACK;
    assert!(
        total <= budget,
        "an idle engine took {total} context switches in {} s (budget {budget}): {per_thread:?}",
        window.as_secs()
    );
}

fn completed(room: &Postroom, consumer: &str) -> u64 {
    room.stats()
        .unwrap()
        .inbox
        .get(consumer)
        .map_or(0, |c| c.completed)
}

fn failed(room: &Postroom, consumer: &str) -> u64 {
    room.stats()
        .unwrap()
        .inbox
        .get(consumer)
        .map_or(0, |c| c.failed)
}

/// Fails its first `fails` attempts, asking for a retry after `after`.
fn failing(fails: u32, after: Duration) -> impl Fn(&mut Tx<'_>, &Message) -> Result<(), Failure> {
    let runs = AtomicU32::new(0);
    move |_: &mut Tx<'_>, _: &Message| {
        if runs.fetch_add(1, Ordering::SeqCst) < fails {
            Err(Failure::retry_after("not yet", after))
        } else {
            Ok(())
        }
    }
}

/// With every polling setting at an hour: nothing polls.
fn sleepy() -> postroom::Builder {
    let hour = Duration::from_secs(3600);
    Postroom::builder()
        .poll_interval(hour)
        .relay_poll(hour)
        .reaper_interval(hour)
}

/// (b) The timers come from the data: a retry due in 2 s is processed in
/// about 2 s, an outbox row the sink could not take is handed over again
/// when it said, with every polling setting at an hour.
#[test]
fn a_retry_comes_due_without_polling() {
    let dir = tempfile::tempdir().unwrap();
    let down = Arc::new(AtomicBool::new(true));
    let sink_down = Arc::clone(&down);
    let room = sleepy()
        .consumer("orders", handler_fn(failing(1, Duration::from_secs(2))))
        .sink(sink_fn(move |_: &OutboxMessage| {
            if sink_down.swap(false, Ordering::SeqCst) {
                SendResult::unavailable("down", Duration::from_secs(2))
            } else {
                SendResult::Sent
            }
        }))
        .open(dir.path().join("app.db"))
        .unwrap();
    let started = Instant::now();
    room.receive("orders", Message::new("shop", "1", "a"))
        .unwrap();
    room.transaction(|tx| {
        tx.publish(Outgoing::new("t", "x"))?;
        Ok(())
    })
    .unwrap();
    eventually(30, "the retry processed", || {
        completed(&room, "orders") == 1
    });
    let retried = started.elapsed();
    eventually(30, "the row handed over again", || {
        room.stats().unwrap().outbox.sent == 1
    });
    let resent = started.elapsed();
    assert!(!down.load(Ordering::SeqCst));
    // Not before it was due; well before an hour.
    assert!(retried >= Duration::from_millis(1500), "{retried:?}");
    assert!(resent >= Duration::from_millis(1500), "{resent:?}");
    room.shutdown(Duration::from_secs(10)).unwrap();
}

/// (b) Rows another connection made due (as the CLI's `retry` and
/// `redeliver` do, or a `sqlite3` beside the engine) are picked up within a
/// few seconds, with every polling setting at an hour.
#[test]
fn rows_another_connection_made_due_are_picked_up() {
    let dir = tempfile::tempdir().unwrap();
    let later = Arc::new(AtomicBool::new(true));
    let sink_later = Arc::clone(&later);
    let room = sleepy()
        .consumer("orders", handler_fn(failing(1, Duration::from_secs(3600))))
        .sink(sink_fn(move |_: &OutboxMessage| {
            if sink_later.swap(false, Ordering::SeqCst) {
                SendResult::unavailable("down", Duration::from_secs(3600))
            } else {
                SendResult::Sent
            }
        }))
        .open(dir.path().join("app.db"))
        .unwrap();
    room.receive("orders", Message::new("shop", "1", "a"))
        .unwrap();
    room.transaction(|tx| {
        tx.publish(Outgoing::new("t", "x"))?;
        Ok(())
    })
    .unwrap();
    eventually(30, "the first attempt failed", || {
        failed(&room, "orders") == 1
    });
    eventually(30, "the sink said later", || !later.load(Ordering::SeqCst));
    // Both put off for an hour; now made due by another connection.
    std::thread::sleep(Duration::from_secs(2));
    let conn = raw(room.path());
    conn.execute("UPDATE postroom_inbox SET next_attempt_at = 0", [])
        .unwrap();
    conn.execute(
        "UPDATE postroom_outbox SET next_attempt_at = 0 WHERE status = 'pending'",
        [],
    )
    .unwrap();
    let changed = Instant::now();
    eventually(15, "the inbox row processed", || {
        completed(&room, "orders") == 1
    });
    eventually(15, "the outbox row handed over", || {
        room.stats().unwrap().outbox.sent == 1
    });
    println!(
        "picked up {:?} after the other connection's commit",
        changed.elapsed()
    );
    room.shutdown(Duration::from_secs(10)).unwrap();
}

/// (b) A step of the wall clock (an NTP correction, a device that booted
/// in 1970) wakes the sleepers: due times are read against the clock, and
/// a sleep computed before the step would be too long.
#[test]
fn a_step_of_the_clock_wakes_the_sleepers() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_800_000_000_000);
    let room = sleepy()
        .clock(clock.clone())
        .consumer("orders", handler_fn(failing(1, Duration::from_secs(3600))))
        .open(dir.path().join("app.db"))
        .unwrap();
    room.receive("orders", Message::new("shop", "1", "a"))
        .unwrap();
    eventually(30, "the first attempt failed", || {
        failed(&room, "orders") == 1
    });
    std::thread::sleep(Duration::from_secs(2));
    clock.advance(Duration::from_secs(3601));
    eventually(15, "the retry processed", || {
        completed(&room, "orders") == 1
    });
    room.shutdown(Duration::from_secs(10)).unwrap();
}

/// (c) Shutdown with every thread asleep returns promptly and cleanly.
#[test]
fn shutdown_of_a_sleeping_engine_is_prompt() {
    let dir = tempfile::tempdir().unwrap();
    let room = Postroom::builder()
        .consumer("orders", handler_fn(|_: &mut Tx<'_>, _: &Message| Ok(())))
        .effectful_consumer("payments", Charge)
        .sink(sink_fn(|_: &OutboxMessage| SendResult::Sent))
        .open(dir.path().join("app.db"))
        .unwrap();
    room.receive("payments", Message::new("shop", "1", "b"))
        .unwrap();
    eventually(30, "processed and relayed", || {
        room.stats().unwrap().outbox.sent == 1
    });
    std::thread::sleep(Duration::from_secs(2));
    let started = Instant::now();
    let report = room.shutdown(Duration::from_secs(20)).unwrap();
    let took = started.elapsed();
    assert!(report.is_clean(), "{report:?}");
    assert!(took < Duration::from_secs(5), "shutdown took {took:?}");
}
