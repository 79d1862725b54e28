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
