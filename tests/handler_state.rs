//! What one handler leaves behind never reaches another message: the
//! engine checks the *state* after each handler (its transaction and
//! savepoint, statements still running, deferred foreign keys, schema
//! objects that reach postroom's tables, TEMP objects) and fails that
//! message alone, with the rule it broke. Each poison here passed the SQL
//! allowlist before the check existed, and hurt other messages or the
//! engine: an innocent delivery answered another's COMMIT error, a wedged
//! writer, dedupe keys deleted by a trigger another connection fired,
//! retention stopped by a foreign key.
//!
//! Real files in temp directories; item 3 runs the real `sqlite3` shell
//! (skipped, saying so, where none is installed; `.ci/run` installs it).

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use postroom::{handler_fn, Error, Failure, Message, Outcome, Postroom, Receipt, Tx};

/// The application's schema: a deferred foreign key (children may arrive
/// before their parent within a transaction), a table that a poison's
/// `INSERT OR ROLLBACK` collides with, and a table other connections
/// update.
const APP_SQL: &str = "
    CREATE TABLE parent (id TEXT PRIMARY KEY);
    CREATE TABLE child (id TEXT PRIMARY KEY,
        parent TEXT REFERENCES parent(id) DEFERRABLE INITIALLY DEFERRED);
    CREATE TABLE once (id INTEGER PRIMARY KEY);
    INSERT INTO once VALUES (1);
    CREATE TABLE my_table (id INTEGER PRIMARY KEY, n INTEGER);
    INSERT INTO my_table VALUES (1, 0);";

/// The six poisons, one per kind of leftover, plus one refused statement.
const POISONS: [&str; 7] = [
    "deferred-fk",
    "savepoint-after-rollback",
    "trigger-on-app-table",
    "leaked-statement",
    "fk-to-engine-table",
    "temp-trigger",
    "refused-pragma",
];

/// Records every message in `applied` (as the common handler), and does
/// the poison its payload names first.
fn handle(tx: &mut Tx<'_>, msg: &Message) -> Result<(), Failure> {
    match msg.payload() {
        b"deferred-fk" => {
            // An out-of-order child: its parent has not arrived.
            tx.execute(
                "INSERT INTO child (id, parent) VALUES (?1, 'not-yet')",
                [msg.id()],
            )?;
        }
        b"savepoint-after-rollback" => {
            // SQLite rolls the whole transaction back; the error is ignored
            // and a savepoint begins a new transaction of the handler's.
            let _ = tx.execute("INSERT OR ROLLBACK INTO once VALUES (1)", []);
            tx.execute("SAVEPOINT mine", [])?;
        }
        b"trigger-on-app-table" => {
            tx.execute_batch(
                "CREATE TRIGGER wipe_keys AFTER UPDATE ON my_table
                 BEGIN DELETE FROM postroom_inbox_keys; END",
            )?;
        }
        b"leaked-statement" => {
            let mut stmt = tx.prepare(
                "INSERT INTO applied (consumer, message_id) VALUES ('leak', ?1) RETURNING rowid",
            )?;
            let mut rows = stmt.query([msg.id()])?;
            rows.next()?;
            // Safe Rust: the statement never finishes, never resets.
            std::mem::forget(rows);
            std::mem::forget(stmt);
        }
        b"leak-then-rollback" => {
            // A running statement, then SQLite rolls the transaction back.
            let mut stmt = tx.prepare(
                "WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n WHERE x < 100)
                 SELECT x FROM n",
            )?;
            let mut rows = stmt.query([])?;
            rows.next()?;
            std::mem::forget(rows);
            std::mem::forget(stmt);
            let _ = tx.execute("INSERT OR ROLLBACK INTO once VALUES (1)", []);
        }
        b"leak-idle" => {
            // Leaked before it ran: not running, so no rule is broken, but
            // the write connection could not close with it alive.
            std::mem::forget(tx.prepare("SELECT 1")?);
        }
        b"fk-to-engine-table" => {
            tx.execute_batch("CREATE TABLE r (iid INTEGER REFERENCES postroom_inbox(id))")?;
        }
        b"temp-trigger" => {
            tx.execute_batch(
                "CREATE TEMP TRIGGER tt AFTER INSERT ON applied
                 BEGIN UPDATE my_table SET n = n + 1; END",
            )?;
        }
        b"refused-pragma" => {
            tx.execute_batch("PRAGMA journal_mode = DELETE")?;
        }
        _ => {}
    }
    apply(tx, msg)
}

fn builder() -> postroom::Builder {
    Postroom::builder()
        .max_attempts(3)
        .backoff(Duration::from_millis(1), Duration::from_millis(2))
        .poll_interval(Duration::from_millis(5))
        .workers(0)
        .consumer("c", handler_fn(handle))
}

fn open(dir: &Path) -> Postroom {
    with_schema(builder().open(dir.join("app.db")).expect("open"))
}

/// `room` with the domain table and the application's schema.
fn with_schema(room: Postroom) -> Postroom {
    create_domain(&room);
    room.transaction(|tx| Ok(tx.execute_batch(APP_SQL)?))
        .expect("app schema");
    room
}

fn poison(id: &str, kind: &str) -> Message {
    Message::new("s", id, kind.as_bytes().to_vec())
}

fn innocent(id: impl Into<String>) -> Message {
    Message::new("s", id, "fine")
}

/// Delivers `msg` until its answer is final (dead or processed), waiting
/// out each backoff; returns every answer.
fn deliver_until_settled(room: &Postroom, msg: &Message) -> Vec<Outcome> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut answers = Vec::new();
    loop {
        let outcome = room.deliver("c", msg.clone()).expect("deliver answers Ok");
        let again = outcome.retry_after();
        answers.push(outcome);
        match again {
            Some(after) if Instant::now() < deadline => std::thread::sleep(after),
            _ => return answers,
        }
    }
}

fn error_of(outcome: &Outcome) -> &str {
    match outcome {
        Outcome::Failed { error, .. } | Outcome::Dead { error, .. } => error,
        other => panic!("expected a failure, got {other:?}"),
    }
}

fn schema_has(conn: &rusqlite::Connection, name: &str) -> bool {
    count(
        conn,
        &format!("SELECT count(*) FROM sqlite_schema WHERE name = '{name}'"),
    ) > 0
}

/// Item 1: A deferred foreign key left unmet is the message's failure: counted,
/// retried with backoff, dead after `max_attempts`; no `COMMIT` error
/// reaches anyone.
#[test]
fn a_deferred_foreign_key_left_unmet_fails_its_own_message_with_backoff() {
    let dir = tempfile::tempdir().unwrap();
    let room = open(dir.path());
    let answers = deliver_until_settled(&room, &poison("p", "deferred-fk"));
    let attempts: Vec<_> = answers
        .iter()
        .map(|o| match o {
            Outcome::Failed { attempts, .. } | Outcome::Dead { attempts, .. } => *attempts,
            other => panic!("expected a failure, got {other:?}"),
        })
        .collect();
    assert_eq!(attempts, [1, 2, 3], "{answers:?}");
    assert!(matches!(answers[2], Outcome::Dead { .. }), "{answers:?}");
    assert!(
        error_of(&answers[0]).contains("deferred foreign-key"),
        "{answers:?}"
    );
    // The parent arrives: a later child of it commits.
    room.transaction(|tx| Ok(tx.execute_batch("INSERT INTO parent VALUES ('not-yet')")?))
        .unwrap();
    assert!(matches!(
        room.deliver("c", poison("q", "deferred-fk")).unwrap(),
        Outcome::Processed { attempts: 1 }
    ));
    let conn = raw(&dir.path().join("app.db"));
    assert_eq!(count(&conn, "SELECT count(*) FROM child"), 1);
    assert_eq!(applied_count(&conn, "p"), 0);
    room.shutdown(Duration::from_secs(10)).unwrap();
}

/// Item 1, queued: one such message among 200 received does not stop the
/// consumer, and is counted rather than left `pending` with 0 attempts.
#[test]
fn a_queued_deferred_foreign_key_does_not_stop_its_consumer() {
    let dir = tempfile::tempdir().unwrap();
    let room = with_schema(
        builder()
            .workers(1)
            .open(dir.path().join("app.db"))
            .unwrap(),
    );
    let mut batch: Vec<Message> = (0..200).map(|i| innocent(format!("m{i}"))).collect();
    batch[100] = poison("p", "deferred-fk");
    let receipts = room.receive_batch("c", batch).unwrap();
    assert!(receipts.iter().all(|r| *r == Receipt::Accepted));
    let conn = raw(&dir.path().join("app.db"));
    eventually(60, "199 innocents applied and the poison dead", || {
        let stats = room.stats().unwrap();
        stats.inbox["c"].completed == 199 && stats.inbox["c"].dead == 1
    });
    assert_eq!(
        count(
            &conn,
            "SELECT count(*) FROM applied WHERE message_id <> 'p'"
        ),
        199
    );
    let row = inbox_row(&conn, "c", "s", "p").unwrap();
    assert_eq!(row.1, 3, "{row:?}");
    room.shutdown(Duration::from_secs(10)).unwrap();
}

/// Queued, every kind: one poison of each among received messages, and
/// the consumer goes on: every innocent applied once, every poison dead
/// (none left `pending` with no attempt counted), and every
/// `receive_batch` answered.
#[test]
fn a_queued_poison_of_each_kind_does_not_stop_its_consumer() {
    let dir = tempfile::tempdir().unwrap();
    let room = with_schema(
        builder()
            .workers(1)
            .open(dir.path().join("app.db"))
            .unwrap(),
    );
    for (k, kind) in POISONS.iter().enumerate() {
        let mut batch: Vec<Message> = (0..20).map(|i| innocent(format!("k{k}-{i}"))).collect();
        batch[10] = poison(&format!("p{k}"), kind);
        let receipts = room
            .receive_batch("c", batch)
            .expect("receive_batch answers");
        assert!(receipts.iter().all(|r| *r == Receipt::Accepted));
    }
    let innocents = 19 * POISONS.len() as u64;
    eventually(60, "every innocent applied and every poison dead", || {
        let stats = room.stats().unwrap();
        stats.inbox["c"].completed == innocents && stats.inbox["c"].dead == POISONS.len() as u64
    });
    let conn = raw(&dir.path().join("app.db"));
    assert_eq!(
        count(
            &conn,
            "SELECT count(*) FROM applied WHERE CAST(payload AS TEXT) = 'fine'"
        ),
        innocents as i64
    );
    for (k, kind) in POISONS.iter().enumerate() {
        let row = inbox_row(&conn, "c", "s", &format!("p{k}")).unwrap();
        assert!(row.0 == "dead" && row.1 >= 1, "{kind}: {row:?}");
    }
    room.shutdown(Duration::from_secs(10)).unwrap();
}

/// Item 2: A savepoint begun after SQLite rolled the transaction back does not
/// pass for the engine's transaction: the attempt is counted as rolled
/// back, and a `transaction()` closure that does it commits nothing.
#[test]
fn a_savepoint_after_sqlite_rolled_back_is_not_taken_for_the_engines_transaction() {
    let dir = tempfile::tempdir().unwrap();
    let room = open(dir.path());
    let first = room
        .deliver("c", poison("p", "savepoint-after-rollback"))
        .expect("answered, not an error");
    assert!(
        matches!(first, Outcome::Failed { attempts: 1, .. }),
        "{first:?}"
    );
    assert!(error_of(&first).contains("rolled back"), "{first:?}");
    let answers = deliver_until_settled(&room, &poison("p", "savepoint-after-rollback"));
    assert!(
        matches!(answers.last(), Some(Outcome::Dead { attempts: 3, .. })),
        "{answers:?}"
    );
    let lone = room.transaction(|tx| {
        tx.execute("INSERT INTO parent VALUES ('first')", [])?;
        let _ = tx.execute("INSERT OR ROLLBACK INTO once VALUES (1)", []);
        tx.execute("SAVEPOINT mine", [])?;
        tx.execute("INSERT INTO parent VALUES ('second')", [])?;
        Ok(())
    });
    assert!(matches!(lone, Err(Error::RolledBack { .. })), "{lone:?}");
    let conn = raw(&dir.path().join("app.db"));
    assert_eq!(count(&conn, "SELECT count(*) FROM parent"), 0);
    assert_eq!(applied_count(&conn, "p"), 0);
    // The engine goes on.
    assert!(matches!(
        room.deliver("c", innocent("after")).unwrap(),
        Outcome::Processed { .. }
    ));
    room.shutdown(Duration::from_secs(10)).unwrap();
}

/// The `sqlite3` CLI runs `sql` on `db`, or `None` where it is missing.
fn sqlite3(db: &Path, sql: &str) -> Option<std::process::Output> {
    match Command::new("sqlite3")
        .arg("-cmd")
        .arg(".timeout 10000")
        .arg(db)
        .arg(sql)
        .output()
    {
        Ok(out) => Some(out),
        Err(e) => {
            eprintln!("skipped: no sqlite3 CLI ({e}; apt-get install sqlite3)");
            None
        }
    }
}

/// Item 3: A trigger made in a handler never reaches the file, so another
/// connection's update cannot fire it; one made from outside (the `sqlite3`
/// shell) is refused at open, naming it.
#[test]
fn a_trigger_on_an_app_table_that_writes_engine_tables_is_refused_from_anywhere() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    let room = open(dir.path());
    assert!(matches!(
        room.deliver("c", innocent("m1")).unwrap(),
        Outcome::Processed { .. }
    ));
    let answer = room
        .deliver("c", poison("p", "trigger-on-app-table"))
        .unwrap();
    assert!(
        matches!(answer, Outcome::Dead { attempts: 1, .. }),
        "{answer:?}"
    );
    assert!(
        error_of(&answer).contains("trigger wipe_keys"),
        "{answer:?}"
    );
    let conn = raw(&db);
    assert!(!schema_has(&conn, "wipe_keys"));
    let Some(out) = sqlite3(&db, "UPDATE my_table SET n = n + 1;") else {
        return;
    };
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        room.deliver("c", innocent("m1")).unwrap(),
        Outcome::Duplicate
    );
    assert_eq!(applied_count(&conn, "m1"), 1);
    room.shutdown(Duration::from_secs(10)).unwrap();
    drop(conn);

    // The same trigger, made by the shell while the engine is closed.
    let out = sqlite3(
        &db,
        "CREATE TRIGGER wipe_keys AFTER UPDATE ON my_table
         BEGIN DELETE FROM postroom_inbox_keys; END;",
    )
    .unwrap();
    assert!(out.status.success(), "{out:?}");
    let Err(refused) = builder().open(&db) else {
        panic!("open must refuse")
    };
    let text = refused.to_string();
    assert!(
        matches!(refused, Error::InvalidInput { .. }) && text.contains("trigger wipe_keys"),
        "{text}"
    );
    // `postroom check` names it too.
    let conn = raw(&db);
    let report = postroom::admin::check(&conn, postroom::admin::CheckDepth::Quick).unwrap();
    assert!(!report.is_ok(), "{report:?}");
    assert!(format!("{report:?}").contains("wipe_keys"), "{report:?}");
}

/// Item 4: A statement leaked from a handler is that message's failure and is
/// reset: the writer takes the next message.
#[test]
fn a_leaked_statement_fails_its_message_and_does_not_wedge_the_writer() {
    let dir = tempfile::tempdir().unwrap();
    let room = open(dir.path());
    let answer = room.deliver("c", poison("p", "leaked-statement")).unwrap();
    assert!(
        matches!(answer, Outcome::Dead { attempts: 1, .. }),
        "{answer:?}"
    );
    assert!(
        error_of(&answer).contains("statement running"),
        "{answer:?}"
    );
    for i in 0..5 {
        let id = format!("after{i}");
        assert!(matches!(
            room.deliver("c", innocent(&id)).unwrap(),
            Outcome::Processed { .. }
        ));
        let n: i64 = room
            .transaction(|tx| Ok(tx.query_row("SELECT count(*) FROM applied", [], |r| r.get(0))?))
            .unwrap();
        assert_eq!(n, i + 1);
    }
    // A leak beside a rolled-back transaction: its own failure, not the
    // next message's.
    let answer = room
        .deliver("c", poison("q", "leak-then-rollback"))
        .unwrap();
    assert!(
        matches!(answer, Outcome::Failed { attempts: 1, .. }),
        "{answer:?}"
    );
    assert!(error_of(&answer).contains("rolled back"), "{answer:?}");
    assert!(matches!(
        room.deliver("c", innocent("after-q")).unwrap(),
        Outcome::Processed { attempts: 1 }
    ));
    assert!(matches!(
        room.deliver("c", poison("idle", "leak-idle")).unwrap(),
        Outcome::Processed { attempts: 1 }
    ));
    let conn = raw(&dir.path().join("app.db"));
    assert_eq!(applied_count(&conn, "p"), 0);
    drop(conn);
    room.shutdown(Duration::from_secs(10)).unwrap();
    // The leaked statements were finalized: the write connection closed,
    // with its files (Linux: no descriptor left on the -wal or -shm).
    let open = wal_and_shm_descriptors(dir.path());
    assert!(open.is_empty(), "still open after shutdown: {open:?}");
}

/// Item 5: A foreign key to an engine table is refused: retention keeps
/// deleting.
#[test]
fn a_foreign_key_to_an_engine_table_is_refused_and_retention_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    let room = builder()
        .retention(Duration::from_millis(1))
        .open(&db)
        .unwrap();
    create_domain(&room);
    room.transaction(|tx| Ok(tx.execute_batch(APP_SQL)?))
        .unwrap();
    assert!(matches!(
        room.deliver("c", innocent("m1")).unwrap(),
        Outcome::Processed { .. }
    ));
    let answer = room
        .deliver("c", poison("p", "fk-to-engine-table"))
        .unwrap();
    assert!(
        matches!(answer, Outcome::Dead { attempts: 1, .. }),
        "{answer:?}"
    );
    assert!(error_of(&answer).contains("table r"), "{answer:?}");
    let conn = raw(&db);
    assert!(!schema_has(&conn, "r"));
    // The same from a transaction closure.
    let closure = room.transaction(|tx| {
        Ok(tx.execute_batch("CREATE TABLE r2 (iid INTEGER REFERENCES postroom_inbox(id))")?)
    });
    assert!(
        matches!(&closure, Err(Error::Aborted { reason }) if reason.contains("table r2")),
        "{closure:?}"
    );
    assert!(!schema_has(&conn, "r2"));
    eventually(30, "retention deletes the completed row", || {
        inbox_row(&conn, "c", "s", "m1").is_none()
    });
    room.shutdown(Duration::from_secs(10)).unwrap();
    // Made from outside (an application's migration): refused at open,
    // named. A view over postroom's tables is not (it only reads).
    conn.execute_batch(
        "CREATE VIEW app_dead AS SELECT id FROM postroom_inbox WHERE status = 'dead';
         CREATE TABLE r3 (iid INTEGER REFERENCES postroom_inbox(id));",
    )
    .unwrap();
    let Err(refused) = builder().open(&db) else {
        panic!("open must refuse")
    };
    assert!(refused.to_string().contains("table r3"), "{refused}");
    conn.execute_batch("DROP TABLE r3").unwrap();
    builder()
        .open(&db)
        .expect("a view is fine")
        .shutdown(Duration::from_secs(10))
        .unwrap();
}

/// Item 6: TEMP objects do not outlive their message: the one that made them
/// fails, later handlers run as if it never had.
#[test]
fn temp_objects_do_not_outlive_their_message() {
    let dir = tempfile::tempdir().unwrap();
    let room = open(dir.path());
    let answer = room.deliver("c", poison("p", "temp-trigger")).unwrap();
    assert!(
        matches!(answer, Outcome::Dead { attempts: 1, .. }),
        "{answer:?}"
    );
    assert!(
        error_of(&answer).contains("may not leave TEMP objects behind (trigger tt)"),
        "{answer:?}"
    );
    for i in 0..3 {
        assert!(matches!(
            room.deliver("c", innocent(format!("after{i}"))).unwrap(),
            Outcome::Processed { .. }
        ));
    }
    // A TEMP table dropped before the handler returns is fine.
    let scratch = room.transaction(|tx| {
        tx.execute_batch("CREATE TEMP TABLE scratch (x); INSERT INTO scratch VALUES (1)")?;
        let n: i64 = tx.query_row("SELECT count(*) FROM scratch", [], |r| r.get(0))?;
        tx.execute_batch("DROP TABLE scratch")?;
        Ok(n)
    });
    assert_eq!(scratch.unwrap(), 1);
    let conn = raw(&dir.path().join("app.db"));
    // The trigger never fired for later messages.
    assert_eq!(count(&conn, "SELECT n FROM my_table"), 0);
    room.shutdown(Duration::from_secs(10)).unwrap();
}

/// Refused SQL says which rule refused it, and is the handler's to fix:
/// dead at once rather than retried until dead.
#[test]
fn refused_sql_names_its_rule_and_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let room = open(dir.path());
    let answer = room.deliver("c", poison("p", "refused-pragma")).unwrap();
    assert!(
        matches!(answer, Outcome::Dead { attempts: 1, .. }),
        "{answer:?}"
    );
    assert!(
        error_of(&answer).contains("a handler may not change the connection: PRAGMA journal_mode"),
        "{answer:?}"
    );
    let closure = room.transaction(|tx| Ok(tx.execute_batch("COMMIT")?));
    let text = format!("{closure:?}");
    assert!(
        text.contains("may not end or control the transaction"),
        "{text}"
    );
    room.shutdown(Duration::from_secs(10)).unwrap();
}

/// Eight threads deliver at once, one poison of each kind among the
/// innocents: every innocent is answered exactly as if the poisons were
/// absent (`Processed`, once), round after round.
#[test]
fn an_eight_thread_group_with_poisons_answers_every_innocent_as_without_them() {
    let rounds = env_u64("POSTROOM_POISON_ROUNDS").unwrap_or(50);
    let dir = tempfile::tempdir().unwrap();
    let room = Arc::new(open(dir.path()));
    let per_thread = 6;
    for round in 0..rounds {
        std::thread::scope(|s| {
            for t in 0..8u64 {
                let room = Arc::clone(&room);
                s.spawn(move || {
                    for i in 0..per_thread {
                        // Thread t's message i is a poison on one thread per
                        // kind, the middle one.
                        let kind = POISONS.get(t as usize).filter(|_| i == per_thread / 2);
                        let id = format!("r{round}-t{t}-{i}");
                        let msg = match kind {
                            Some(kind) => poison(&id, kind),
                            None => innocent(&id),
                        };
                        let answer = room.deliver("c", msg);
                        match (kind, answer) {
                            (None, Ok(Outcome::Processed { attempts: 1 })) => {}
                            (None, other) => panic!("innocent {id} answered {other:?}"),
                            (Some(_), Ok(Outcome::Failed { .. } | Outcome::Dead { .. })) => {}
                            (Some(kind), other) => panic!("poison {kind} answered {other:?}"),
                        }
                    }
                });
            }
        });
    }
    let conn = raw(&dir.path().join("app.db"));
    let innocents = rounds as i64 * (8 * per_thread as i64 - POISONS.len() as i64);
    assert_eq!(
        count(
            &conn,
            "SELECT count(*) FROM applied WHERE CAST(payload AS TEXT) = 'fine'"
        ),
        innocents
    );
    assert_eq!(
        count(
            &conn,
            "SELECT count(*) FROM (SELECT message_id FROM applied GROUP BY message_id HAVING count(*) > 1)"
        ),
        0
    );
    assert_eq!(
        count(
            &conn,
            "SELECT count(*) FROM applied WHERE coalesce(CAST(payload AS TEXT), '') <> 'fine'"
        ),
        0
    );
    assert_eq!(count(&conn, "SELECT count(*) FROM child"), 0);
    Arc::try_unwrap(room)
        .ok()
        .unwrap()
        .shutdown(Duration::from_secs(10))
        .unwrap();
}
