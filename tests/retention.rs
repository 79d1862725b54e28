//! Retention's key entries (schema 3): deleting a completed row notes its
//! key in `postroom_retired_keys`; the entry itself is deleted later, in key
//! order, by the rest of the pass. Until then it answers its own payload
//! as a duplicate, takes another as a new message, and `check` accepts it
//! only with its note. A pass killed part-way is finished by the next.

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use postroom::{handler_fn, Failure, Message, Outcome, Postroom, Receipt};
use rusqlite::Connection;

#[test]
#[ignore = "entry point for child processes of the retention tests"]
fn child_main() {
    let Some((role, db)) = child_role() else {
        return;
    };
    match role.as_str() {
        // Armed by the parent to die inside the pass.
        "cleanup" => {
            let room = Postroom::builder()
                .workers(0)
                .reaper_interval(Duration::from_secs(3600))
                .open(&db)
                .unwrap();
            report("OPENED");
            let _ = room.cleanup();
            report("CLEANED");
        }
        other => panic!("unknown role {other}"),
    }
}

/// An engine whose consumer `orders` counts its handler runs.
fn open(db: &Path, runs: &Arc<AtomicU32>) -> Postroom {
    let runs = Arc::clone(runs);
    let room = Postroom::builder()
        .workers(1)
        .poll_interval(Duration::from_millis(5))
        .reaper_interval(Duration::from_secs(3600))
        .consumer(
            "orders",
            handler_fn(move |tx, msg: &Message| -> Result<(), Failure> {
                runs.fetch_add(1, Ordering::SeqCst);
                apply(tx, msg)
            }),
        )
        .open(db)
        .unwrap();
    create_domain(&room);
    room
}

/// A running engine (see [`open`]) in a temporary directory, each of `ids`
/// delivered inline with its id as payload, and a raw connection.
struct Fixture {
    runs: Arc<AtomicU32>,
    room: Postroom,
    conn: Connection,
    /// Last: deleted after the rest is dropped.
    _dir: tempfile::TempDir,
}

fn fixture(ids: &[&str]) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("r.db");
    let runs = Arc::new(AtomicU32::new(0));
    let room = open(&db, &runs);
    for id in ids {
        room.deliver("orders", msg(id, id)).unwrap();
    }
    Fixture {
        conn: raw(&db),
        _dir: dir,
        runs,
        room,
    }
}

/// The inbox row id of message `id`.
fn row_id(conn: &Connection, id: &str) -> i64 {
    conn.query_row(
        "SELECT id FROM postroom_inbox WHERE message_id = ?1",
        [id],
        |r| r.get(0),
    )
    .unwrap()
}

/// Deletes `from`'s inbox row behind the engine's back, then delivers `to`,
/// whose new row takes the freed id (SQLite gives a new row the highest id
/// plus one).
fn reuse_row_id(room: &Postroom, conn: &Connection, from: &str, to: &str) {
    let old_id = row_id(conn, from);
    conn.execute("DELETE FROM postroom_inbox WHERE message_id = ?1", [from])
        .unwrap();
    room.deliver("orders", msg(to, to)).unwrap();
    assert_eq!(row_id(conn, to), old_id, "{to} took {from}'s row id");
}

fn msg(id: &str, payload: &str) -> Message {
    Message::new("shop", id, payload.to_owned())
}

/// Key entries, notes, and key entries whose row is gone.
fn key_counts(conn: &Connection) -> (i64, i64, i64) {
    (
        count(conn, "SELECT count(*) FROM postroom_inbox_keys"),
        count(conn, "SELECT count(*) FROM postroom_retired_keys"),
        count(
            conn,
            "SELECT count(*) FROM postroom_inbox_keys k
             WHERE NOT EXISTS (SELECT 1 FROM postroom_inbox i WHERE i.id = k.inbox_id
                                 AND i.message_id = k.message_id)",
        ),
    )
}

fn check_ok(conn: &Connection) {
    let report = postroom::admin::check(conn, postroom::admin::CheckDepth::Quick).unwrap();
    assert!(report.is_ok(), "{report:?}");
}

#[test]
fn a_pass_deletes_the_rows_key_entries_and_leaves_no_note() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("r.db");
    let runs = Arc::new(AtomicU32::new(0));
    let room = open(&db, &runs);
    for i in 0..300 {
        let m = msg(&format!("m{i}"), "x");
        assert_eq!(
            room.deliver("orders", m).unwrap(),
            Outcome::Processed { attempts: 1 }
        );
    }
    room.shutdown(Duration::from_secs(10)).unwrap();
    let conn = raw(&db);
    // The first half completed long ago (retention walks in id order: a
    // young row holds the rows after it).
    conn.execute(
        "UPDATE postroom_inbox SET processed_at = 1000 WHERE CAST(substr(message_id, 2) AS INT) < 150",
        [],
    )
    .unwrap();

    let room = open(&db, &runs);
    let report = room.cleanup().unwrap();
    assert_eq!((report.inbox_deleted, report.keys_deleted), (150, 150));
    assert_eq!(key_counts(&conn), (150, 0, 0));
    check_ok(&conn);
    // Forgotten: processed again. Kept: still a duplicate.
    assert_eq!(
        room.deliver("orders", msg("m0", "x")).unwrap(),
        Outcome::Processed { attempts: 1 }
    );
    assert_eq!(
        room.deliver("orders", msg("m150", "x")).unwrap(),
        Outcome::Duplicate
    );
    room.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(applied_count(&conn, "m0"), 2);
    assert_eq!(applied_count(&conn, "m150"), 1);
}

/// Rows deleted by hand SQL are noted like retention's; until a pass
/// deletes their entries, the same payload is a duplicate and another
/// payload a new message, inline and queued alike.
#[test]
fn a_retired_key_answers_its_payload_as_a_duplicate_and_another_as_new() {
    let Fixture {
        runs,
        room,
        conn,
        _dir,
    } = fixture(&["a", "b", "c", "d"]);
    conn.execute(
        "DELETE FROM postroom_inbox WHERE message_id IN ('a', 'b', 'c', 'd')",
        [],
    )
    .unwrap();
    assert_eq!(key_counts(&conn), (4, 4, 4));
    check_ok(&conn);

    assert_eq!(
        room.deliver("orders", msg("a", "a")).unwrap(),
        Outcome::Duplicate
    );
    assert_eq!(
        room.receive("orders", msg("b", "b")).unwrap(),
        Receipt::Duplicate
    );
    assert_eq!(
        room.deliver("orders", msg("c", "changed")).unwrap(),
        Outcome::Processed { attempts: 1 }
    );
    assert_eq!(
        room.receive("orders", msg("d", "changed")).unwrap(),
        Receipt::Accepted
    );
    eventually(20, "d processed again", || applied_count(&conn, "d") == 2);
    assert_eq!(runs.load(Ordering::SeqCst), 4 + 2);
    // c and d have rows again; a and b are still retired.
    assert_eq!(key_counts(&conn), (4, 4, 2));
    check_ok(&conn);

    let report = room.cleanup().unwrap();
    assert_eq!((report.inbox_deleted, report.keys_deleted), (0, 2));
    assert_eq!(key_counts(&conn), (2, 0, 0));
    check_ok(&conn);
    assert_eq!(
        room.deliver("orders", msg("a", "a")).unwrap(),
        Outcome::Processed { attempts: 1 },
        "forgotten once its entry is gone"
    );
    assert_eq!(
        room.deliver("orders", msg("c", "changed")).unwrap(),
        Outcome::Duplicate
    );
    room.shutdown(Duration::from_secs(10)).unwrap();
}

/// A pass killed after deleting an entry but before clearing its note
/// leaves the note; the key may then be delivered anew and its row may
/// even reuse the old row id. The next pass must keep that live entry.
#[test]
fn a_stale_note_never_deletes_a_live_key_entry() {
    let Fixture {
        room, conn, _dir, ..
    } = fixture(&["a", "b", "c"]);
    let old_id = row_id(&conn, "c");
    conn.execute_batch(
        "DELETE FROM postroom_inbox WHERE message_id = 'c';
         DELETE FROM postroom_inbox_keys WHERE message_id = 'c';",
    )
    .unwrap();
    assert_eq!(key_counts(&conn), (2, 1, 0));
    assert_eq!(
        room.deliver("orders", msg("c", "c")).unwrap(),
        Outcome::Processed { attempts: 1 }
    );
    assert_eq!(row_id(&conn, "c"), old_id, "the newest row's id is reused");

    let report = room.cleanup().unwrap();
    assert_eq!(report.keys_deleted, 0);
    assert_eq!(key_counts(&conn), (3, 0, 0));
    check_ok(&conn);
    assert_eq!(
        room.deliver("orders", msg("c", "c")).unwrap(),
        Outcome::Duplicate
    );
    room.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(applied_count(&conn, "c"), 2);
}

/// `check` accepts an entry without its row only while its note says why.
#[test]
fn check_reports_a_retired_entry_without_its_note() {
    let Fixture {
        room, conn, _dir, ..
    } = fixture(&["a", "b"]);
    room.shutdown(Duration::from_secs(10)).unwrap();
    conn.execute("DELETE FROM postroom_inbox WHERE message_id = 'a'", [])
        .unwrap();
    check_ok(&conn);
    conn.execute("DELETE FROM postroom_retired_keys", [])
        .unwrap();
    let report = postroom::admin::check(&conn, postroom::admin::CheckDepth::Quick).unwrap();
    let found: Vec<_> = report
        .violations
        .iter()
        .map(|f| (f.kind.to_string(), f.table))
        .collect();
    assert_eq!(
        found,
        [("key_table".to_string(), "postroom_inbox_keys")],
        "{report:?}"
    );
}

/// A pass of more rows than a drain reads at once drains part-way, after
/// exactly `READ_LIMIT` rows; killed there — before its first deletion of
/// key entries, or after two of them — it leaves every entry it has not
/// deleted noted. The next pass finishes the job.
#[cfg(feature = "failpoints")]
#[test]
fn a_pass_killed_mid_drain_is_finished_by_the_next() {
    const ROWS: i64 = 140_000;
    const READ_LIMIT: i64 = 131_072;
    const DELETE_BATCH: i64 = 1_024;
    // Hit 1 is the drain's read, hit 1 + k its k-th write.
    for (abort_at, entries_deleted) in [(2, 0), (4, 2 * DELETE_BATCH)] {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("r.db");
        Postroom::builder()
            .workers(0)
            .open(&db)
            .unwrap()
            .shutdown(Duration::from_secs(10))
            .unwrap();
        let conn = raw(&db);
        // Random ids, so key order is not row order; all completed long ago.
        conn.execute(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1)
             INSERT INTO postroom_inbox (consumer, source, message_id, status, payload_hash,
                 attempts, received_at, updated_at, processed_at)
             SELECT 'orders', 'shop', lower(hex(randomblob(16))), 'completed', zeroblob(32),
                 1, 1000, 1000, 1000 FROM n",
            [ROWS],
        )
        .unwrap();
        let mut child = spawn_child(
            "cleanup",
            &db,
            &[(
                "POSTROOM_FAILPOINTS",
                format!("reaper.retired_keys=abort@{abort_at}"),
            )],
        );
        let status = wait_or_kill(&mut child, 300, "child dying mid-pass");
        assert!(!status.success(), "the child was to die mid-pass");
        assert_eq!(
            count(&conn, "SELECT count(*) FROM postroom_inbox"),
            ROWS - READ_LIMIT,
            "the drain starts once READ_LIMIT rows are deleted"
        );
        assert_eq!(
            key_counts(&conn),
            (
                ROWS - entries_deleted,
                READ_LIMIT,
                READ_LIMIT - entries_deleted
            ),
            "abort@{abort_at}"
        );
        check_ok(&conn);

        let runs = Arc::new(AtomicU32::new(0));
        let room = open(&db, &runs);
        let report = room.cleanup().unwrap();
        // All but the newest row, which retention keeps.
        assert_eq!(
            (report.inbox_deleted, report.keys_deleted),
            (
                (ROWS - READ_LIMIT - 1) as u64,
                (ROWS - entries_deleted - 1) as u64
            )
        );
        assert_eq!(key_counts(&conn), (1, 0, 0));
        check_ok(&conn);
        room.shutdown(Duration::from_secs(10)).unwrap();
    }
}

/// A retired entry whose row id another key's new row has taken is still
/// retired: the pass deletes it (a check by id alone would keep it, and
/// once its note is cleared, for good).
#[test]
fn a_retired_entry_whose_row_id_another_key_took_is_deleted() {
    let Fixture {
        room, conn, _dir, ..
    } = fixture(&["a", "b", "c"]);
    reuse_row_id(&room, &conn, "c", "z");
    assert_eq!(key_counts(&conn), (4, 1, 1));

    let report = room.cleanup().unwrap();
    assert_eq!(report.keys_deleted, 1);
    assert_eq!(key_counts(&conn), (3, 0, 0));
    check_ok(&conn);
    room.shutdown(Duration::from_secs(10)).unwrap();
}

/// `conflicts show` finds the stored row through the key table; once that
/// row is deleted and its id reused by another message, it shows none
/// rather than the other message.
#[test]
fn a_conflicts_stored_row_is_not_taken_from_a_reused_row_id() {
    let Fixture {
        room, conn, _dir, ..
    } = fixture(&["a"]);
    let Outcome::Conflict { conflict_id } = room.deliver("orders", msg("a", "other")).unwrap()
    else {
        panic!("a conflict")
    };
    let shown = postroom::admin::conflicts_show(&conn, conflict_id)
        .unwrap()
        .unwrap();
    assert_eq!(shown.stored.map(|s| s.message_id).as_deref(), Some("a"));
    reuse_row_id(&room, &conn, "a", "b");
    let shown = postroom::admin::conflicts_show(&conn, conflict_id)
        .unwrap()
        .unwrap();
    assert!(shown.stored.is_none(), "{:?}", shown.stored);
    room.shutdown(Duration::from_secs(10)).unwrap();
}

/// A device idle past retention: every row delivered, sent and then deleted
/// by retention. New rows must not take old numbers — a downstream that
/// keeps the last `seq` it saw per key would drop them as stale, and an
/// operator's note "inbox row 3" would name another message. Retention
/// keeps the newest row of each table, whatever its age; so does
/// `dead_retention` (a dead letter may be the newest inbox row); and an
/// operator's discard of a dead outbox row marks it instead of deleting it.
#[test]
fn retention_and_discards_never_give_a_row_number_out_twice() {
    const HOUR: Duration = Duration::from_secs(3600);
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("r.db");
    let clock = postroom::ManualClock::new(start_ms());
    let (sent, seqs) = crossbeam_channel::unbounded();
    let room = Postroom::builder()
        .workers(0)
        .max_attempts(1)
        .reaper_interval(HOUR)
        .retention(HOUR)
        .dead_retention(Some(HOUR))
        .relay_poll(Duration::from_millis(20))
        .clock(clock.clone())
        .consumer(
            "orders",
            handler_fn(|tx, msg: &Message| -> Result<(), Failure> {
                if msg.payload() == b"poison" {
                    return Err(Failure::reject("poison"));
                }
                apply(tx, msg)
            }),
        )
        .sink(postroom::sink_fn(move |m| {
            if m.payload == b"x" {
                return postroom::SendResult::Dead {
                    reason: "refused".into(),
                };
            }
            sent.send(m.seq).unwrap();
            postroom::SendResult::Sent
        }))
        .open(&db)
        .unwrap();
    create_domain(&room);
    let conn = raw(&db);
    let next_seq = || seqs.recv_timeout(Duration::from_secs(10)).unwrap();

    let mut handed_over = Vec::new();
    for id in ["a", "b", "c"] {
        room.deliver("orders", msg(id, id)).unwrap();
        handed_over.push(next_seq());
    }
    eventually(10, "all marked sent", || {
        room.stats().unwrap().outbox.sent == 3
    });
    clock.advance(2 * HOUR);
    let report = room.cleanup().unwrap();
    assert_eq!((report.inbox_deleted, report.outbox_deleted), (2, 2));
    assert_eq!(row_id(&conn, "c"), 3, "the newest inbox row is kept");

    room.deliver("orders", msg("d", "d")).unwrap();
    handed_over.push(next_seq());
    assert!(
        row_id(&conn, "d") > 3,
        "d took row id {}",
        row_id(&conn, "d")
    );
    assert!(
        handed_over.windows(2).all(|w| w[0] < w[1]),
        "seq went back: {handed_over:?}"
    );

    // A dead letter as the newest row, past dead_retention.
    assert!(matches!(
        room.deliver("orders", msg("p", "poison")).unwrap(),
        Outcome::Dead { .. }
    ));
    let poison = row_id(&conn, "p");
    clock.advance(2 * HOUR);
    let report = room.cleanup().unwrap();
    assert_eq!(
        (report.inbox_deleted, report.dead_deleted),
        (2, 0),
        "c and d deleted, the dead letter kept as the newest row"
    );
    room.deliver("orders", msg("e", "e")).unwrap();
    assert!(
        row_id(&conn, "e") > poison,
        "e took the dead letter's row id"
    );
    handed_over.push(next_seq());

    // An operator discards the newest outbox row, dead, after retention
    // deleted every row below it.
    room.deliver("orders", msg("x", "x")).unwrap();
    eventually(10, "x's outbox row dead", || {
        room.stats().unwrap().outbox.dead == 1
    });
    let refused = room.outbox_dead_letters(1).unwrap()[0].seq;
    clock.advance(2 * HOUR);
    assert!(room.cleanup().unwrap().outbox_deleted > 0);
    assert!(room.discard_outbox(refused).unwrap());
    assert!(!room.discard_outbox(refused).unwrap(), "discarded once");
    assert!(room.outbox_dead_letters(10).unwrap().is_empty());
    room.deliver("orders", msg("f", "f")).unwrap();
    handed_over.push(next_seq());
    assert!(
        *handed_over.last().unwrap() > refused,
        "f's outbox row took the discarded row's seq {refused}: {handed_over:?}"
    );
    check_ok(&conn);
    room.shutdown(Duration::from_secs(10)).unwrap();
}
