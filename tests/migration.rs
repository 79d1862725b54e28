//! Schema migrations: a file written under schema version 1, 2, 3, 5, 6, 7, 8, 9, 10, 11 or 12 (their
//! DDL kept in `tests/fixtures/`) opens under the current version with every row intact, gives the
//! same dedupe answers as before, and a process killed in the middle of the migration leaves the
//! file exactly as it was.

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use postroom::{handler_fn, Failure, Message, Outcome, Postroom, Receipt, Status};
use rusqlite::params;

const SCHEMA_V1: &str = include_str!("fixtures/schema_v1.sql");
const SCHEMA_V2: &str = include_str!("fixtures/schema_v2.sql");
const SCHEMA_V3: &str = include_str!("fixtures/schema_v3.sql");
const SCHEMA_V5: &str = include_str!("fixtures/schema_v5.sql");
const SCHEMA_V6: &str = include_str!("fixtures/schema_v6.sql");
const SCHEMA_V7: &str = include_str!("fixtures/schema_v7.sql");
const SCHEMA_V8: &str = include_str!("fixtures/schema_v8.sql");
const SCHEMA_V9: &str = include_str!("fixtures/schema_v9.sql");
const SCHEMA_V10: &str = include_str!("fixtures/schema_v10.sql");
const SCHEMA_V11: &str = include_str!("fixtures/schema_v11.sql");
const SCHEMA_V12: &str = include_str!("fixtures/schema_v12.sql");

/// Every column of every inbox row, in id order, as text.
const DUMP_INBOX: &str = "SELECT id || '|' || consumer || '|' || source || '|' || message_id
        || '|' || status || '|' || quote(payload) || '|' || hex(payload_hash) || '|'
        || quote(headers) || '|' || quote(ordering_key) || '|' || attempts || '|'
        || quote(last_error) || '|' || received_at || '|' || updated_at || '|'
        || quote(next_attempt_at) || '|' || quote(lease_until) || '|'
        || quote(lease_token) || '|' || quote(processed_at) || '|' || queued
    FROM postroom_inbox ORDER BY id";

fn digest(payload: &str) -> Vec<u8> {
    blake3::hash(payload.as_bytes()).as_bytes().to_vec()
}

/// A version 1 file, as that schema stored these messages of consumer
/// `orders` from source `shop`:
/// * `done-0..extra`: completed inline, payload not kept;
/// * `failed`: failed once inline, due now;
/// * `queued`: received, pending for the workers;
/// * `dead`: dead-lettered.
///
/// Returns the inbox dump.
fn write_v1(path: &Path, extra: u32) -> Vec<String> {
    write_old(path, SCHEMA_V1, 1, extra)
}

/// The same messages under schema `version`, created by `ddl`.
fn write_old(path: &Path, ddl: &str, version: u32, extra: u32) -> Vec<String> {
    let mut conn = rusqlite::Connection::open(path).unwrap();
    conn.pragma_update(None, "journal_mode", "WAL").unwrap();
    let tx = conn.transaction().unwrap();
    tx.execute_batch(ddl).unwrap();
    tx.execute_batch(common::DOMAIN_SQL).unwrap();
    // An application's view over the inbox, which must survive the rebuild.
    tx.execute_batch(
        "CREATE VIEW app_waiting AS
         SELECT message_id FROM postroom_inbox WHERE status IN ('failed', 'dead')",
    )
    .unwrap();
    tx.execute(
        "INSERT INTO postroom_meta (key, value) VALUES ('schema_version', ?1)",
        [version.to_string()],
    )
    .unwrap();
    let insert = "INSERT INTO postroom_inbox (consumer, source, message_id, status, payload,
            payload_hash, attempts, last_error, received_at, updated_at, next_attempt_at,
            processed_at, queued)
        VALUES ('orders', 'shop', ?1, ?2, ?3, ?4, ?5, ?6, 1000, 1000, ?7, ?8, ?9)";
    for i in 0..extra {
        let id = format!("done-{i}");
        tx.execute(
            insert,
            params![
                id,
                "completed",
                None::<Vec<u8>>,
                digest(&id),
                1,
                None::<String>,
                None::<i64>,
                1000,
                0
            ],
        )
        .unwrap();
    }
    for (id, status, attempts, error, next, queued) in [
        ("failed", "failed", 1, Some("boom"), Some(1000), 0),
        ("queued", "pending", 0, None, Some(1000), 1),
        ("dead", "dead", 5, Some("gave up"), None, 0),
    ] {
        tx.execute(
            insert,
            params![
                id,
                status,
                id.as_bytes(),
                digest(id),
                attempts,
                error,
                next,
                None::<i64>,
                queued
            ],
        )
        .unwrap();
    }
    tx.commit().unwrap();
    column(&conn, DUMP_INBOX)
}

/// postroom's tables, indexes and triggers: (type, name, table, SQL with
/// `IF NOT EXISTS` dropped and whitespace collapsed).
fn schema_objects(conn: &rusqlite::Connection) -> Vec<(String, String, String, String)> {
    let mut stmt = conn
        .prepare(
            "SELECT type, name, tbl_name, coalesce(sql, '') FROM sqlite_master
             WHERE name LIKE 'postroom%' ORDER BY type, name",
        )
        .unwrap();
    let rows = stmt
        .query_map([], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get::<_, String>(3)?))
        })
        .unwrap();
    rows.map(|row| {
        let (kind, name, table, sql) = row.unwrap();
        let sql = sql.replace("IF NOT EXISTS ", "");
        (
            kind,
            name,
            table,
            sql.split_whitespace().collect::<Vec<_>>().join(" "),
        )
    })
    .collect()
}

fn stored_version(conn: &rusqlite::Connection) -> String {
    conn.query_row(
        "SELECT value FROM postroom_meta WHERE key = 'schema_version'",
        [],
        |r| r.get(0),
    )
    .unwrap()
}

fn open(path: &Path, runs: &Arc<AtomicU32>) -> Postroom {
    let runs = Arc::clone(runs);
    Postroom::builder()
        .poll_interval(Duration::from_millis(5))
        .consumer(
            "orders",
            handler_fn(move |tx, msg: &Message| -> Result<(), Failure> {
                runs.fetch_add(1, Ordering::SeqCst);
                apply(tx, msg)
            }),
        )
        .open(path)
        .unwrap()
}

/// A migrated file: the current version, every inbox row as `before`, and
/// the same tables, indexes and triggers as a file created at this version
/// (in `dir`).
fn assert_migrated(dir: &Path, conn: &rusqlite::Connection, before: &[String]) {
    assert_eq!(stored_version(conn), postroom::SCHEMA_VERSION.to_string());
    assert_eq!(column::<Vec<String>>(conn, DUMP_INBOX), before);
    let fresh = dir.join("fresh.db");
    open_once(&fresh);
    assert_eq!(schema_objects(conn), schema_objects(&raw(&fresh)));
}

/// Opens `path` with no workers (creating or migrating it) and shuts down.
fn open_once(path: &Path) {
    Postroom::builder()
        .workers(0)
        .open(path)
        .unwrap()
        .shutdown(Duration::from_secs(10))
        .unwrap();
}

#[test]
#[ignore = "entry point for child processes of the migration tests"]
fn child_main() {
    let Some((role, db)) = child_role() else {
        return;
    };
    match role.as_str() {
        // Armed by the parent to abort inside the migration transaction.
        "open" => {
            let _ = Postroom::builder().workers(0).open(&db);
            report("OPENED");
        }
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn a_version_1_file_keeps_every_row_and_every_dedupe_answer() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("v1.db");
    let before = write_v1(&db, 300);
    // Without workers first: they would claim `queued` while the dump is read.
    open_once(&db);

    let conn = raw(&db);
    assert_migrated(dir.path(), &conn, &before);
    assert_eq!(
        count(&conn, "SELECT count(*) FROM postroom_inbox_keys"),
        before.len() as i64
    );
    let report = postroom::admin::check(&conn, postroom::admin::CheckDepth::Full).unwrap();
    assert!(report.is_ok(), "{report:?}");
    let waiting: Vec<String> = column(&conn, "SELECT message_id FROM app_waiting ORDER BY 1");
    assert_eq!(waiting, ["dead", "failed"]);
    // The old table is gone, the new one has no UNIQUE constraint of its own.
    assert_eq!(
        count(
            &conn,
            "SELECT count(*) FROM sqlite_master WHERE name LIKE 'postroom_inbox_v1%'
                 OR name LIKE 'sqlite_autoindex_postroom_inbox_%'"
        ),
        0
    );
    let runs = Arc::new(AtomicU32::new(0));
    let room = open(&db, &runs);

    // A completed message: its redelivery is a duplicate, a different
    // payload under its id a conflict; the handler runs for neither.
    assert_eq!(
        room.deliver("orders", Message::new("shop", "done-7", "done-7"))
            .unwrap(),
        Outcome::Duplicate
    );
    assert_eq!(
        room.receive("orders", Message::new("shop", "done-8", "done-8"))
            .unwrap(),
        Receipt::Duplicate
    );
    assert!(matches!(
        room.deliver("orders", Message::new("shop", "done-7", "other"))
            .unwrap(),
        Outcome::Conflict { .. }
    ));
    for id in ["done-7", "done-8"] {
        assert_eq!(applied_count(&conn, id), 0, "{id}");
    }

    // The failed one is retried as its second attempt; the dead one stays dead.
    assert_eq!(
        room.deliver("orders", Message::new("shop", "failed", "failed"))
            .unwrap(),
        Outcome::Processed { attempts: 2 }
    );
    assert!(matches!(
        room.deliver("orders", Message::new("shop", "dead", "dead"))
            .unwrap(),
        Outcome::Dead { attempts: 5, .. }
    ));

    // The queued one is processed by the workers, once.
    let deadline = Instant::now() + Duration::from_secs(20);
    while applied_count(&conn, "queued") == 0 {
        assert!(Instant::now() < deadline, "queued message never processed");
        std::thread::sleep(Duration::from_millis(10));
    }
    // A new message goes in under the new schema, once.
    let fresh = Message::new("shop", "new", "new");
    assert_eq!(
        room.deliver("orders", fresh.clone()).unwrap(),
        Outcome::Processed { attempts: 1 }
    );
    assert_eq!(room.deliver("orders", fresh).unwrap(), Outcome::Duplicate);
    room.shutdown(Duration::from_secs(10)).unwrap();

    assert_eq!(runs.load(Ordering::SeqCst), 3, "failed, queued, new");
    for id in ["failed", "queued", "new"] {
        assert_eq!(applied_count(&conn, id), 1, "{id}");
    }
    let status = |id: &str| inbox_row(&conn, "orders", "shop", id).unwrap().0;
    assert_eq!(status("queued"), Status::Completed.to_string());
    let report = postroom::admin::check(&conn, postroom::admin::CheckDepth::Full).unwrap();
    assert!(report.is_ok(), "{report:?}");
}

#[cfg(feature = "failpoints")]
#[test]
fn a_process_killed_mid_migration_leaves_the_version_1_file_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("v1.db");
    let before = write_v1(&db, 2000);
    let mut child = spawn_child(
        "open",
        &db,
        &[("POSTROOM_FAILPOINTS", "schema.migrate=abort@1".to_string())],
    );
    let status = wait_or_kill(&mut child, 120, "child dying mid-migration");
    assert!(!status.success(), "the child was to die mid-migration");

    let conn = raw(&db);
    assert_eq!(stored_version(&conn), "1");
    assert_eq!(column::<Vec<String>>(&conn, DUMP_INBOX), before);
    assert_eq!(
        count(
            &conn,
            "SELECT count(*) FROM sqlite_master WHERE name LIKE 'postroom_inbox_keys%'
                 OR name LIKE 'postroom_inbox_v1%'"
        ),
        0
    );
    drop(conn);

    // The next open migrates it.
    open_once(&db);
    let conn = raw(&db);
    assert_eq!(stored_version(&conn), postroom::SCHEMA_VERSION.to_string());
    assert_eq!(column::<Vec<String>>(&conn, DUMP_INBOX), before);
    assert!(
        postroom::admin::check(&conn, postroom::admin::CheckDepth::Quick)
            .unwrap()
            .is_ok()
    );
}

#[test]
fn the_cli_asks_for_a_version_1_file_to_be_migrated_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("v1.db");
    let before = write_v1(&db, 3);
    let err = postroom::admin::open(&db, postroom::admin::Access::ReadOnly)
        .unwrap_err()
        .to_string();
    assert!(err.contains("older than this build"), "{err}");
    let conn = raw(&db);
    assert_eq!(stored_version(&conn), "1");
    assert_eq!(column::<Vec<String>>(&conn, DUMP_INBOX), before);
}

#[test]
fn a_version_2_file_keeps_every_row_and_key_and_retention_notes_its_keys() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("v2.db");
    let before = write_old(&db, SCHEMA_V2, 2, 300);
    let conn = raw(&db);
    const DUMP_KEYS: &str = "SELECT consumer || '|' || source || '|' || message_id || '|'
            || inbox_id || '|' || hex(digest) || '|' || completed
        FROM postroom_inbox_keys ORDER BY 1";
    let keys_before: Vec<String> = column(&conn, DUMP_KEYS);
    assert_eq!(keys_before.len(), before.len());
    open_once(&db);

    assert_migrated(dir.path(), &conn, &before);
    assert_eq!(column::<Vec<String>>(&conn, DUMP_KEYS), keys_before);
    let runs = Arc::new(AtomicU32::new(0));
    let room = open(&db, &runs);
    assert_eq!(
        room.deliver("orders", Message::new("shop", "done-7", "done-7"))
            .unwrap(),
        Outcome::Duplicate
    );

    // The 300 completed rows are long past retention: deleting them notes
    // their keys, and the same pass deletes the entries.
    let report = room.cleanup().unwrap();
    assert_eq!((report.inbox_deleted, report.keys_deleted), (300, 300));
    assert_eq!(
        count(&conn, "SELECT count(*) FROM postroom_inbox_keys"),
        before.len() as i64 - 300
    );
    assert_eq!(
        count(&conn, "SELECT count(*) FROM postroom_retired_keys"),
        0
    );
    assert_eq!(
        room.deliver("orders", Message::new("shop", "done-7", "done-7"))
            .unwrap(),
        Outcome::Processed { attempts: 1 },
        "forgotten after retention"
    );
    room.shutdown(Duration::from_secs(10)).unwrap();
    let report = postroom::admin::check(&conn, postroom::admin::CheckDepth::Full).unwrap();
    assert!(report.is_ok(), "{report:?}");
}

/// Version 3 to 4 rebuilds the conflicts table with `AUTOINCREMENT` ids
/// and an index for `conflict_retention`: its rows keep their ids and
/// contents, and a new conflict's id follows the largest one even after
/// that one is discarded.
#[test]
fn a_version_3_file_keeps_its_conflicts_and_never_reuses_their_ids() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("v3.db");
    let before = write_old(&db, SCHEMA_V3, 3, 3);
    let conn = raw(&db);
    for (id, message_id, payload, headers, seen) in [
        (5, "done-0", "other-0", None, (1000, 2000)),
        (9, "done-1", "other-1", Some(r#"{"h":"v"}"#), (1500, 1500)),
    ] {
        conn.execute(
            "INSERT INTO postroom_conflicts (id, consumer, source, message_id, stored_hash,
                 payload_hash, payload, headers, first_seen_at, last_seen_at, deliveries)
             VALUES (?1, 'orders', 'shop', ?2, ?3, ?4, ?5, ?6, ?7, ?8, 3)",
            params![
                id,
                message_id,
                digest(message_id),
                digest(payload),
                payload.as_bytes(),
                headers,
                seen.0,
                seen.1
            ],
        )
        .unwrap();
    }
    const DUMP_CONFLICTS: &str = "SELECT id || '|' || consumer || '|' || source || '|'
            || message_id || '|' || hex(stored_hash) || '|' || hex(payload_hash) || '|'
            || quote(payload) || '|' || quote(headers) || '|' || first_seen_at || '|'
            || last_seen_at || '|' || deliveries
        FROM postroom_conflicts ORDER BY id";
    let conflicts_before: Vec<String> = column(&conn, DUMP_CONFLICTS);
    open_once(&db);

    assert_migrated(dir.path(), &conn, &before);
    assert_eq!(
        column::<Vec<String>>(&conn, DUMP_CONFLICTS),
        conflicts_before
    );
    assert!(postroom::admin::conflicts_discard(&conn, 9).unwrap());
    let runs = Arc::new(AtomicU32::new(0));
    let room = open(&db, &runs);
    assert_eq!(
        room.deliver("orders", Message::new("shop", "done-2", "other-2"))
            .unwrap(),
        Outcome::Conflict { conflict_id: 10 }
    );
    room.shutdown(Duration::from_secs(10)).unwrap();
    let report = postroom::admin::check(&conn, postroom::admin::CheckDepth::Full).unwrap();
    assert!(report.is_ok(), "{report:?}");
}

/// Version 5 to 6 adds the sequence columns (NULL for every existing
/// row), the watermark tables, index and triggers, and the file's
/// instance id: every row and dedupe answer stays, the schema reads as a
/// new file's, and sequenced messages are recognised after retention.
#[test]
fn a_version_5_file_keeps_every_row_and_gets_sequence_watermarks() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("v5.db");
    let before = write_old(&db, SCHEMA_V5, 5, 3);
    let conn = raw(&db);
    open_once(&db);

    assert_migrated(dir.path(), &conn, &before);
    assert_eq!(
        count(
            &conn,
            "SELECT count(*) FROM postroom_inbox WHERE seq IS NOT NULL OR seq_stream IS NOT NULL"
        ),
        0
    );
    let instance: String = conn
        .query_row(
            "SELECT value FROM postroom_meta WHERE key = 'instance_id'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(instance.len(), 32, "{instance:?}");
    let runs = Arc::new(AtomicU32::new(0));
    let room = open(&db, &runs);
    assert_eq!(
        room.deliver("orders", Message::new("shop", "done-1", "done-1"))
            .unwrap(),
        Outcome::Duplicate
    );
    // An old row and a sequenced redelivery of it: the row answers.
    assert_eq!(
        room.deliver(
            "orders",
            Message::new("shop", "done-2", "done-2").with_sequence(1)
        )
        .unwrap(),
        Outcome::Duplicate
    );
    for seq in 1..=3 {
        let msg = Message::new("device", format!("s-{seq}"), "p").with_sequence(seq);
        assert_eq!(
            room.deliver("orders", msg).unwrap(),
            Outcome::Processed { attempts: 1 }
        );
    }
    let w = room.stats().unwrap().sequences;
    assert_eq!(w.len(), 1);
    assert_eq!((w[0].watermark, w[0].highest), (3, Some(3)));
    for seq in 1..=3 {
        assert_eq!(applied_count(&conn, &format!("s-{seq}")), 1);
    }
    room.shutdown(Duration::from_secs(10)).unwrap();
    // Opening again changes nothing (the instance id is kept).
    open_once(&db);
    let again: String = conn
        .query_row(
            "SELECT value FROM postroom_meta WHERE key = 'instance_id'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(again, instance);
    let report = postroom::admin::check(&conn, postroom::admin::CheckDepth::Full).unwrap();
    assert!(report.is_ok(), "{report:?}");
}

/// The migration replaces the delete trigger; a version 2 file that lost
/// it may have key entries without rows, and is refused as at any open.
#[test]
fn a_version_2_file_missing_its_delete_trigger_is_refused_and_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("v2.db");
    let before = write_old(&db, SCHEMA_V2, 2, 3);
    let conn = raw(&db);
    conn.execute_batch("DROP TRIGGER postroom_inbox_key_delete")
        .unwrap();
    let err = Postroom::builder()
        .workers(0)
        .open(&db)
        .map(drop)
        .expect_err("refused")
        .to_string();
    assert!(
        err.contains("trigger postroom_inbox_key_delete is missing"),
        "{err}"
    );
    assert_eq!(stored_version(&conn), "2");
    assert_eq!(column::<Vec<String>>(&conn, DUMP_INBOX), before);
    assert_eq!(
        count(
            &conn,
            "SELECT count(*) FROM sqlite_master WHERE name = 'postroom_retired_keys'"
        ),
        0
    );
}

/// Version 6 to 7: each ordering key's head (its lowest unfinished inbox
/// row, its lowest pending outbox row) is filled from the rows, the due
/// index is made again without keyed rows, and the held-back rows then run
/// in key order. From version 1 as well (the heads fill while the inbox is
/// rebuilt, and again at the last step). Version 7 to 8: the outbox's
/// heads move from their table into the rows' `head` column (the table and
/// the index of every pending row dropped), which `check` then finds
/// consistent.
#[test]
fn a_version_6_file_gets_the_heads_of_its_keys_and_runs_them_in_order() {
    for (ddl, version) in [(SCHEMA_V7, 7), (SCHEMA_V6, 6), (SCHEMA_V1, 1)] {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("v6.db");
        write_old(&db, ddl, version, 2);
        let conn = raw(&db);
        // Key `k`: a failed head due now, two pending rows behind it; key
        // `j`: a completed row, then one pending. Outbox: key `o`, a sent row
        // then two pending.
        let insert = "INSERT INTO postroom_inbox (consumer, source, message_id, status, payload,
                payload_hash, ordering_key, attempts, last_error, received_at, updated_at,
                next_attempt_at, processed_at, queued)
            VALUES ('orders', 'shop', ?1, ?2, ?8, ?3, ?4, ?5, ?6, 2000, 2000, NULL, ?7, 1)";
        for (id, status, key, attempts, error, processed) in [
            ("k-1", "failed", "k", 1, Some("boom"), None),
            ("j-1", "completed", "j", 1, None, Some(2000)),
            ("k-2", "pending", "k", 0, None, None),
            ("j-2", "pending", "j", 0, None, None),
            ("k-3", "pending", "k", 0, None, None),
        ] {
            conn.execute(
                insert,
                params![
                    id,
                    status,
                    digest(id),
                    key,
                    attempts,
                    error,
                    processed,
                    id.as_bytes()
                ],
            )
            .unwrap();
        }
        conn.execute_batch(
            "INSERT INTO postroom_outbox (message_id, topic, key, payload, status, created_at,
                 next_attempt_at, sent_at)
             VALUES ('o-1', 't', 'o', x'', 'sent', 1, 1, 1),
                    ('o-2', 't', 'o', x'', 'pending', 1, 0, NULL),
                    ('o-3', 't', 'o', x'', 'pending', 1, 0, NULL);",
        )
        .unwrap();
        let before = column::<Vec<String>>(&conn, DUMP_INBOX);
        open_once(&db);
        assert_migrated(dir.path(), &conn, &before);
        let heads: Vec<String> = column(
            &conn,
            "SELECT h.consumer || '/' || h.ordering_key || '=' || i.message_id
             FROM postroom_inbox_heads h JOIN postroom_inbox i ON i.id = h.head_id
             ORDER BY h.ordering_key",
        );
        assert_eq!(
            heads,
            ["orders/j=j-2", "orders/k=k-1"],
            "from version {version}"
        );
        let heads: Vec<String> = column(
            &conn,
            "SELECT key || '=' || message_id FROM postroom_outbox
             WHERE status = 'pending' AND head = 1 AND key IS NOT NULL",
        );
        assert_eq!(heads, ["o=o-2"], "from version {version}");
        let runs = Arc::new(AtomicU32::new(0));
        let room = open(&db, &runs);
        let deadline = Instant::now() + Duration::from_secs(30);
        let done = loop {
            let left = count(
                &conn,
                "SELECT count(*) FROM postroom_inbox WHERE ordering_key IS NOT NULL
                   AND status <> 'completed'",
            );
            if left == 0 || Instant::now() > deadline {
                break left == 0;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        assert!(
            done,
            "from version {version}: {:?} heads {:?}",
            column::<Vec<String>>(&conn, DUMP_INBOX),
            column::<Vec<String>>(
                &conn,
                "SELECT consumer || '/' || ordering_key || '=' || head_id FROM postroom_inbox_heads"
            )
        );
        let order: Vec<String> = column(
            &conn,
            "SELECT message_id FROM applied WHERE message_id LIKE 'k-%' ORDER BY rowid",
        );
        assert_eq!(order, ["k-1", "k-2", "k-3"], "from version {version}");
        assert_eq!(
            count(&conn, "SELECT count(*) FROM postroom_inbox_heads"),
            0,
            "every key finished: no heads left"
        );
        room.shutdown(Duration::from_secs(10)).unwrap();
        let report = postroom::admin::check(&conn, postroom::admin::CheckDepth::Full).unwrap();
        assert!(report.is_ok(), "{report:?}");
    }
}

/// Version 8 to 9: the partial index of dead keyed rows that strict order
/// probes (`postroom_inbox_dead_keys`) is built from the rows, nothing
/// else changes; a dead row migrated from version 8 (or 7) holds its key
/// for a strict consumer while the other keys run, and `check` finds the
/// file sound.
#[test]
fn a_version_8_file_gets_the_dead_keys_index_and_its_dead_rows_hold_strict_keys() {
    for (ddl, version) in [(SCHEMA_V8, 8), (SCHEMA_V7, 7)] {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("v8.db");
        write_old(&db, ddl, version, 2);
        let conn = raw(&db);
        let insert = "INSERT INTO postroom_inbox (consumer, source, message_id, status, payload,
                payload_hash, ordering_key, attempts, last_error, received_at, updated_at,
                queued)
            VALUES ('orders', 'shop', ?1, ?2, ?1, ?3, ?4, ?5, ?6, 2000, 2000, 1)";
        for (id, status, key, attempts, error) in [
            ("k-1", "dead", "k", 5, Some("gave up")),
            ("k-2", "pending", "k", 0, None),
            ("j-1", "pending", "j", 0, None),
        ] {
            conn.execute(
                insert,
                params![id, status, digest(id), key, attempts, error],
            )
            .unwrap();
        }
        let before = column::<Vec<String>>(&conn, DUMP_INBOX);
        open_once(&db);
        assert_migrated(dir.path(), &conn, &before);
        assert_eq!(
            count(
                &conn,
                "SELECT count(*) FROM postroom_inbox INDEXED BY postroom_inbox_dead_keys
                 WHERE status = 'dead' AND ordering_key IS NOT NULL"
            ),
            1,
            "from version {version}"
        );
        let room = Postroom::builder()
            .poll_interval(Duration::from_millis(5))
            .consumer("orders", handler_fn(apply))
            .strict_order("orders")
            .open(&db)
            .unwrap();
        eventually(30, "the other key ran", || applied_count(&conn, "j-1") == 1);
        assert_eq!(applied_count(&conn, "k-2"), 0, "from version {version}");
        room.shutdown(Duration::from_secs(10)).unwrap();
        let report = postroom::admin::check(&conn, postroom::admin::CheckDepth::Full).unwrap();
        assert!(report.is_ok(), "{report:?}");
    }
}

/// Version 9 to 10: the outbox's `alone` hint is added as 0 on every row
/// (the relay reads each key's rows, as version 9 did) and the head
/// triggers that keep it are made again; nothing else changes. The
/// migrated rows go out in key order, a row published afterwards with a
/// key of its own is marked, and `check` finds the file sound. Planner
/// statistics on postroom's tables are gone after open and after shutdown.
#[test]
fn a_version_9_file_gets_the_lone_head_hint_and_relays_in_key_order() {
    for (ddl, version) in [(SCHEMA_V9, 9), (SCHEMA_V8, 8)] {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("v9.db");
        write_old(&db, ddl, version, 2);
        let conn = raw(&db);
        conn.execute_batch(
            "INSERT INTO postroom_outbox (message_id, topic, key, payload, status, created_at,
                 next_attempt_at, sent_at)
             VALUES ('o-1', 't', 'o', x'', 'sent', 1, 1, 1),
                    ('o-2', 't', 'o', x'', 'pending', 1, 0, NULL),
                    ('p-1', 't', 'p', x'', 'pending', 1, 0, NULL),
                    ('o-3', 't', 'o', x'', 'pending', 1, 0, NULL),
                    ('n-1', 't', NULL, x'', 'pending', 1, 0, NULL);",
        )
        .unwrap();
        let before = column::<Vec<String>>(&conn, DUMP_INBOX);
        open_once(&db);
        assert_migrated(dir.path(), &conn, &before);
        assert_eq!(
            count(
                &conn,
                "SELECT count(*) FROM postroom_outbox WHERE alone <> 0"
            ),
            0,
            "from version {version}"
        );
        // Statistics as `PRAGMA optimize` leaves them: the engine forgets
        // those of its own tables at open and again at shutdown.
        conn.execute_batch("ANALYZE").unwrap();
        let postroom_statistics = "SELECT count(*) FROM sqlite_stat1 WHERE tbl LIKE 'postroom%'";
        assert!(count(&conn, postroom_statistics) > 0);
        let (tx, rx) = crossbeam_channel::unbounded();
        let room = Postroom::builder()
            .sink(postroom::ChannelSink::new(tx))
            .open(&db)
            .unwrap();
        assert_eq!(count(&conn, postroom_statistics), 0, "forgotten at open");
        room.transaction(|tx| {
            tx.publish(
                postroom::Outgoing::new("t", b"q".to_vec())
                    .with_key("q")
                    .with_id("q-1"),
            )
        })
        .unwrap();
        let mut sent = Vec::new();
        while sent.len() < 5 {
            let m = rx
                .recv_timeout(Duration::from_secs(30))
                .unwrap_or_else(|e| panic!("from version {version}: {e}; sent {sent:?}"));
            sent.push(m.id);
        }
        room.shutdown(Duration::from_secs(10)).unwrap();
        assert_eq!(
            count(&conn, postroom_statistics),
            0,
            "none left by shutdown"
        );
        assert_eq!(
            sent[..4],
            ["o-2", "p-1", "o-3", "n-1"],
            "from version {version}"
        );
        assert_eq!(sent[4], "q-1");
        assert_eq!(
            count(
                &conn,
                "SELECT alone FROM postroom_outbox WHERE message_id = 'q-1'"
            ),
            1,
            "stored as the only pending row of its key"
        );
        let report = postroom::admin::check(&conn, postroom::admin::CheckDepth::Full).unwrap();
        assert!(report.is_ok(), "{report:?}");
    }
}

/// Schema 11 drops the index of completed rows by completion time:
/// retention walks the inbox in id order instead, from the first row the
/// first time (nothing says where it stopped). A migrated file's old
/// completed rows go, its failed, pending and dead ones stay, and the
/// dry run counts what the run deletes.
#[test]
fn a_version_10_file_loses_the_completed_index_and_retention_walks_it() {
    for (ddl, version) in [(SCHEMA_V10, 10), (SCHEMA_V9, 9)] {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("v10.db");
        let before = write_old(&db, ddl, version, 300);
        let conn = raw(&db);
        assert_eq!(
            count(
                &conn,
                "SELECT count(*) FROM sqlite_master WHERE name = 'postroom_inbox_done'"
            ),
            1
        );
        open_once(&db);
        assert_migrated(dir.path(), &conn, &before);
        let cleanup = |mode| {
            postroom::admin::cleanup(&conn, 1_000_000, Duration::from_secs(1), mode).unwrap()
        };
        let counted = cleanup(postroom::admin::CleanupMode::DryRun);
        let done = cleanup(postroom::admin::CleanupMode::Delete);
        assert_eq!(done.inbox_deleted, 300, "from version {version}");
        assert_eq!(counted.inbox_deleted, done.inbox_deleted);
        assert_eq!(
            column::<Vec<String>>(&conn, "SELECT message_id FROM postroom_inbox ORDER BY id"),
            ["failed", "queued", "dead"],
            "from version {version}"
        );
        let report = postroom::admin::check(&conn, postroom::admin::CheckDepth::Full).unwrap();
        assert!(report.is_ok(), "{report:?}");
    }
}

/// Schema 12 checks only the outbox ids the application names: SQLite
/// cannot drop a column's UNIQUE, so the outbox is rebuilt. Every row
/// keeps its columns, its seq and its head marks, and is kept `named` (its
/// id was checked when stored, so a later named id must not repeat it);
/// the old UNIQUE index is gone; the migrated rows go out in key order
/// before a new one; a handler's derived publish is not `named`; a new
/// named id repeating an old one fails; `check` finds the file sound.
#[test]
fn a_version_11_file_loses_the_unique_outbox_id_and_keeps_every_row() {
    const DUMP_OUTBOX: &str = "SELECT seq || '|' || message_id || '|' || topic || '|'
            || quote(key) || '|' || hex(payload) || '|' || quote(headers) || '|' || status
            || '|' || attempts || '|' || quote(last_error) || '|' || created_at || '|'
            || next_attempt_at || '|' || quote(sent_at) || '|' || quote(cause_consumer)
            || '|' || quote(cause_source) || '|' || quote(cause_message_id)
        FROM postroom_outbox ORDER BY seq";
    // The marks a version 10 or 11 file has (earlier ones get them set).
    const DUMP_MARKS: &str = "SELECT seq || '|' || head || '|' || alone
        FROM postroom_outbox ORDER BY seq";
    for (ddl, version) in [(SCHEMA_V11, 11), (SCHEMA_V9, 9), (SCHEMA_V6, 6)] {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("v11.db");
        write_old(&db, ddl, version, 2);
        let conn = raw(&db);
        conn.execute_batch(
            "INSERT INTO postroom_outbox (message_id, topic, key, payload, headers, status,
                 attempts, last_error, created_at, next_attempt_at, sent_at, cause_consumer,
                 cause_source, cause_message_id)
             VALUES ('o-1', 't', 'o', x'01', NULL, 'sent', 1, NULL, 1, 1, 5, 'orders', 'shop',
                     'done-0'),
                    ('o-2', 't', 'o', x'02', '{\"h\":\"v\"}', 'pending', 0, NULL, 2, 0, NULL,
                     NULL, NULL, NULL),
                    ('p-1', 't', 'p', x'03', NULL, 'pending', 2, 'refused', 3, 0, NULL, NULL,
                     NULL, NULL),
                    ('o-3', 't', 'o', x'04', NULL, 'pending', 0, NULL, 4, 0, NULL, NULL, NULL,
                     NULL),
                    ('d-1', 't', NULL, x'05', NULL, 'dead', 9, 'gone', 5, 0, NULL, NULL, NULL,
                     NULL),
                    ('n-1', 't', NULL, x'06', NULL, 'pending', 0, NULL, 6, 0, NULL, NULL, NULL,
                     NULL);",
        )
        .unwrap();
        // The application's own index and trigger on the outbox, which
        // must survive the rebuild.
        conn.execute_batch(
            "CREATE INDEX app_outbox_topic ON postroom_outbox (topic);
             CREATE TABLE app_sent (seq INTEGER);
             CREATE TRIGGER app_outbox_sent AFTER UPDATE OF status ON postroom_outbox
             WHEN NEW.status = 'sent' BEGIN INSERT INTO app_sent VALUES (NEW.seq); END;",
        )
        .unwrap();
        let before = column::<Vec<String>>(&conn, DUMP_INBOX);
        let outbox_before = column::<Vec<String>>(&conn, DUMP_OUTBOX);
        let marks_before = (version >= 10).then(|| column::<Vec<String>>(&conn, DUMP_MARKS));
        open_once(&db);
        assert_migrated(dir.path(), &conn, &before);
        assert_eq!(
            column::<Vec<String>>(&conn, DUMP_OUTBOX),
            outbox_before,
            "from version {version}"
        );
        if let Some(marks) = marks_before {
            assert_eq!(column::<Vec<String>>(&conn, DUMP_MARKS), marks);
        }
        assert_eq!(
            count(
                &conn,
                "SELECT count(*) FROM postroom_outbox WHERE named = 1"
            ),
            6,
            "from version {version}: every migrated id stays checked"
        );
        assert_eq!(
            count(
                &conn,
                "SELECT count(*) FROM sqlite_master
                 WHERE tbl_name LIKE 'postroom_outbox%' AND name LIKE 'sqlite_autoindex%'"
            ),
            0,
            "from version {version}: the UNIQUE id index is gone"
        );
        let (tx, rx) = crossbeam_channel::unbounded();
        let room = Postroom::builder()
            .sink(postroom::ChannelSink::new(tx))
            .consumer(
                "orders",
                handler_fn(|tx, msg: &Message| -> Result<(), Failure> {
                    tx.publish(postroom::Outgoing::new("t", msg.payload().to_vec()))?;
                    Ok(())
                }),
            )
            .open(&db)
            .unwrap();
        let repeated = room.transaction(|tx| {
            tx.publish(postroom::Outgoing::new("t", b"x".to_vec()).with_id("p-1"))
        });
        assert!(
            repeated.is_err(),
            "from version {version}: a named id repeating a migrated one: {repeated:?}"
        );
        room.deliver("orders", Message::new("shop", "fresh", "f"))
            .unwrap();
        // The four migrated pending rows, then what "fresh" (inline) and
        // "queued" (the fixture's, processed by the workers) publish.
        let mut sent = Vec::new();
        while sent.len() < 6 {
            let m = rx
                .recv_timeout(Duration::from_secs(30))
                .unwrap_or_else(|e| panic!("from version {version}: {e}; sent {sent:?}"));
            sent.push(m.id);
        }
        room.shutdown(Duration::from_secs(10)).unwrap();
        assert_eq!(
            sent[..4],
            ["o-2", "p-1", "o-3", "n-1"],
            "from version {version}"
        );
        let mut published = column::<Vec<String>>(
            &conn,
            "SELECT message_id || ':' || named FROM postroom_outbox
             WHERE cause_message_id IN ('fresh', 'queued')",
        );
        published.sort();
        let mut derived: Vec<String> = sent[4..].iter().map(|id| format!("{id}:0")).collect();
        derived.sort();
        assert_eq!(
            published, derived,
            "from version {version}: derived ids are not named"
        );
        assert_eq!(
            column::<Vec<String>>(
                &conn,
                "SELECT name FROM sqlite_master WHERE tbl_name = 'postroom_outbox'
                   AND name LIKE 'app%' ORDER BY name"
            ),
            ["app_outbox_sent", "app_outbox_topic"],
            "from version {version}: the application's index and trigger are kept"
        );
        assert_eq!(
            count(&conn, "SELECT count(*) FROM app_sent"),
            6,
            "from version {version}: and the trigger fires on the new table"
        );
        let report = postroom::admin::check(&conn, postroom::admin::CheckDepth::Full).unwrap();
        assert!(report.is_ok(), "{report:?}");
    }
}

/// Schema 13 keeps settled sequences past the listing's bound as runs: a
/// version 12 file whose stream has a gap, a full listing and three
/// sequences counted unrecorded keeps all of it (its triggers made anew),
/// a later settled sequence goes into a run, and closing the gap walks the
/// listing up to the first unrecorded one, which stays unpassed (what the
/// old file did not keep cannot be made up); `check` finds it sound.
#[test]
fn a_version_12_file_keeps_its_watermarks_and_settles_into_runs() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("v12.db");
    write_old(&db, SCHEMA_V12, 12, 0);
    let mut conn = raw(&db);
    let settle = |conn: &mut rusqlite::Connection, seqs: std::ops::RangeInclusive<i64>| {
        let tx = conn.transaction().unwrap();
        {
            let mut insert = tx
                .prepare(
                    "INSERT INTO postroom_inbox (consumer, source, message_id, status,
                         payload_hash, received_at, updated_at, processed_at, seq, seq_stream)
                     VALUES ('orders', 'dev', 's-' || ?1, 'completed', zeroblob(32), 0, 0, 0,
                             ?1, 'dev')",
                )
                .unwrap();
            for seq in seqs {
                insert.execute([seq]).unwrap();
            }
        }
        tx.commit().unwrap();
    };
    settle(&mut conn, 2..=4100);
    const WATERMARK: &str = "SELECT settled_below || '|' || highest || '|' || unrecorded
        || '|' || (SELECT count(*) FROM postroom_watermark_settled)
        FROM postroom_watermarks";
    assert_eq!(column::<Vec<String>>(&conn, WATERMARK), ["1|4100|3|4096"]);
    let before = column::<Vec<String>>(&conn, DUMP_INBOX);
    open_once(&db);
    assert_migrated(dir.path(), &conn, &before);
    assert_eq!(column::<Vec<String>>(&conn, WATERMARK), ["1|4100|3|4096"]);
    settle(&mut conn, 4101..=4101);
    assert_eq!(
        column::<Vec<String>>(&conn, "SELECT lo || '-' || hi FROM postroom_watermark_runs"),
        ["4101-4101"]
    );
    let room = Postroom::builder()
        .workers(0)
        .consumer("orders", handler_fn(apply))
        .open(&db)
        .unwrap();
    room.deliver("orders", Message::new("dev", "s-1", "p").with_sequence(1))
        .unwrap();
    room.shutdown(Duration::from_secs(10)).unwrap();
    assert_eq!(column::<Vec<String>>(&conn, WATERMARK), ["4098|4101|3|0"]);
    integrity_ok(&conn);
}
