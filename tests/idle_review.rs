//! A hostile review of the idle engine (issue 33 item 1): wakeups that
//! could be lost now that the engine's threads sleep until their data says
//! work is due. Needs `--features failpoints` (armed from the environment,
//! so this binary holds one test: the variable is set before any engine
//! opens).
#![cfg(feature = "failpoints")]

mod common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use common::*;
use postroom::{handler_fn, Failure, Message, Postroom, Tx};

/// The checkpointer is the only thread that sees another process's
/// commits (its watch of `data_version`). When it cannot open its
/// connection it used to end, and the watch with it: a row the CLI made
/// due then waited for the dispatcher's safety net (an hour here, 5 min by
/// default), and the reaper, which has none, slept for good.
#[test]
fn without_the_checkpointers_connection_rows_made_due_elsewhere_are_picked_up() {
    std::env::set_var("POSTROOM_FAILPOINTS", "checkpoint.open=error@1");
    let dir = tempfile::tempdir().unwrap();
    let hour = Duration::from_secs(3600);
    let runs = AtomicU32::new(0);
    let room = Postroom::builder()
        .poll_interval(hour)
        .relay_poll(hour)
        .reaper_interval(hour)
        .consumer(
            "orders",
            handler_fn(move |_: &mut Tx<'_>, _: &Message| {
                if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                    Err(Failure::retry_after("not yet", hour))
                } else {
                    Ok(())
                }
            }),
        )
        .open(dir.path().join("app.db"))
        .unwrap();
    let stat = |f: fn(&postroom::StatusCounts) -> u64| {
        room.stats().unwrap().inbox.get("orders").map_or(0, f)
    };
    room.receive("orders", Message::new("shop", "1", "a"))
        .unwrap();
    eventually(30, "the first attempt failed", || stat(|c| c.failed) == 1);
    std::thread::sleep(Duration::from_secs(2));
    // As the CLI's `retry` does: another connection makes the row due.
    raw(room.path())
        .execute("UPDATE postroom_inbox SET next_attempt_at = 0", [])
        .unwrap();
    eventually(20, "the row made due elsewhere processed", || {
        stat(|c| c.completed) == 1
    });
    room.shutdown(Duration::from_secs(10)).unwrap();
}
