//! Sequence watermarks (issue 26): a sequenced message whose row retention
//! deleted is still recognised as settled, out-of-order arrival never
//! drops a message that has not settled, a counter that goes back is a
//! conflict, and a postroom-to-postroom chain replayed whole after
//! retention applies nothing twice. Real files, a manual clock, the
//! reaper's retention pass run by hand.

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use postroom::{
    handler_fn, Failure, InboxSink, ManualClock, Message, OutboxMessage, Outcome, Outgoing,
    Postroom, Receipt, SendResult, Sink, StreamWatermark,
};
use rusqlite::Connection;

const DAY: Duration = Duration::from_secs(24 * 3600);

/// An engine on `clock` whose consumer `orders` applies each message once
/// per run (a domain row) unless its payload is `reject`, and whose
/// consumer `flaky` fails while `failing` is set; inline only unless
/// `workers`.
fn open(db: &Path, clock: &ManualClock, workers: usize, failing: &Arc<AtomicBool>) -> Postroom {
    let failing = Arc::clone(failing);
    let room = Postroom::builder()
        .clock(clock.clone())
        .workers(workers)
        .poll_interval(Duration::from_millis(5))
        .reaper_interval(Duration::from_secs(3600))
        .consumer(
            "orders",
            handler_fn(|tx, msg: &Message| -> Result<(), Failure> {
                if msg.payload() == b"reject" {
                    return Err(Failure::reject("poison"));
                }
                apply(tx, msg)
            }),
        )
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

fn seq_msg(id: &str, seq: u64) -> Message {
    Message::new("device-7", id, format!("payload of {id}")).with_sequence(seq)
}

/// The stream's watermark row in `stats()`.
fn stream(room: &Postroom, consumer: &str, stream: &str) -> StreamWatermark {
    room.stats()
        .unwrap()
        .sequences
        .into_iter()
        .find(|w| w.consumer == consumer && w.stream == stream)
        .unwrap_or_else(|| panic!("no watermark for {consumer}/{stream}"))
}

/// Runs retention `days` later: completed rows are deleted, key entries
/// too. Retention never deletes a table's newest row, so a filler message
/// (dead-lettered by `orders`, applying nothing) is stored first to be it.
fn weeks_later(room: &Postroom, clock: &ManualClock, days: u32) {
    let filler = Message::new("filler", format!("f-{}", clock_ms(clock)), "reject");
    assert!(matches!(
        room.deliver("orders", filler).unwrap(),
        Outcome::Dead { .. }
    ));
    clock.advance(DAY * days);
    room.cleanup().unwrap();
}

fn clock_ms(clock: &ManualClock) -> i64 {
    postroom::Clock::now_ms(clock)
}

/// Inbox rows other than the fillers.
fn inbox_rows(conn: &Connection) -> i64 {
    count(
        conn,
        "SELECT count(*) FROM postroom_inbox WHERE source != 'filler'",
    )
}

/// A device reconnecting three weeks later resends its whole log: every
/// message is recognised by its sequence, none applied twice. The same
/// resend without sequences is applied again (the failure this fixes).
#[test]
fn a_redelivery_weeks_after_retention_is_a_duplicate_by_sequence() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(start_ms());
    let room = open(&dir.path().join("w.db"), &clock, 0, &Arc::default());
    let conn = raw(room.path());
    for seq in 1..=5 {
        let id = format!("s-{seq}");
        assert_eq!(
            room.deliver("orders", seq_msg(&id, seq)).unwrap(),
            Outcome::Processed { attempts: 1 }
        );
        let plain = Message::new("legacy", format!("p-{seq}"), "x");
        room.deliver("orders", plain).unwrap();
    }
    let w = stream(&room, "orders", "device-7");
    assert_eq!((w.watermark, w.highest, w.listed), (5, Some(5), 0));
    assert!(w.missing.is_empty(), "{w:?}");

    weeks_later(&room, &clock, 21);
    assert_eq!(inbox_rows(&conn), 0, "retention deleted every row");
    for seq in 1..=5 {
        let id = format!("s-{seq}");
        let outcome = room.deliver("orders", seq_msg(&id, seq)).unwrap();
        assert_eq!(outcome, Outcome::DuplicateBySequence { sequence: seq });
        assert!(outcome.should_ack());
        assert_eq!(applied_count(&conn, &id), 1, "{id} applied twice");
        // Queued mode answers the same.
        assert_eq!(
            room.receive("orders", seq_msg(&id, seq)).unwrap(),
            Receipt::DuplicateBySequence { sequence: seq }
        );
        // Without a sequence, nothing remembers it.
        let plain = Message::new("legacy", format!("p-{seq}"), "x");
        assert_eq!(
            room.deliver("orders", plain).unwrap(),
            Outcome::Processed { attempts: 1 }
        );
    }
    assert_eq!(inbox_rows(&conn), 5, "only the unsequenced resends stored");
    integrity_ok(&conn);
}

/// 5 before 4, then 4 after retention deleted 5's row; a gap that fills
/// weeks later; a failed message in a gap redelivered after retention
/// deleted its neighbours: each is processed once, never dropped.
#[test]
fn out_of_order_and_gaps_never_drop_an_unsettled_message() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(start_ms());
    let failing = Arc::new(AtomicBool::new(true));
    let room = open(&dir.path().join("w.db"), &clock, 0, &failing);
    let conn = raw(room.path());
    for seq in [1, 2, 3, 5] {
        room.deliver("orders", seq_msg(&format!("s-{seq}"), seq))
            .unwrap();
    }
    let w = stream(&room, "orders", "device-7");
    assert_eq!((w.watermark, w.highest, w.listed), (3, Some(5), 1));
    assert_eq!(w.missing_text(), "4");

    weeks_later(&room, &clock, 21);
    assert_eq!(inbox_rows(&conn), 0);
    // 4 arrives after 5's row is gone: it is new, not a duplicate.
    assert_eq!(
        room.deliver("orders", seq_msg("s-4", 4)).unwrap(),
        Outcome::Processed { attempts: 1 }
    );
    assert_eq!(applied_count(&conn, "s-4"), 1);
    let w = stream(&room, "orders", "device-7");
    assert_eq!((w.watermark, w.listed), (5, 0), "{w:?}");
    // And 5, long gone, is still known.
    assert_eq!(
        room.deliver("orders", seq_msg("s-5", 5)).unwrap(),
        Outcome::DuplicateBySequence { sequence: 5 }
    );

    // A gap of several: 6 fails (its row stays), 7-9 never arrive, 10
    // completes. An operator sees what is missing. This sender numbers
    // from 6, which the operator said beforehand.
    assert!(!room.reset_sequence("flaky", "device-7", 6).unwrap());
    let flaky = |id: &str, seq| seq_msg(id, seq);
    assert!(matches!(
        room.deliver("flaky", flaky("f-6", 6)).unwrap(),
        Outcome::Failed { .. }
    ));
    failing.store(false, Ordering::SeqCst);
    room.deliver("flaky", flaky("f-10", 10)).unwrap();
    let w = stream(&room, "flaky", "device-7");
    assert_eq!((w.watermark, w.highest), (5, Some(10)));
    assert_eq!(w.missing_text(), "6-9", "{w:?}");

    weeks_later(&room, &clock, 21);
    // 10's row is gone, 6's failed row stays. 6 is redelivered and
    // processed; 8 arrives and is processed; 10 is still a duplicate.
    assert_eq!(
        room.deliver("flaky", flaky("f-6", 6)).unwrap(),
        Outcome::Processed { attempts: 2 }
    );
    assert_eq!(
        room.deliver("flaky", flaky("f-8", 8)).unwrap(),
        Outcome::Processed { attempts: 1 }
    );
    assert_eq!(
        room.deliver("flaky", flaky("f-10", 10)).unwrap(),
        Outcome::DuplicateBySequence { sequence: 10 }
    );
    let w = stream(&room, "flaky", "device-7");
    assert_eq!(w.watermark, 6);
    assert_eq!(w.missing_text(), "7, 9");
    for id in ["f-6", "f-8"] {
        assert_eq!(applied_count(&conn, id), 1);
    }
    assert_eq!(applied_count(&conn, "f-10"), 1);
    integrity_ok(&conn);
}

/// A dead letter settles its sequence (the watermark passes it), and
/// queued processing advances the watermark in the workers' commits.
#[test]
fn dead_letters_and_queued_processing_settle_sequences() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(start_ms());
    let room = open(&dir.path().join("w.db"), &clock, 1, &Arc::default());
    let conn = raw(room.path());
    let msgs = (1..=6).map(|seq| {
        let payload = if seq == 3 { "reject" } else { "fine" };
        Message::new("device-7", format!("q-{seq}"), payload).with_sequence(seq)
    });
    // Out of order within the batch.
    let mut msgs: Vec<Message> = msgs.collect();
    msgs.reverse();
    let receipts = room.receive_batch("orders", msgs.clone()).unwrap();
    assert!(receipts.iter().all(|r| *r == Receipt::Accepted));
    eventually(30, "the workers settled all six", || {
        stream(&room, "orders", "device-7").watermark == 6
    });
    assert_eq!(
        count(
            &conn,
            "SELECT count(*) FROM postroom_inbox WHERE status = 'dead'"
        ),
        1
    );
    // The dead letter's row answers while it exists; after retention of
    // the completed rows, the others are known by sequence.
    weeks_later(&room, &clock, 21);
    for msg in msgs {
        let seq = msg.sequence().unwrap();
        let receipt = room.receive("orders", msg).unwrap();
        if seq == 3 {
            assert_eq!(receipt, Receipt::Duplicate, "the dead row is kept");
        } else {
            assert_eq!(receipt, Receipt::DuplicateBySequence { sequence: seq });
        }
    }
    assert_eq!(count(&conn, "SELECT count(*) FROM applied"), 5);
    integrity_ok(&conn);
}

/// A sender whose counter went back: the same id under another sequence,
/// another id under a sequence a retained row holds, another id under a
/// sequence listed settled after retention — each quarantined as a
/// conflict, never dropped or applied. `reset_sequence` starts a new
/// epoch, whose numbers are then processed.
#[test]
fn a_counter_reset_is_a_conflict_and_reset_sequence_starts_an_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(start_ms());
    let room = open(&dir.path().join("w.db"), &clock, 0, &Arc::default());
    let conn = raw(room.path());
    for seq in [1, 2, 4] {
        room.deliver("orders", seq_msg(&format!("s-{seq}"), seq))
            .unwrap();
    }
    let conflict = |outcome: Outcome| {
        assert!(
            matches!(outcome, Outcome::Conflict { .. }),
            "expected a conflict, got {outcome:?}"
        );
        assert!(outcome.should_ack());
    };
    // Row retained, same id and payload, another sequence.
    conflict(room.deliver("orders", seq_msg("s-2", 7)).unwrap());
    // Row retained: sequence 1 held by s-1.
    conflict(room.deliver("orders", seq_msg("new-1", 1)).unwrap());
    assert!(matches!(
        room.receive("orders", seq_msg("new-1", 1)).unwrap(),
        Receipt::Conflict { .. }
    ));
    weeks_later(&room, &clock, 21);
    assert_eq!(inbox_rows(&conn), 0);
    // After retention: 4 is listed settled above the watermark (2) as s-4.
    conflict(room.deliver("orders", seq_msg("new-4", 4)).unwrap());
    // ... with the same id and another payload, too.
    let changed = Message::new("device-7", "s-4", "changed").with_sequence(4);
    conflict(room.deliver("orders", changed).unwrap());
    // Below the watermark nothing tells a new message from an old one:
    // documented; the answer is a duplicate.
    assert_eq!(
        room.deliver("orders", seq_msg("new-2", 2)).unwrap(),
        Outcome::DuplicateBySequence { sequence: 2 }
    );
    assert!(
        count(&conn, "SELECT count(*) FROM postroom_conflicts") >= 4,
        "every conflict quarantined"
    );
    for id in ["new-1", "new-4"] {
        assert_eq!(applied_count(&conn, id), 0);
    }

    // New epoch from 1.
    assert!(room.reset_sequence("orders", "device-7", 1).unwrap());
    let w = stream(&room, "orders", "device-7");
    assert_eq!((w.watermark, w.listed, w.highest), (0, 0, None));
    for seq in 1..=4 {
        let id = format!("epoch2-{seq}");
        assert_eq!(
            room.deliver("orders", seq_msg(&id, seq)).unwrap(),
            Outcome::Processed { attempts: 1 }
        );
    }
    assert_eq!(stream(&room, "orders", "device-7").watermark, 4);
    // Sequence 0 and past the maximum are refused; nothing stored.
    for bad in [0, postroom::MAX_SEQUENCE + 1] {
        let err = room.deliver("orders", seq_msg("bad", bad)).unwrap_err();
        assert!(matches!(err, postroom::Error::InvalidInput { .. }), "{err}");
        assert!(room.reset_sequence("orders", "device-7", bad).is_err());
    }
    let err = room
        .deliver(
            "orders",
            Message::new("d", "x", "p").with_sequence_in("bad\nstream", 1),
        )
        .unwrap_err();
    assert!(matches!(err, postroom::Error::InvalidInput { .. }), "{err}");
    assert_eq!(applied_count(&conn, "bad"), 0);
    // An operator's typo creates nothing.
    let err = room.reset_sequence("ordres", "device-7", 1).unwrap_err();
    assert!(
        matches!(err, postroom::Error::UnknownConsumer { .. }),
        "{err}"
    );
    let err = room.reset_sequence("orders", "bad\u{7}", 1).unwrap_err();
    assert!(matches!(err, postroom::Error::InvalidInput { .. }), "{err}");
    assert_eq!(
        count(&conn, "SELECT count(*) FROM postroom_watermarks"),
        1,
        "only orders/device-7"
    );
    integrity_ok(&conn);
}

/// Past the listing's bound: settled sequences above a gap are listed up
/// to 4096 (with key and digest), later ones kept as runs (at most 4096
/// runs, however long), and only past both counted, never dropped. A
/// sequence that joins two runs merges them; the gap closing walks the
/// watermark over the listing and the runs alike.
#[test]
fn the_settled_sequences_past_a_gap_are_listed_then_kept_as_runs() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(start_ms());
    let room = open(&dir.path().join("w.db"), &clock, 0, &Arc::default());
    let listed = postroom::MAX_LISTED_SEQUENCES;
    let runs = postroom::MAX_SETTLED_RUNS;
    // Settles `seqs` as raw rows, the way any path settles them (the
    // triggers do the work), in one transaction.
    let settle = |seqs: &mut dyn Iterator<Item = u64>| {
        let mut conn = raw(room.path());
        let tx = conn.transaction().unwrap();
        {
            // Prepared once: each prepare compiles the inbox's triggers.
            let mut insert = tx
                .prepare(
                    "INSERT INTO postroom_inbox (consumer, source, message_id, status,
                         payload_hash, received_at, updated_at, processed_at, seq, seq_stream)
                     VALUES ('orders', 'device-7', ?1, 'completed', zeroblob(32), 0, 0, 0, ?2,
                             'device-7')",
                )
                .unwrap();
            for seq in seqs {
                insert
                    .execute(rusqlite::params![format!("s-{seq}"), seq as i64])
                    .unwrap();
            }
        }
        tx.commit().unwrap();
    };
    // Sequence 1 is the gap; those less than `listed` above it are listed
    // (2..=listed); the next 1,000 are one run.
    let run_end = listed + 1000;
    settle(&mut (2..=run_end));
    let w = stream(&room, "orders", "device-7");
    assert_eq!(
        (w.watermark, w.listed, w.in_runs, w.runs, w.unrecorded),
        (0, listed - 1, 1000, 1, 0)
    );
    assert_eq!(w.missing_text(), "1");
    // Isolated sequences above: one run each up to the bound, then counted.
    let base = run_end + 10;
    settle(&mut (0..runs).map(|k| base + 2 * k));
    let w = stream(&room, "orders", "device-7");
    assert_eq!((w.runs, w.unrecorded), (runs, 1), "the bound holds");
    assert_eq!(w.in_runs, 1000 + runs - 1);
    // One that joins two runs merges them: a run is freed.
    settle(&mut std::iter::once(base + 1));
    let w = stream(&room, "orders", "device-7");
    assert_eq!(
        (w.runs, w.in_runs, w.unrecorded),
        (runs - 1, 1000 + runs, 1)
    );
    integrity_ok(&raw(room.path()));
    // The gap closes: the watermark walks the listing and the first run.
    room.deliver("orders", seq_msg("s-1", 1)).unwrap();
    let w = stream(&room, "orders", "device-7");
    assert_eq!((w.watermark, w.listed, w.runs), (run_end, 0, runs - 2));
    integrity_ok(&raw(room.path()));
    // After retention, a sequence of the first run and one of a later run
    // are duplicates; the one counted past both bounds is taken as new
    // (as without a sequence): never dropped.
    weeks_later(&room, &clock, 21);
    for seq in [run_end - 1, base + 4] {
        assert!(
            matches!(
                room.deliver("orders", seq_msg(&format!("s-{seq}"), seq))
                    .unwrap(),
                Outcome::DuplicateBySequence { .. }
            ),
            "{seq}"
        );
    }
    let unrecorded = base + 2 * (runs - 1);
    assert_eq!(
        room.deliver("orders", seq_msg(&format!("s-{unrecorded}"), unrecorded))
            .unwrap(),
        Outcome::Processed { attempts: 1 }
    );
}

/// One stuck change among 100,000: sequence 100 fails inline and waits for
/// its redelivery while the rest are applied (the first 6,000 through the
/// engine, as the finding had it; the rest settled as raw rows, the
/// triggers doing the same work, to keep the test short); retention runs;
/// 100 is redelivered and settles. The watermark passes everything
/// (listed, then one run), `resume_point` is 100,000, and a puller that
/// sends everything again anyway has each one taken as a duplicate: no
/// change applied twice. (The old listing stopped at 4,196: 1,804 of the
/// engine's 6,000 were applied again.)
#[test]
fn one_stuck_change_among_100000_makes_nothing_apply_twice() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(start_ms());
    let failing = Arc::new(AtomicBool::new(false));
    let room = open(&dir.path().join("w.db"), &clock, 0, &failing);
    const N: u64 = 100_000;
    const ENGINE: u64 = 6_000;
    let change = |seq: u64| seq_msg(&format!("c{seq}"), seq);
    for seq in 1..=ENGINE {
        failing.store(seq == 100, Ordering::SeqCst);
        let outcome = room.deliver("flaky", change(seq)).unwrap();
        if seq == 100 {
            assert!(matches!(outcome, Outcome::Failed { .. }), "{outcome:?}");
        }
    }
    failing.store(false, Ordering::SeqCst);
    let mut conn = raw(room.path());
    let tx = conn.transaction().unwrap();
    {
        // Prepared once: each prepare compiles the inbox's triggers.
        let mut insert = tx
            .prepare(
                "INSERT INTO postroom_inbox (consumer, source, message_id, status, payload_hash,
                     received_at, updated_at, processed_at, seq, seq_stream)
                 VALUES ('flaky', 'device-7', ?1, 'completed', zeroblob(32), 0, 0, 0, ?2,
                         'device-7')",
            )
            .unwrap();
        for seq in ENGINE + 1..=N {
            insert
                .execute(rusqlite::params![format!("c{seq}"), seq as i64])
                .unwrap();
        }
    }
    tx.commit().unwrap();
    assert_eq!(room.resume_point("flaky", "device-7").unwrap(), 99);
    weeks_later(&room, &clock, 21);
    assert_eq!(
        room.deliver("flaky", change(100)).unwrap(),
        Outcome::Processed { attempts: 2 }
    );
    let w = stream(&room, "flaky", "device-7");
    assert_eq!((w.watermark, w.listed, w.runs, w.unrecorded), (N, 0, 0, 0));
    assert_eq!(room.resume_point("flaky", "device-7").unwrap(), N);
    // A puller that ignores it: one in 97, and all around the listing's
    // bound, are duplicates.
    let edge = 100 + postroom::MAX_LISTED_SEQUENCES;
    for seq in (1..=N).step_by(97).chain(edge - 3..=edge + 3) {
        let outcome = room.deliver("flaky", change(seq)).unwrap();
        assert!(
            matches!(outcome, Outcome::DuplicateBySequence { .. }),
            "{seq}: {outcome:?}"
        );
    }
    assert_eq!(
        count(
            &conn,
            "SELECT count(*) FROM applied WHERE consumer = 'flaky'"
        ),
        ENGINE as i64
    );
    assert_eq!(
        count(
            &conn,
            "SELECT count(*) FROM (SELECT message_id FROM applied WHERE consumer = 'flaky'
                                   GROUP BY message_id HAVING count(*) > 1)"
        ),
        0
    );
}

/// A sink that records what it hands to the inner one.
struct Recording<S> {
    inner: S,
    seen: Arc<Mutex<Vec<OutboxMessage>>>,
}

impl<S: Sink> Sink for Recording<S> {
    fn send(&mut self, batch: &[OutboxMessage]) -> Vec<SendResult> {
        self.seen.lock().unwrap().extend_from_slice(batch);
        self.inner.send(batch)
    }
}

/// A postroom-to-postroom chain through the inbox sink: A's handler
/// publishes on two topics (so per topic the outbox seq has gaps), B
/// consumes both. Weeks later, after B's retention, A's whole outbox is
/// replayed into B, queued and inline: nothing is applied twice, and B's
/// one stream for A shows no gap.
#[test]
fn a_chain_replayed_whole_after_retention_applies_nothing_twice() {
    let dir = tempfile::tempdir().unwrap();
    let clock_b = ManualClock::new(start_ms());
    let b_runs = Arc::new(AtomicU32::new(0));
    let runs = Arc::clone(&b_runs);
    let b = Arc::new(
        Postroom::builder()
            .clock(clock_b.clone())
            .workers(1)
            .poll_interval(Duration::from_millis(5))
            .reaper_interval(Duration::from_secs(3600))
            .consumer(
                "orders",
                handler_fn(move |tx, msg: &Message| -> Result<(), Failure> {
                    runs.fetch_add(1, Ordering::SeqCst);
                    if msg.payload() == b"reject" {
                        return Err(Failure::reject("poison"));
                    }
                    apply(tx, msg)
                }),
            )
            .open(dir.path().join("b.db"))
            .unwrap(),
    );
    create_domain(&b);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let a = Postroom::builder()
        .workers(0)
        .relay_poll(Duration::from_millis(5))
        .consumer(
            "checkout",
            handler_fn(|tx, msg: &Message| -> Result<(), Failure> {
                tx.publish(Outgoing::new("order.placed", msg.payload().to_vec()))?;
                tx.publish(Outgoing::new("order.billed", msg.payload().to_vec()))?;
                Ok(())
            }),
        )
        .sink(Recording {
            inner: InboxSink::new(Arc::clone(&b), "orders"),
            seen: Arc::clone(&seen),
        })
        .open(dir.path().join("a.db"))
        .unwrap();
    let orders = 20;
    for i in 0..orders {
        a.deliver(
            "checkout",
            Message::new("web", format!("o-{i}"), format!("{i}")),
        )
        .unwrap();
    }
    let b_conn = raw(b.path());
    eventually(60, "B applied every message once", || {
        count(&b_conn, "SELECT count(*) FROM applied") == 2 * orders
    });
    let all: Vec<OutboxMessage> = seen.lock().unwrap().clone();
    assert_eq!(all.len() as i64, 2 * orders);
    let origin = all[0].origin.clone();
    assert_eq!(origin.len(), 32, "instance id: {origin:?}");
    let stream_name = postroom::outbox_stream(&origin);
    eventually(30, "B's watermark for A reached the last seq", || {
        stream(&b, "orders", &stream_name).watermark == 2 * orders as u64
    });
    assert!(stream(&b, "orders", &stream_name).missing.is_empty());

    weeks_later(&b, &clock_b, 21);
    assert_eq!(inbox_rows(&b_conn), 0, "B's retention deleted every row");
    let runs_before = b_runs.load(Ordering::SeqCst);
    // Replay the whole upstream outbox, queued, then inline.
    let mut queued = InboxSink::new(Arc::clone(&b), "orders");
    assert!(queued.send(&all).iter().all(|r| *r == SendResult::Sent));
    let mut inline = InboxSink::new(Arc::clone(&b), "orders").inline();
    assert!(inline.send(&all).iter().all(|r| *r == SendResult::Sent));
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(b_runs.load(Ordering::SeqCst), runs_before, "a handler ran");
    assert_eq!(count(&b_conn, "SELECT count(*) FROM applied"), 2 * orders);
    assert_eq!(inbox_rows(&b_conn), 0);
    integrity_ok(&b_conn);
    a.shutdown(Duration::from_secs(10)).unwrap();
    b.shutdown(Duration::from_secs(10)).unwrap();
}

/// What an operator sees for a gap: `postroom status` lists the stream
/// with its watermark, highest and missing ranges; `postroom metrics`
/// exports them.
#[test]
fn the_cli_shows_a_streams_gap() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(start_ms());
    let room = open(&dir.path().join("w.db"), &clock, 0, &Arc::default());
    for seq in (1..=40).chain(46..=50) {
        room.deliver("orders", seq_msg(&format!("s-{seq}"), seq))
            .unwrap();
    }
    let w = stream(&room, "orders", "device-7");
    assert_eq!(w.missing_text(), "41-45");
    let path = room.path().to_path_buf();
    room.shutdown(Duration::from_secs(10)).unwrap();
    let run = |args: &[&str]| {
        let out = target_command(env!("CARGO_BIN_EXE_postroom"))
            .arg(&path)
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let status = run(&["status"]);
    let line = status
        .lines()
        .find(|l| l.contains("device-7"))
        .unwrap_or_else(|| panic!("no stream line in:\n{status}"));
    let cells: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(
        cells,
        ["orders", "device-7", "40", "50", "5", "0", "41-45"],
        "{status}"
    );
    let metrics = run(&["metrics"]);
    for sample in [
        "postroom_sequence_watermark{consumer=\"orders\",stream=\"device-7\"} 40",
        "postroom_sequence_highest{consumer=\"orders\",stream=\"device-7\"} 50",
        "postroom_sequence_missing{consumer=\"orders\",stream=\"device-7\"} 5",
    ] {
        assert!(
            metrics.contains(sample),
            "{sample} missing from:\n{metrics}"
        );
    }
}

/// An upstream with history (its first rows handed to another sink, one
/// of them dead) gets an inbox sink: the downstream stream starts where
/// the upstream's unsettled rows start (the dead one), not at 1, so its
/// watermark is not left waiting for rows that went elsewhere; the dead
/// row shows as missing until redriven, then the watermark passes it.
#[test]
fn an_upstream_with_history_starts_the_downstream_stream_at_its_first_unsettled_row() {
    let dir = tempfile::tempdir().unwrap();
    let b = Arc::new(
        Postroom::builder()
            .workers(1)
            .poll_interval(Duration::from_millis(5))
            .consumer("orders", handler_fn(apply))
            .open(dir.path().join("b.db"))
            .unwrap(),
    );
    create_domain(&b);
    let publisher = || {
        handler_fn(|tx, msg: &Message| -> Result<(), Failure> {
            tx.publish(Outgoing::new("order.placed", msg.payload().to_vec()))?;
            Ok(())
        })
    };
    let a_db = dir.path().join("a.db");
    // Before: rows 1-10 go to a sink that drops row 5 as dead.
    let a = Postroom::builder()
        .workers(0)
        .relay_poll(Duration::from_millis(5))
        .consumer("checkout", publisher())
        .sink(postroom::sink_fn(|m: &OutboxMessage| {
            if m.seq == 5 {
                SendResult::dead("refused")
            } else {
                SendResult::Sent
            }
        }))
        .open(&a_db)
        .unwrap();
    for i in 0..10 {
        a.deliver(
            "checkout",
            Message::new("web", format!("o-{i}"), format!("{i}")),
        )
        .unwrap();
    }
    let a_conn = raw(&a_db);
    eventually(30, "A's relay handed rows 1-10 over", || {
        count(
            &a_conn,
            "SELECT count(*) FROM postroom_outbox WHERE status != 'pending'",
        ) == 10
    });
    a.shutdown(Duration::from_secs(10)).unwrap();
    // After: the inbox sink, and rows 11-20.
    let a = Postroom::builder()
        .workers(0)
        .relay_poll(Duration::from_millis(5))
        .consumer("checkout", publisher())
        .sink(InboxSink::new(Arc::clone(&b), "orders"))
        .open(&a_db)
        .unwrap();
    for i in 10..20 {
        a.deliver(
            "checkout",
            Message::new("web", format!("o-{i}"), format!("{i}")),
        )
        .unwrap();
    }
    let b_conn = raw(b.path());
    eventually(30, "B applied rows 11-20", || {
        count(&b_conn, "SELECT count(*) FROM applied") == 10
    });
    let origin: String = a_conn
        .query_row(
            "SELECT value FROM postroom_meta WHERE key = 'instance_id'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    let name = postroom::outbox_stream(&origin);
    eventually(30, "B's watermark waits at the dead row", || {
        let w = stream(&b, "orders", &name);
        w.watermark == 4 && w.highest == Some(20) && w.listed == 10
    });
    assert_eq!(stream(&b, "orders", &name).missing_text(), "5-10");
    // Rows 6-10 were handed to the other sink: they never come. Redriving
    // row 5 sends it here; B's watermark moves past it to 5, and rows
    // 6-10 stay missing (the upstream gave them to another sink before
    // this one's first batch, which did not start the stream past them
    // because row 5 was dead then).
    assert!(a.redrive_outbox(5).unwrap());
    eventually(30, "B applied the redriven row", || {
        count(&b_conn, "SELECT count(*) FROM applied") == 11
    });
    eventually(30, "B's watermark passed row 5", || {
        stream(&b, "orders", &name).watermark == 5
    });
    a.shutdown(Duration::from_secs(10)).unwrap();
    b.shutdown(Duration::from_secs(10)).unwrap();
}

/// An inbox sink told `unsequenced()` forwards without numbers: the target
/// keeps no stream (a sink that gets only some of the upstream's rows
/// would otherwise leave it gaps that never fill) and dedupes by id.
#[test]
fn an_unsequenced_inbox_sink_forwards_without_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let b = Arc::new(
        Postroom::builder()
            .workers(1)
            .poll_interval(Duration::from_millis(5))
            .consumer("orders", handler_fn(apply))
            .open(dir.path().join("b.db"))
            .unwrap(),
    );
    create_domain(&b);
    let a = Postroom::builder()
        .workers(0)
        .relay_poll(Duration::from_millis(5))
        .consumer(
            "checkout",
            handler_fn(|tx, msg: &Message| -> Result<(), Failure> {
                tx.publish(Outgoing::new("order.placed", msg.payload().to_vec()))?;
                Ok(())
            }),
        )
        .sink(InboxSink::new(Arc::clone(&b), "orders").unsequenced())
        .open(dir.path().join("a.db"))
        .unwrap();
    for i in 0..5 {
        a.deliver(
            "checkout",
            Message::new("web", format!("o-{i}"), format!("{i}")),
        )
        .unwrap();
    }
    let b_conn = raw(b.path());
    eventually(30, "B applied all five", || {
        count(&b_conn, "SELECT count(*) FROM applied") == 5
    });
    assert!(b.stats().unwrap().sequences.is_empty());
    assert_eq!(
        count(
            &b_conn,
            "SELECT count(*) FROM postroom_inbox WHERE seq IS NOT NULL"
        ),
        0
    );
    a.shutdown(Duration::from_secs(10)).unwrap();
    b.shutdown(Duration::from_secs(10)).unwrap();
}
