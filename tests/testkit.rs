//! The testkit (feature `testkit`) aimed at handlers and sinks with the
//! four classic exactly-once bugs: each scenario must FAIL, naming the
//! violation and a shrunk schedule holding the fault that exposes it. And
//! correct handlers of the same shapes pass every seed with every fault
//! kind firing.
//!
//! `POSTROOM_TESTKIT_SEEDS=1000 cargo test --release --features testkit
//! --test testkit correct` runs the passing scenario over 1,000 seeds.

use std::io::Write;

use postroom::testkit::{Check, Downstream, FaultKind, Rng, Scenario, Service, Violation};
use postroom::{
    handler_fn, EffectContext, EffectHandler, Failure, Message, OutboxMessage, Outgoing,
    SendResult, Sink, Tx,
};

/// Orders paid: `order_id` in the payload, `n` of them per seed.
fn orders(rng: &mut Rng, n: u64) -> Vec<Message> {
    (0..n)
        .map(|i| {
            let amount = rng.range(1, 500);
            Message::new(
                "shop",
                format!("order-{i}"),
                format!(r#"{{"order_id":{i},"amount":{amount}}}"#),
            )
        })
        .collect()
}

fn order_id(msg: &Message) -> Result<i64, Failure> {
    let v: serde_json::Value = msg.json()?;
    v["order_id"]
        .as_i64()
        .ok_or_else(|| Failure::reject("no order_id"))
}

fn schema(tx: &mut Tx<'_>) -> Result<(), Failure> {
    tx.execute_batch(
        "CREATE TABLE paid (order_id INTEGER NOT NULL);
         CREATE TABLE charges (order_id INTEGER NOT NULL, receipt INTEGER NOT NULL);",
    )?;
    Ok(())
}

/// The correct inline handler: a row and a shipping request, both in the
/// transaction.
fn mark_paid(tx: &mut Tx<'_>, msg: &Message) -> Result<(), Failure> {
    let id = order_id(msg)?;
    tx.execute("INSERT INTO paid (order_id) VALUES (?1)", [id])?;
    tx.publish(Outgoing::new("shipping", msg.payload().to_vec()).with_key(format!("k{}", id % 3)))?;
    Ok(())
}

/// Charges through the payment service stand-in; `use_key: false` is the
/// bug of ignoring the idempotency key.
struct Charge {
    payments: Service,
    use_key: bool,
}

impl EffectHandler for Charge {
    type Output = u64;

    fn effect(&self, ctx: &EffectContext<'_>, msg: &Message) -> Result<u64, Failure> {
        let key = self.use_key.then(|| ctx.idempotency_key());
        Ok(self.payments.call(key, &format!("charge {}", msg.id())))
    }

    fn apply(&self, tx: &mut Tx<'_>, msg: &Message, receipt: u64) -> Result<(), Failure> {
        tx.execute(
            "INSERT INTO charges (order_id, receipt) VALUES (?1, ?2)",
            [order_id(msg)?, receipt as i64],
        )?;
        Ok(())
    }
}

/// A sink whose destination acknowledges each message before it answers
/// `Sent` (correct: a timed-out acknowledgement is `Retry`, and so is
/// everything after it in the batch, so that no later message of its key
/// overtakes it), or, with `buffer`, one that answers `Sent` at once and
/// forwards in batches of three (the bug), flushing on drop; or, with
/// `sent_on_timeout`, one that takes a timed-out acknowledgement for
/// "it probably arrived" (the bug).
struct Forward {
    down: Downstream,
    buffer: Option<Vec<OutboxMessage>>,
    sent_on_timeout: bool,
}

impl Forward {
    fn correct(down: Downstream) -> Forward {
        Forward {
            down,
            buffer: None,
            sent_on_timeout: false,
        }
    }
}

impl Sink for Forward {
    fn send(&mut self, batch: &[OutboxMessage]) -> Vec<SendResult> {
        let mut out: Vec<SendResult> = Vec::with_capacity(batch.len());
        for m in batch {
            if out.last().is_some_and(|r| *r != SendResult::Sent) {
                out.push(SendResult::retry("an earlier message of the batch failed"));
                continue;
            }
            match &mut self.buffer {
                None => match self.down.accept(m) {
                    Ok(()) => out.push(SendResult::Sent),
                    Err(_) if self.sent_on_timeout => out.push(SendResult::Sent),
                    Err(timeout) => out.push(SendResult::retry(timeout.to_string())),
                },
                Some(buf) => {
                    buf.push(m.clone());
                    if buf.len() >= 3 {
                        buf.drain(..).for_each(|m| {
                            let _ = self.down.accept(&m);
                        });
                    }
                    out.push(SendResult::Sent);
                }
            }
        }
        out
    }
}

impl Drop for Forward {
    fn drop(&mut self) {
        if let Some(buf) = &mut self.buffer {
            buf.drain(..).for_each(|m| {
                let _ = self.down.accept(&m);
            });
        }
    }
}

/// Whether the shrunk schedule holds a fault that rolls a handler's
/// transaction back after it ran: a crash before the commit, a rollback by
/// SQL, a full disk. Each exposes an effect outside the transaction.
fn rolls_back(failed: &postroom::testkit::Failed) -> bool {
    [
        FaultKind::CrashBeforeCommit,
        FaultKind::SqlRollback,
        FaultKind::DiskFull,
    ]
    .into_iter()
    .any(|k| failed.blames(k))
}

fn paid_rows(check: &Check<'_>, msg: &Message) -> u64 {
    let id = order_id(msg).unwrap();
    check.count("SELECT count(*) FROM paid WHERE order_id = ?1", [id])
}

#[test]
fn correct_handlers_pass_every_seed_with_every_fault_firing() {
    let report = Scenario::new(|app| {
        app.consumer("billing", handler_fn(mark_paid));
        let payments = app.service("payments");
        app.effectful_consumer(
            "payments",
            Charge {
                payments,
                use_key: true,
            },
        );
        app.sink(Forward::correct(app.downstream()));
    })
    .schema(schema)
    .messages(|rng| orders(rng, 10))
    .effects(|check, msg| paid_rows(check, msg) + check.service("payments").applied(&format!("charge {}", msg.id())))
    .invariant(|check| {
        let dup = check.count(
            "SELECT count(*) FROM (SELECT order_id FROM paid GROUP BY order_id HAVING count(*) > 1)",
            [],
        );
        if dup == 0 {
            Ok(())
        } else {
            Err(format!("{dup} orders paid twice"))
        }
    })
    .outcome(|check| {
        let n = check.count("SELECT count(*) FROM paid", []);
        let sum = check.count("SELECT sum(order_id) FROM paid", []);
        format!("paid={n} sum={sum}")
    })
    .seeds(40)
    .run();
    assert!(report.seeds >= 1);
    assert!(report.not_applicable.is_empty(), "{report}");
    for kind in FaultKind::ALL
        .into_iter()
        .filter(|k| *k != FaultKind::RetentionPass)
    {
        assert!(
            report.fired.get(&kind).copied().unwrap_or(0) > 0,
            "{kind} never fired: {report}"
        );
    }
}

/// Bug 1: an "email sent" line appended to a file beside the database,
/// outside the transaction: a crash before the commit sends it twice.
fn email_outside_the_transaction() -> Scenario {
    Scenario::new(|app| {
        let log = app.dir().join("emails.log");
        app.consumer(
            "billing",
            handler_fn(move |tx, msg| {
                let mut f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&log)
                    .map_err(Failure::retry)?;
                writeln!(f, "{}", msg.id()).map_err(Failure::retry)?;
                mark_paid(tx, msg)
            }),
        );
    })
    .schema(schema)
    .messages(|rng| orders(rng, 10))
    .effects(|check, msg| {
        let text = std::fs::read_to_string(check.dir().join("emails.log")).unwrap_or_default();
        text.lines().filter(|l| *l == msg.id()).count() as u64
    })
}

#[test]
fn catches_an_effect_outside_the_transaction() {
    let failed = email_outside_the_transaction()
        .try_run()
        .expect_err("an effect outside the transaction must be caught");
    eprintln!("{failed}");
    assert!(
        matches!(
            failed.violation,
            Violation::EffectsNotOnce { counted: 2, .. }
        ),
        "{failed}"
    );
    assert!(rolls_back(&failed), "{failed}");
    assert_eq!(failed.shrunk.len(), 1, "{failed}");
    assert!(failed.replay.contains("POSTROOM_TESTKIT_SEED="), "{failed}");
}

#[test]
fn catches_a_double_charge_by_an_effect_ignoring_its_idempotency_key() {
    // Bug 2: the payment call without the idempotency key; the service
    // cannot recognise the repeat after a crash or an expired lease: a
    // double charge.
    let failed = Scenario::new(|app| {
        let payments = app.service("payments");
        app.effectful_consumer(
            "payments",
            Charge {
                payments,
                use_key: false,
            },
        );
    })
    .schema(schema)
    .messages(|rng| orders(rng, 10))
    .effects(|check, msg| {
        check
            .service("payments")
            .applied(&format!("charge {}", msg.id()))
    })
    .try_run()
    .expect_err("a double charge must be caught");
    eprintln!("{failed}");
    assert!(
        matches!(
            failed.violation,
            Violation::EffectsNotOnce { counted: 2, .. }
        ),
        "{failed}"
    );
    // A crash after the call, or its lease expiring under it: either way
    // the call runs again.
    assert!(
        rolls_back(&failed) || failed.blames(FaultKind::LeaseExpiry),
        "{failed}"
    );
}

#[test]
fn catches_a_handler_that_depends_on_arrival_order() {
    // Bug 3: "last write wins" on an account's status; versions say which
    // is newest, and the handler ignores them.
    fn updates(rng: &mut Rng) -> Vec<Message> {
        (0..10)
            .map(|v| {
                let account = rng.range(1, 3);
                Message::new(
                    "accounts",
                    format!("update-{v}"),
                    format!(r#"{{"account":{account},"version":{v}}}"#),
                )
            })
            .collect()
    }
    let failed = Scenario::new(|app| {
        app.consumer(
            "status",
            handler_fn(|tx, msg| {
                let v: serde_json::Value = msg.json()?;
                tx.execute(
                    "INSERT INTO accounts (id, version) VALUES (?1, ?2)
                     ON CONFLICT (id) DO UPDATE SET version = excluded.version",
                    [v["account"].as_i64(), v["version"].as_i64()],
                )?;
                Ok(())
            }),
        );
    })
    .schema(|tx| {
        tx.execute_batch("CREATE TABLE accounts (id INTEGER PRIMARY KEY, version INTEGER)")?;
        Ok(())
    })
    .messages(updates)
    .outcome(|check| {
        let mut stmt = check
            .conn()
            .prepare("SELECT id, version FROM accounts ORDER BY id")
            .unwrap();
        let rows: Vec<String> = stmt
            .query_map([], |r| {
                Ok(format!("{}@{}", r.get::<_, i64>(0)?, r.get::<_, i64>(1)?))
            })
            .unwrap()
            .map(Result::unwrap)
            .collect();
        rows.join(" ")
    })
    .try_run()
    .expect_err("an order-dependent handler must be caught");
    eprintln!("{failed}");
    assert!(
        matches!(failed.violation, Violation::OutcomeDiffers { .. }),
        "{failed}"
    );
    assert!(
        [
            FaultKind::Reorder,
            FaultKind::SqlRollback,
            FaultKind::DiskFull
        ]
        .into_iter()
        .any(|k| failed.blames(k)),
        "{failed}"
    );
}

#[test]
fn catches_a_sink_that_answers_sent_before_its_ack() {
    // Bug 4: the sink buffers and answers Sent at once; a crash loses the
    // buffer (no destructor runs in a killed process), and a flush the
    // downstream times out drops what it held; either way the relay has
    // marked the rows sent: downstream messages lost.
    let failed = Scenario::new(|app| {
        app.consumer("billing", handler_fn(mark_paid));
        let down = app.downstream();
        app.sink(Forward {
            down,
            buffer: Some(Vec::new()),
            sent_on_timeout: false,
        });
    })
    .schema(schema)
    .messages(|rng| orders(rng, 10))
    .effects(paid_rows)
    .try_run()
    .expect_err("a sink that answers Sent before its ack must be caught");
    eprintln!("{failed}");
    assert!(
        matches!(failed.violation, Violation::LostDownstream { .. }),
        "{failed}"
    );
    // Which of the two the shrinker keeps depends on the seed (seed 4:
    // one sink timeout alone); one of them must be there.
    assert!(
        failed
            .shrunk
            .iter()
            .any(|f| f.kind.is_crash() || f.kind == FaultKind::SinkTimeout),
        "{failed}"
    );
}

#[test]
fn a_fault_kind_that_never_fires_fails_the_run() {
    let failed = Scenario::new(|app| {
        app.consumer("billing", handler_fn(mark_paid));
    })
    .schema(schema)
    .messages(|rng| orders(rng, 2))
    .fault_rate(0)
    .seeds(2)
    .try_run()
    .expect_err("faults that never fired cannot pass");
    match &failed.violation {
        Violation::NeverFired { kinds } => {
            assert!(kinds.contains(&FaultKind::CrashBeforeCommit), "{failed}");
            // No sink: its faults are not applicable, not "never fired".
            assert!(!kinds.contains(&FaultKind::SinkFails), "{failed}");
        }
        other => panic!("expected NeverFired, got {other}"),
    }
}

#[test]
fn a_failing_seed_replays_the_same_schedule_and_shrinks_the_same_way() {
    let a = email_outside_the_transaction()
        .try_run()
        .expect_err("must fail");
    let b = email_outside_the_transaction()
        .try_run()
        .expect_err("must fail");
    assert_eq!(a.seed, b.seed);
    assert_eq!(a.schedule, b.schedule);
    assert_eq!(a.shrunk, b.shrunk);
    assert_eq!(a.replay, b.replay);
}

#[test]
fn fuzzer_bytes_drive_the_same_scenario() {
    // Seed 0, then one fault: message #1, kind 4 of the kinds that apply
    // without a sink (crash-before-commit), size 0.
    let mut data = 0u64.to_le_bytes().to_vec();
    data.extend([1, 4, 0]);
    let failed = email_outside_the_transaction()
        .try_run_bytes(&data)
        .expect_err("the crash before commit must expose the email bug");
    assert!(failed.blames(FaultKind::CrashBeforeCommit), "{failed}");
    // The same bytes leave a correct handler alone.
    Scenario::new(|app| {
        app.consumer("billing", handler_fn(mark_paid));
    })
    .schema(schema)
    .messages(|rng| orders(rng, 10))
    .effects(paid_rows)
    .run_bytes(&data);
}

/// docs/TESTING-YOUR-HANDLERS.md's scenario, as the guide has it (with
/// `try_run` for `run`): it must find the double email.
mod guide {
    use postroom::testkit::{Rng, Scenario, Violation};
    use postroom::{handler_fn, Failure, Message, Outgoing, Tx};

    fn payments(rng: &mut Rng) -> Vec<Message> {
        (1..=8)
            .map(|id| {
                let cents = rng.range(100, 10_000);
                Message::new(
                    "payments",
                    format!("evt-{id}"),
                    format!(r#"{{"order_id":{id},"amount_cents":{cents}}}"#),
                )
            })
            .collect()
    }

    fn on_order_paid(
        tx: &mut Tx<'_>,
        msg: &Message,
        emails: &std::path::Path,
    ) -> Result<(), Failure> {
        let paid: serde_json::Value = msg.json()?;
        let id = paid["order_id"]
            .as_i64()
            .ok_or_else(|| Failure::reject("no order_id"))?;
        use std::io::Write; // "send the email": a line in a file
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(emails)
            .map_err(Failure::retry)?;
        writeln!(f, "{id}").map_err(Failure::retry)?;
        tx.execute(
            "UPDATE orders SET times_paid = times_paid + 1 WHERE id = ?1",
            [id],
        )?;
        tx.publish(Outgoing::json("shipping.requested", &paid)?.with_key(id.to_string()))?;
        Ok(())
    }

    #[test]
    fn the_guides_scenario_finds_the_double_email() {
        let failed = Scenario::new(|app| {
            let emails = app.dir().join("emails.txt");
            app.consumer(
                "order-service",
                handler_fn(move |tx, msg| on_order_paid(tx, msg, &emails)),
            );
        })
        .schema(|tx| {
            tx.execute_batch(
                "CREATE TABLE orders (id INTEGER PRIMARY KEY, times_paid INTEGER DEFAULT 0);
                 INSERT INTO orders (id) VALUES (1),(2),(3),(4),(5),(6),(7),(8);",
            )?;
            Ok(())
        })
        .messages(payments)
        .effects(|check, msg| {
            let sent = std::fs::read_to_string(check.dir().join("emails.txt")).unwrap_or_default();
            let id = msg.id().trim_start_matches("evt-");
            sent.lines().filter(|l| *l == id).count() as u64
        })
        .invariant(|check| {
            match check.count("SELECT count(*) FROM orders WHERE times_paid > 1", []) {
                0 => Ok(()),
                n => Err(format!("{n} orders paid twice")),
            }
        })
        .seeds(200)
        .try_run()
        .expect_err("the guide's handler sends an email twice");
        eprintln!("{failed}");
        assert!(
            matches!(failed.violation, Violation::EffectsNotOnce { .. }),
            "{failed}"
        );
        assert!(super::rolls_back(&failed), "{failed}");
    }
}

/// The orders of [`orders`] through a handler that keeps an in-memory
/// "already handled" set (a cache, a dedupe filter) and skips ids in it.
/// The set is not rolled back with the transaction: after a rollback
/// without a restart, the redelivery is skipped and the order never paid.
fn in_memory_dedupe() -> Scenario {
    Scenario::new(|app| {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(std::collections::HashSet::new()));
        app.consumer(
            "billing",
            handler_fn(move |tx, msg| {
                if !seen.lock().unwrap().insert(msg.id().to_owned()) {
                    return Ok(()); // "already handled"
                }
                mark_paid(tx, msg)
            }),
        );
    })
    .schema(schema)
    .messages(|rng| orders(rng, 10))
    .effects(paid_rows)
}

#[test]
fn catches_an_in_memory_dedupe_that_a_rollback_outlives() {
    let failed = in_memory_dedupe()
        .try_run()
        .expect_err("an in-memory dedupe set outliving a rollback must be caught");
    eprintln!("{failed}");
    assert!(
        matches!(
            failed.violation,
            Violation::EffectsNotOnce { counted: 0, .. }
        ),
        "{failed}"
    );
    assert!(
        failed.blames(FaultKind::SqlRollback) || failed.blames(FaultKind::DiskFull),
        "{failed}"
    );
    assert_eq!(failed.shrunk.len(), 1, "{failed}");
}

#[test]
fn a_full_disk_alone_catches_the_in_memory_dedupe() {
    // Each rollback-without-restart kind finds it on its own; the kinds the
    // testkit had before them do not (the crashes restart the process and
    // so clear the set).
    let by_disk = in_memory_dedupe()
        .without(FaultKind::SqlRollback)
        .try_run()
        .expect_err("the full disk rolls back without a restart");
    assert!(by_disk.blames(FaultKind::DiskFull), "{by_disk}");
    let by_sql = in_memory_dedupe()
        .without(FaultKind::DiskFull)
        .try_run()
        .expect_err("the SQL rollback rolls back without a restart");
    assert!(by_sql.blames(FaultKind::SqlRollback), "{by_sql}");
    in_memory_dedupe()
        .without(FaultKind::SqlRollback)
        .without(FaultKind::DiskFull)
        .run();
}

/// A handler with an in-memory poison-message guard: a message it has
/// seen before must have failed it, so it is rejected. After a rollback
/// without a restart (a full disk), a message that only met the fault is
/// dead-lettered: lost until someone redrives it.
fn rejects_what_it_saw_before() -> Scenario {
    Scenario::new(|app| {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(std::collections::HashSet::new()));
        app.consumer(
            "billing",
            handler_fn(move |tx, msg| {
                if !seen.lock().unwrap().insert(msg.id().to_owned()) {
                    return Err(Failure::reject("seen before: a poison message"));
                }
                mark_paid(tx, msg)
            }),
        );
    })
    .schema(schema)
    .messages(|rng| orders(rng, 10))
    .effects(paid_rows)
}

#[test]
fn catches_a_handler_that_dead_letters_a_message_a_fault_delayed() {
    let failed = rejects_what_it_saw_before()
        .try_run()
        .expect_err("a message dead-lettered by a transient fault must be caught");
    eprintln!("{failed}");
    assert!(
        matches!(failed.violation, Violation::LostToFault { .. }),
        "{failed}"
    );
    assert!(
        failed.blames(FaultKind::DiskFull) || failed.blames(FaultKind::SqlRollback),
        "{failed}"
    );
    assert_eq!(failed.shrunk.len(), 1, "{failed}");
    // The kinds the testkit had before do not see it.
    rejects_what_it_saw_before()
        .without(FaultKind::SqlRollback)
        .without(FaultKind::DiskFull)
        .run();
}

/// A sink that answers `Sent` when its destination's acknowledgement
/// timed out ("it probably arrived").
fn sent_on_timeout() -> Scenario {
    Scenario::new(|app| {
        app.consumer("billing", handler_fn(mark_paid));
        app.sink(Forward {
            down: app.downstream(),
            buffer: None,
            sent_on_timeout: true,
        });
    })
    .schema(schema)
    .messages(|rng| orders(rng, 10))
    .effects(paid_rows)
}

#[test]
fn catches_a_sink_that_takes_a_timed_out_ack_for_sent() {
    let failed = sent_on_timeout()
        .try_run()
        .expect_err("a sink answering Sent on a timeout must be caught");
    eprintln!("{failed}");
    assert!(
        matches!(failed.violation, Violation::LostDownstream { .. }),
        "{failed}"
    );
    assert!(failed.blames(FaultKind::SinkTimeout), "{failed}");
    // Without the timeout (the kinds before it), the bug goes unseen.
    sent_on_timeout()
        .without(FaultKind::SinkTimeout)
        .without(FaultKind::SqlRollback)
        .without(FaultKind::DiskFull)
        .seeds(40)
        .run();
}

#[test]
fn a_redelivery_after_retention_is_a_known_limit_in_the_report() {
    // The correct handler: the redelivery after the retention pass is
    // processed again (a second row); the verdict allows it and the
    // report counts it, rather than passing silently.
    let scenario = || {
        Scenario::new(|app| {
            app.consumer("billing", handler_fn(mark_paid));
        })
        .schema(schema)
        .messages(|rng| orders(rng, 10))
        .effects(paid_rows)
        .with(FaultKind::RetentionPass)
        .fault_rate(100)
        .seeds(10)
    };
    let report = scenario().run();
    assert!(report.fired[&FaultKind::RetentionPass] > 0, "{report}");
    // Counted only where the pass removed the message's row: each is
    // processed again (and others may be too, redelivered by other kinds
    // once a pass removed their rows).
    assert!(
        report.reprocessed_after_retention >= report.fired[&FaultKind::RetentionPass],
        "{report}"
    );
    assert!(report.to_string().contains("known limit"), "{report}");
    // Alone: every pass reported fired processes its message again, and
    // nothing else is.
    let report = only(scenario(), FaultKind::RetentionPass).run();
    assert!(report.fired[&FaultKind::RetentionPass] > 0, "{report}");
    assert_eq!(
        report.reprocessed_after_retention,
        report.fired[&FaultKind::RetentionPass],
        "{report}"
    );
}

/// A running total kept by adding each order's amount. Processed again
/// after retention removed its inbox row (the engine's dedupe horizon), an
/// order is added twice; the fixed twin records each order under a unique
/// key first and adds only a new one.
fn running_total(fixed: bool) -> Scenario {
    Scenario::new(move |app| {
        app.consumer(
            "billing",
            handler_fn(move |tx, msg| {
                let id = order_id(msg)?;
                let v: serde_json::Value = msg.json()?;
                let amount = v["amount"]
                    .as_i64()
                    .ok_or_else(|| Failure::reject("no amount"))?;
                let new = tx.execute(
                    "INSERT OR IGNORE INTO counted (order_id, amount) VALUES (?1, ?2)",
                    [id, amount],
                )?;
                if fixed && new == 0 {
                    return Ok(());
                }
                tx.execute("UPDATE total SET sum = sum + ?1", [amount])?;
                Ok(())
            }),
        );
    })
    .schema(|tx| {
        tx.execute_batch(
            "CREATE TABLE counted (order_id INTEGER PRIMARY KEY, amount INTEGER NOT NULL);
             CREATE TABLE total (sum INTEGER NOT NULL); INSERT INTO total VALUES (0);",
        )?;
        Ok(())
    })
    .messages(|rng| orders(rng, 10))
    .effects(|check, msg| {
        let id = order_id(msg).unwrap();
        check.count("SELECT count(*) FROM counted WHERE order_id = ?1", [id])
    })
    .invariant(|check| {
        let total = check.count("SELECT sum FROM total", []);
        let orders = check.count("SELECT coalesce(sum(amount), 0) FROM counted", []);
        if total == orders {
            Ok(())
        } else {
            Err(format!(
                "the total is {total}, the orders add up to {orders}"
            ))
        }
    })
    .with(FaultKind::RetentionPass)
}

#[test]
fn a_retention_pass_catches_a_total_added_to_twice_and_passes_its_fix() {
    // Five seeds: a pass that removes the row every time it fires finds
    // it in the first (one run where the newest row was the message's, so
    // mostly nothing was removed, needed 19).
    let failed = running_total(false)
        .seeds(5)
        .try_run()
        .expect_err("an order processed again after retention is added twice");
    eprintln!("{failed}");
    assert!(failed.blames(FaultKind::RetentionPass), "{failed}");
    let report = running_total(true).seeds(20).run();
    assert!(report.fired[&FaultKind::RetentionPass] > 0, "{report}");
}

/// Orders noted with a 3 KB row and an empty one, in one statement (so
/// that the write needs a new page, and a full disk reaches it), by a
/// handler that answers a failed write in
/// one of three ways: `Return` passes the error on (`?`: the engine
/// retries), `Swallow` drops it and answers `Ok` (SQLite undid the
/// statement alone: the commit goes ahead without the row), `Reject` turns
/// it into a permanent failure (the message is dead-lettered, though the
/// disk had room again a moment later). Only the full disk is on.
#[derive(Clone, Copy)]
enum OnWriteError {
    Return,
    Swallow,
    Reject,
}

/// `scenario` with every fault kind but `kind` off.
fn only(scenario: Scenario, kind: FaultKind) -> Scenario {
    FaultKind::ALL
        .into_iter()
        .filter(|k| *k != kind)
        .fold(scenario, Scenario::without)
}

fn notes_orders(on_error: OnWriteError) -> Scenario {
    let scenario = Scenario::new(move |app| {
        app.consumer(
            "billing",
            handler_fn(move |tx, msg| {
                let id = order_id(msg)?;
                // Two rows in one statement: SQLite undoes just this
                // statement on a full disk (one row's failure rolls the
                // whole transaction back, which the engine fails anyway).
                let wrote = tx.execute(
                    "INSERT INTO notes (order_id, body) VALUES (?1, zeroblob(3000)), (?1, x'')",
                    [id],
                );
                match (wrote, on_error) {
                    (Ok(_), _) => Ok(()),
                    (Err(e), OnWriteError::Return) => Err(e.into()),
                    (Err(_), OnWriteError::Swallow) => Ok(()),
                    (Err(e), OnWriteError::Reject) => {
                        Err(Failure::reject(format!("cannot note the order: {e}")))
                    }
                }
            }),
        );
    })
    .schema(|tx| {
        // One note there already: its page has no room for another, so
        // every note needs a new page.
        tx.execute_batch(
            "CREATE TABLE notes (order_id INTEGER NOT NULL, body BLOB NOT NULL);
             INSERT INTO notes VALUES (-1, zeroblob(3000));",
        )?;
        Ok(())
    })
    .messages(|rng| orders(rng, 10))
    .effects(|check, msg| {
        let id = order_id(msg).unwrap();
        check.count("SELECT count(*) FROM notes WHERE order_id = ?1", [id]) / 2
    })
    .fault_rate(100)
    .seeds(20);
    only(scenario, FaultKind::DiskFull)
}

#[test]
fn a_handler_that_swallows_a_full_disk_is_caught_and_its_fix_passes() {
    let failed = notes_orders(OnWriteError::Swallow)
        .try_run()
        .expect_err("a swallowed full disk commits the order without its note");
    eprintln!("{failed}");
    assert!(
        matches!(
            failed.violation,
            Violation::EffectsNotOnce { counted: 0, .. }
        ),
        "{failed}"
    );
    assert!(failed.blames(FaultKind::DiskFull), "{failed}");
    let report = notes_orders(OnWriteError::Return).run();
    assert!(report.fired[&FaultKind::DiskFull] > 0, "{report}");
}

#[test]
fn a_handler_that_rejects_a_full_disk_loses_the_message_to_it_and_its_fix_passes() {
    let failed = notes_orders(OnWriteError::Reject)
        .try_run()
        .expect_err("a full disk taken for permanent dead-letters the message");
    eprintln!("{failed}");
    assert!(
        matches!(failed.violation, Violation::LostToFault { .. }),
        "{failed}"
    );
    assert!(failed.blames(FaultKind::DiskFull), "{failed}");
    notes_orders(OnWriteError::Return).run();
}

/// Only the real-process mode: no in-process seed (so no in-process kind
/// can fire, and none is asked to).
fn only_real_kills(scenario: Scenario, kills: u64) -> Scenario {
    scenario.seeds(0).real_kills(kills)
}

#[test]
fn catches_an_effect_outside_the_transaction_across_a_real_kill() {
    let failed = only_real_kills(email_outside_the_transaction(), 6)
        .try_run()
        .expect_err("a child killed inside the handler sends the email twice");
    eprintln!("{failed}");
    assert!(
        matches!(
            failed.violation,
            Violation::EffectsNotOnce { counted: 2, .. }
        ),
        "{failed}"
    );
    assert_eq!(failed.shrunk.len(), 1, "{failed}");
    assert_eq!(
        failed.shrunk[0].kind,
        FaultKind::CrashBeforeCommit,
        "{failed}"
    );
    assert!(failed.to_string().contains("SIGKILL"), "{failed}");
    assert!(failed.replay.contains("POSTROOM_TESTKIT_KILL="), "{failed}");
}

#[test]
fn a_correct_handler_survives_real_kills() {
    let report = only_real_kills(
        Scenario::new(|app| {
            app.consumer("billing", handler_fn(mark_paid));
            app.sink(Forward::correct(app.downstream()));
        })
        .schema(schema)
        .messages(|rng| orders(rng, 10))
        .effects(paid_rows),
        4,
    )
    .run();
    assert_eq!(report.real_kills, 4, "{report}");
}

/// Orders stamped when paid: with the engine's clock (`tx.now_ms()`), or,
/// the bug, with the wall clock.
fn stamps_paid_orders(wall_clock: bool) -> Scenario {
    Scenario::new(move |app| {
        app.consumer(
            "billing",
            handler_fn(move |tx, msg| {
                let now = if wall_clock {
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_err(Failure::retry)?
                        .as_millis() as i64
                } else {
                    tx.now_ms()
                };
                tx.execute(
                    "INSERT INTO paid_at (order_id, at) VALUES (?1, ?2)",
                    [order_id(msg)?, now],
                )?;
                Ok(())
            }),
        );
    })
    .schema(|tx| {
        tx.execute_batch("CREATE TABLE paid_at (order_id INTEGER NOT NULL, at INTEGER NOT NULL)")?;
        Ok(())
    })
    .messages(|rng| orders(rng, 5))
    .effects(|check, msg| {
        let id = order_id(msg).unwrap();
        check.count("SELECT count(*) FROM paid_at WHERE order_id = ?1", [id])
    })
    .detect_wall_clock(|check| {
        // Ages in whole hours, relative to the engine's clock.
        let hours = check.count(
            "SELECT sum(abs(?1 - at) / 3600000) FROM paid_at",
            [check.now_ms()],
        );
        format!("paid {hours} order-hours ago")
    })
    .seeds(10)
}

#[test]
fn catches_a_handler_that_reads_the_wall_clock() {
    let failed = stamps_paid_orders(true)
        .try_run()
        .expect_err("a handler reading the wall clock must be caught");
    eprintln!("{failed}");
    assert!(
        matches!(failed.violation, Violation::ReadsWallClock { .. }),
        "{failed}"
    );
    assert!(failed.shrunk.is_empty(), "{failed}");
    // The engine's clock passes.
    stamps_paid_orders(false).run();
}

/// The payment consumer alone (with or without the idempotency key),
/// every fault kind off but the lease expiring under its external step.
/// Kinds are named, not matched, so this compiles against a testkit that
/// lacks the kind (and then must fail: nothing is left on to catch it).
fn only_a_lease_expiring(use_key: bool) -> Scenario {
    let scenario = Scenario::new(move |app| {
        let payments = app.service("payments");
        app.effectful_consumer("payments", Charge { payments, use_key });
    })
    .schema(schema)
    .messages(|rng| orders(rng, 10))
    .effects(|check, msg| {
        check
            .service("payments")
            .applied(&format!("charge {}", msg.id()))
    })
    .seeds(20);
    FaultKind::ALL
        .into_iter()
        .filter(|k| k.name() != "lease-expiry")
        .fold(scenario, Scenario::without)
}

#[test]
fn catches_a_double_charge_by_a_lease_expiring_under_the_effect() {
    // Bug 2 with only the lease-expiry fault: the payment call outlives
    // its lease, the engine runs it again (the same idempotency key); a
    // call without the key is charged twice, in one live process.
    let failed = only_a_lease_expiring(false)
        .try_run()
        .expect_err("a lease expiring under a keyless payment call must be caught");
    eprintln!("{failed}");
    assert!(
        matches!(
            failed.violation,
            Violation::EffectsNotOnce { counted: 2, .. }
        ),
        "{failed}"
    );
    assert!(!failed.shrunk.is_empty(), "{failed}");
    assert!(
        failed
            .shrunk
            .iter()
            .all(|f| f.kind.name() == "lease-expiry"),
        "{failed}"
    );
}

#[test]
fn a_keyed_effect_survives_its_lease_expiring_and_the_fault_is_counted() {
    let report = only_a_lease_expiring(true).run();
    let fired: u64 = report
        .fired
        .iter()
        .filter(|(k, _)| k.name() == "lease-expiry")
        .map(|(_, n)| *n)
        .sum();
    assert!(fired > 0, "{report}");
    // Switched on, it must fire: with no faults scheduled the run fails.
    let failed = only_a_lease_expiring(true)
        .fault_rate(0)
        .try_run()
        .expect_err("a kind that never fired must fail the run");
    assert!(
        matches!(&failed.violation, Violation::NeverFired { kinds } if kinds.iter().any(|k| k.name() == "lease-expiry")),
        "{failed}"
    );
}

/// Fuzzer bytes keep a clock jump within the documented range (forward up
/// to two days, back up to a minute), as the seeded schedule does: a
/// handler stamps each message with the engine's clock, and the clock
/// must never be more than a minute behind a stamp. (Bytes once meant up
/// to 128 minutes back, which a fault-free drain then spent tens of
/// seconds polling through.)
#[test]
fn fuzzer_bytes_jump_the_clock_back_at_most_a_minute() {
    let scenario = FaultKind::ALL
        .into_iter()
        .filter(|k| *k != FaultKind::ClockJump)
        .fold(
            Scenario::new(|app| {
                app.consumer(
                    "stamps",
                    handler_fn(|tx, msg| {
                        tx.execute(
                            "INSERT INTO stamps (id, at) VALUES (?1, ?2)",
                            (msg.id(), tx.now_ms()),
                        )?;
                        Ok(())
                    }),
                );
            }),
            Scenario::without,
        )
        .schema(|tx| {
            tx.execute_batch("CREATE TABLE stamps (id TEXT, at INTEGER)")?;
            Ok(())
        })
        .messages(|rng| orders(rng, 3))
        .invariant(|check| {
            let latest = check.count("SELECT max(at) FROM stamps", []) as i64;
            if check.now_ms() >= latest - 60_000 {
                Ok(())
            } else {
                Err(format!(
                    "the clock went back {} ms",
                    latest - check.now_ms()
                ))
            }
        });
    // Seed 0; then the largest jump back the bytes can say (size 0), and
    // the largest forward (size 255), each at message #1.
    for size in [0u8, 255] {
        let mut data = vec![0u8; 8];
        data.extend([1, 0, size]);
        if let Err(failed) = scenario.try_run_bytes(&data) {
            panic!("size {size}: {failed}");
        }
    }
}
