//! A sync receiver's cursor (issue 36, item 3): `resume_point` names the
//! sequence a puller resumes after. Every sequence at or below it is
//! settled or stored for queued processing, so resuming there loses
//! nothing; a row taken inline that has not settled is not counted (its
//! sender must deliver it again). Real files; the kill test SIGKILLs a real
//! puller process mid-stream and resumes it from the answer, three times.

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use postroom::{handler_fn, Error, Failure, Message, Outcome, Postroom, Receipt};

const STREAM: &str = "server";

/// An engine whose consumer `sync` applies each change once (a domain
/// row), and whose consumer `flaky` fails while `failing` is set.
fn open(db: &Path, workers: usize, failing: &Arc<AtomicBool>) -> Postroom {
    let failing = Arc::clone(failing);
    let room = Postroom::builder()
        .workers(workers)
        .poll_interval(Duration::from_millis(20))
        .backoff(Duration::from_millis(1), Duration::from_millis(1))
        .consumer("sync", handler_fn(apply))
        .consumer(
            "flaky",
            handler_fn(move |tx, msg: &Message| -> Result<(), Failure> {
                if failing.load(Ordering::SeqCst) {
                    return Err(Failure::retry("not yet"));
                }
                apply(tx, msg)
            }),
        )
        .open(db)
        .unwrap();
    create_domain(&room);
    room
}

fn change(seq: u64) -> Message {
    Message::new(STREAM, format!("c{seq}"), format!("change {seq}")).with_sequence(seq)
}

#[test]
fn the_resume_point_counts_received_and_settled_sequences_up_to_the_first_gap() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    let failing = Arc::new(AtomicBool::new(false));
    // No workers: received rows stay pending, and still count.
    let room = open(&db, 0, &failing);
    assert_eq!(room.resume_point("sync", STREAM).unwrap(), 0, "unknown");
    match room.resume_point("nobody", STREAM) {
        Err(Error::UnknownConsumer { .. }) => {}
        other => panic!("{other:?}"),
    }

    // Queued: received is enough; the first gap stops it.
    for seq in [1, 2, 4, 5] {
        assert_eq!(
            room.receive("sync", change(seq)).unwrap(),
            Receipt::Accepted
        );
    }
    assert_eq!(room.resume_point("sync", STREAM).unwrap(), 2);
    room.receive("sync", change(3)).unwrap();
    assert_eq!(room.resume_point("sync", STREAM).unwrap(), 5);

    // Inline: a failed delivery is stored but not settled, so it is not
    // counted, nor anything above it, until it settles.
    failing.store(true, Ordering::SeqCst);
    assert!(matches!(
        room.deliver("flaky", change(1)).unwrap(),
        Outcome::Failed { .. }
    ));
    failing.store(false, Ordering::SeqCst);
    assert!(room.deliver("flaky", change(2)).unwrap().should_ack());
    assert_eq!(room.resume_point("flaky", STREAM).unwrap(), 0);
    // Its sender delivers it again (after the backoff) until it settles.
    eventually(30, "the redelivery to settle", || {
        room.deliver("flaky", change(1)).unwrap().should_ack()
    });
    assert_eq!(room.resume_point("flaky", STREAM).unwrap(), 2);

    // A reopened engine answers the same: the answer is the file's.
    drop(room);
    let room = open(&db, 0, &failing);
    assert_eq!(room.resume_point("sync", STREAM).unwrap(), 5);
    assert_eq!(room.resume_point("flaky", STREAM).unwrap(), 2);
    // Streams are per consumer.
    assert_eq!(room.resume_point("sync", "elsewhere").unwrap(), 0);
}

/// The answer is never past a sequence that is not stored. A puller is
/// SIGKILLed at random points mid-stream (three times), and each time
/// resumes from `resume_point` in a fresh process; in the end every change
/// is applied exactly once, and no answer was below the last batch the
/// puller was told was stored.
#[test]
fn a_killed_puller_resumes_from_the_resume_point_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    let total: u64 = 3000;
    let mut rng = Rng::new(seed());
    let mut last_acked = 0;
    for round in 0..3 {
        let mut child = spawn_child("puller", &db, &[("RESUME_TOTAL", total.to_string())]);
        let lines = lines_of(&mut child);
        let resumed_from = wait_for_line(&lines, "FROM ");
        assert!(
            resumed_from >= last_acked,
            "round {round}: resumed from {resumed_from}, but {last_acked} was acknowledged"
        );
        // Let it store a few batches, then kill it somewhere in the next
        // (one that has nothing left to pull says nothing more).
        let batches = if resumed_from < total {
            1 + rng.below(4)
        } else {
            0
        };
        for _ in 0..batches {
            let acked = wait_for_line(&lines, "ACK ");
            assert!(
                acked > last_acked || acked == total,
                "{acked} after {last_acked}"
            );
            last_acked = acked;
        }
        std::thread::sleep(Duration::from_millis(rng.below(30)));
        let _ = child.kill();
        let _ = child.wait();
        // What it said after the last line read was stored too.
        while let Ok((_, line)) = lines.try_recv() {
            if let Some(n) = line.strip_prefix("ACK ") {
                last_acked = n.parse().unwrap();
            }
        }
    }
    // The last puller runs to the end in this process.
    let room = open(&db, 2, &Arc::default());
    let from = room.resume_point("sync", STREAM).unwrap();
    assert!(
        from >= last_acked,
        "resumed from {from}, {last_acked} acked"
    );
    pull(&room, from, total, |_| {});
    eventually(120, "every change applied", || {
        room.stats().unwrap().inbox["sync"].completed == total
    });
    let conn = raw(&db);
    assert_eq!(count(&conn, "SELECT count(*) FROM applied"), total as i64);
    assert_eq!(
        count(&conn, "SELECT count(DISTINCT message_id) FROM applied"),
        total as i64,
        "a change applied twice"
    );
    assert_eq!(room.resume_point("sync", STREAM).unwrap(), total);
}

/// Receives changes `from + 1 ..= total` in batches of 50, as a puller
/// asking a server for the changes after its cursor would; calls `acked`
/// with the last sequence of each stored batch.
fn pull(room: &Postroom, from: u64, total: u64, mut acked: impl FnMut(u64)) {
    let mut next = from + 1;
    while next <= total {
        let last = (next + 49).min(total);
        let batch: Vec<Message> = (next..=last).map(change).collect();
        let receipts = room.receive_batch("sync", batch).unwrap();
        assert!(receipts.iter().all(|r| r.should_ack()), "{receipts:?}");
        acked(last);
        next = last + 1;
    }
}

/// Waits for the child's next line starting with `prefix`; returns the
/// number after it.
fn wait_for_line(
    lines: &std::sync::mpsc::Receiver<(std::time::Instant, String)>,
    prefix: &str,
) -> u64 {
    loop {
        match lines.recv_timeout(Duration::from_secs(60)) {
            Ok((_, line)) => {
                if let Some(n) = line.strip_prefix(prefix) {
                    return n.parse().unwrap();
                }
            }
            Err(e) => panic!("the puller never said {prefix:?}: {e}"),
        }
    }
}

/// Entry point of the child processes. Not a test: it only does something
/// when started by `spawn_child`, and is ignored otherwise.
#[test]
#[ignore = "entry point for child processes of the resume tests"]
fn child_main() {
    let Some((role, db)) = child_role() else {
        return;
    };
    report("");
    assert_eq!(role, "puller", "unknown child role");
    let total = env_u64("RESUME_TOTAL").unwrap();
    let room = open(&db, 2, &Arc::default());
    let from = room.resume_point("sync", STREAM).unwrap();
    report(&format!("FROM {from}"));
    pull(&room, from, total, |last| report(&format!("ACK {last}")));
    // Until killed (the parent decides when), or orphaned by a parent that
    // failed.
    let parent = std::os::unix::process::parent_id();
    for _ in 0..6000 {
        if std::os::unix::process::parent_id() != parent {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
