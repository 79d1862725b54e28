//! Inline delivery: the state machine of docs/DESIGN.md ("How it works") on real SQLite files.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::Duration;

use common::*;
use postroom::{handler_fn, Failure, ManualClock, Message, Outcome, Outgoing, Postroom};

/// Inline tests run without workers: they would otherwise retry failed
/// rows in the background and race the test's own redeliveries.
fn open(dir: &tempfile::TempDir, builder: postroom::Builder) -> Postroom {
    let room = builder
        .workers(0)
        .open(dir.path().join("app.db"))
        .expect("open");
    create_domain(&room);
    room
}

/// Seed test 2: the same message from ten threads at once. The handler's
/// effect happens exactly once; the others are told Duplicate; no error.
#[test]
fn ten_threads_delivering_the_same_message_apply_it_once() {
    let dir = tempfile::tempdir().unwrap();
    let calls = Arc::new(AtomicU32::new(0));
    let c = Arc::clone(&calls);
    let room = open(
        &dir,
        Postroom::builder().consumer(
            "orders",
            handler_fn(move |tx, msg| {
                c.fetch_add(1, Ordering::SeqCst);
                // Widen the window in which a racing duplicate could slip by.
                thread::sleep(Duration::from_millis(20));
                apply(tx, msg)
            }),
        ),
    );
    for round in 0..5 {
        let id = format!("evt-{round}");
        let barrier = Barrier::new(10);
        let outcomes: Vec<_> = thread::scope(|s| {
            let handles: Vec<_> = (0..10)
                .map(|_| {
                    s.spawn(|| {
                        barrier.wait();
                        room.deliver("orders", Message::new("broker", id.clone(), "pay"))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let outcomes: Vec<Outcome> = outcomes
            .into_iter()
            .map(|r| r.expect("no error surfaces from a duplicate race"))
            .collect();
        let processed = outcomes
            .iter()
            .filter(|o| matches!(o, Outcome::Processed { .. }))
            .count();
        assert_eq!(processed, 1, "{outcomes:?}");
        assert!(
            outcomes
                .iter()
                .all(|o| matches!(o, Outcome::Processed { .. } | Outcome::Duplicate)),
            "{outcomes:?}"
        );
        let conn = raw(room.path());
        assert_eq!(applied_count(&conn, &id), 1);
        assert_eq!(
            count(
                &conn,
                &format!("SELECT count(*) FROM postroom_outbox WHERE cause_message_id = '{id}'")
            ),
            1
        );
    }
    assert_eq!(calls.load(Ordering::SeqCst), 5);
}

/// Seed test 3: a failing handler leaves the row `failed` with the error
/// stored; its writes are rolled back; attempts increment on the next
/// delivery; an early redelivery is answered without running the handler.
#[test]
fn handler_failure_is_recorded_and_retried_with_backoff() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(start_ms());
    let failing = Arc::new(AtomicBool::new(true));
    let calls = Arc::new(AtomicU32::new(0));
    let (f, c) = (Arc::clone(&failing), Arc::clone(&calls));
    let room = open(
        &dir,
        Postroom::builder().clock(clock.clone()).consumer(
            "orders",
            handler_fn(move |tx, msg| {
                c.fetch_add(1, Ordering::SeqCst);
                apply(tx, msg)?; // written, then rolled back on failure
                if f.load(Ordering::SeqCst) {
                    return Err(Failure::retry("payment gateway timed out"));
                }
                Ok(())
            }),
        ),
    );
    let msg = Message::new("broker", "evt-1", "pay");
    let conn = raw(room.path());

    let first = room.deliver("orders", msg.clone()).unwrap();
    let Outcome::Failed {
        attempts,
        error,
        retry_after,
    } = &first
    else {
        panic!("expected Failed, got {first:?}")
    };
    assert_eq!(
        (*attempts, error.as_str()),
        (1, "payment gateway timed out")
    );
    assert!(*retry_after >= Duration::from_millis(500) && *retry_after <= Duration::from_secs(1));
    assert!(!first.should_ack());
    let (status, attempts, last_error, payload) =
        inbox_row(&conn, "orders", "broker", "evt-1").unwrap();
    assert_eq!(status, "failed");
    assert_eq!(attempts, 1);
    assert_eq!(last_error.as_deref(), Some("payment gateway timed out"));
    assert_eq!(
        payload.as_deref(),
        Some(&b"pay"[..]),
        "failed rows keep their payload"
    );
    assert_eq!(
        applied_count(&conn, "evt-1"),
        0,
        "failed attempt's writes rolled back"
    );
    assert_eq!(count(&conn, "SELECT count(*) FROM postroom_outbox"), 0);

    // The broker redelivers early: backoff is honoured, the handler not run.
    clock.advance(Duration::from_millis(100));
    let early = room.deliver("orders", msg.clone()).unwrap();
    assert!(
        matches!(early, Outcome::Failed { attempts: 1, .. }),
        "{early:?}"
    );
    assert!(early.retry_after().unwrap() < *retry_after);
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    // Once due, it runs again and attempts increment.
    clock.advance(Duration::from_secs(1));
    let second = room.deliver("orders", msg.clone()).unwrap();
    assert!(
        matches!(second, Outcome::Failed { attempts: 2, .. }),
        "{second:?}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(inbox_row(&conn, "orders", "broker", "evt-1").unwrap().1, 2);

    failing.store(false, Ordering::SeqCst);
    clock.advance(Duration::from_secs(2));
    assert_eq!(
        room.deliver("orders", msg.clone()).unwrap(),
        Outcome::Processed { attempts: 3 }
    );
    assert_eq!(room.deliver("orders", msg).unwrap(), Outcome::Duplicate);
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    assert_eq!(applied_count(&conn, "evt-1"), 1);
    let (status, attempts, last_error, payload) =
        inbox_row(&conn, "orders", "broker", "evt-1").unwrap();
    assert_eq!(
        (status.as_str(), attempts, last_error, payload),
        ("completed", 3, None, None)
    );
}

/// Seed test 5: a row whose attempts are above the cap is dead-lettered on
/// its next delivery, without running the handler, and stays dead.
#[test]
fn attempts_above_the_cap_go_dead_without_running_the_handler() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(start_ms());
    let calls = Arc::new(AtomicU32::new(0));
    let c = Arc::clone(&calls);
    let room = open(
        &dir,
        Postroom::builder()
            .clock(clock.clone())
            .max_attempts(3)
            .consumer(
                "orders",
                handler_fn(move |_, _| {
                    c.fetch_add(1, Ordering::SeqCst);
                    Err(Failure::retry("still broken"))
                }),
            ),
    );
    let conn = raw(room.path());
    let msg = Message::new("broker", "evt-1", "pay");
    assert!(matches!(
        room.deliver("orders", msg.clone()).unwrap(),
        Outcome::Failed { attempts: 1, .. }
    ));
    conn.execute("UPDATE postroom_inbox SET attempts = 10", [])
        .unwrap();
    clock.advance(Duration::from_secs(3600));
    let outcome = room.deliver("orders", msg.clone()).unwrap();
    let Outcome::Dead {
        attempts: 10,
        error,
    } = &outcome
    else {
        panic!("{outcome:?}")
    };
    assert!(
        error.contains("attempts exhausted") && error.contains("still broken"),
        "{error}"
    );
    assert!(outcome.should_ack());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let (status, _, _, payload) = inbox_row(&conn, "orders", "broker", "evt-1").unwrap();
    assert_eq!(status, "dead");
    assert_eq!(
        payload.as_deref(),
        Some(&b"pay"[..]),
        "dead letters keep their payload"
    );

    // And the ordinary way there: the third failing attempt is the last.
    let msg2 = Message::new("broker", "evt-2", "pay");
    for n in 1..=2 {
        assert!(
            matches!(room.deliver("orders", msg2.clone()).unwrap(), Outcome::Failed { attempts, .. } if attempts == n)
        );
        clock.advance(Duration::from_secs(3600));
    }
    assert!(matches!(
        room.deliver("orders", msg2.clone()).unwrap(),
        Outcome::Dead { attempts: 3, .. }
    ));
    clock.advance(Duration::from_secs(3600));
    assert!(matches!(
        room.deliver("orders", msg2).unwrap(),
        Outcome::Dead { attempts: 3, .. }
    ));
    assert_eq!(calls.load(Ordering::SeqCst), 4, "no retries after dead");
}

#[test]
fn rejected_and_undecodable_messages_are_dead_at_once_with_payload() {
    let dir = tempfile::tempdir().unwrap();
    #[derive(serde::Deserialize)]
    struct Paid {
        #[allow(dead_code)]
        order_id: i64,
    }
    let room = open(
        &dir,
        Postroom::builder()
            .consumer(
                "json",
                handler_fn(|tx, msg| {
                    let _: Paid = msg.json()?;
                    apply(tx, msg)
                }),
            )
            .consumer(
                "strict",
                handler_fn(|tx, msg| {
                    apply(tx, msg)?;
                    Err(Failure::reject("amount must be positive"))
                }),
            ),
    );
    let conn = raw(room.path());
    let outcome = room
        .deliver("json", Message::new("b", "m1", "{not json"))
        .unwrap();
    let Outcome::Dead { attempts: 1, error } = &outcome else {
        panic!("{outcome:?}")
    };
    assert!(error.starts_with("invalid JSON"), "{error}");
    let outcome = room
        .deliver("strict", Message::new("b", "m2", "-5"))
        .unwrap();
    assert_eq!(
        outcome,
        Outcome::Dead {
            attempts: 1,
            error: "amount must be positive".into()
        }
    );
    assert_eq!(count(&conn, "SELECT count(*) FROM applied"), 0);
    assert_eq!(
        inbox_row(&conn, "strict", "b", "m2").unwrap().3.as_deref(),
        Some(&b"-5"[..])
    );
    // Valid JSON for the first consumer still flows.
    assert!(room
        .deliver("json", Message::new("b", "m3", r#"{"order_id": 1}"#))
        .unwrap()
        .should_ack());
}

#[test]
fn a_panicking_handler_is_a_counted_retryable_failure_and_the_engine_carries_on() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(start_ms());
    let room = open(
        &dir,
        Postroom::builder().clock(clock.clone()).consumer(
            "c",
            handler_fn(|tx, msg| {
                apply(tx, msg)?;
                if msg.payload() == b"boom" {
                    panic!("index out of range in handler");
                }
                Ok(())
            }),
        ),
    );
    let outcome = room.deliver("c", Message::new("b", "p", "boom")).unwrap();
    let Outcome::Failed {
        attempts: 1, error, ..
    } = &outcome
    else {
        panic!("{outcome:?}")
    };
    assert!(
        error.contains("panicked") && error.contains("index out of range"),
        "{error}"
    );
    let conn = raw(room.path());
    assert_eq!(
        applied_count(&conn, "p"),
        0,
        "the panicking attempt's writes are rolled back"
    );
    assert_eq!(
        room.deliver("c", Message::new("b", "q", "fine")).unwrap(),
        Outcome::Processed { attempts: 1 }
    );
    assert_eq!(applied_count(&conn, "q"), 1);
}

/// Quarantined deliveries do not pile up for ever: `conflict_retention`
/// deletes those last seen before it, an operator can discard one, and
/// neither gives a conflict id out again (a caller logged it).
#[test]
fn conflicts_expire_or_are_discarded_without_reusing_ids() {
    const MINUTE: Duration = Duration::from_secs(60);
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(start_ms());
    let room = open(
        &dir,
        Postroom::builder()
            .clock(clock.clone())
            .reaper_interval(Duration::from_secs(3600))
            .conflict_retention(Some(60 * MINUTE))
            .consumer("c", handler_fn(apply)),
    );
    let conn = raw(room.path());
    let conflict = |id: &str| match room.deliver("c", Message::new("b", id, "2")).unwrap() {
        Outcome::Conflict { conflict_id } => conflict_id,
        other => panic!("{other:?}"),
    };
    let listed = || {
        postroom::admin::conflicts_list(&conn, postroom::admin::Page::all())
            .unwrap()
            .into_iter()
            .map(|c| c.id)
            .collect::<Vec<_>>()
    };
    for id in ["a", "b", "c", "d"] {
        room.deliver("c", Message::new("b", id, "1")).unwrap();
    }
    let a = conflict("a");
    let b = conflict("b");
    clock.advance(30 * MINUTE);
    assert_eq!(conflict("b"), b, "seen again: last seen now");
    clock.advance(45 * MINUTE);
    let report = room.cleanup().unwrap();
    assert_eq!(report.conflicts_deleted, 1);
    assert_eq!(listed(), [b], "a, last seen 75 minutes ago, is gone");

    assert!(postroom::admin::conflicts_discard(&conn, b).unwrap());
    assert!(!postroom::admin::conflicts_discard(&conn, b).unwrap());
    assert!(listed().is_empty());
    let c = conflict("c");
    assert!(c > b, "conflict id {c} given out again (a = {a}, b = {b})");
    clock.advance(120 * MINUTE);
    assert_eq!(room.cleanup().unwrap().conflicts_deleted, 1);
    assert!(conflict("d") > c);
    assert_eq!(
        room.deliver("c", Message::new("b", "a", "1")).unwrap(),
        Outcome::Duplicate,
        "the stored messages are untouched"
    );
    assert!(
        postroom::admin::check(&conn, postroom::admin::CheckDepth::Quick)
            .unwrap()
            .is_ok()
    );
}

/// Same id, different payload: the stored message is untouched, the new
/// delivery quarantined whole, the caller told and allowed to ack.
#[test]
fn same_id_with_a_different_payload_is_quarantined() {
    let dir = tempfile::tempdir().unwrap();
    let calls = Arc::new(AtomicU32::new(0));
    let c = Arc::clone(&calls);
    let room = open(
        &dir,
        Postroom::builder().keep_payloads(true).consumer(
            "c",
            handler_fn(move |tx, msg| {
                c.fetch_add(1, Ordering::SeqCst);
                apply(tx, msg)
            }),
        ),
    );
    let conn = raw(room.path());
    assert!(room
        .deliver("c", Message::new("b", "id", "amount=10"))
        .unwrap()
        .should_ack());
    let before: (Vec<u8>, Vec<u8>) = conn
        .query_row(
            "SELECT payload, payload_hash FROM postroom_inbox",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();

    let bad = Message::new("b", "id", "amount=99").with_header("producer", "buggy");
    let outcome = room.deliver("c", bad.clone()).unwrap();
    let Outcome::Conflict { conflict_id } = outcome else {
        panic!("{outcome:?}")
    };
    assert!(outcome.should_ack());
    let again = room.deliver("c", bad).unwrap();
    assert_eq!(
        again,
        Outcome::Conflict { conflict_id },
        "a repeat bumps the same row"
    );
    assert_eq!(
        room.deliver("c", Message::new("b", "id", "amount=10"))
            .unwrap(),
        Outcome::Duplicate
    );

    let after: (Vec<u8>, Vec<u8>) = conn
        .query_row(
            "SELECT payload, payload_hash FROM postroom_inbox",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!(before, after, "stored message untouched");
    let (payload, headers, deliveries, stored_hash, hash): (Vec<u8>, String, i64, Vec<u8>, Vec<u8>) = conn
        .query_row(
            "SELECT payload, headers, deliveries, stored_hash, payload_hash FROM postroom_conflicts WHERE id = ?1",
            [conflict_id],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)),
        )
        .unwrap();
    assert_eq!(payload, b"amount=99");
    assert!(headers.contains("buggy"));
    assert_eq!(deliveries, 2);
    assert_eq!(stored_hash, before.1);
    assert_eq!(hash, blake3::hash(b"amount=99").as_bytes());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(applied_count(&conn, "id"), 1);
    assert_eq!(room.stats().unwrap().conflicts, 1);
}

/// Outbox rows are written in the handler's transaction, with ids that are
/// stable across attempts (a rolled-back attempt and the committing one
/// publish the same ids) and link back to the inbox message.
#[test]
fn published_messages_have_stable_ids_and_causation() {
    static KEYS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(start_ms());
    let ids = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let seen = Arc::clone(&ids);
    let room = open(
        &dir,
        Postroom::builder().clock(clock.clone()).consumer(
            "c",
            handler_fn(move |tx, msg| {
                let a = tx.publish(Outgoing::new("shipping.requested", "a").with_key("order-7"))?;
                let b = tx.publish(Outgoing::new("email.send", "b").with_header("x", "1"))?;
                seen.lock().unwrap().extend([a, b]);
                KEYS.lock().unwrap().push(tx.idempotency_key().unwrap());
                if tx.attempt() == 1 && msg.id() == "evt-9" {
                    return Err(Failure::retry_after("flaky", Duration::ZERO));
                }
                Ok(())
            }),
        ),
    );
    let msg = Message::new("b", "evt-9", "x").with_header("correlation-id", "saga-1");
    assert!(matches!(
        room.deliver("c", msg.clone()).unwrap(),
        Outcome::Failed { .. }
    ));
    assert_eq!(
        room.deliver("c", msg).unwrap(),
        Outcome::Processed { attempts: 2 }
    );
    assert!(room
        .deliver("c", Message::new("b", "evt-10", "x"))
        .unwrap()
        .should_ack());
    let keys = KEYS.lock().unwrap().clone();
    assert_eq!(keys.len(), 3);
    assert_eq!(keys[0].len(), 32);
    assert_eq!(
        keys[0], keys[1],
        "the idempotency key is stable across attempts"
    );
    assert_ne!(keys[1], keys[2], "and distinct per message");
    let mut ids = ids.lock().unwrap().clone();
    ids.truncate(4);
    assert_eq!(ids.len(), 4);
    assert_eq!(ids[0..2], ids[2..4], "ids are the same on every attempt");
    assert_ne!(ids[0], ids[1]);

    let conn = raw(room.path());
    let mut stmt = conn
        .prepare(
            "SELECT message_id, topic, key, status, headers, cause_consumer, cause_source, cause_message_id
             FROM postroom_outbox WHERE cause_message_id = 'evt-9' ORDER BY seq",
        )
        .unwrap();
    type OutboxRow = (
        String,
        String,
        Option<String>,
        String,
        String,
        String,
        String,
        String,
    );
    let rows: Vec<OutboxRow> = stmt
        .query_map([], |r| {
            Ok((
                r.get(0)?,
                r.get(1)?,
                r.get(2)?,
                r.get(3)?,
                r.get(4)?,
                r.get(5)?,
                r.get(6)?,
                r.get(7)?,
            ))
        })
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(rows.len(), 2, "only the committing attempt leaves rows");
    assert_eq!(rows[0].0, ids[0]);
    assert_eq!(rows[0].1, "shipping.requested");
    assert_eq!(rows[0].2.as_deref(), Some("order-7"));
    assert_eq!(rows[1].0, ids[1]);
    for row in &rows {
        assert_eq!(row.3, "pending");
        assert_eq!(
            (row.5.as_str(), row.6.as_str(), row.7.as_str()),
            ("c", "b", "evt-9")
        );
        let headers: serde_json::Value = serde_json::from_str(&row.4).unwrap();
        assert_eq!(headers["causation-id"], "evt-9");
        assert_eq!(headers["correlation-id"], "saga-1");
    }
    assert_eq!(room.stats().unwrap().outbox.pending, 4);
}

/// Concurrent callers share commits: with eight threads delivering, the
/// writer commits several jobs per transaction, and every message is
/// applied exactly once.
#[test]
fn concurrent_deliveries_are_group_committed() {
    let dir = tempfile::tempdir().unwrap();
    let room = open(
        &dir,
        Postroom::builder()
            .workers(0)
            // No reaper pass meanwhile: its jobs would count too (under
            // qemu or a loaded host the test outlasts the 5 s default).
            .reaper_interval(Duration::from_secs(3600))
            .consumer(
                "c",
                handler_fn(|tx, msg| {
                    thread::sleep(Duration::from_micros(200));
                    apply(tx, msg)
                }),
            ),
    );
    thread::scope(|s| {
        for t in 0..8 {
            let room = &room;
            s.spawn(move || {
                for i in 0..100 {
                    let out = room
                        .deliver("c", Message::new("b", format!("{t}-{i}"), "x"))
                        .unwrap();
                    assert_eq!(out, Outcome::Processed { attempts: 1 });
                }
            });
        }
    });
    let stats = room.stats().unwrap();
    assert_eq!(stats.inbox["c"].completed, 800);
    assert_eq!(stats.outbox.pending, 800);
    let conn = raw(room.path());
    assert_eq!(count(&conn, "SELECT count(*) FROM applied"), 800);
    assert_eq!(
        count(&conn, "SELECT count(DISTINCT message_id) FROM applied"),
        800
    );
    // 800 deliveries + 1 schema transaction (no workers: no claim jobs).
    assert_eq!(stats.jobs_committed, 801);
    assert!(
        stats.batches_committed < 700,
        "expected group commit to share transactions: {} batches for {} jobs",
        stats.batches_committed,
        stats.jobs_committed
    );
}

#[test]
fn consumers_have_separate_dedupe_namespaces_and_sources_too() {
    let dir = tempfile::tempdir().unwrap();
    let room = open(
        &dir,
        Postroom::builder()
            .consumer("a", handler_fn(apply))
            .consumer("b", handler_fn(apply)),
    );
    let m = Message::new("s1", "same-id", "x");
    assert!(matches!(
        room.deliver("a", m.clone()).unwrap(),
        Outcome::Processed { .. }
    ));
    assert!(matches!(
        room.deliver("b", m.clone()).unwrap(),
        Outcome::Processed { .. }
    ));
    assert!(matches!(
        room.deliver("a", Message::new("s2", "same-id", "y"))
            .unwrap(),
        Outcome::Processed { .. }
    ));
    assert_eq!(room.deliver("a", m).unwrap(), Outcome::Duplicate);
    let stats = room.stats().unwrap();
    assert_eq!(stats.inbox["a"].completed, 2);
    assert_eq!(stats.inbox["b"].completed, 1);
}

/// An engine whose handler runs the payload as SQL after its domain write.
fn sql_running_engine(dir: &tempfile::TempDir) -> Postroom {
    open(
        dir,
        Postroom::builder().consumer(
            "c",
            handler_fn(|tx, msg| {
                apply(tx, msg)?;
                let sql = std::str::from_utf8(msg.payload()).unwrap();
                if !sql.is_empty() {
                    tx.execute_batch(sql)?;
                }
                Ok(())
            }),
        ),
    )
}

/// Delivers each statement as a message: each is dead at once, "not
/// authorized" with the rule named, and commits nothing of itself.
fn assert_refused(room: &Postroom, prefix: &str, statements: &[&str]) {
    let conn = raw(room.path());
    for (i, sql) in statements.iter().enumerate() {
        let id = format!("{prefix}{i}");
        let outcome = room
            .deliver("c", Message::new("b", id.clone(), *sql))
            .unwrap();
        // Dead at once: the same SQL is refused the same way on every
        // attempt; the answer names the rule.
        let Outcome::Dead { error, attempts: 1 } = &outcome else {
            panic!("{sql}: {outcome:?}")
        };
        assert!(error.contains("not authorized"), "{sql}: {error}");
        assert!(error.contains("a handler may not"), "{sql}: {error}");
        assert_eq!(
            applied_count(&conn, &id),
            0,
            "{sql}: nothing of the attempt committed"
        );
    }
}

#[test]
fn a_handler_cannot_end_the_engines_transaction() {
    let dir = tempfile::tempdir().unwrap();
    let room = sql_running_engine(&dir);
    assert_refused(
        &room,
        "m",
        &[
            "COMMIT",
            "ROLLBACK",
            "BEGIN",
            "RELEASE postroom_job",
            "ROLLBACK TO postroom_handler",
            "SAVEPOINT postroom_handler",
        ],
    );
    let conn = raw(room.path());
    // A handler's own savepoints are its business.
    let ok = room
        .deliver(
            "c",
            Message::new("b", "own", "SAVEPOINT mine; RELEASE mine;"),
        )
        .unwrap();
    assert_eq!(ok, Outcome::Processed { attempts: 1 });
    assert_eq!(applied_count(&conn, "own"), 1);
    // So are transaction closures.
    let err = room
        .transaction(|tx| {
            tx.execute_batch("COMMIT")?;
            Ok(())
        })
        .unwrap_err();
    assert!(err.to_string().contains("not authorized"), "{err}");
}

#[test]
fn a_handler_cannot_change_how_the_engine_commits() {
    let dir = tempfile::tempdir().unwrap();
    let room = sql_running_engine(&dir);
    assert_refused(
        &room,
        "p",
        &[
            "PRAGMA synchronous = OFF",
            "pragma Synchronous=0",
            "PRAGMA wal_autocheckpoint = 0",
            "PRAGMA journal_mode = DELETE",
            "PRAGMA locking_mode = EXCLUSIVE",
            "PRAGMA wal_checkpoint",
            "PRAGMA wal_checkpoint(TRUNCATE)",
            // Connection state too: the allowlist sets none of it.
            "PRAGMA cache_size = -4000",
        ],
    );
    // Reading them, and setting the application's header fields, is the
    // handler's business.
    let ok = room
        .deliver(
            "c",
            Message::new("b", "reads", "PRAGMA synchronous; PRAGMA user_version = 3;"),
        )
        .unwrap();
    assert_eq!(ok, Outcome::Processed { attempts: 1 });
    assert_eq!(applied_count(&raw(room.path()), "reads"), 1);
}

#[test]
fn calling_the_engine_from_its_own_handler_is_an_error_not_a_deadlock() {
    fn refused_as_caller(e: Option<&postroom::Error>) -> bool {
        matches!(
            e,
            Some(postroom::Error::InvalidInput {
                field: "caller",
                ..
            })
        )
    }
    let dir = tempfile::tempdir().unwrap();
    let slot: Arc<std::sync::OnceLock<std::sync::Weak<Postroom>>> = Default::default();
    let s = Arc::clone(&slot);
    let room = Arc::new(
        Postroom::builder()
            .consumer(
                "c",
                handler_fn(move |_, msg| {
                    let room = s.get().and_then(|w| w.upgrade()).expect("engine");
                    let inner = room.deliver("c", Message::new("b", "inner", "x"));
                    if !refused_as_caller(inner.as_ref().err()) {
                        return Err(Failure::reject(format!("deliver: {inner:?}")));
                    }
                    if msg.id() == "stop" {
                        let stop = room.shutdown(Duration::from_secs(1));
                        if !refused_as_caller(stop.as_ref().err()) {
                            return Err(Failure::reject(format!("shutdown: {stop:?}")));
                        }
                    }
                    Ok(())
                }),
            )
            .open(dir.path().join("app.db"))
            .unwrap(),
    );
    slot.set(Arc::downgrade(&room)).unwrap();
    assert_eq!(
        room.deliver("c", Message::new("b", "outer", "x")).unwrap(),
        Outcome::Processed { attempts: 1 }
    );
    // Shutting down from inside a handler cannot wait for itself either: it
    // is refused, the engine stops after that batch, and the delivery that
    // asked still commits.
    assert_eq!(
        room.deliver("c", Message::new("b", "stop", "x")).unwrap(),
        Outcome::Processed { attempts: 1 }
    );
    assert!(matches!(
        room.deliver("c", Message::new("b", "after", "x")),
        Err(postroom::Error::Closed)
    ));
    let conn = raw(room.path());
    assert_eq!(
        count(
            &conn,
            "SELECT count(*) FROM postroom_inbox WHERE status = 'completed'"
        ),
        2
    );
}

/// A handler may deliver into another engine (the refusal above is per
/// engine, not per thread): the inner delivery runs on the same thread,
/// nested in the outer batch, and both commit. The inner engine is also
/// busy with other callers, so the nested call may have to queue.
#[test]
fn a_handler_may_deliver_into_another_engine() {
    let dir = tempfile::tempdir().unwrap();
    let inner = Arc::new(
        Postroom::builder()
            .consumer("in", handler_fn(|_, _| Ok(())))
            .open(dir.path().join("inner.db"))
            .unwrap(),
    );
    let target = Arc::clone(&inner);
    let outer = Postroom::builder()
        .consumer(
            "out",
            handler_fn(move |_, msg| {
                let copy = Message::new("outer", msg.id(), msg.payload().to_vec());
                match target.deliver("in", copy) {
                    Ok(Outcome::Processed { .. } | Outcome::Duplicate) => Ok(()),
                    other => Err(Failure::reject(format!("inner deliver: {other:?}"))),
                }
            }),
        )
        .open(dir.path().join("outer.db"))
        .unwrap();
    let busy = Arc::clone(&inner);
    let background = thread::spawn(move || {
        for i in 0..200 {
            busy.deliver("in", Message::new("side", format!("s{i}"), "x"))
                .unwrap();
        }
    });
    for i in 0..200 {
        let outcome = outer
            .deliver("out", Message::new("src", format!("m{i}"), "x"))
            .unwrap();
        assert_eq!(outcome, Outcome::Processed { attempts: 1 }, "m{i}");
    }
    background.join().unwrap();
    let sql = "SELECT count(*) FROM postroom_inbox WHERE status = 'completed'";
    assert_eq!(count(&raw(outer.path()), sql), 200);
    assert_eq!(count(&raw(inner.path()), sql), 400);
}

#[test]
fn shutdown_joins_the_writer_and_releases_the_database() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let room = Postroom::builder()
        .consumer("c", handler_fn(|_, _| Ok(())))
        .open(&path)
        .unwrap();
    assert!(matches!(
        Postroom::builder().open(&path),
        Err(postroom::Error::AlreadyOpen { .. })
    ));
    room.deliver("c", Message::new("b", "1", "x")).unwrap();
    let report = room.shutdown(Duration::from_secs(5)).unwrap();
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(
        report.joined,
        [
            "postroom-dispatcher",
            "postroom-worker-0",
            "postroom-worker-1",
            "postroom-reaper",
            "postroom-checkpointer",
            "postroom-writer"
        ]
    );
    assert!(matches!(
        room.deliver("c", Message::new("b", "2", "x")),
        Err(postroom::Error::Closed)
    ));
    assert!(matches!(room.stats(), Err(postroom::Error::Closed)));
    assert!(matches!(
        room.shutdown(Duration::from_secs(1)),
        Err(postroom::Error::Closed)
    ));
    // The lock went with the writer: the file opens again, state intact.
    let again = Postroom::builder()
        .consumer("c", handler_fn(|_, _| Ok(())))
        .open(&path)
        .unwrap();
    assert_eq!(
        again.deliver("c", Message::new("b", "1", "x")).unwrap(),
        Outcome::Duplicate
    );
    drop(again);
    // Drop shut it down too.
    Postroom::builder().open(&path).unwrap();
}

#[test]
fn durability_sets_the_writer_connections_synchronous_pragma() {
    for (durability, expected) in [(None, 2i64), (Some(postroom::Durability::Normal), 1)] {
        let dir = tempfile::tempdir().unwrap();
        let mut builder = Postroom::builder().consumer("c", handler_fn(apply));
        if let Some(d) = durability {
            builder = builder.durability(d);
        }
        let room = open(&dir, builder);
        let (sync, journal, fk): (i64, String, i64) = room
            .transaction(|tx| {
                Ok((
                    tx.query_row("PRAGMA synchronous", [], |r| r.get(0))?,
                    tx.query_row("PRAGMA journal_mode", [], |r| r.get(0))?,
                    tx.query_row("PRAGMA foreign_keys", [], |r| r.get(0))?,
                ))
            })
            .unwrap();
        assert_eq!(
            (sync, journal.as_str(), fk),
            (expected, "wal", 1),
            "{durability:?}"
        );
        for i in 0..20 {
            assert!(room
                .deliver("c", Message::new("b", i.to_string(), "x"))
                .unwrap()
                .should_ack());
        }
        assert_eq!(room.stats().unwrap().inbox["c"].completed, 20);
    }
}

/// The engine's own `COMMIT` sits in the statement cache; a handler that
/// asks `prepare_cached` for it is not handed the engine's statement (a
/// cache hit skips the authorizer) but prepares its own, which is refused:
/// nothing is committed, and the message is processed as usual.
#[test]
fn a_cached_commit_from_a_handler_commits_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let room = open(
        &dir,
        Postroom::builder().consumer(
            "c",
            handler_fn(|tx, msg| {
                apply(tx, msg)?;
                if msg.id() == "evil" {
                    let refused = tx.prepare_cached("COMMIT").and_then(|mut s| s.execute([]));
                    let e = refused.expect_err("COMMIT from a handler");
                    assert!(e.to_string().contains("not authorized"), "{e}");
                }
                Ok(())
            }),
        ),
    );
    room.deliver("c", Message::new("b", "warm", "x")).unwrap(); // COMMIT is cached now
    for _ in 0..2 {
        let outcome = room.deliver("c", Message::new("b", "evil", "x")).unwrap();
        assert!(
            matches!(
                outcome,
                Outcome::Processed { attempts: 1 } | Outcome::Duplicate
            ),
            "{outcome:?}"
        );
    }
    let conn = raw(room.path());
    assert_eq!(applied_count(&conn, "evil"), 1);
    assert_eq!(applied_count(&conn, "warm"), 1);
    assert!(room
        .deliver("c", Message::new("b", "next", "x"))
        .unwrap()
        .should_ack());
}

/// Callers racing a shutdown get an answer (`Closed` or their outcome);
/// none is left waiting for a job that landed behind the stop.
#[test]
fn shutdown_while_callers_deliver_leaves_nobody_waiting() {
    for round in 0..30 {
        let dir = tempfile::tempdir().unwrap();
        let room = Arc::new(
            Postroom::builder()
                .max_batch(1)
                .consumer(
                    "c",
                    handler_fn(|_, _| {
                        thread::sleep(Duration::from_micros(200));
                        Ok(())
                    }),
                )
                .open(dir.path().join("app.db"))
                .unwrap(),
        );
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        for t in 0..8 {
            let room = Arc::clone(&room);
            let done_tx = done_tx.clone();
            thread::spawn(move || {
                for i in 0.. {
                    match room.deliver("c", Message::new("b", format!("{t}-{i}"), "x")) {
                        Ok(_) => {}
                        Err(postroom::Error::Closed) => break,
                        Err(e) => panic!("{e}"),
                    }
                }
                done_tx.send(()).unwrap();
            });
        }
        thread::sleep(Duration::from_millis(10));
        assert!(room.shutdown(Duration::from_secs(5)).unwrap().is_clean());
        for t in 0..8 {
            assert!(
                done_rx.recv_timeout(Duration::from_secs(30)).is_ok(),
                "round {round}: caller {t} still blocked after shutdown returned"
            );
        }
    }
}

/// `SQLITE_LOCKED` on the engine's own connection can only be the handler's
/// doing; it is counted like any handler failure, so it ends dead.
#[test]
fn a_handler_that_locks_itself_is_counted_not_retried_forever() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(start_ms());
    let room = open(
        &dir,
        Postroom::builder()
            .clock(clock.clone())
            .max_attempts(2)
            .consumer(
                "c",
                handler_fn(|tx, _| {
                    tx.execute_batch(
                        "CREATE TEMP TABLE IF NOT EXISTS t(x); INSERT INTO t VALUES (1),(2);",
                    )?;
                    let mut s = tx.prepare("SELECT x FROM t")?;
                    let mut rows = s.query([])?;
                    let _ = rows.next()?;
                    tx.execute_batch("DROP TABLE t")?;
                    Ok(())
                }),
            ),
    );
    assert!(matches!(
        room.deliver("c", Message::new("b", "m", "x")).unwrap(),
        Outcome::Failed { attempts: 1, .. }
    ));
    clock.advance(Duration::from_secs(10));
    assert!(matches!(
        room.deliver("c", Message::new("b", "m", "x")).unwrap(),
        Outcome::Dead { attempts: 2, .. }
    ));
}

/// An engine in `dir` whose consumer "orders" publishes one keyed message
/// per message, keyed by its id.
fn keyed_publisher(dir: &tempfile::TempDir) -> Postroom {
    open(
        dir,
        Postroom::builder().consumer(
            "orders",
            handler_fn(|tx, msg| {
                tx.publish(Outgoing::new("t", "payload").with_key(msg.id()))?;
                Ok(())
            }),
        ),
    )
}

/// Issue 33 (flash): what one inline delivery writes is what the job needs.
/// A delivery whose handler publishes one keyed message adds 5 B-tree
/// entries: the inbox row and its key; the outbox row, its key's entry and
/// its entry among the rows the relay may send now (a key's head). Schema
/// 7 added 9 (a separate pending index, and a heads table with an index of
/// its own), schema 10 added 7 (an index of completed rows, retention's
/// order before it walked the inbox in id order), schema 11 added 6 (a
/// UNIQUE index of every outbox id; schema 12 indexes only the ids the
/// application names), each a page written to the WAL per commit. Sent,
/// the row leaves every pending index. Counted with `dbstat` (entries on
/// leaf pages of each B-tree).
#[test]
fn an_inline_delivery_publishing_a_keyed_message_adds_five_b_tree_entries() {
    let dir = tempfile::tempdir().unwrap();
    let room = keyed_publisher(&dir);
    let conn = raw(&dir.path().join("app.db"));
    let entries = || -> std::collections::BTreeMap<String, i64> {
        let mut stmt = conn
            .prepare(
                "SELECT name, coalesce(sum(ncell), 0) FROM dbstat
                 WHERE pagetype = 'leaf' AND name LIKE '%postroom%' GROUP BY name",
            )
            .unwrap();
        stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    };
    let added = |before: &std::collections::BTreeMap<String, i64>| {
        let after = entries();
        let mut added: Vec<(String, i64)> = after
            .iter()
            .map(|(name, n)| (name.clone(), n - before.get(name).copied().unwrap_or(0)))
            .filter(|(_, n)| *n != 0)
            .collect();
        added.sort();
        added
    };
    // A first delivery, so that every table has its pages.
    let first = room
        .deliver("orders", Message::new("shop", "m-0", "p"))
        .unwrap();
    assert_eq!(first, Outcome::Processed { attempts: 1 });
    let before = entries();
    let outcome = room
        .deliver("orders", Message::new("shop", "m-1", "p"))
        .unwrap();
    assert_eq!(outcome, Outcome::Processed { attempts: 1 });
    let added = added(&before);
    let total: i64 = added.iter().map(|(_, n)| n).sum();
    assert_eq!(total, 5, "entries added per delivery: {added:?}");
}

/// A new inbox row takes the id one past the highest, chosen before its
/// handler runs (the handler's publishes derive their ids from it). A row
/// stored by hand with the highest id there is leaves none to choose: the
/// delivery is an error naming the cause, nothing of it is stored, and
/// the engine goes on answering what it has.
#[test]
fn an_inbox_holding_the_highest_row_id_refuses_new_rows_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let room = keyed_publisher(&dir);
    let m0 = Message::new("shop", "m-0", "p");
    assert_eq!(
        room.deliver("orders", m0.clone()).unwrap(),
        Outcome::Processed { attempts: 1 }
    );
    let conn = raw(&dir.path().join("app.db"));
    conn.execute_batch(
        "INSERT INTO postroom_inbox (id, consumer, source, message_id, status, payload_hash,
             received_at, updated_at, processed_at)
         VALUES (9223372036854775807, 'other', 'shop', 'by-hand', 'completed', zeroblob(32),
                 1, 1, 1)",
    )
    .unwrap();
    let err = room
        .deliver("orders", Message::new("shop", "m-1", "p"))
        .unwrap_err();
    assert!(err.to_string().contains("no higher id is left"), "{err}");
    assert!(matches!(err, postroom::Error::Corrupt { .. }), "{err:?}");
    // Received for the workers, the same: SQLite would have chosen an id
    // at random, perhaps one given out before.
    let err = room
        .receive("orders", Message::new("shop", "m-2", "p"))
        .unwrap_err();
    assert!(err.to_string().contains("no higher id is left"), "{err}");
    assert_eq!(count(&conn, "SELECT count(*) FROM postroom_inbox"), 2);
    assert_eq!(count(&conn, "SELECT count(*) FROM postroom_outbox"), 1);
    assert_eq!(room.deliver("orders", m0).unwrap(), Outcome::Duplicate);
}

/// Only ids the application names are checked at publish (schema 12): a
/// second publish of a named id fails, and the handler's attempt with it.
/// A named id that copies one the engine derived is stored (no index
/// holds derived ids), and `postroom check` reports the two rows.
#[test]
fn a_repeated_named_id_fails_its_publish_and_check_reports_one_copying_a_derived_id() {
    let dir = tempfile::tempdir().unwrap();
    let copy = Arc::new(std::sync::Mutex::new(None::<String>));
    let seen = Arc::clone(&copy);
    let room = open(
        &dir,
        Postroom::builder().consumer(
            "orders",
            handler_fn(move |tx, msg| {
                let id = seen.lock().unwrap().clone();
                match id {
                    Some(id) if msg.id() == "copy" => {
                        tx.publish(Outgoing::new("t", "again").with_id(id))?;
                    }
                    _ => {
                        let id = tx.publish(Outgoing::new("t", "first"))?;
                        // m-0's (m-1's attempt rolls back).
                        seen.lock().unwrap().get_or_insert(id);
                        tx.publish(Outgoing::new("t", "named").with_id("order-1"))?;
                    }
                }
                Ok(())
            }),
        ),
    );
    assert_eq!(
        room.deliver("orders", Message::new("shop", "m-0", "p"))
            .unwrap(),
        Outcome::Processed { attempts: 1 }
    );
    // "order-1" again: refused, nothing of the attempt stored.
    assert!(matches!(
        room.deliver("orders", Message::new("shop", "m-1", "p"))
            .unwrap(),
        Outcome::Failed { .. }
    ));
    let conn = raw(&dir.path().join("app.db"));
    assert_eq!(count(&conn, "SELECT count(*) FROM postroom_outbox"), 2);
    let report = postroom::admin::check(&conn, postroom::admin::CheckDepth::Quick).unwrap();
    assert!(report.is_ok(), "{report:?}");
    // m-0's derived id, named by another handler: stored, and reported.
    assert_eq!(
        room.deliver("orders", Message::new("shop", "copy", "p"))
            .unwrap(),
        Outcome::Processed { attempts: 1 }
    );
    let report = postroom::admin::check(&conn, postroom::admin::CheckDepth::Quick).unwrap();
    let kinds: Vec<_> = report.violations.iter().map(|f| (f.kind, f.id)).collect();
    assert_eq!(
        kinds,
        [(postroom::admin::FindingKind::DuplicateId, 3)],
        "{report:?}"
    );
}
