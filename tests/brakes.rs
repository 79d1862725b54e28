//! Brakes (issue 36, item 4): a consumer given a backlog bound
//! (`Builder::backlog_limit`) stores nothing past it and answers the
//! retryable `Error::Backlogged`, so a fast sender is held to the pace of
//! the workers with nothing lost. Real files, real worker threads.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use postroom::{handler_fn, Error, Message, Postroom, Receipt};

fn msg(i: u64) -> Message {
    Message::new("sender", format!("m{i}"), format!("payload {i}"))
}

/// The backlog as the engine's own stats count it.
fn backlog(room: &Postroom) -> u64 {
    let counts = room
        .stats()
        .unwrap()
        .inbox
        .get("c")
        .copied()
        .unwrap_or_default();
    counts.pending + counts.processing + counts.failed
}

#[test]
fn past_the_bound_a_receive_stores_nothing_and_is_told_to_slow_down() {
    let dir = tempfile::tempdir().unwrap();
    // No workers: nothing drains, so the bound is met and stays met.
    let room = Postroom::builder()
        .workers(0)
        .consumer("c", handler_fn(apply))
        .consumer("free", handler_fn(apply))
        .backlog_limit("c", 100)
        .open(dir.path().join("app.db"))
        .unwrap();
    create_domain(&room);
    // Under the bound a call is taken whole, even one that passes it.
    let first: Vec<Message> = (0..60).map(msg).collect();
    assert!(room
        .receive_batch("c", first)
        .unwrap()
        .iter()
        .all(|r| *r == Receipt::Accepted));
    let second: Vec<Message> = (60..120).map(msg).collect();
    assert!(room
        .receive_batch("c", second)
        .unwrap()
        .iter()
        .all(|r| *r == Receipt::Accepted));
    assert_eq!(backlog(&room), 120);
    let conn = raw(room.path());
    let stored = count(&conn, "SELECT count(*) FROM postroom_inbox");
    for call in 0..3 {
        match room.receive("c", msg(1000 + call)) {
            Err(e @ Error::Backlogged { .. }) => {
                assert!(e.is_retryable(), "{e}");
                let Error::Backlogged { backlog, limit, .. } = e else {
                    unreachable!()
                };
                // The brake's count may be a moment old (it is read at
                // most every so often): it is at least the bound, which is
                // why the call was refused, and at most what is stored.
                assert_eq!(limit, 100);
                assert!((100..=120).contains(&backlog), "backlog {backlog}");
            }
            other => panic!("call {call}: {other:?}"),
        }
        assert!(matches!(
            room.receive_batch("c", vec![msg(2000 + call), msg(3000 + call)]),
            Err(Error::Backlogged { .. })
        ));
    }
    assert_eq!(
        count(&conn, "SELECT count(*) FROM postroom_inbox"),
        stored,
        "a refused call stored something"
    );
    // Other consumers, and inline delivery, are not braked.
    assert_eq!(room.receive("free", msg(1)).unwrap(), Receipt::Accepted);
    assert!(room.deliver("c", msg(5000)).unwrap().should_ack());
    // Invalid input is still told as such.
    assert!(matches!(
        room.receive("c", Message::new("sender", "", "x")),
        Err(Error::InvalidInput { .. })
    ));
}

#[test]
fn a_bound_for_an_unknown_consumer_or_of_zero_is_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    for builder in [
        Postroom::builder()
            .consumer("c", handler_fn(apply))
            .backlog_limit("typo", 10),
        Postroom::builder()
            .consumer("c", handler_fn(apply))
            .backlog_limit("c", 0),
        Postroom::builder()
            .consumer("c", handler_fn(apply))
            .backlog_limit("c", u64::MAX),
        Postroom::builder()
            .consumer("c", handler_fn(apply))
            .backlog_limit("c", 10)
            .backlog_limit("c", 20),
    ] {
        match builder.open(dir.path().join("app.db")) {
            Err(Error::InvalidInput { field, .. }) => assert_eq!(field, "backlog_limit"),
            other => panic!("{other:?}"),
        }
        assert!(!dir.path().join("app.db").exists());
    }
}

/// A sender much faster than the workers: it is held to their pace (each
/// `Backlogged` answer makes it pause and send the same batch again), the
/// backlog stays within the bound plus one batch, and every message is
/// processed exactly once.
#[test]
fn a_fast_sender_is_held_to_the_workers_pace_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let limit = 200;
    let batch = 50;
    let total = 2000;
    let room = Arc::new(
        Postroom::builder()
            .process_batch(10)
            .consumer(
                "c",
                handler_fn(|tx, m| {
                    std::thread::sleep(Duration::from_millis(1));
                    apply(tx, m)
                }),
            )
            .backlog_limit("c", limit)
            .open(dir.path().join("app.db"))
            .unwrap(),
    );
    create_domain(&room);
    let done = Arc::new(AtomicBool::new(false));
    let most = Arc::new(AtomicU64::new(0));
    let watcher = {
        let (room, done, most) = (Arc::clone(&room), Arc::clone(&done), Arc::clone(&most));
        std::thread::spawn(move || {
            while !done.load(Ordering::SeqCst) {
                most.fetch_max(backlog(&room), Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
    let mut refused = 0;
    let mut next = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(300);
    while next < total {
        assert!(
            std::time::Instant::now() < deadline,
            "the sender never got through"
        );
        let msgs: Vec<Message> = (next..(next + batch).min(total)).map(msg).collect();
        match room.receive_batch("c", msgs) {
            Ok(receipts) => {
                assert!(receipts.iter().all(|r| r.should_ack()));
                next += batch;
            }
            Err(Error::Backlogged { .. }) => {
                refused += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) if e.is_retryable() => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => panic!("{e}"),
        }
    }
    eventually(120, "every message processed", || {
        room.stats().unwrap().inbox["c"].completed == total
    });
    done.store(true, Ordering::SeqCst);
    watcher.join().unwrap();
    let most = most.load(Ordering::SeqCst);
    eprintln!("refused {refused} times; the backlog peaked at {most} (bound {limit})");
    assert!(
        refused > 0,
        "the sender was never braked: the test proved nothing"
    );
    assert!(
        most <= limit + batch,
        "the backlog reached {most}, bound {limit}"
    );
    let conn = raw(room.path());
    assert_eq!(count(&conn, "SELECT count(*) FROM applied"), total as i64);
    assert_eq!(
        count(&conn, "SELECT count(DISTINCT message_id) FROM applied"),
        total as i64
    );
}
