//! Soak test: for a chosen duration, a child process delivers (inline) and
//! receives (queued) a stream of messages with duplicates while the parent
//! kills it with SIGKILL at random moments and starts it again. At the end
//! the parent recovers, redelivers everything that was ever sent, lets the
//! workers drain, and a total-queue checker reports lost / duplicated /
//! unexpected / recovered counts; the `-wal` size is reported over time.
//!
//! Ids keep growing for the whole run: each child starts its new ids where
//! the last one stopped, and one message in three repeats one of the last
//! 5,000 ids, so kills keep landing while new work is written (reported as
//! "kills during new work") and duplicates stay common.
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

/// Duplicates repeat one of this many most recent ids of their consumer.
const WINDOW: u64 = 5_000;

const USAGE: &str = "\
usage: soak [--duration SECS] [--db PATH] [--seed N]

Delivers and receives messages in a child process, killing it with SIGKILL at
random moments, for --duration seconds (default 30); then checks that every
acknowledged message was applied exactly once. --db keeps the database (default:
a temporary directory, removed at the end); --seed replays a run.";

/// The value after `name`, if given.
fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// Refuses what is not an option this program takes (the child's options
/// are internal); `--help` prints the usage and exits.
fn check_args() {
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            "--duration" | "--db" | "--seed" | "--next-inline" | "--next-queued" => {
                if args.next().is_none() {
                    eprintln!("soak: {a} needs a value\n\n{USAGE}");
                    std::process::exit(2);
                }
            }
            "--child" => {}
            other => {
                eprintln!("soak: unknown argument {other:?}\n\n{USAGE}");
                std::process::exit(2);
            }
        }
    }
}

/// The numeric part of an id (`i123` is 123).
fn number(id: &str) -> Option<u64> {
    id.get(1..)?.parse().ok()
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

/// Ids of one consumer: mostly new ones, counting up from where the last
/// child stopped; one in three a repeat of a recent one.
struct Ids {
    prefix: char,
    next: u64,
}

impl Ids {
    fn pick(&mut self, rng: &mut Rng) -> String {
        let n = if self.next > 0 && rng.below(3) == 0 {
            self.next - 1 - rng.below(self.next.min(WINDOW))
        } else {
            self.next += 1;
            self.next - 1
        };
        format!("{}{n}", self.prefix)
    }
}

/// The child: deliver and receive until killed, reporting what was sent
/// and what was acknowledged.
fn child(db: &Path, seed: u64) -> Result<(), Box<dyn std::error::Error>> {
    let next = |name| -> Result<u64, Box<dyn std::error::Error>> {
        Ok(arg(name).map(|s| s.parse()).transpose()?.unwrap_or(0))
    };
    let mut inline = Ids {
        prefix: 'i',
        next: next("--next-inline")?,
    };
    let mut queued = Ids {
        prefix: 'q',
        next: next("--next-queued")?,
    };
    let room = open(db)?;
    let mut out = std::io::stdout().lock();
    let mut rng = Rng(seed);
    loop {
        let id = inline.pick(&mut rng);
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
                let id = queued.pick(&mut rng);
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
    check_args();
    let seed: u64 = match arg("--seed") {
        Some(s) => s.parse()?,
        None => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_nanos() as u64,
    };
    if std::env::args().any(|a| a == "--child") {
        // The parent always names the database: a child is killed, and a
        // temporary directory of its own would never be removed.
        let db: PathBuf = arg("--db").ok_or("--child needs --db")?.into();
        return child(&db, seed);
    }
    let tmp = tempfile::tempdir()?;
    let db: PathBuf = arg("--db")
        .map(Into::into)
        .unwrap_or_else(|| tmp.path().join("soak.db"));
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
    // Per consumer: the next new id, and kills that landed while a message
    // with a new id was sent but not yet acknowledged.
    let mut next = [0u64; 2];
    let mut kills_new_work = 0u64;
    // Messages sent again with an id sent before.
    let mut repeats = 0u64;
    while started.elapsed() < duration {
        let mut child = Command::new(std::env::current_exe()?)
            .args(["--child", "--seed", &rng.next().to_string()])
            .args(["--next-inline", &next[0].to_string()])
            .args(["--next-queued", &next[1].to_string()])
            .arg("--db")
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
        // Sent by this child and not acknowledged (yet): new to the run?
        let mut open_new: BTreeSet<(usize, String)> = BTreeSet::new();
        for line in reader.join().map_err(|_| "reader panicked")? {
            let mut parts = line.splitn(3, ' ');
            let (Some(kind), Some(consumer), Some(id)) = (parts.next(), parts.next(), parts.next())
            else {
                continue;
            };
            let i = usize::from(consumer == "queued");
            match kind {
                "SENT" => {
                    if let Some(n) = number(id) {
                        next[i] = next[i].max(n + 1);
                    }
                    if sent[i].insert(id.to_owned()) {
                        open_new.insert((i, id.to_owned()));
                    } else {
                        repeats += 1;
                    }
                }
                "ACK" => {
                    open_new.remove(&(i, id.to_owned()));
                    acked[i].insert(id.to_owned());
                }
                _ => {}
            }
        }
        kills_new_work += u64::from(!open_new.is_empty());
        let wal = std::fs::metadata(format!("{}-wal", db.display()))
            .map(|m| m.len())
            .unwrap_or(0);
        wal_peak = wal_peak.max(wal);
        if last_report.elapsed() >= Duration::from_secs(5) {
            last_report = Instant::now();
            println!(
                "  {:>4}s  {kills:>5} kills ({kills_new_work:>5} during new work)  {:>7} ids  \
                 {:>7} acknowledged  -wal {:>8} bytes",
                started.elapsed().as_secs(),
                sent[0].len() + sent[1].len(),
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
        "\n{kills} SIGKILLs in {:.0?}, {kills_new_work} of them while a new message was sent \
         and not yet acknowledged; {repeats} messages sent again with an id sent before; \
         integrity_check {integrity}; peak -wal {wal_peak} bytes",
        started.elapsed()
    );
    if failed {
        return Err("the checker found lost, duplicated or unexpected messages".into());
    }
    println!("lost = 0, duplicated = 0: every acknowledged message applied exactly once");
    Ok(())
}
