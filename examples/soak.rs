//! Soak test: for a chosen duration, a child process delivers (inline) and
//! receives (queued) a stream of messages with duplicates while the parent
//! kills it with SIGKILL at random moments and starts it again. At the end
//! the parent recovers, redelivers everything that was ever sent, lets the
//! workers drain, and a total-queue checker reports lost / duplicated /
//! unexpected / recovered counts; the `-wal` size is reported over time.
//!
//! ```text
//! cargo run --release --example soak -- --duration 60 [--db PATH] [--seed N]
//! ```
//! Exits non-zero if anything acknowledged was lost or applied twice.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use postroom::{handler_fn, Failure, Message, Postroom, Tx};

/// Distinct ids per consumer: small enough that duplicates are common.
const IDS: u64 = 5_000;

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn record(tx: &mut Tx<'_>, msg: &Message) -> Result<(), Failure> {
    tx.execute(
        "INSERT INTO effects (consumer, message_id) VALUES (?1, ?2)",
        [tx.consumer().unwrap_or(""), msg.id()],
    )?;
    Ok(())
}

fn open(db: &Path) -> postroom::Result<Postroom> {
    let room = Postroom::builder()
        .max_attempts(1_000_000)
        .poll_interval(Duration::from_millis(10))
        .consumer("inline", handler_fn(record))
        .consumer("queued", handler_fn(record))
        .open(db)?;
    room.transaction(|tx| {
        tx.execute_batch(
            "CREATE TABLE IF NOT EXISTS effects (consumer TEXT NOT NULL, message_id TEXT NOT NULL)",
        )?;
        Ok(())
    })?;
    Ok(room)
}

/// The child: deliver and receive until killed, reporting what was sent
/// and what was acknowledged.
fn child(db: &Path, seed: u64) -> Result<(), Box<dyn std::error::Error>> {
    let room = open(db)?;
    let mut out = std::io::stdout().lock();
    let mut rng = Rng(seed);
    loop {
        let id = format!("i{}", rng.below(IDS));
        writeln!(out, "SENT inline {id}")?;
        out.flush()?;
        if room
            .deliver("inline", Message::new("s", id.clone(), id.clone()))?
            .should_ack()
        {
            writeln!(out, "ACK inline {id}")?;
        }
        let batch: Vec<Message> = (0..4)
            .map(|_| {
                let id = format!("q{}", rng.below(IDS));
                Message::new("s", id.clone(), id)
            })
            .collect();
        for m in &batch {
            writeln!(out, "SENT queued {}", m.id())?;
        }
        out.flush()?;
        room.receive_batch("queued", batch.clone())?;
        for m in &batch {
            writeln!(out, "ACK queued {}", m.id())?;
        }
        out.flush()?;
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let seed: u64 = match arg("--seed") {
        Some(s) => s.parse()?,
        None => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_nanos() as u64,
    };
    let tmp = tempfile::tempdir()?;
    let db: PathBuf = arg("--db")
        .map(Into::into)
        .unwrap_or_else(|| tmp.path().join("soak.db"));
    if std::env::args().any(|a| a == "--child") {
        return child(&db, seed);
    }
    let duration = Duration::from_secs(
        arg("--duration")
            .map(|s| s.parse())
            .transpose()?
            .unwrap_or(30),
    );
    println!(
        "soak: {duration:?}, database {}, --seed {seed}",
        db.display()
    );
    let mut rng = Rng(seed);
    let mut sent: [BTreeSet<String>; 2] = Default::default();
    let mut acked: [BTreeSet<String>; 2] = Default::default();
    let (started, mut kills, mut last_report) = (Instant::now(), 0u64, Instant::now());
    let mut wal_peak = 0u64;
    while started.elapsed() < duration {
        let mut child = Command::new(std::env::current_exe()?)
            .args(["--child", "--seed", &rng.next().to_string(), "--db"])
            .arg(&db)
            .stdout(Stdio::piped())
            .spawn()?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let reader = std::thread::spawn(move || {
            BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
                .collect::<Vec<_>>()
        });
        std::thread::sleep(Duration::from_millis(20 + rng.below(300)));
        child.kill()?; // SIGKILL
        child.wait()?;
        kills += 1;
        for line in reader.join().map_err(|_| "reader panicked")? {
            let mut parts = line.splitn(3, ' ');
            let (Some(kind), Some(consumer), Some(id)) = (parts.next(), parts.next(), parts.next())
            else {
                continue;
            };
            let i = usize::from(consumer == "queued");
            match kind {
                "SENT" => sent[i].insert(id.to_owned()),
                "ACK" => acked[i].insert(id.to_owned()),
                _ => false,
            };
        }
        let wal = std::fs::metadata(format!("{}-wal", db.display()))
            .map(|m| m.len())
            .unwrap_or(0);
        wal_peak = wal_peak.max(wal);
        if last_report.elapsed() >= Duration::from_secs(5) {
            last_report = Instant::now();
            println!(
                "  {:>4}s  {kills:>5} kills  {:>6} acknowledged  -wal {:>8} bytes",
                started.elapsed().as_secs(),
                acked[0].len() + acked[1].len(),
                wal
            );
        }
    }

    // Recovery: redeliver everything ever sent, let the workers drain.
    let room = open(&db)?;
    for id in &sent[0] {
        while !room
            .deliver("inline", Message::new("s", id.clone(), id.clone()))?
            .should_ack()
        {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    let queued: Vec<Message> = sent[1]
        .iter()
        .map(|id| Message::new("s", id.clone(), id.clone()))
        .collect();
    room.receive_batch("queued", queued)?;
    loop {
        let stats = room.stats()?;
        let busy: u64 = stats
            .inbox
            .values()
            .map(|c| c.pending + c.processing + c.failed)
            .sum();
        if busy == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    room.shutdown(Duration::from_secs(10))?;

    let conn = rusqlite::Connection::open(&db)?;
    let integrity: String = conn.query_row("PRAGMA integrity_check", [], |r| r.get(0))?;
    let mut failed = integrity != "ok";
    println!(
        "\n{:<8} {:>8} {:>8} {:>6} {:>10} {:>10} {:>9}",
        "consumer", "sent", "acked", "lost", "duplicated", "unexpected", "recovered"
    );
    for (i, consumer) in ["inline", "queued"].into_iter().enumerate() {
        let mut applied: BTreeMap<String, i64> = BTreeMap::new();
        let mut stmt = conn
            .prepare("SELECT message_id, count(*) FROM effects WHERE consumer = ?1 GROUP BY 1")?;
        for row in stmt.query_map([consumer], |r| Ok((r.get(0)?, r.get(1)?)))? {
            let (id, n) = row?;
            applied.insert(id, n);
        }
        let lost = acked[i]
            .iter()
            .filter(|id| !applied.contains_key(*id))
            .count();
        let duplicated = applied.values().filter(|&&n| n > 1).count();
        let unexpected = applied.keys().filter(|id| !sent[i].contains(*id)).count();
        let recovered = applied
            .keys()
            .filter(|id| sent[i].contains(*id) && !acked[i].contains(*id))
            .count();
        println!(
            "{consumer:<8} {:>8} {:>8} {lost:>6} {duplicated:>10} {unexpected:>10} {recovered:>9}",
            sent[i].len(),
            acked[i].len()
        );
        failed |= lost + duplicated + unexpected > 0;
    }
    println!(
        "\n{kills} SIGKILLs in {:.0?}; integrity_check {integrity}; peak -wal {wal_peak} bytes",
        started.elapsed()
    );
    if failed {
        return Err("the checker found lost, duplicated or unexpected messages".into());
    }
    println!("lost = 0, duplicated = 0: every acknowledged message applied exactly once");
    Ok(())
}
