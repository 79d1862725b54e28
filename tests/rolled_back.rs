//! Application SQL that makes SQLite roll the whole transaction back (a
//! trigger's `RAISE(ROLLBACK)`, `INSERT OR ROLLBACK`): the message's doing,
//! not the storage's. It is counted as a failed attempt (dead after
//! `max_attempts`), and the messages that shared its commit are not failed
//! with it.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use postroom::{handler_fn, Error, Failure, Message, Outcome, Postroom, Receipt, Tx};

/// A ledger whose trigger refuses a negative amount by rolling back the
/// whole transaction, as an application's own schema may.
const LEDGER: &str = "CREATE TABLE ledger (id TEXT PRIMARY KEY, amount INTEGER NOT NULL);
     CREATE TRIGGER ledger_no_negative BEFORE INSERT ON ledger
     WHEN NEW.amount < 0
     BEGIN SELECT RAISE(ROLLBACK, 'amount must not be negative'); END;";

fn book(tx: &mut Tx<'_>, msg: &Message) -> Result<(), Failure> {
    let amount: i64 = std::str::from_utf8(msg.payload())
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| Failure::reject("not a number"))?;
    tx.execute(
        "INSERT INTO ledger (id, amount) VALUES (?1, ?2)",
        rusqlite::params![msg.id(), amount],
    )?;
    Ok(())
}

fn open(dir: &std::path::Path) -> Postroom {
    let room = Postroom::builder()
        .max_attempts(3)
        .backoff(Duration::from_millis(1), Duration::from_millis(2))
        .poll_interval(Duration::from_millis(5))
        .consumer("pay", handler_fn(book))
        .open(dir.join("app.db"))
        .unwrap();
    room.transaction(|tx| {
        tx.execute_batch(LEDGER)?;
        Ok(())
    })
    .unwrap();
    room
}

fn last_error(dir: &std::path::Path, id: &str) -> (String, u32, String) {
    raw(&dir.join("app.db"))
        .query_row(
            "SELECT status, attempts, coalesce(last_error, '') FROM postroom_inbox
             WHERE message_id = ?1",
            [id],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap()
}

#[test]
fn a_handler_that_rolls_back_the_whole_transaction_is_dead_lettered_and_spares_its_group() {
    let dir = tempfile::tempdir().unwrap();
    let room = Arc::new(open(dir.path()));
    // Eight callers deliver valid messages while one redelivers the poison
    // until it may be acknowledged: they share group commits with it.
    let stop = Arc::new(AtomicBool::new(false));
    let failures = Arc::new(AtomicU64::new(0));
    let callers: Vec<_> = (0..8)
        .map(|t| {
            let (room, stop, failures) = (room.clone(), stop.clone(), failures.clone());
            thread::spawn(move || {
                let mut n = 0u64;
                while !stop.load(Ordering::Acquire) || n < 20 {
                    let msg = Message::new("s", format!("ok-{t}-{n}"), "5");
                    match room.deliver("pay", msg) {
                        Ok(Outcome::Processed { attempts: 1 }) => {}
                        other => {
                            eprintln!("valid message ok-{t}-{n}: {other:?}");
                            failures.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    n += 1;
                }
                n
            })
        })
        .collect();
    let poison = Message::new("s", "poison", "-5");
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut answers = Vec::new();
    let outcome = loop {
        let outcome = room
            .deliver("pay", poison.clone())
            .expect("the poison's delivery is answered, not failed as a storage error");
        answers.push(outcome.clone());
        if outcome.should_ack() {
            break outcome;
        }
        assert!(Instant::now() < deadline, "never dead: {answers:?}");
        thread::sleep(Duration::from_millis(3));
    };
    stop.store(true, Ordering::Release);
    let valid: u64 = callers.into_iter().map(|c| c.join().unwrap()).sum();
    let Outcome::Dead { attempts, error } = &outcome else {
        panic!("poison ended {outcome:?} after {answers:?}");
    };
    assert_eq!(*attempts, 3, "{answers:?}");
    assert!(
        error.contains("rolled back the whole transaction"),
        "{error}"
    );
    assert_eq!(
        failures.load(Ordering::Relaxed),
        0,
        "valid messages that shared the poison's commits failed with it"
    );
    let booked = count(
        &raw(&dir.path().join("app.db")),
        "SELECT count(*) FROM ledger",
    );
    assert_eq!(u64::try_from(booked).unwrap(), valid);
    let (status, attempts, last) = last_error(dir.path(), "poison");
    assert_eq!((status.as_str(), attempts), ("dead", 3), "{last}");
    // Its payload is kept for an operator.
    assert_eq!(room.dead_letters(Some("pay"), 10).unwrap().len(), 1);
}

#[test]
fn a_received_message_whose_handler_rolls_back_is_dead_lettered_and_frees_its_key() {
    let dir = tempfile::tempdir().unwrap();
    let room = Arc::new(open(dir.path()));
    let keyed = |id: &str, amount: &str| {
        Message::new("s", id, amount.to_owned()).with_ordering_key("acct-1")
    };
    let receipts = room
        .receive_batch(
            "pay",
            vec![keyed("poison", "-5"), keyed("after-poison", "7")],
        )
        .unwrap();
    assert_eq!(receipts, vec![Receipt::Accepted, Receipt::Accepted]);
    // Unrelated receipts meanwhile, one by one: none may fail while the
    // poison is retried beside them.
    let receiver = {
        let room = room.clone();
        thread::spawn(move || {
            (0..200)
                .map(|n| room.receive("pay", Message::new("s", format!("r{n}"), "1")))
                .filter(|r| !matches!(r, Ok(Receipt::Accepted)))
                .map(|r| format!("{r:?}"))
                .collect::<Vec<_>>()
        })
    };
    eventually(
        30,
        "the poison dead and every other message processed",
        || {
            let s = room.stats().unwrap();
            let c = &s.inbox["pay"];
            c.dead == 1 && c.completed == 201
        },
    );
    let refused = receiver.join().unwrap();
    assert!(refused.is_empty(), "receipts failed: {refused:?}");
    let (status, attempts, last) = last_error(dir.path(), "poison");
    assert_eq!((status.as_str(), attempts), ("dead", 3), "{last}");
    assert!(last.contains("rolled back the whole transaction"), "{last}");
    assert_eq!(last_error(dir.path(), "after-poison").0, "completed");
}

#[test]
fn a_transaction_whose_sql_rolls_back_says_so_and_is_not_called_retryable() {
    let dir = tempfile::tempdir().unwrap();
    let room = open(dir.path());
    let err = room
        .transaction(|tx| {
            tx.execute("INSERT INTO ledger (id, amount) VALUES ('x', -1)", [])?;
            Ok(())
        })
        .unwrap_err();
    assert!(matches!(err, Error::RolledBack { .. }), "{err:?}");
    assert!(!err.is_retryable(), "{err}");
    assert!(!err.to_string().contains("disk full"), "{err}");
    // The engine goes on.
    assert_eq!(
        room.deliver("pay", Message::new("s", "fine", "3")).unwrap(),
        Outcome::Processed { attempts: 1 }
    );
}

/// `transaction()` closures and effectful steps cannot run again, so a
/// batch runs them after everything that can: a queued handler that rolls
/// its batch back never undoes them.
#[test]
fn work_that_cannot_run_again_is_never_undone_by_a_batch_a_handler_rolled_back() {
    use postroom::{EffectContext, EffectHandler};
    struct Charge(Arc<AtomicU64>);
    impl EffectHandler for Charge {
        type Output = ();
        fn effect(&self, _: &EffectContext<'_>, _: &Message) -> Result<(), Failure> {
            self.0.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
        fn apply(&self, tx: &mut Tx<'_>, msg: &Message, (): ()) -> Result<(), Failure> {
            tx.execute(
                "INSERT INTO ledger (id, amount) VALUES (?1, 1)",
                [format!("fx-{}", msg.id())],
            )?;
            Ok(())
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let effects = Arc::new(AtomicU64::new(0));
    let room = Arc::new(
        Postroom::builder()
            .max_attempts(3)
            .workers(4)
            .backoff(Duration::from_millis(1), Duration::from_millis(2))
            .poll_interval(Duration::from_millis(5))
            .consumer("pay", handler_fn(book))
            .effectful_consumer("fx", Charge(effects.clone()))
            .open(dir.path().join("app.db"))
            .unwrap(),
    );
    room.transaction(|tx| {
        tx.execute_batch(LEDGER)?;
        tx.execute_batch("CREATE TABLE notes (n INTEGER)")?;
        Ok(())
    })
    .unwrap();
    let writers: Vec<_> = (0..4)
        .map(|t| {
            let room = room.clone();
            thread::spawn(move || {
                (0..150)
                    .filter_map(|n| {
                        room.transaction(move |tx| {
                            tx.execute("INSERT INTO notes (n) VALUES (?1)", [t * 1000 + n])?;
                            Ok(())
                        })
                        .err()
                        .map(|e| format!("{e} (retryable: {})", e.is_retryable()))
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for n in 0..40 {
        room.receive("pay", Message::new("s", format!("poison-{n}"), "-1"))
            .unwrap();
        room.receive("fx", Message::new("s", format!("charge-{n}"), "x"))
            .unwrap();
        thread::sleep(Duration::from_millis(2));
    }
    let failed: Vec<String> = writers
        .into_iter()
        .flat_map(|w| w.join().unwrap())
        .collect();
    assert!(
        failed.is_empty(),
        "{} transactions failed, the first: {:?}",
        failed.len(),
        failed.first()
    );
    eventually(30, "every poison dead, every charge applied", || {
        let s = room.stats().unwrap();
        s.inbox["pay"].dead == 40 && s.inbox["fx"].completed == 40
    });
    let conn = raw(&dir.path().join("app.db"));
    assert_eq!(count(&conn, "SELECT count(*) FROM notes"), 600);
    assert_eq!(
        effects.load(Ordering::Relaxed),
        40,
        "an effect ran again: its apply was undone by another message's rollback"
    );
    assert_eq!(
        count(
            &conn,
            "SELECT count(*) FROM postroom_inbox WHERE consumer = 'fx' AND attempts != 1"
        ),
        0
    );
}

/// A handler that passes on a storage error (here: its own attached
/// database is read-only) fails its message, not the storage: its row is
/// held back, uncounted, and every other row goes on.
#[test]
fn a_queued_row_whose_handler_passes_on_a_storage_error_does_not_stop_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let stuck = |tx: &mut Tx<'_>, msg: &Message| -> Result<(), Failure> {
        if msg.id() == "stuck" {
            return Err(Failure::Sqlite(rusqlite::Error::SqliteFailure(
                rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_READONLY),
                Some("attempt to write a readonly database".into()),
            )));
        }
        book(tx, msg)
    };
    let room = Postroom::builder()
        .backoff(Duration::from_millis(50), Duration::from_millis(100))
        .poll_interval(Duration::from_millis(5))
        .consumer("a", handler_fn(stuck))
        .consumer("b", handler_fn(book))
        .open(dir.path().join("app.db"))
        .unwrap();
    room.transaction(|tx| {
        tx.execute_batch(LEDGER)?;
        Ok(())
    })
    .unwrap();
    let mut a = vec![Message::new("s", "stuck", "1")];
    a.extend((0..5).map(|n| Message::new("s", format!("a{n}"), "1")));
    room.receive_batch("a", a).unwrap();
    room.receive_batch("b", (0..5).map(|n| Message::new("s", format!("b{n}"), "1")))
        .unwrap();
    eventually(10, "every other row processed", || {
        let s = room.stats().unwrap();
        s.inbox["a"].completed == 5 && s.inbox["b"].completed == 5
    });
    let (status, attempts, _) = last_error(dir.path(), "stuck");
    assert_eq!((status.as_str(), attempts), ("pending", 0));
}
