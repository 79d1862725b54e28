//! The two-device bridge scenario both demos run: device A publishes orders
//! through its outbox and a sink, device B — a child process, this same
//! program started with `device-b DB ADDRESS` — takes them into its inbox
//! through an intake and applies each to its own table. First a burst is
//! timed through the sink alone; then, in a steady stream, the broker or
//! server is taken down and brought back, and device B is SIGKILLed and
//! started again. At the end every order must have been applied on B
//! exactly once, each customer's in order: the demo fails otherwise.
//!
//! The transport is the caller's: [`Link`] (device A's side: how to open A
//! with its sink, how to restart the server, what device B is told) and a
//! [`StartIntake`] (device B's side). Every wait is bounded.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use postroom::hop::IntakeStats;
use postroom::{handler_fn, Message, Outgoing, Postroom};

/// Orders published during the chaos run.
const ORDERS: i64 = 3000;
/// Orders committed at once first, to time the sink alone.
const BURST: i64 = 5000;
const CUSTOMERS: i64 = 20;

/// The demos' result: any error ends the demo with its message.
pub type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Device B's intake, whichever bridge it is.
pub trait Intake {
    /// Its counters so far.
    fn stats(&self) -> IntakeStats;
    /// Stops it cleanly within `deadline`.
    fn shutdown(self: Box<Self>, deadline: Duration) -> postroom::Result<()>;
}

impl Intake for postroom::mqtt::MqttIntake {
    fn stats(&self) -> IntakeStats {
        postroom::mqtt::MqttIntake::stats(self)
    }
    fn shutdown(self: Box<Self>, deadline: Duration) -> postroom::Result<()> {
        postroom::mqtt::MqttIntake::shutdown(*self, deadline)
    }
}

impl Intake for postroom::nats::NatsIntake {
    fn stats(&self) -> IntakeStats {
        postroom::nats::NatsIntake::stats(self)
    }
    fn shutdown(self: Box<Self>, deadline: Duration) -> postroom::Result<()> {
        postroom::nats::NatsIntake::shutdown(*self, deadline)
    }
}

/// Starts device B's intake on `room` from the address on B's command line
/// and returns it once it is ready to take messages (an error if it is not
/// within a bounded wait).
pub type StartIntake = fn(address: &str, room: Arc<Postroom>) -> Res<Box<dyn Intake>>;

/// A broker or server the demo can take down and bring back.
pub trait Restart {
    /// Down for `outage`, then up again where it was.
    fn restart(&mut self, outage: Duration);
}

impl Restart for crate::broker::Broker {
    fn restart(&mut self, outage: Duration) {
        crate::broker::Broker::restart(self, outage);
    }
}

impl Restart for crate::nats_server::NatsServer {
    fn restart(&mut self, outage: Duration) {
        crate::nats_server::NatsServer::restart(self, outage);
    }
}

/// Device A's side of one bridge, and the words its report uses.
pub struct Link<'a> {
    /// Where the databases go (a temp dir the caller keeps).
    pub dir: PathBuf,
    /// What device B is told on its command line to reach the server.
    pub address: String,
    /// The running broker or server.
    pub server: &'a mut dyn Restart,
    /// Opens device A at the path with its sink.
    pub open_a: &'a dyn Fn(&Path) -> postroom::Result<Postroom>,
    /// The report's words for this transport.
    pub words: Words,
}

/// What the report calls things on this transport.
pub struct Words {
    /// The first report line, naming the server.
    pub server: String,
    /// The line printed as the outage starts.
    pub outage: &'static str,
    /// The server's acknowledgement ("PUBACK").
    pub ack: &'static str,
    /// "all {acked_all} in … s" for the burst.
    pub acked_all: &'static str,
    /// "{server_down} outage … s".
    pub server_down: &'static str,
    /// How a redelivery shows ("redelivered with DUP").
    pub redelivered: &'static str,
    /// What the intake's `connects` counter counts ("connections").
    pub connects: &'static str,
}

/// When this process was started as device B (`device-b DB ADDRESS`), runs
/// it with `intake` and returns its result; `None` otherwise.
pub fn device_b_if_asked(intake: StartIntake) -> Option<Res<()>> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) != Some("device-b") {
        return None;
    }
    let (Some(db), Some(address)) = (args.get(2), args.get(3)) else {
        return Some(Err("usage: device-b DB ADDRESS".into()));
    };
    Some(device_b(Path::new(db), address, intake))
}

/// Device B, in its own process: applies each order to `applied`, says
/// READY once its intake is ready, prints its intake's counters every
/// 100 ms, and stops cleanly when its stdin closes.
fn device_b(db: &Path, address: &str, start: StartIntake) -> Res<()> {
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
    let intake = start(address, Arc::clone(&room))?;
    println!("READY");
    let (eof_tx, eof) = mpsc::sync_channel(1);
    thread::spawn(move || {
        let _ = std::io::stdin().read_line(&mut String::new());
        let _ = eof_tx.send(());
    });
    let print = |intake: &dyn Intake| {
        let s = intake.stats();
        println!(
            "STATS {} {} {} {}",
            s.received, s.redelivered, s.duplicates, s.connects
        );
    };
    while eof.recv_timeout(Duration::from_millis(100)).is_err() {
        print(&*intake);
    }
    print(&*intake);
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
    fn start(db: &Path, address: &str) -> Res<DeviceB> {
        let mut child = Command::new(std::env::current_exe()?)
            .arg("device-b")
            .arg(db)
            .arg(address)
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

/// Step 1, the sink alone: a burst committed at once, timed until all
/// sent and until all applied on B (seconds).
fn burst(a: &Postroom, b_db: &Path) -> Res<(f64, f64)> {
    let t = Instant::now();
    for chunk in 0..BURST / 500 {
        publish(a, chunk * 500, (chunk + 1) * 500)?;
    }
    wait_until(60, "the burst sent", || {
        a.stats().is_ok_and(|s| s.outbox.sent == BURST as u64)
    })?;
    let sent = t.elapsed().as_secs_f64();
    wait_until(60, "the burst applied on B", || applied(b_db).1 == BURST)?;
    Ok((sent, t.elapsed().as_secs_f64()))
}

/// What step 2 saw: B's counters when it was killed, the outage's length
/// and its span in unix ms.
struct Chaos {
    killed_b: [u64; 4],
    outage: Duration,
    outage_ms: (i64, i64),
}

/// Step 2: a steady stream, with the server restarted and B killed midway.
fn chaos(a: &Postroom, b: &mut Option<DeviceB>, b_db: &Path, link: &mut Link<'_>) -> Res<Chaos> {
    let total = BURST + ORDERS;
    let mut seen = Chaos {
        killed_b: [0; 4],
        outage: Duration::ZERO,
        outage_ms: (0, 0),
    };
    thread::scope(|s| -> Res<()> {
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
        println!("{}", link.words.outage);
        let down = Instant::now();
        seen.outage_ms.0 = unix_ms();
        link.server.restart(Duration::from_secs(1));
        seen.outage_ms.1 = unix_ms();
        seen.outage = down.elapsed();
        wait_until(30, "two thirds of the stream applied", || {
            applied(b_db).1 >= BURST + 2 * ORDERS / 3
        })?;
        println!("SIGKILL device B, start it again");
        seen.killed_b = b.take().ok_or("no device B")?.kill()?;
        thread::sleep(Duration::from_millis(300));
        *b = Some(DeviceB::start(b_db, &link.address)?);
        publisher.join().expect("publisher panicked")?;
        Ok(())
    })?;
    Ok(seen)
}

/// Commit-to-acknowledgement latency of A's outbox rows matching
/// `filter`: (rows, p50 ms, max ms).
fn latency(conn: &rusqlite::Connection, filter: &str) -> rusqlite::Result<(i64, i64, i64)> {
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
}

/// Runs the scenario over `link` and prints the report; an error when an
/// order was not applied on B exactly once, or out of its customer's order.
pub fn run(mut link: Link<'_>) -> Res<()> {
    let started = Instant::now();
    let b_db = link.dir.join("device-b.db");
    let a_db = link.dir.join("device-a.db");
    let mut b = Some(DeviceB::start(&b_db, &link.address)?);
    let a = (link.open_a)(&a_db)?;

    let (burst_secs, burst_applied_secs) = burst(&a, &b_db)?;
    let total = BURST + ORDERS;
    let seen = chaos(&a, &mut b, &b_db, &mut link)?;
    wait_until(40, "every order applied on B", || applied(&b_db).1 == total)?;
    let last_b = b.take().ok_or("no device B")?.stop()?;
    wait_until(10, "every row sent", || {
        a.stats().is_ok_and(|s| s.outbox.sent == total as u64)
    })?;

    // 3. The checks, on B's own table.
    let (rows, distinct, order) = applied(&b_db);
    let in_order = order.values().all(|ns| ns.windows(2).all(|w| w[0] < w[1]));
    let conn = rusqlite::Connection::open(&a_db)?;
    // The stream's rows (the burst's rows queue behind each other by
    // design), and those that met the outage.
    let (_, p50, max) = latency(&conn, &format!("seq > {BURST}"))?;
    let (in_outage, outage_p50, outage_max) = latency(
        &conn,
        &format!(
            "created_at BETWEEN {} AND {}",
            seen.outage_ms.0, seen.outage_ms.1
        ),
    )?;
    let (put_off, _, _) = latency(&conn, "last_error IS NOT NULL")?;
    let sum = |i: usize| seen.killed_b[i] + last_b[i];
    let w = &link.words;
    println!();
    println!(
        "{}; {total} orders in {:.1} s",
        w.server,
        started.elapsed().as_secs_f64()
    );
    println!(
        "sink alone: {BURST} committed at once, {} in {burst_secs:.2} s = {:.0} msg/s \
         (applied on B after {burst_applied_secs:.2} s)",
        w.acked_all,
        BURST as f64 / burst_secs
    );
    println!(
        "stream: commit-to-{} latency p50 {p50} ms, max {max} ms",
        w.ack
    );
    println!(
        "{} outage {:.1} s: {in_outage} rows committed meanwhile, commit-to-{} \
         latency p50 {outage_p50} ms, max {outage_max} ms; {put_off} rows (one per customer \
         key: the rest waited behind them) put off without counting an attempt, none dead",
        w.server_down,
        seen.outage.as_secs_f64(),
        w.ack
    );
    println!(
        "device B (as its two processes last reported): received {} ({} {}), duplicates \
         absorbed {}, {} {}",
        sum(0),
        w.redelivered,
        sum(1),
        sum(2),
        w.connects,
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
