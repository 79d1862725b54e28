//! What the testkit's runs cost: a plain (inline) consumer and an
//! effectful one, each over the same seeds with every fault kind on and
//! then with each kind alone, timed on the wall clock. The figures in
//! docs/TESTING-YOUR-HANDLERS.md come from this command.
//!
//! ```text
//! cargo run --release --example testkit_speed --features testkit            # 200 seeds
//! cargo run --release --example testkit_speed --features testkit -- 1000 all  # the first row only
//! ```

use std::time::Instant;

use postroom::testkit::{FaultKind, Rng, Scenario, Service};
use postroom::{handler_fn, EffectContext, EffectHandler, Failure, Message, Tx};

/// Ten orders per seed.
fn orders(rng: &mut Rng) -> Vec<Message> {
    (0..10)
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

/// A charge through the payment service stand-in, with the idempotency
/// key, and its receipt stored.
struct Charge {
    payments: Service,
}

impl EffectHandler for Charge {
    type Output = u64;

    fn effect(&self, ctx: &EffectContext<'_>, msg: &Message) -> Result<u64, Failure> {
        Ok(self
            .payments
            .call(Some(ctx.idempotency_key()), &format!("charge {}", msg.id())))
    }

    fn apply(&self, tx: &mut Tx<'_>, msg: &Message, receipt: u64) -> Result<(), Failure> {
        tx.execute(
            "INSERT INTO charges (order_id, receipt) VALUES (?1, ?2)",
            [order_id(msg)?, receipt as i64],
        )?;
        Ok(())
    }
}

fn plain() -> Scenario {
    Scenario::new(|app| {
        app.consumer(
            "billing",
            handler_fn(|tx, msg| {
                tx.execute("INSERT INTO paid (order_id) VALUES (?1)", [order_id(msg)?])?;
                Ok(())
            }),
        );
    })
    .schema(schema)
    .messages(orders)
    .effects(|check, msg| {
        check.count(
            "SELECT count(*) FROM paid WHERE order_id = ?1",
            [order_id(msg).unwrap_or(-1)],
        )
    })
}

fn effectful() -> Scenario {
    Scenario::new(|app| {
        let payments = app.service("payments");
        app.effectful_consumer("payments", Charge { payments });
    })
    .schema(schema)
    .messages(orders)
    .effects(|check, msg| {
        check
            .service("payments")
            .applied(&format!("charge {}", msg.id()))
    })
}

/// Seconds for `seeds` seeds of `scenario`; exits on a failed seed (the
/// handlers here are correct: a failure is the testkit's).
fn seconds(scenario: Scenario, seeds: u64) -> f64 {
    let started = Instant::now();
    if let Err(failed) = scenario.seeds(seeds).try_run() {
        eprintln!("{failed}");
        std::process::exit(1);
    }
    started.elapsed().as_secs_f64()
}

fn main() {
    let seeds: u64 = match std::env::args().nth(1) {
        Some(n) => n.parse().unwrap_or_else(|_| {
            eprintln!("usage: testkit_speed [SEEDS [all]]");
            std::process::exit(2)
        }),
        None => 200,
    };
    println!("{seeds} seeds of 10 messages, seconds on the wall clock");
    println!("{:<22} {:>8} {:>10}", "faults", "plain", "effectful");
    let row = |name: &str, only: Option<FaultKind>| {
        let pick = |s: Scenario| match only {
            None => s,
            Some(kind) => FaultKind::ALL
                .into_iter()
                .filter(|k| *k != kind)
                .fold(s, Scenario::without),
        };
        let p = seconds(pick(plain()), seeds);
        let e = seconds(pick(effectful()), seeds);
        println!("{name:<22} {p:>8.1} {e:>10.1}");
    };
    row("all (the default)", None);
    if std::env::args().nth(2).as_deref() == Some("all") {
        return;
    }
    for kind in FaultKind::ALL {
        row(&kind.to_string(), Some(kind));
    }
}
