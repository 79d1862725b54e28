//! The pattern articles' flow: an `OrderPaid` event marks the order paid
//! and publishes a shipping request, exactly once, although the (simulated)
//! broker delivers at least once: it duplicates, redelivers early, the
//! handler fails now and then, one message is poison, one producer reuses an
//! id with a different payload, and the engine is restarted mid-run.
//!
//! ```text
//! cargo run --release --example order_service [-- --orders 5000 --db path.db]
//! ```
//! Without `--db` it works on a temporary database.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use postroom::{handler_fn, Failure, Message, Outcome, Outgoing, Postroom};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct OrderPaid {
    order_id: i64,
    amount_cents: i64,
}

/// A broker that delivers at least once: unacked messages come back, and
/// acked ones sometimes come back anyway.
struct Broker {
    queue: Mutex<VecDeque<(Message, Instant)>>,
    rng: AtomicU64,
}

impl Broker {
    fn chance(&self, percent: u64) -> bool {
        // SplitMix64 step; a shared counter is plenty for a demo.
        let mut z = self.rng.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) % 100 < percent
    }
    fn next(&self) -> Option<Message> {
        let mut q = self.queue.lock().unwrap();
        let now = Instant::now();
        for _ in 0..q.len() {
            let (msg, due) = q.pop_front()?;
            if due <= now {
                return Some(msg);
            }
            q.push_back((msg, due));
        }
        None
    }
    fn requeue(&self, msg: Message, after: Duration) {
        self.queue
            .lock()
            .unwrap()
            .push_back((msg, Instant::now() + after));
    }
    fn is_empty(&self) -> bool {
        self.queue.lock().unwrap().is_empty()
    }
}

#[derive(Default)]
struct Tally {
    deliveries: AtomicU64,
    processed: AtomicU64,
    duplicates: AtomicU64,
    failed: AtomicU64,
    dead: AtomicU64,
    conflicts: AtomicU64,
}

fn open(db: &std::path::Path) -> postroom::Result<Postroom> {
    Postroom::builder()
        .backoff(Duration::from_millis(5), Duration::from_millis(100))
        .consumer(
            "order-service",
            handler_fn(|tx, msg| {
                let paid: OrderPaid = msg.json()?; // undecodable: dead at once
                if paid.amount_cents <= 0 {
                    return Err(Failure::reject(format!(
                        "amount {} is not positive",
                        paid.amount_cents
                    )));
                }
                // A flaky payment ledger: one first attempt in ten times out.
                if tx.attempt() == 1 && paid.order_id % 10 == 3 {
                    return Err(Failure::retry("ledger timed out"));
                }
                tx.execute(
                    "UPDATE orders SET paid = 1, times_paid = times_paid + 1 WHERE id = ?1",
                    [paid.order_id],
                )?;
                tx.publish(
                    Outgoing::json("shipping.requested", &paid)?
                        .with_key(paid.order_id.to_string()),
                )?;
                Ok(())
            }),
        )
        .open(db)
}

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let orders: i64 = arg("--orders")
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(2000);
    let tmp = tempfile::tempdir()?;
    let db = arg("--db")
        .map(Into::into)
        .unwrap_or_else(|| tmp.path().join("orders.db"));
    println!(
        "postroom order_service demo: {orders} orders, database {}",
        db.display()
    );

    let mut room = open(&db)?;
    room.transaction(move |tx| {
        tx.execute_batch(
            "CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, paid INTEGER NOT NULL DEFAULT 0,
                                                times_paid INTEGER NOT NULL DEFAULT 0);",
        )?;
        for id in 1..=orders {
            tx.execute("INSERT OR IGNORE INTO orders (id) VALUES (?1)", [id])?;
        }
        Ok(())
    })?;

    let broker = Broker {
        queue: Mutex::new(VecDeque::new()),
        rng: AtomicU64::new(42),
    };
    for id in 1..=orders {
        let amount_cents = if id == 777 { -500 } else { 1000 + id };
        let msg = Message::from_json(
            "payments",
            format!("evt-{id}"),
            &OrderPaid {
                order_id: id,
                amount_cents,
            },
        )?;
        broker.requeue(msg, Duration::ZERO);
    }
    // A producer bug: evt-5 sent again with another payload.
    broker.requeue(
        Message::from_json(
            "payments",
            "evt-5",
            &OrderPaid {
                order_id: 5,
                amount_cents: 99_999,
            },
        )?,
        Duration::ZERO,
    );

    let tally = Tally::default();
    let started = Instant::now();
    for phase in 0..2 {
        // Phase 0 stops half-way through for a restart (as in a deploy).
        let stop_at = if phase == 0 {
            orders as u64 / 2
        } else {
            u64::MAX
        };
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| consume(&room, &broker, &tally, stop_at));
            }
        });
        if phase == 0 {
            let report = room.shutdown(Duration::from_secs(5))?;
            println!(
                "  restarting the engine mid-run (clean shutdown: {})",
                report.is_clean()
            );
            drop(room);
            room = open(&db)?;
        }
    }
    let elapsed = started.elapsed();

    let stats = room.stats()?;
    let check = rusqlite::Connection::open(&db)?;
    let paid_twice: i64 = check.query_row(
        "SELECT count(*) FROM orders WHERE times_paid > 1",
        [],
        |r| r.get(0),
    )?;
    let paid: i64 = check.query_row("SELECT count(*) FROM orders WHERE paid = 1", [], |r| {
        r.get(0)
    })?;
    let shipping: i64 = check.query_row(
        "SELECT count(DISTINCT key) FROM postroom_outbox WHERE topic = 'shipping.requested'",
        [],
        |r| r.get(0),
    )?;
    let inbox = stats
        .inbox
        .get("order-service")
        .copied()
        .unwrap_or_default();
    let t = |c: &AtomicU64| c.load(Ordering::Relaxed);
    println!();
    println!(
        "{:<44} {:>10}",
        "deliveries made by the broker",
        t(&tally.deliveries)
    );
    println!(
        "{:<44} {:>10}",
        "processed (handler committed)",
        t(&tally.processed)
    );
    println!(
        "{:<44} {:>10}",
        "duplicates absorbed (handler not run)",
        t(&tally.duplicates)
    );
    println!(
        "{:<44} {:>10}",
        "retries asked for (not acked)",
        t(&tally.failed)
    );
    println!("{:<44} {:>10}", "dead letters (poison message)", inbox.dead);
    println!(
        "{:<44} {:>10}",
        "conflicts quarantined (id reused)", stats.conflicts
    );
    println!(
        "{:<44} {:>10}",
        "outbox rows waiting for the relay", stats.outbox.pending
    );
    println!(
        "{:<44} {:>10.0}",
        "deliveries per second",
        t(&tally.deliveries) as f64 / elapsed.as_secs_f64()
    );
    println!();
    let checks = [
        ("every valid order paid", paid == orders - 1),
        ("no order paid twice", paid_twice == 0),
        ("one shipping request per paid order", shipping == paid),
        (
            "the poison message is a dead letter",
            inbox.dead == 1 && t(&tally.dead) >= 1,
        ),
        (
            "the reused id is quarantined",
            stats.conflicts == 1 && t(&tally.conflicts) >= 1,
        ),
        (
            "inbox completed == orders paid",
            inbox.completed as i64 == paid,
        ),
    ];
    let mut ok = true;
    for (what, passed) in checks {
        println!("  [{}] {what}", if passed { "ok" } else { "FAILED" });
        ok &= passed;
    }
    room.shutdown(Duration::from_secs(5))?;
    if !ok {
        return Err("invariants violated".into());
    }
    println!("\nall invariants hold ({:.1} s)", elapsed.as_secs_f64());
    Ok(())
}

fn consume(room: &Postroom, broker: &Broker, tally: &Tally, stop_at: u64) {
    let total = broker.queue.lock().unwrap().len().max(1) as u64;
    loop {
        if tally.processed.load(Ordering::Relaxed) >= stop_at {
            return;
        }
        let Some(msg) = broker.next() else {
            if broker.is_empty() {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
            continue;
        };
        let n = tally.deliveries.fetch_add(1, Ordering::Relaxed) + 1;
        if n.is_multiple_of(1000) {
            println!(
                "  {n} deliveries, {} processed",
                tally.processed.load(Ordering::Relaxed)
            );
        }
        let outcome = match room.deliver("order-service", msg.clone()) {
            Ok(outcome) => outcome,
            Err(e) => {
                // Nothing was acknowledged; the broker will try again.
                eprintln!("  delivery error ({e}); redelivering");
                broker.requeue(msg, Duration::from_millis(10));
                continue;
            }
        };
        let counter = match &outcome {
            Outcome::Processed { .. } => &tally.processed,
            Outcome::Duplicate => &tally.duplicates,
            Outcome::Dead { .. } => &tally.dead,
            Outcome::Conflict { .. } => &tally.conflicts,
            _ => &tally.failed,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        if outcome.should_ack() {
            // At-least-once: one acked message in five comes back anyway.
            if broker.chance(20) && n < total * 3 {
                broker.requeue(msg, Duration::ZERO);
            }
        } else {
            // Brokers do not always honour retry_after: redeliver early a
            // third of the time; postroom answers without running the handler.
            let after = if broker.chance(33) {
                Duration::ZERO
            } else {
                outcome.retry_after().unwrap_or_default()
            };
            broker.requeue(msg, after);
        }
    }
}
