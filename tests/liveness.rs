//! Never wedged (issue 32): every wait of the engine has a bound, and what
//! holds everyone up is said.
//! * shutdown divides its deadline: a sink stuck in `send` costs the relay
//!   its share, never the writer's;
//! * two engines whose handlers deliver into each other get an error
//!   (`Error::Busy`, retryable) within their busy timeout, not a deadlock;
//! * a handler holding the writer past `slow_handler` is logged, counted
//!   and visible in the engine file (`postroom status`/`top`).

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use postroom::{handler_fn, sink_fn, Message, Postroom, SendResult};

/// The fourth finding: `shutdown(2 s)` with a sink stuck in `send`
/// reported both the relay and the writer as `missed_deadline`: the writer
/// was told to stop only once the whole deadline had passed. Now the relay
/// misses it (it is stuck in user code), and the writer stops in its share.
#[test]
fn a_stuck_sink_leaves_the_writer_its_share_of_the_shutdown_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let release = Arc::new(AtomicBool::new(false));
    let stuck = Arc::clone(&release);
    let room = Postroom::builder()
        .consumer("c", handler_fn(apply))
        .sink(sink_fn(move |_msg| {
            // Stuck until the test ends (bounded, so nothing outlives it).
            let until = Instant::now() + Duration::from_secs(60);
            while !stuck.load(Ordering::SeqCst) && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(10));
            }
            SendResult::Sent
        }))
        .open(&path)
        .unwrap();
    create_domain(&room);
    let _release = SetOnDrop(&release);
    room.deliver("c", Message::new("s", "m1", b"x".to_vec()))
        .unwrap();
    // The relay picks the row up and sticks in the sink.
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    let report = room.shutdown(Duration::from_secs(2)).unwrap();
    let took = started.elapsed();
    assert_eq!(
        report.missed_deadline,
        vec!["postroom-relay".to_owned()],
        "{report:?}"
    );
    assert!(
        report.joined.iter().any(|t| t == "postroom-writer"),
        "{report:?}"
    );
    assert!(took < Duration::from_secs(10), "shutdown took {took:?}");
}

/// Both handlers wait here until the other has arrived (each holding its
/// own engine's writer), so the two calls into each other cross for sure.
fn meet(arrived: &std::sync::atomic::AtomicUsize) {
    arrived.fetch_add(1, Ordering::SeqCst);
    let until = Instant::now() + Duration::from_secs(10);
    while arrived.load(Ordering::SeqCst) < 2 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// An engine whose handler, for a message from outside, delivers into
/// `other` (a message that goes no further).
fn crossing(
    path: &std::path::Path,
    other: Arc<std::sync::OnceLock<Postroom>>,
    arrived: Arc<std::sync::atomic::AtomicUsize>,
) -> Postroom {
    Postroom::builder()
        .busy_timeout(Duration::from_secs(1))
        .consumer(
            "c",
            handler_fn(move |_tx, msg| {
                if msg.source() != "outside" {
                    return Ok(());
                }
                meet(&arrived);
                let other = other.get().expect("both engines open");
                match other.deliver("c", Message::new("inside", msg.id(), b"x".to_vec())) {
                    Ok(_) => Ok(()),
                    Err(e) => Err(postroom::Failure::retry(e)),
                }
            }),
        )
        .open(path)
        .unwrap()
}

/// The second finding: A's handler delivers into B while B's
/// delivers into A, at the same time on two threads: each held its own
/// writer and queued for the other's, and neither ever returned; an
/// unrelated call timed out and shutdown left five threads behind. Now a
/// caller that holds a writer (it runs in a handler) waits at most the
/// other engine's busy timeout, and gets the retryable `Error::Busy`: the
/// handler fails this attempt, the cycle is broken, and everything goes on.
#[test]
fn two_engines_whose_handlers_deliver_into_each_other_get_an_error_not_a_deadlock() {
    let dir = tempfile::tempdir().unwrap();
    let arrived = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (a_cell, b_cell) = (
        Arc::new(std::sync::OnceLock::new()),
        Arc::new(std::sync::OnceLock::new()),
    );
    let a = crossing(
        &dir.path().join("a.db"),
        Arc::clone(&b_cell),
        Arc::clone(&arrived),
    );
    let b = crossing(
        &dir.path().join("b.db"),
        Arc::clone(&a_cell),
        Arc::clone(&arrived),
    );
    assert!(a_cell.set(a).is_ok() && b_cell.set(b).is_ok());
    let started = Instant::now();
    let calls: Vec<_> = [(&a_cell, "to-a"), (&b_cell, "to-b")]
        .into_iter()
        .map(|(room, id)| {
            let room = Arc::clone(room);
            std::thread::spawn(move || {
                let room = room.get().unwrap();
                room.deliver("c", Message::new("outside", id, b"x".to_vec()))
            })
        })
        .collect();
    let outcomes: Vec<_> = calls
        .into_iter()
        .map(|call| join_within(call, 20, "a delivery into crossing engines"))
        .collect();
    let took = started.elapsed();
    eprintln!("crossing deliveries answered in {took:?}: {outcomes:?}");
    // At least one side's inner call met the other's held writer and gave
    // up; its handler failed this attempt (retried later), nothing hung.
    assert!(
        outcomes.iter().any(
            |o| matches!(o, Ok(postroom::Outcome::Failed { error, .. }) if error.contains("busy"))
        ),
        "{outcomes:?}"
    );
    assert!(took < Duration::from_secs(10), "took {took:?}");
    // Both engines still answer, and shut down cleanly.
    let (a, b) = (a_cell.get().unwrap(), b_cell.get().unwrap());
    let other = within(10, "an unrelated delivery", {
        let a_cell = Arc::clone(&a_cell);
        move || {
            a_cell
                .get()
                .unwrap()
                .deliver("c", Message::new("elsewhere", "n1", b"x".to_vec()))
        }
    });
    assert!(other.unwrap().should_ack());
    for room in [a, b] {
        let report = room.shutdown(Duration::from_secs(5)).unwrap();
        assert!(report.is_clean(), "{report:?}");
    }
}

/// The seventh finding: a queued or inline handler that hangs
/// holds every write of the engine, and nothing told an operator which one
/// or for how long. Now one past `slow_handler` is named in the engine file
/// (what `postroom status`/`top` print) while it runs, and the record goes
/// when it returns.
#[test]
fn a_slow_handler_is_named_while_it_holds_the_writer() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let room = Arc::new(
        Postroom::builder()
            .slow_handler(Duration::from_millis(200))
            .consumer(
                "c",
                handler_fn(|_tx, msg| {
                    if msg.id().starts_with("slow") {
                        std::thread::sleep(Duration::from_secs(2));
                    }
                    Ok(())
                }),
            )
            .open(&path)
            .unwrap(),
    );
    assert_eq!(postroom::admin::slow_handler(&path), None);
    let call = {
        let room = Arc::clone(&room);
        std::thread::spawn(move || room.deliver("c", Message::new("s", "slow-1", b"x".to_vec())))
    };
    let mut seen = None;
    eventually(10, "the slow handler to be recorded", || {
        seen = postroom::admin::slow_handler(&path);
        seen.is_some() || call.is_finished()
    });
    let seen = seen.expect("recorded while it ran");
    assert_eq!(
        (seen.consumer.as_str(), seen.message_id.as_str()),
        ("c", "slow-1")
    );
    let age = postroom::admin::now_ms() - seen.since_ms;
    assert!((0..60_000).contains(&age), "started {age} ms ago?");
    if let Some(cli) = option_env!("CARGO_BIN_EXE_postroom") {
        let out = std::process::Command::new(cli)
            .arg(&path)
            .arg("status")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        // The handler may just have returned on a loaded machine.
        if !call.is_finished() {
            assert!(
                text.contains("SLOW HANDLER") && text.contains("c/slow-1"),
                "{text}"
            );
        }
    }
    let outcome = join_within(call, 30, "the slow delivery").unwrap();
    assert!(outcome.should_ack(), "{outcome:?}");
    assert_eq!(room.stats().unwrap().slow_handlers, 1);
    eventually(10, "the record to be cleared", || {
        postroom::admin::slow_handler(&path).is_none()
    });
}

/// A queued processing batch takes no further rows once its handlers have
/// held the writer `slow_handler`: a caller waits for about that, not for
/// the whole batch (here 20 rows of 200 ms: 4 s).
#[test]
fn a_queued_batch_of_slow_handlers_stops_taking_rows_past_the_threshold() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let started = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&started);
    let room = Postroom::builder()
        .slow_handler(Duration::from_millis(200))
        .consumer(
            "q",
            handler_fn(move |_tx, _msg| {
                flag.store(true, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(200));
                Ok(())
            }),
        )
        .consumer("c", handler_fn(|_tx, _msg| Ok(())))
        .open(&path)
        .unwrap();
    let msgs = (0..20).map(|i| Message::new("s", format!("q{i}"), b"x".to_vec()));
    room.receive_batch("q", msgs).unwrap();
    eventually(30, "queued processing to start", || {
        started.load(Ordering::SeqCst)
    });
    let t = Instant::now();
    let outcome = room
        .deliver("c", Message::new("s", "c1", b"x".to_vec()))
        .unwrap();
    let waited = t.elapsed();
    assert!(outcome.should_ack());
    eprintln!("a delivery beside a batch of slow handlers waited {waited:?}");
    assert!(waited < Duration::from_millis(2500), "waited {waited:?}");
    eventually(60, "the queued rows to be processed", || {
        room.stats().unwrap().inbox["q"].completed == 20
    });
}
