//! Two postroom devices bridged through a real NATS JetStream server:
//! device A publishes orders through its outbox (`NatsSink`) into the
//! stream `SHOP`, device B — a child process — pulls them through a durable
//! consumer into its inbox (`NatsIntake`) and applies each to its own
//! table. Midway the server is SIGKILLed and started again on its store,
//! and later device B is SIGKILLed and started again. At the end every
//! order must have been applied on B exactly once, each customer's in
//! order.
//!
//! Needs `nats-server` (Debian: `apt-get install nats-server`), started on
//! a free localhost port with JetStream and its store in a temp dir; the
//! example says so and stops when it is not installed.
//!
//! ```text
//! cargo run --features nats --example nats_bridge
//! ```

#[path = "../tests/support/nats_server.rs"]
mod nats_server;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use postroom::nats::{ensure_stream, NatsIntake, NatsSink};
use postroom::{handler_fn, Message, Outgoing, Postroom};

/// Orders published during the chaos run.
const ORDERS: i64 = 3000;
/// Orders committed at once first, to time the sink alone.
const BURST: i64 = 5000;
const CUSTOMERS: i64 = 20;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("device-b") {
        return device_b(Path::new(&args[2]), &args[3]);
    }
    run()
}

/// Device B, in its own process: applies each order to `applied`, says
/// READY once bound to its durable consumer, prints its intake's counters every 100 ms, and
/// stops cleanly when its stdin closes.
fn device_b(db: &Path, url: &str) -> Res<()> {
    let room = Postroom::builder()
        .consumer(
            "shipping",
            handler_fn(|tx, msg: &Message| {
                let order: serde_json::Value = msg.json()?;
                tx.execute(
                    "INSERT INTO applied (order_id, customer, n) VALUES (?1, ?2, ?3)",
                    rusqlite::params![msg.id(), order["customer"].as_i64(), order["n"].as_i64()],
                )?;
                Ok(())
            }),
        )
        .open(db)?;
    room.transaction(|tx| {
        tx.execute_batch(
            "CREATE TABLE IF NOT EXISTS applied (order_id TEXT NOT NULL, customer INTEGER, n INTEGER)",
        )?;
        Ok(())
    })?;
    let room = Arc::new(room);
    // A short ack wait: what the killed B pulled and never answered comes
    // back after it (nothing behind it is applied first).
    let intake = NatsIntake::builder(url, Arc::clone(&room), "shipping", "SHOP", "device-b")
        .ack_wait(Duration::from_secs(2))
        .start()?;
    if !intake.wait_bound(Duration::from_secs(30)) {
        return Err("device B: not bound to its consumer".into());
    }
    println!("READY");
    let (eof_tx, eof) = mpsc::sync_channel(1);
    thread::spawn(move || {
        let _ = std::io::stdin().read_line(&mut String::new());
        let _ = eof_tx.send(());
    });
    let print = |intake: &NatsIntake| {
        let s = intake.stats();
        println!(
            "STATS {} {} {} {}",
            s.received, s.redelivered, s.duplicates, s.connects
        );
    };
    while eof.recv_timeout(Duration::from_millis(100)).is_err() {
        print(&intake);
    }
    print(&intake);
    intake.shutdown(Duration::from_secs(5))?;
    room.shutdown(Duration::from_secs(5))?;
    Ok(())
}

/// A running device B and the last counters it printed.
struct DeviceB {
    child: Child,
    lines: mpsc::Receiver<String>,
    stats: [u64; 4],
}

impl DeviceB {
    fn start(db: &Path, url: &str) -> Res<DeviceB> {
        let mut child = Command::new(std::env::current_exe()?)
            .arg("device-b")
            .arg(db)
            .arg(url)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let (tx, lines) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut b = DeviceB {
            child,
            lines,
            stats: [0; 4],
        };
        loop {
            match b.lines.recv_timeout(Duration::from_secs(30))?.as_str() {
                "READY" => return Ok(b),
                line => b.note(line),
            }
        }
    }

    fn note(&mut self, line: &str) {
        if let Some(rest) = line.strip_prefix("STATS ") {
            for (slot, n) in self.stats.iter_mut().zip(rest.split(' ')) {
                *slot = n.parse().unwrap_or(*slot);
            }
        }
    }

    /// SIGKILL; returns the counters it had printed last.
    fn kill(mut self) -> Res<[u64; 4]> {
        self.child.kill()?;
        self.child.wait()?;
        while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(5)) {
            self.note(&line);
        }
        Ok(self.stats)
    }

    /// Closes its stdin and waits for it to stop cleanly.
    fn stop(mut self) -> Res<[u64; 4]> {
        drop(self.child.stdin.take());
        let status = self.child.wait()?;
        if !status.success() {
            return Err(format!("device B exited {status}").into());
        }
        while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(5)) {
            self.note(&line);
        }
        Ok(self.stats)
    }
}

/// B's `applied`: (rows, distinct orders, each customer's numbers in the
/// order applied).
fn applied(db: &Path) -> (i64, i64, HashMap<i64, Vec<i64>>) {
    let Ok(conn) = rusqlite::Connection::open_with_flags(
        db,
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
    ) else {
        return (0, 0, HashMap::new());
    };
    let _ = conn.busy_timeout(Duration::from_secs(5));
    let (rows, distinct) = conn
        .query_row(
            "SELECT count(*), count(DISTINCT order_id) FROM applied",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap_or((0, 0));
    let mut order: HashMap<i64, Vec<i64>> = HashMap::new();
    if let Ok(mut stmt) = conn.prepare("SELECT customer, n FROM applied ORDER BY rowid") {
        if let Ok(rows) = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?))) {
            for (customer, n) in rows.flatten() {
                order.entry(customer).or_default().push(n);
            }
        }
    }
    (rows, distinct, order)
}

fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

fn wait_until(secs: u64, what: &str, mut f: impl FnMut() -> bool) -> Res<()> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !f() {
        if Instant::now() > deadline {
            return Err(format!("timed out waiting for {what}").into());
        }
        thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

fn publish(a: &Postroom, from: i64, to: i64) -> postroom::Result<()> {
    a.transaction(move |tx| {
        for n in from..to {
            let customer = n % CUSTOMERS;
            let order = serde_json::json!({ "customer": customer, "n": n });
            tx.publish(Outgoing::json("order.placed", &order)?.with_key(customer.to_string()))?;
        }
        Ok(())
    })
}

fn run() -> Res<()> {
    let started = Instant::now();
    let dir = tempfile::tempdir()?;
    let Some(mut server) = nats_server::NatsServer::start(&dir.path().join("nats")) else {
        return Ok(());
    };
    let url = server.url();
    ensure_stream(&url, "SHOP", &["shop.>"])?;
    let b_db = dir.path().join("device-b.db");
    let a_db = dir.path().join("device-a.db");
    let mut b = Some(DeviceB::start(&b_db, &url)?);
    let a = Postroom::builder()
        .relay_poll(Duration::from_millis(20))
        .sink(
            NatsSink::new(&url)
                .source("device-a")
                .subject_prefix("shop.")
                .ack_timeout(Duration::from_secs(2))
                .backoff(Duration::from_millis(50), Duration::from_millis(500)),
        )
        .open(&a_db)?;

    // 1. The sink alone: a burst committed at once, timed until all sent.
    let t = Instant::now();
    for chunk in 0..BURST / 500 {
        publish(&a, chunk * 500, (chunk + 1) * 500)?;
    }
    wait_until(60, "the burst sent", || {
        a.stats().is_ok_and(|s| s.outbox.sent == BURST as u64)
    })?;
    let burst_secs = t.elapsed().as_secs_f64();
    wait_until(60, "the burst applied on B", || applied(&b_db).1 == BURST)?;
    let burst_applied_secs = t.elapsed().as_secs_f64();

    // 2. A steady stream, with the server killed and restarted and B killed midway.
    let total = BURST + ORDERS;
    let mut killed_b = [0u64; 4];
    let mut outage = Duration::ZERO;
    let mut outage_ms = (0, 0);
    thread::scope(|s| -> Res<()> {
        let a = &a;
        let publisher = s.spawn(move || -> postroom::Result<()> {
            for n in BURST..total {
                publish(a, n, n + 1)?;
                thread::sleep(Duration::from_micros(1500));
            }
            Ok(())
        });
        // Mid-stream on A's side, however far behind B is.
        wait_until(30, "a third of the stream committed", || {
            a.stats()
                .is_ok_and(|s| s.outbox.sent + s.outbox.pending >= (BURST + ORDERS / 3) as u64)
        })?;
        println!("SIGKILL the server, start it again after 1 s");
        let down = Instant::now();
        outage_ms.0 = unix_ms();
        server.restart(Duration::from_secs(1));
        outage_ms.1 = unix_ms();
        outage = down.elapsed();
        wait_until(30, "two thirds of the stream applied", || {
            applied(&b_db).1 >= BURST + 2 * ORDERS / 3
        })?;
        println!("SIGKILL device B, start it again");
        killed_b = b.take().ok_or("no device B")?.kill()?;
        thread::sleep(Duration::from_millis(300));
        b = Some(DeviceB::start(&b_db, &url)?);
        publisher.join().expect("publisher panicked")?;
        Ok(())
    })?;
    wait_until(40, "every order applied on B", || applied(&b_db).1 == total)?;
    let last_b = b.take().ok_or("no device B")?.stop()?;
    wait_until(10, "every row sent", || {
        a.stats().is_ok_and(|s| s.outbox.sent == total as u64)
    })?;

    // 3. The checks, on B's own table.
    let (rows, distinct, order) = applied(&b_db);
    let in_order = order.values().all(|ns| ns.windows(2).all(|w| w[0] < w[1]));
    let conn = rusqlite::Connection::open(&a_db)?;
    // Commit-to-publish-ack latency of the stream's rows (the burst's rows
    // queue behind each other by design), and of those that met the outage.
    let latency = |filter: &str| -> rusqlite::Result<(i64, i64, i64)> {
        conn.query_row(
            &format!(
                "WITH l AS (SELECT sent_at - created_at AS ms FROM postroom_outbox WHERE {filter})
                 SELECT count(*), coalesce((SELECT ms FROM l ORDER BY ms
                        LIMIT 1 OFFSET (SELECT count(*) / 2 FROM l)), 0),
                        coalesce(max(ms), 0) FROM l"
            ),
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
    };
    let (_, p50, max) = latency(&format!("seq > {BURST}"))?;
    let (in_outage, outage_p50, outage_max) = latency(&format!(
        "created_at BETWEEN {} AND {}",
        outage_ms.0, outage_ms.1
    ))?;
    let (put_off, _, _) = latency("last_error IS NOT NULL")?;
    let sum = |i: usize| killed_b[i] + last_b[i];
    println!();
    println!(
        "nats-server on {url}; {total} orders in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    println!(
        "sink alone: {BURST} committed at once, all acknowledged by the stream in {burst_secs:.2} s = {:.0} msg/s \
         (applied on B after {burst_applied_secs:.2} s)",
        BURST as f64 / burst_secs
    );
    println!("stream: commit-to-publish-ack latency p50 {p50} ms, max {max} ms");
    println!(
        "server outage {:.1} s: {in_outage} rows committed meanwhile, commit-to-publish-ack \
         latency p50 {outage_p50} ms, max {outage_max} ms; {put_off} rows (one per customer \
         key: the rest waited behind them) put off without counting an attempt, none dead",
        outage.as_secs_f64()
    );
    println!(
        "device B (as its two processes last reported): received {} (redelivered {}), duplicates absorbed {}, bindings {}",
        sum(0),
        sum(1),
        sum(2),
        sum(3)
    );
    println!(
        "sent {} / applied on B {distinct} distinct in {rows} effects; per customer in order: \
         {in_order}",
        a.stats()?.outbox.sent
    );
    a.shutdown(Duration::from_secs(5))?;
    if rows != total || distinct != total || !in_order {
        return Err("exactly-once check FAILED".into());
    }
    println!("exactly once: OK");
    Ok(())
}
