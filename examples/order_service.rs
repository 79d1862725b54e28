//! The pattern articles' flow: an `OrderPaid` event marks the order paid
//! and publishes a shipping request, exactly once, although the (simulated)
//! broker delivers at least once: it duplicates, redelivers early, the
//! handler fails now and then, one message is poison, one producer reuses an
//! id with a different payload, and half-way through the engine's process
//! is killed with SIGKILL.
//!
//! ```text
//! cargo run --example order_service [-- --orders 5000 --db path.db]
//! ```
//! Without `--db` it works on a temporary database.
//!
//! How the crash works: the demo starts itself again as a child process
//! (hidden `--child` argument, same database), which opens the engine and
//! consumes from the broker. The broker's durable state is a journal file
//! beside the database (`<db>.broker-journal`): a line when a message is
//! handed to the consumer, and a line for every ack or nack, written only
//! after `deliver` answered. Once about half the orders are acknowledged the
//! parent kills the child with SIGKILL at whatever instant it happens to be
//! at — inside a handler, in the middle of a COMMIT, between a commit and
//! its ack. It then replays the journal, as a broker recovering a dead
//! consumer would: every message not acknowledged is redelivered (some were
//! in flight at the kill), and some acknowledged ones come back too. The
//! parent reopens the engine in-process (recovery at open counts the attempt
//! of a handler that died) and finishes the run.
//!
//! What to look for: the `SIGKILL` line and the in-flight deliveries it
//! interrupted — some had committed before the kill and are answered
//! `Duplicate` on redelivery, the others are processed then — and the
//! invariants at the end, checked against the domain table: every valid
//! order paid exactly once, one shipping request each, the poison message a
//! dead letter, the reused id quarantined. The exit status is non-zero when
//! one fails.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use postroom::{handler_fn, Failure, Message, Outcome, Outgoing, Postroom};
use serde::{Deserialize, Serialize};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const CONSUMER: &str = "order-service";
/// Consumer threads, in the child and in the parent alike.
const CALLERS: usize = 4;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct OrderPaid {
    order_id: i64,
    amount_cents: i64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The order whose payment event is poison (a negative amount).
fn poison_order(orders: i64) -> i64 {
    if orders >= 777 {
        777
    } else {
        orders - 1
    }
}

/// The broker's messages. Both processes derive the same list from the
/// order count, so a journal line names a message by its index (its tag):
/// tags `0..orders` are `evt-1..=evt-N`, and tag `orders` is the producer
/// bug, evt-5 sent again with another payload.
fn messages(orders: i64) -> Res<Vec<Message>> {
    let poison = poison_order(orders);
    let mut msgs = Vec::new();
    for id in 1..=orders {
        let amount_cents = if id == poison { -500 } else { 1000 + id };
        let paid = OrderPaid {
            order_id: id,
            amount_cents,
        };
        msgs.push(Message::from_json("payments", format!("evt-{id}"), &paid)?);
    }
    let reused = OrderPaid {
        order_id: 5,
        amount_cents: 99_999,
    };
    msgs.push(Message::from_json("payments", "evt-5", &reused)?);
    Ok(msgs)
}

/// What the broker keeps on disk: `D <tag>` when a message is handed to
/// the consumer, `A <tag> <outcome>` / `N <tag> <outcome>` for its ack or
/// nack. Each line is a single append `write(2)`, so a SIGKILL cuts the
/// journal between lines, never inside one. (No fsync: the kernel keeps
/// what a killed process wrote; the demo does not simulate power loss.)
/// The outcome word is not something a broker would know; the demo keeps
/// it to build its table from the journal alone, across both processes.
struct Journal {
    file: Mutex<File>,
}

impl Journal {
    fn append_to(path: &Path) -> std::io::Result<Journal> {
        let file = OpenOptions::new().append(true).open(path)?;
        Ok(Journal {
            file: Mutex::new(file),
        })
    }

    fn record(&self, line: String) -> std::io::Result<()> {
        lock(&self.file).write_all(line.as_bytes())
    }
}

/// The journal read back: per tag, whether it was ever acknowledged and
/// how many deliveries got no answer.
#[derive(Default)]
struct Replay {
    deliveries: u64,
    processed: u64,
    duplicates: u64,
    nacked: u64,
    dead: u64,
    conflicts: u64,
    acked: Vec<bool>,
    unanswered: Vec<u32>,
    /// The first answer each tag got in this stretch of the journal.
    first_answer: Vec<Option<String>>,
}

impl Replay {
    fn of(text: &str, tags: usize) -> Replay {
        let mut r = Replay {
            acked: vec![false; tags],
            unanswered: vec![0; tags],
            first_answer: vec![None; tags],
            ..Replay::default()
        };
        // A final piece without its newline would be a torn line; there
        // is none (one write per line), but a broker would skip it too.
        let complete = text.rfind('\n').map_or("", |end| &text[..end]);
        for line in complete.lines() {
            let mut parts = line.split(' ');
            let (Some(op), Some(Ok(tag))) = (parts.next(), parts.next().map(str::parse::<usize>))
            else {
                continue;
            };
            if tag >= tags {
                continue;
            }
            let kind = parts.next().unwrap_or("");
            match op {
                "D" => {
                    r.deliveries += 1;
                    r.unanswered[tag] += 1;
                    continue;
                }
                "A" => r.acked[tag] = true,
                "N" => r.nacked += 1,
                _ => continue,
            }
            r.unanswered[tag] = r.unanswered[tag].saturating_sub(1);
            r.first_answer[tag].get_or_insert_with(|| kind.to_owned());
            match kind {
                "processed" => r.processed += 1,
                "duplicate" => r.duplicates += 1,
                "dead" => r.dead += 1,
                "conflict" => r.conflicts += 1,
                _ => {}
            }
        }
        r
    }
}

/// A broker that delivers at least once: unacked messages come back, and
/// acked ones sometimes come back anyway.
struct Broker {
    messages: Vec<Message>,
    queue: Mutex<VecDeque<(usize, Instant)>>,
    rng: AtomicU64,
    journal: Journal,
    /// Across both processes, for the progress lines.
    deliveries: AtomicU64,
    processed: AtomicU64,
    /// No more duplicate redeliveries of acked messages past this many
    /// deliveries, so the run ends.
    duplicate_budget: u64,
}

impl Broker {
    fn chance(&self, percent: u64) -> bool {
        // SplitMix64 step; a shared counter is plenty for a demo.
        let mut z = self.rng.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) % 100 < percent
    }

    fn next(&self) -> Option<usize> {
        let mut q = lock(&self.queue);
        let now = Instant::now();
        for _ in 0..q.len() {
            let (tag, due) = q.pop_front()?;
            if due <= now {
                return Some(tag);
            }
            q.push_back((tag, due));
        }
        None
    }

    fn requeue(&self, tag: usize, after: Duration) {
        lock(&self.queue).push_back((tag, Instant::now() + after));
    }

    fn is_empty(&self) -> bool {
        lock(&self.queue).is_empty()
    }
}

/// The engine, as both processes open it. `workers(0)`: the broker does
/// the redelivering here. With workers, a failed message may be in a
/// worker's hands when the broker redelivers it, and the answer is
/// `InFlight` with the rest of the lease (30 s by default) as `retry_after`.
fn open(db: &Path) -> postroom::Result<Postroom> {
    Postroom::builder()
        .workers(0)
        .backoff(Duration::from_millis(5), Duration::from_millis(100))
        .consumer(
            CONSUMER,
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
                    "UPDATE orders SET paid = 1, times_paid = times_paid + 1, amount_cents = ?2
                     WHERE id = ?1",
                    [paid.order_id, paid.amount_cents],
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

fn journal_path(db: &Path) -> PathBuf {
    let mut path = db.as_os_str().to_owned();
    path.push(".broker-journal");
    path.into()
}

fn main() -> Res<()> {
    let orders: i64 = arg("--orders")
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(2000);
    if orders < 10 {
        return Err("--orders must be at least 10".into());
    }
    if std::env::args().any(|a| a == "--child") {
        let db = arg("--db").ok_or("--child needs --db")?;
        return child_main(orders, Path::new(&db));
    }
    let tmp = tempfile::tempdir()?;
    let db = arg("--db")
        .map(PathBuf::from)
        .unwrap_or_else(|| tmp.path().join("orders.db"));
    if db.exists() {
        // The checks count conflicts and dead letters from this run only.
        return Err(format!("{} exists; give a new file", db.display()).into());
    }
    let journal = journal_path(&db);
    println!(
        "postroom order_service demo: {orders} orders, database {}",
        db.display()
    );

    {
        let room = open(&db)?;
        room.transaction(move |tx| {
            tx.execute_batch(
                "CREATE TABLE IF NOT EXISTS orders (
                     id INTEGER PRIMARY KEY, paid INTEGER NOT NULL DEFAULT 0,
                     times_paid INTEGER NOT NULL DEFAULT 0, amount_cents INTEGER);",
            )?;
            for id in 1..=orders {
                tx.execute("INSERT OR IGNORE INTO orders (id) VALUES (?1)", [id])?;
            }
            Ok(())
        })?;
        room.shutdown(Duration::from_secs(5))?;
    }
    File::create(&journal)?;
    let msgs = messages(orders)?;
    let tags = msgs.len();

    // Phase 1: the engine runs in a child process, which we kill.
    let started = Instant::now();
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--child", "--orders", &orders.to_string(), "--db"])
        .arg(&db)
        .stdin(Stdio::null())
        .spawn()?;
    println!(
        "  engine running in child process {} (broker journal {})",
        child.id(),
        journal.display()
    );
    let kill_after = orders as u64 / 2;
    let acks = match wait_for_acks(&mut child, &journal, kill_after) {
        Ok(acks) => acks,
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
    };
    // Let it run on for a moment so the kill lands at an arbitrary instant,
    // not right after an ack.
    std::thread::sleep(Duration::from_micros(
        u64::from(started.elapsed().subsec_nanos()) % 20_000,
    ));
    child.kill()?; // SIGKILL
    let status = child.wait()?;
    let killed = was_killed(&status);

    // The broker recovers from its journal.
    let crash_text = std::fs::read_to_string(&journal)?;
    let before = Replay::of(&crash_text, tags);
    let in_flight: Vec<usize> = (0..tags).filter(|&t| before.unanswered[t] > 0).collect();
    let broker = Broker {
        messages: msgs,
        queue: Mutex::new(VecDeque::new()),
        rng: AtomicU64::new(7),
        journal: Journal::append_to(&journal)?,
        deliveries: AtomicU64::new(before.deliveries),
        processed: AtomicU64::new(before.processed),
        duplicate_budget: tags as u64 * 3,
    };
    let (mut unacked, mut acked_again) = (0u64, 0u64);
    for tag in 0..tags {
        if !before.acked[tag] {
            unacked += 1;
            broker.requeue(tag, Duration::ZERO);
        } else if broker.chance(10) {
            // Acks the broker had not made durable when its consumer died.
            acked_again += 1;
            broker.requeue(tag, Duration::ZERO);
        }
    }
    println!(
        "  SIGKILL sent after {acks} acks: child {status}; {} deliveries were in flight",
        in_flight.len()
    );
    println!(
        "  broker redelivers {unacked} unacknowledged messages and {acked_again} acknowledged ones"
    );

    // Phase 2: this process reopens the engine and finishes the run.
    let room = open(&db)?;
    println!("  engine reopened in this process");
    run_consumers(&room, &broker)?;
    let elapsed = started.elapsed();

    let full_text = std::fs::read_to_string(&journal)?;
    let all = Replay::of(&full_text, tags);
    let after = Replay::of(&full_text[crash_text.len()..], tags);
    let redelivered_in_flight: Vec<&str> = in_flight
        .iter()
        .filter_map(|&t| after.first_answer[t].as_deref())
        .collect();
    let committed_before_kill = redelivered_in_flight
        .iter()
        .filter(|&&k| k == "duplicate")
        .count();

    let stats = room.stats()?;
    let dead_letters = room.dead_letters(Some(CONSUMER), 10)?;
    let check = rusqlite::Connection::open(&db)?;
    let count = |sql: &str| -> rusqlite::Result<i64> { check.query_row(sql, [], |r| r.get(0)) };
    let paid = count("SELECT count(*) FROM orders WHERE paid = 1")?;
    let paid_twice = count("SELECT count(*) FROM orders WHERE times_paid > 1")?;
    let order5_amount: Option<i64> =
        check.query_row("SELECT amount_cents FROM orders WHERE id = 5", [], |r| {
            r.get(0)
        })?;
    let shipping =
        count("SELECT count(*) FROM postroom_outbox WHERE topic = 'shipping.requested'")?;
    let shipping_keys = count(
        "SELECT count(DISTINCT key) FROM postroom_outbox WHERE topic = 'shipping.requested'",
    )?;
    let inbox = stats.inbox.get(CONSUMER).copied().unwrap_or_default();

    println!();
    let row = |what: &str, n: u64| println!("{what:<44} {n:>10}");
    row("deliveries made by the broker", all.deliveries);
    row("processed (handler committed, acked)", all.processed);
    row("duplicates absorbed (handler not run)", all.duplicates);
    row("retries asked for (not acked)", all.nacked);
    row("dead letters (poison message)", inbox.dead);
    row("conflicts quarantined (id reused)", stats.conflicts);
    row(
        "deliveries in flight at the SIGKILL",
        in_flight.len() as u64,
    );
    row(
        "  of which had committed before it",
        committed_before_kill as u64,
    );
    row(
        "messages redelivered after the SIGKILL",
        unacked + acked_again,
    );
    row("outbox rows waiting for the relay", stats.outbox.pending);
    println!(
        "{:<44} {:>10.0}",
        "deliveries per second",
        all.deliveries as f64 / elapsed.as_secs_f64()
    );
    println!();
    let poison_id = format!("evt-{}", poison_order(orders));
    let checks = [
        (
            format!(
                "the engine was killed with SIGKILL mid-run ({} deliveries in flight, \
                 {} redelivered after it)",
                in_flight.len(),
                unacked + acked_again
            ),
            killed && unacked > 0 && after.deliveries > 0,
        ),
        ("every valid order paid".into(), paid == orders - 1),
        ("no order paid twice".into(), paid_twice == 0),
        (
            "one shipping request per paid order".into(),
            shipping == paid && shipping_keys == paid,
        ),
        (
            "the poison message is a dead letter".into(),
            inbox.dead == 1
                && all.dead >= 1
                && dead_letters.len() == 1
                && dead_letters[0].message.id() == poison_id,
        ),
        (
            "the reused id is quarantined (order 5 kept its first payload)".into(),
            stats.conflicts == 1 && all.conflicts >= 1 && order5_amount == Some(1005),
        ),
        (
            "inbox completed == orders paid".into(),
            inbox.completed as i64 == paid,
        ),
        (
            "every message acknowledged in the end".into(),
            all.acked.iter().all(|&a| a) && broker.is_empty(),
        ),
    ];
    let mut ok = true;
    for (what, passed) in &checks {
        println!("  [{}] {what}", if *passed { "ok" } else { "FAILED" });
        ok &= passed;
    }
    room.shutdown(Duration::from_secs(5))?;
    if !ok {
        return Err("invariants violated".into());
    }
    println!("\nall invariants hold ({:.1} s)", elapsed.as_secs_f64());
    Ok(())
}

/// Waits until the journal holds `wanted` acks, reading only what was
/// appended since the last look.
fn wait_for_acks(child: &mut std::process::Child, journal: &Path, wanted: u64) -> Res<u64> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut file = File::open(journal)?;
    let (mut pos, mut acks, mut buf) = (0u64, 0u64, String::new());
    loop {
        if let Some(status) = child.try_wait()? {
            return Err(format!("the engine process ended on its own ({status})").into());
        }
        if Instant::now() > deadline {
            return Err("no progress from the engine process in 60 s".into());
        }
        buf.clear();
        file.seek(SeekFrom::Start(pos))?;
        file.read_to_string(&mut buf)?;
        if let Some(end) = buf.rfind('\n') {
            acks += buf[..end].lines().filter(|l| l.starts_with("A ")).count() as u64;
            pos += end as u64 + 1;
        }
        if acks >= wanted {
            return Ok(acks);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The child: opens the engine and consumes until it is killed.
fn child_main(orders: i64, db: &Path) -> Res<()> {
    let room = open(db)?;
    let msgs = messages(orders)?;
    let tags = msgs.len();
    let broker = Broker {
        messages: msgs,
        queue: Mutex::new((0..tags).map(|t| (t, Instant::now())).collect()),
        rng: AtomicU64::new(42),
        journal: Journal::append_to(&journal_path(db))?,
        deliveries: AtomicU64::new(0),
        processed: AtomicU64::new(0),
        duplicate_budget: tags as u64 * 3,
    };
    run_consumers(&room, &broker)?;
    // The parent kills us long before the queue is empty; should it have
    // died, do not linger.
    std::thread::sleep(Duration::from_secs(120));
    Err("the parent never killed this child".into())
}

fn run_consumers(room: &Postroom, broker: &Broker) -> Res<()> {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..CALLERS)
            .map(|_| s.spawn(|| consume(room, broker)))
            .collect();
        for h in handles {
            h.join().map_err(|_| "a consumer thread panicked")??;
        }
        Ok(())
    })
}

fn consume(room: &Postroom, broker: &Broker) -> std::io::Result<()> {
    loop {
        let Some(tag) = broker.next() else {
            if broker.is_empty() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(1));
            continue;
        };
        broker.journal.record(format!("D {tag}\n"))?;
        let n = broker.deliveries.fetch_add(1, Ordering::Relaxed) + 1;
        if n.is_multiple_of(1000) {
            println!(
                "  {n} deliveries, {} processed (pid {})",
                broker.processed.load(Ordering::Relaxed),
                std::process::id()
            );
        }
        let outcome = match room.deliver(CONSUMER, broker.messages[tag].clone()) {
            Ok(outcome) => outcome,
            Err(e) => {
                // Nothing was acknowledged; the broker will try again.
                eprintln!("  delivery error ({e}); redelivering");
                broker.journal.record(format!("N {tag} error\n"))?;
                broker.requeue(tag, Duration::from_millis(10));
                continue;
            }
        };
        let kind = match &outcome {
            Outcome::Processed { .. } => {
                broker.processed.fetch_add(1, Ordering::Relaxed);
                "processed"
            }
            Outcome::Duplicate => "duplicate",
            Outcome::Dead { .. } => "dead",
            Outcome::Conflict { .. } => "conflict",
            Outcome::Failed { .. } => "failed",
            Outcome::InFlight { .. } => "in-flight",
            _ => "other",
        };
        if outcome.should_ack() {
            broker.journal.record(format!("A {tag} {kind}\n"))?;
            // At-least-once: one acked message in five comes back anyway.
            if broker.chance(20) && n < broker.duplicate_budget {
                broker.requeue(tag, Duration::ZERO);
            }
        } else {
            broker.journal.record(format!("N {tag} {kind}\n"))?;
            // Brokers do not always honour retry_after: redeliver early a
            // third of the time; postroom answers without running the handler.
            let after = if broker.chance(33) {
                Duration::ZERO
            } else {
                outcome.retry_after().unwrap_or_default()
            };
            broker.requeue(tag, after);
        }
    }
}

/// Whether `Child::kill` ended the child: SIGKILL on unix; on Windows
/// `TerminateProcess`, which std calls with exit code 1.
fn was_killed(status: &std::process::ExitStatus) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        status.signal() == Some(9)
    }
    #[cfg(not(unix))]
    {
        status.code() == Some(1)
    }
}
