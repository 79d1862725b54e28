//! `order_service`'s `OrderPaid` handler in two versions, as testkit
//! scenarios: [`buggy`] emails outside the transaction, [`fixed`] publishes
//! the email request through the outbox. One file, included by the example
//! (`examples/testkit_orders.rs`), the libFuzzer target and its stable run
//! (`fuzz/fuzz_targets/testkit_orders.rs`, `fuzz/tests/testkit_orders.rs`,
//! through `#[path]`), so the fuzzer exercises the very handlers the
//! example shows.
//!
//! Invariants: only the public API (`postroom::testkit` and the engine's
//! types); both scenarios judge the same messages, schema and invariant.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::PathBuf;

use postroom::testkit::{Check, Downstream, Rng, Scenario};
use postroom::{handler_fn, Failure, Message, OutboxMessage, Outgoing, SendResult, Sink, Tx};
use serde::{Deserialize, Serialize};

const ORDERS: i64 = 8;

#[derive(Serialize, Deserialize)]
struct OrderPaid {
    order_id: i64,
    amount_cents: i64,
}

/// The broker's messages for one seed: each order paid once, amounts
/// from the seed.
fn payments(rng: &mut Rng) -> Vec<Message> {
    (1..=ORDERS)
        .map(|order_id| {
            let paid = OrderPaid {
                order_id,
                amount_cents: rng.range(100, 10_000),
            };
            Message::from_json("payments", format!("evt-{order_id}"), &paid).expect("serialisable")
        })
        .collect()
}

fn schema(tx: &mut Tx<'_>) -> Result<(), Failure> {
    tx.execute_batch(
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, paid INTEGER NOT NULL DEFAULT 0,
                              times_paid INTEGER NOT NULL DEFAULT 0);",
    )?;
    for id in 1..=ORDERS {
        tx.execute("INSERT INTO orders (id) VALUES (?1)", [id])?;
    }
    Ok(())
}

/// What both versions do in the transaction.
fn mark_paid(tx: &mut Tx<'_>, paid: &OrderPaid) -> Result<(), Failure> {
    tx.execute(
        "UPDATE orders SET paid = 1, times_paid = times_paid + 1 WHERE id = ?1",
        [paid.order_id],
    )?;
    tx.publish(Outgoing::json("shipping.requested", paid)?.with_key(paid.order_id.to_string()))?;
    Ok(())
}

/// The relay's sink: `Sent` once the destination acknowledged; a timed-out
/// acknowledgement is `Retry`, and so is the rest of the batch (a later
/// message of the same key must not overtake it).
struct Broker(Downstream);

impl Sink for Broker {
    fn send(&mut self, batch: &[OutboxMessage]) -> Vec<SendResult> {
        let mut out = Vec::with_capacity(batch.len());
        for m in batch {
            match self.0.accept(m) {
                Ok(()) => out.push(SendResult::Sent),
                Err(timeout) => {
                    let why = timeout.to_string();
                    out.resize_with(batch.len(), || SendResult::retry(why.clone()));
                    break;
                }
            }
        }
        out
    }
}

fn no_order_paid_twice(check: &Check<'_>) -> Result<(), String> {
    match check.count("SELECT count(*) FROM orders WHERE times_paid > 1", []) {
        0 => Ok(()),
        n => Err(format!("{n} orders paid twice")),
    }
}

/// Version 1: emails outside the transaction.
pub fn buggy() -> Scenario {
    Scenario::new(|app| {
        let outbox_file: PathBuf = app.dir().join("emails.txt");
        app.consumer(
            "order-service",
            handler_fn(move |tx, msg| {
                let paid: OrderPaid = msg.json()?;
                mark_paid(tx, &paid)?;
                // The bug: an effect outside the transaction.
                let mut f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&outbox_file)
                    .map_err(Failure::retry)?;
                writeln!(f, "{}", paid.order_id).map_err(Failure::retry)?;
                Ok(())
            }),
        );
        let broker = Broker(app.downstream());
        app.sink(broker);
    })
    .replay_command("cargo run --example testkit_orders --features testkit")
    .schema(schema)
    .messages(payments)
    .effects(|check, msg| {
        let paid: OrderPaid = msg.json().expect("generated");
        let sent = std::fs::read_to_string(check.dir().join("emails.txt")).unwrap_or_default();
        sent.lines()
            .filter(|l| *l == paid.order_id.to_string())
            .count() as u64
    })
    .invariant(no_order_paid_twice)
}

/// Version 2: the email request goes through the outbox, in the
/// transaction; the mail sender downstream dedupes by message id.
pub fn fixed() -> Scenario {
    Scenario::new(|app| {
        app.consumer(
            "order-service",
            handler_fn(|tx, msg| {
                let paid: OrderPaid = msg.json()?;
                mark_paid(tx, &paid)?;
                tx.publish(
                    Outgoing::json("email.requested", &paid)?.with_key(paid.order_id.to_string()),
                )?;
                Ok(())
            }),
        );
        let broker = Broker(app.downstream());
        app.sink(broker);
    })
    .replay_command("cargo run --example testkit_orders --features testkit")
    .schema(schema)
    .messages(payments)
    .effects(|check, msg| {
        let paid: OrderPaid = msg.json().expect("generated");
        let key = paid.order_id.to_string();
        let emails: BTreeSet<String> = check
            .downstream()
            .received()
            .into_iter()
            .filter(|r| r.topic == "email.requested" && r.key.as_deref() == Some(key.as_str()))
            .map(|r| r.id)
            .collect();
        emails.len() as u64
    })
    .invariant(no_order_paid_twice)
}
