//! Handler SQL runs on the engine's write connection, inside the engine's
//! transaction; it must not be able to turn a guarantee off for later
//! batches. A `Tx` is not the connection (what would set connection state
//! does not compile: the `compile_fail` examples on `Tx`), and its SQL
//! passes an allowlist: no pragma sets connection state, no schema change
//! or write touches postroom's objects, no statement the engine cached is
//! handed out. A denied statement fails like any SQL error: the attempt
//! fails, nothing of it is stored, the engine carries on.

mod common;

use std::time::Duration;

use common::*;
use postroom::{handler_fn, Failure, Message, Outcome, Postroom};

/// A consumer `sql` whose handler runs the payload as SQL, then applies the
/// message; and the usual consumer `c`.
fn room(path: &std::path::Path) -> Postroom {
    let room = Postroom::builder()
        .workers(0)
        .max_attempts(1)
        .backoff(Duration::ZERO, Duration::ZERO)
        .consumer(
            "sql",
            handler_fn(|tx, msg| {
                let sql = String::from_utf8(msg.payload().to_vec())
                    .map_err(|e| Failure::reject(e.to_string()))?;
                tx.execute_batch(&sql)?;
                apply(tx, msg)
            }),
        )
        .consumer("c", handler_fn(apply))
        .open(path)
        .unwrap();
    create_domain(&room);
    room
}

/// The writer connection's value of `pragma`, read from user code.
fn pragma(room: &Postroom, pragma: &'static str) -> String {
    room.transaction(move |tx| {
        Ok(tx.query_row(&format!("PRAGMA {pragma}"), [], |r| {
            Ok(match r.get_ref(0)? {
                rusqlite::types::ValueRef::Integer(i) => i.to_string(),
                rusqlite::types::ValueRef::Text(t) => String::from_utf8_lossy(t).into_owned(),
                other => format!("{other:?}"),
            })
        })?)
    })
    .unwrap()
}

const STATE: [&str; 15] = [
    "query_only",
    "foreign_keys",
    "journal_mode",
    "synchronous",
    "locking_mode",
    "writable_schema",
    "recursive_triggers",
    "ignore_check_constraints",
    "busy_timeout",
    "legacy_alter_table",
    "read_uncommitted",
    "reverse_unordered_selects",
    "trusted_schema",
    "cell_size_check",
    "schema_version",
];

#[test]
fn a_handler_cannot_set_connection_state_pragmas() {
    let dir = tempfile::tempdir().unwrap();
    let room = room(&dir.path().join("app.db"));
    let before: Vec<String> = STATE.iter().map(|p| pragma(&room, p)).collect();
    let attempts = [
        "PRAGMA query_only = 1",
        "PRAGMA foreign_keys = OFF",
        "PRAGMA journal_mode = DELETE",
        "PRAGMA main.synchronous = OFF",
        "PRAGMA locking_mode = EXCLUSIVE",
        "PRAGMA writable_schema = ON",
        "PRAGMA recursive_triggers = 1",
        "PRAGMA ignore_check_constraints = 1",
        "PRAGMA busy_timeout = 0",
        "PRAGMA legacy_alter_table = 1",
        "PRAGMA read_uncommitted = 1",
        "PRAGMA reverse_unordered_selects = 1",
        "PRAGMA trusted_schema = 0",
        "PRAGMA cell_size_check = 1",
        "PRAGMA schema_version = 12345",
        "PRAGMA wal_autocheckpoint = 1",
        "PRAGMA case_sensitive_like = 1",
        "PRAGMA journal_size_limit = 0",
    ];
    for (i, sql) in attempts.iter().enumerate() {
        let outcome = room
            .deliver("sql", Message::new("s", format!("p{i}"), *sql))
            .unwrap();
        assert!(
            matches!(&outcome, Outcome::Dead { error, .. } if error.contains("not authorized")),
            "{sql}: {outcome:?}"
        );
        // The next message is processed as usual.
        assert_eq!(
            room.deliver("c", Message::new("s", format!("after-{i}"), "x"))
                .unwrap(),
            Outcome::Processed { attempts: 1 },
            "after {sql}"
        );
    }
    let after: Vec<String> = STATE.iter().map(|p| pragma(&room, p)).collect();
    assert_eq!(after, before, "{STATE:?}");
    // Reading them, and setting the application's own, stays allowed.
    let ok = "PRAGMA user_version = 7; PRAGMA application_id = 9; PRAGMA foreign_keys; \
              PRAGMA table_info(applied); PRAGMA index_list(postroom_inbox)";
    assert_eq!(
        room.deliver("sql", Message::new("s", "allowed", ok))
            .unwrap(),
        Outcome::Processed { attempts: 1 }
    );
    assert_eq!(pragma(&room, "user_version"), "7");
}

#[test]
fn a_handler_cannot_drop_alter_or_create_postroom_objects() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let room = room(&path);
    room.deliver("c", Message::new("s", "first", "x")).unwrap();
    let schema = || {
        column::<Vec<String>>(
            &raw(&path),
            "SELECT type || ' ' || name || ' ' || coalesce(sql, '') FROM sqlite_master ORDER BY name",
        )
    };
    let before = schema();
    let attempts = [
        "DROP TRIGGER postroom_inbox_key_insert",
        "DROP INDEX postroom_inbox_due",
        "DROP TABLE postroom_conflicts",
        "ALTER TABLE postroom_outbox ADD COLUMN extra TEXT",
        "ALTER TABLE postroom_inbox RENAME TO mine",
        "ALTER TABLE postroom_outbox RENAME COLUMN topic TO subject",
        "CREATE TABLE postroom_mine (x)",
        "CREATE INDEX postroom_mine ON applied (message_id)",
        "CREATE UNIQUE INDEX by_topic ON postroom_outbox (topic)",
        "CREATE TRIGGER eat AFTER INSERT ON postroom_outbox \
         BEGIN DELETE FROM postroom_outbox WHERE seq = NEW.seq; END",
        "CREATE TEMP TRIGGER eat AFTER INSERT ON main.postroom_outbox \
         BEGIN DELETE FROM postroom_outbox WHERE seq = NEW.seq; END",
        "CREATE VIEW postroom_view AS SELECT 1",
    ];
    for (i, sql) in attempts.iter().enumerate() {
        let outcome = room
            .deliver("sql", Message::new("s", format!("d{i}"), *sql))
            .unwrap();
        assert!(
            matches!(&outcome, Outcome::Dead { error, .. } if error.contains("not authorized")),
            "{sql}: {outcome:?}"
        );
        assert_eq!(schema(), before, "after {sql}");
        // Dedupe and the outbox still work.
        assert_eq!(
            room.deliver("c", Message::new("s", "first", "x")).unwrap(),
            Outcome::Duplicate,
            "after {sql}"
        );
        let id = format!("after-{i}");
        room.deliver("c", Message::new("s", id.clone(), "x"))
            .unwrap();
        let published = count(
            &raw(&path),
            &format!("SELECT count(*) FROM postroom_outbox WHERE payload = CAST('{id}' AS BLOB)"),
        );
        assert_eq!(published, 1, "after {sql}");
    }
    // The application's own schema stays the application's.
    let ok = "CREATE TABLE mine (x); CREATE INDEX mine_x ON mine (x); \
              CREATE TRIGGER mine_t AFTER INSERT ON mine BEGIN SELECT 1; END; \
              ALTER TABLE mine ADD COLUMN y; DROP TRIGGER mine_t; DROP INDEX mine_x";
    assert_eq!(
        room.deliver("sql", Message::new("s", "own", ok)).unwrap(),
        Outcome::Processed { attempts: 1 }
    );
    integrity_ok(&raw(&path));
}

/// Finding 6: pragmas the old denylist missed wedged every later write
/// until the engine was reopened. Each is refused, and later deliveries
/// (and dedupe) work.
#[test]
fn pragmas_outside_the_allowlist_are_refused_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let room = room(&path);
    room.deliver("c", Message::new("s", "first", "x")).unwrap();
    let attempts = [
        "PRAGMA count_changes = 1",
        "PRAGMA max_page_count = 1",
        "PRAGMA main.max_page_count = 1",
        "PRAGMA defer_foreign_keys = 1",
        "PRAGMA cache_size = 1",
        "PRAGMA mmap_size = 0",
        "PRAGMA temp_store = MEMORY",
        "PRAGMA secure_delete = 1",
        "PRAGMA automatic_index = 0",
        "PRAGMA optimize",
        "PRAGMA shrink_memory",
        "PRAGMA incremental_vacuum",
        "PRAGMA wal_checkpoint",
        "PRAGMA no_such_pragma = 1",
        "ATTACH ':memory:' AS other",
        "ANALYZE",
    ];
    for (i, sql) in attempts.iter().enumerate() {
        let outcome = room
            .deliver("sql", Message::new("s", format!("q{i}"), *sql))
            .unwrap();
        assert!(
            matches!(&outcome, Outcome::Dead { error, .. } if error.contains("not authorized")),
            "{sql}: {outcome:?}"
        );
        assert_eq!(
            room.deliver("c", Message::new("s", format!("after-q{i}"), "x"))
                .unwrap(),
            Outcome::Processed { attempts: 1 },
            "after {sql}"
        );
        assert_eq!(
            room.deliver("c", Message::new("s", "first", "x")).unwrap(),
            Outcome::Duplicate,
            "after {sql}"
        );
    }
    assert_eq!(pragma(&room, "count_changes"), "0");
    assert_ne!(pragma(&room, "max_page_count"), "1");
}

/// Finding 3: on 1b0f395 a handler reached the connection through `Tx`'s
/// Deref (`tx.set_db_config(SQLITE_DBCONFIG_ENABLE_TRIGGER, false)`,
/// `tx.busy_timeout(Duration::ZERO)`): afterwards the same message
/// delivered three times answered `Processed` three times. `Tx` no longer
/// derefs to the connection, so that code does not compile (the
/// `compile_fail` examples on `Tx`); what is left is SQL, and the
/// allowlist refuses the SQL way to the same state.
#[test]
fn a_handler_cannot_turn_dedupe_off_or_the_busy_timeout_down_for_later_messages() {
    let dir = tempfile::tempdir().unwrap();
    let room = Postroom::builder()
        .workers(0)
        .consumer(
            "evil",
            handler_fn(|tx, msg| {
                for sql in [
                    "PRAGMA busy_timeout = 0",
                    "PRAGMA foreign_keys = 0",
                    "PRAGMA writable_schema = 1",
                    "PRAGMA recursive_triggers = 1",
                    "DELETE FROM postroom_inbox",
                    "UPDATE postroom_inbox SET status = 'failed'",
                    "INSERT INTO postroom_outbox (topic) VALUES ('x')",
                    "DELETE FROM sqlite_stat1",
                ] {
                    let denied = tx.execute_batch(sql).unwrap_err().to_string();
                    assert!(denied.contains("not authorized"), "{sql}: {denied}");
                }
                apply(tx, msg)
            }),
        )
        .consumer("c", handler_fn(apply))
        .open(dir.path().join("app.db"))
        .unwrap();
    create_domain(&room);
    let outcomes: Vec<Outcome> = (0..3)
        .map(|_| {
            room.deliver("evil", Message::new("s", "e", "x")).unwrap();
            room.deliver("c", Message::new("s", "m", "x")).unwrap()
        })
        .collect();
    assert_eq!(
        outcomes,
        [
            Outcome::Processed { attempts: 1 },
            Outcome::Duplicate,
            Outcome::Duplicate
        ]
    );
    assert_eq!(pragma(&room, "busy_timeout"), "5000");
}

/// Statements a handler prepares through the statement cache are its own:
/// the engine's cached `RELEASE postroom_handler` (prepared unguarded) is
/// not handed out, so the authorizer sees, and denies, the handler's.
#[test]
fn a_handler_never_gets_the_engines_cached_statements() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let room = Postroom::builder()
        .workers(0)
        .max_attempts(1)
        .consumer(
            "cached",
            handler_fn(|tx, msg| {
                let sql = String::from_utf8(msg.payload().to_vec())
                    .map_err(|e| Failure::reject(e.to_string()))?;
                tx.execute(&sql, [])?;
                apply(tx, msg)
            }),
        )
        .consumer("c", handler_fn(apply))
        .open(&path)
        .unwrap();
    create_domain(&room);
    // The engine has run (and cached) its savepoint statements.
    room.deliver("c", Message::new("s", "first", "x")).unwrap();
    for (i, sql) in ["RELEASE postroom_handler", "ROLLBACK TO postroom_handler"]
        .iter()
        .enumerate()
    {
        let outcome = room
            .deliver("cached", Message::new("s", format!("r{i}"), *sql))
            .unwrap();
        assert!(
            matches!(&outcome, Outcome::Dead { error, .. } if error.contains("not authorized")),
            "{sql}: {outcome:?}"
        );
        assert_eq!(
            room.deliver("c", Message::new("s", "first", "x")).unwrap(),
            Outcome::Duplicate
        );
    }
    integrity_ok(&raw(&path));
}

/// What a handler may do stays possible: savepoints of its own (and
/// `Tx::savepoint`, whose rolled-back publishes are gone), tables with
/// created and dropped, one with AUTOINCREMENT created and written, reading
/// postroom's tables. (Renaming a table is refused: SQLite then updates
/// `sqlite_sequence`, which holds postroom's counters.)
#[test]
fn a_handlers_own_savepoints_and_schema_work() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let room = Postroom::builder()
        .workers(0)
        .max_attempts(1)
        .consumer(
            "c",
            handler_fn(|tx, msg| {
                tx.execute_batch(
                    "CREATE TABLE IF NOT EXISTS plain (id INTEGER PRIMARY KEY, v);
                     INSERT INTO plain (v) VALUES (1);
                     DROP TABLE plain;
                     CREATE TABLE IF NOT EXISTS auto (id INTEGER PRIMARY KEY AUTOINCREMENT, v);
                     INSERT INTO auto (v) VALUES (1);
                     SAVEPOINT mine; INSERT INTO applied VALUES ('x', 'y', NULL);
                     ROLLBACK TO mine; RELEASE mine;",
                )?;
                let seen: i64 =
                    tx.query_row("SELECT count(*) FROM postroom_inbox", [], |r| r.get(0))?;
                assert!(seen >= 0);
                let kept = tx.savepoint(|tx| {
                    tx.publish(postroom::Outgoing::new("kept", "k"))?;
                    Ok::<_, Failure>(tx.last_insert_rowid())
                })?;
                assert!(kept > 0);
                let dropped = tx.savepoint(|tx| {
                    tx.publish(postroom::Outgoing::new("dropped", "d"))?;
                    Err::<(), _>(Failure::retry("changed my mind"))
                });
                assert!(dropped.is_err());
                apply(tx, msg)
            }),
        )
        .open(&path)
        .unwrap();
    create_domain(&room);
    assert_eq!(
        room.deliver("c", Message::new("s", "m", "x")).unwrap(),
        Outcome::Processed { attempts: 1 }
    );
    let conn = raw(&path);
    let topics = column::<Vec<String>>(&conn, "SELECT topic FROM postroom_outbox ORDER BY seq");
    assert_eq!(topics, ["kept", "applied"]);
    assert_eq!(
        count(&conn, "SELECT count(*) FROM applied WHERE consumer = 'x'"),
        0
    );
    integrity_ok(&conn);
}

/// The authorizer is not told the new name of `ALTER TABLE .. RENAME`: a
/// temporary table renamed `postroom_outbox` shadowed the real outbox on the
/// write connection, and every later publish went into it, answered
/// `Processed` and was gone at shutdown (a hostile review of issue 31's
/// fixes; failed before: 0 rows in the outbox). Renames in the temp schema
/// are refused.
#[test]
fn a_temporary_table_renamed_into_postroom_s_namespace_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let room = Postroom::builder()
        .workers(0)
        .consumer(
            "pub",
            handler_fn(|tx, msg| {
                tx.publish(postroom::Outgoing::new("t", msg.payload().to_vec()))?;
                Ok(())
            }),
        )
        .open(&path)
        .unwrap();
    let renamed = room.transaction(|tx| {
        Ok(tx.execute_batch(
            "CREATE TEMP TABLE x (seq INTEGER PRIMARY KEY, message_id TEXT NOT NULL UNIQUE,
               topic TEXT NOT NULL, key TEXT, payload BLOB NOT NULL, headers TEXT,
               status TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0, last_error TEXT,
               created_at INTEGER NOT NULL, next_attempt_at INTEGER NOT NULL, sent_at INTEGER,
               cause_consumer TEXT, cause_source TEXT, cause_message_id TEXT);
             ALTER TABLE temp.x RENAME TO postroom_outbox;",
        )?)
    });
    let err = renamed.expect_err("a rename in the temp schema must be refused");
    assert!(err.to_string().contains("not authorized"), "{err}");
    assert!(matches!(
        room.deliver("pub", Message::new("s", "m1", "hello"))
            .unwrap(),
        Outcome::Processed { .. }
    ));
    room.shutdown(Duration::from_secs(10)).unwrap();
    drop(room);
    let conn = raw(&path);
    assert_eq!(count(&conn, "SELECT count(*) FROM postroom_outbox"), 1);
}

/// `sqlite_sequence` holds the counters of postroom's AUTOINCREMENT tables:
/// a handler that set `postroom_conflicts`' to i64::MAX made every later
/// conflict fail `StorageFull`, retryably, for ever (failed before: the
/// conflicting delivery answered `Err(StorageFull)`). User code may not
/// write it.
#[test]
fn a_handler_cannot_write_the_autoincrement_counters() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let room = room(&path);
    let written = room.transaction(|tx| {
        Ok(tx.execute_batch(
            "INSERT INTO sqlite_sequence (name, seq) VALUES ('postroom_conflicts', 9223372036854775807);",
        )?)
    });
    let err = written.expect_err("a write to sqlite_sequence must be refused");
    assert!(err.to_string().contains("not authorized"), "{err}");
    room.deliver("c", Message::new("s", "m1", "a")).unwrap();
    assert!(matches!(
        room.deliver("c", Message::new("s", "m1", "b")).unwrap(),
        Outcome::Conflict { .. }
    ));
    room.shutdown(Duration::from_secs(10)).unwrap();
}
