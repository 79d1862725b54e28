//! The testkit's fuzz recipe (docs/TESTING-YOUR-HANDLERS.md, "Fuzzing your
//! handlers"), as a user's crate would have it: the fuzzer's bytes choose a
//! seed and a fault schedule (`Scenario::run_bytes`) for an orders
//! handler that marks the order paid and publishes the shipping request
//! in one transaction, through a sink that answers `Sent` only on its
//! destination's acknowledgement. A violation panics: a finding.
//!
//! `RUSTC_BOOTSTRAP=1 cargo fuzz run testkit_orders --sanitizer none -- -max_total_time=60`
//! (or `cargo +nightly fuzz run testkit_orders`), from fuzz/.
#![no_main]

use libfuzzer_sys::fuzz_target;
use postroom::testkit::{Check, Downstream, Rng, Scenario};
use postroom::{handler_fn, Failure, Message, OutboxMessage, Outgoing, SendResult, Sink, Tx};

fn payments(rng: &mut Rng) -> Vec<Message> {
    (1..=6)
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

fn order_id(msg: &Message) -> Result<i64, Failure> {
    let text = std::str::from_utf8(msg.payload()).map_err(|_| Failure::reject("not UTF-8"))?;
    text.split("\"order_id\":")
        .nth(1)
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.trim().parse().ok())
        .ok_or_else(|| Failure::reject("no order_id"))
}

fn on_order_paid(tx: &mut Tx<'_>, msg: &Message) -> Result<(), Failure> {
    let id = order_id(msg)?;
    tx.execute("UPDATE orders SET times_paid = times_paid + 1 WHERE id = ?1", [id])?;
    tx.publish(Outgoing::new("shipping.requested", msg.payload().to_vec()).with_key(id.to_string()))?;
    Ok(())
}

/// `Sent` once the destination acknowledged; the rest of the batch `Retry`
/// after a timeout.
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

fn scenario() -> Scenario {
    Scenario::new(|app| {
        app.consumer("order-service", handler_fn(on_order_paid));
        app.sink(Broker(app.downstream()));
    })
    .schema(|tx| {
        tx.execute_batch(
            "CREATE TABLE orders (id INTEGER PRIMARY KEY, times_paid INTEGER DEFAULT 0);
             INSERT INTO orders (id) VALUES (1),(2),(3),(4),(5),(6);",
        )?;
        Ok(())
    })
    .messages(payments)
    .effects(|check: &Check<'_>, msg| {
        let id = order_id(msg).unwrap_or(0);
        check.count("SELECT times_paid FROM orders WHERE id = ?1", [id])
    })
}

fuzz_target!(|data: &[u8]| scenario().run_bytes(data));
