//! An offline-first device pulling changes from a server over HTTP, in
//! queued mode, and resuming after a SIGKILL from what its database says.
//!
//! The server (a thread on a localhost port, plain HTTP/1.1) serves its
//! change log as pages of newline-delimited JSON: `GET /changes?after=N`
//! answers the next 500 changes after change N. The device asks with a
//! cursor, stores each page with one `receive_batch` (one transaction, one
//! fsync), and worker threads apply the changes to a `documents` table
//! afterwards. Things go wrong:
//!
//! * the server cuts every fourth response part-way: the device stores the
//!   complete changes it got and asks again after the last one stored;
//! * the device asks from 100 changes before its cursor (the safety margin
//!   sync protocols keep), so pages overlap: every repeat is a duplicate;
//! * the device process is **SIGKILLed** three times mid-sync. Each new
//!   process asks the database where to resume — `Postroom::resume_point`:
//!   every change at or below it is stored (or applied) — and pulls from
//!   there, having kept no cursor of its own anywhere.
//!
//! Each change carries the server's change number as its sequence
//! (`Message::with_sequence`) and its document id as ordering key, so four
//! workers apply edits of different documents in parallel and edits of one
//! document in order. The handler compares each change's base version with
//! the stored one and records any mismatch — there must be none.
//!
//! ```text
//! cargo run --example sync_receiver
//! ```
//!
//! What to look for: the page lines (new vs duplicate, the cut responses),
//! the kills and the point each new process resumed from, then the table:
//! every change stored and applied once, every document at its final
//! version. The exit status is non-zero when a check fails.
//!
//! The HTTP here is a few lines of `std::net` on purpose: the example shows
//! the protocol a puller speaks, not an HTTP crate's API.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use postroom::{handler_fn, Message, Postroom, Receipt};
use rusqlite::OptionalExtension;
use serde::{Deserialize, Serialize};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const CONSUMER: &str = "sync";
/// The sequence stream: the changes' source.
const SERVER: &str = "server";
const DOCUMENTS: u32 = 120;
const CHANGES: u64 = 6000;
const PAGE: u64 = 500;
/// How far before its cursor the device asks again.
const OVERLAP: u64 = 100;
const WORKERS: usize = 4;
const KILLS: usize = 3;

/// One edit of one document, made on version `prev`, producing `version`:
/// change number `seq` of the server's log.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Change {
    seq: u64,
    doc: u32,
    prev: u32,
    version: u32,
    body: String,
}

/// A small deterministic generator, so every run tells the same story.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) % n
    }
}

/// The server's change log, and the final version of each document.
fn change_log() -> (Vec<Change>, Vec<u32>) {
    let mut rng = Rng(2024);
    let mut versions = vec![0u32; DOCUMENTS as usize];
    let log = (1..=CHANGES)
        .map(|seq| {
            let doc = rng.below(u64::from(DOCUMENTS)) as u32;
            let prev = versions[doc as usize];
            versions[doc as usize] = prev + 1;
            Change {
                seq,
                doc,
                prev,
                version: prev + 1,
                body: format!("doc {doc} edited (change {seq})"),
            }
        })
        .collect();
    (log, versions)
}

/// Serves the log until the process ends. Every fourth response is cut
/// part-way through its body (the connection drops).
fn serve(listener: TcpListener, log: Vec<Change>) {
    let mut served = 0u64;
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        served += 1;
        let _ = answer(&mut stream, &log, served.is_multiple_of(4));
    }
}

fn answer(stream: &mut TcpStream, log: &[Change], cut: bool) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    // The whole request head, so that closing early never resets a
    // connection with unread bytes.
    let mut reader = BufReader::new(&*stream);
    let mut request = String::new();
    reader.read_line(&mut request)?;
    let mut header = String::new();
    while reader.read_line(&mut header)? > 2 {
        header.clear();
    }
    // "GET /changes?after=N HTTP/1.1"
    let after: Option<u64> = request
        .split_whitespace()
        .nth(1)
        .and_then(|path| path.strip_prefix("/changes?after="))
        .and_then(|n| n.parse().ok());
    let Some(after) = after else {
        return stream.write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n");
    };
    let mut body = Vec::new();
    for change in log.iter().skip(after as usize).take(PAGE as usize) {
        serde_json::to_writer(&mut body, change)?;
        body.push(b'\n');
    }
    write!(
        stream,
        "HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )?;
    if cut && body.len() > 1 {
        // Somewhere in the middle, even mid-line.
        let at = body.len() / 3 + (after as usize * 7919) % (body.len() / 2);
        stream.write_all(&body[..at])?;
        return Ok(());
    }
    stream.write_all(&body)
}

/// A page as it arrived: the complete changes, and whether the response
/// was cut short.
struct Page {
    changes: Vec<Change>,
    cut: bool,
}

/// `GET /changes?after=N` on `addr`; keeps only complete lines.
fn fetch(addr: &str, after: u64) -> Res<Page> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    let request =
        format!("GET /changes?after={after} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes())?;
    // A connection that drops part-way ends the body where it drops.
    let mut response = Vec::new();
    if let Err(e) = stream.read_to_end(&mut response) {
        if response.is_empty() {
            return Err(e.into());
        }
    }
    let split = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("no HTTP header")?;
    let head = String::from_utf8_lossy(&response[..split]);
    if !head.starts_with("HTTP/1.1 200") {
        return Err(format!("server answered {head:?}").into());
    }
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("Content-Length: "))
        .ok_or("no Content-Length")?
        .trim()
        .parse()?;
    let body = &response[split + 4..];
    let complete = body.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    let changes = body[..complete]
        .split(|&b| b == b'\n')
        .filter(|line| !line.is_empty())
        .map(serde_json::from_slice)
        .collect::<Result<Vec<Change>, _>>()?;
    Ok(Page {
        changes,
        cut: body.len() < length,
    })
}

fn open(db: &std::path::Path) -> postroom::Result<Postroom> {
    let room = Postroom::builder()
        .workers(WORKERS)
        .consumer(
            CONSUMER,
            handler_fn(|tx, msg| {
                let change: Change = msg.json()?;
                let stored: Option<u32> = tx
                    .query_row(
                        "SELECT version FROM documents WHERE id = ?1",
                        [change.doc],
                        |r| r.get(0),
                    )
                    .optional()?;
                let stored = stored.unwrap_or(0);
                if stored != change.prev {
                    // Out of order: a bug, not something to retry. Recorded
                    // in the same transaction, so it is counted exactly once.
                    tx.execute(
                        "INSERT INTO version_gaps (change_id, doc, expected, found)
                         VALUES (?1, ?2, ?3, ?4)",
                        (msg.id(), change.doc, change.prev, stored),
                    )?;
                }
                tx.execute(
                    "INSERT INTO documents (id, version, body, changes_applied)
                     VALUES (?1, ?2, ?3, 1)
                     ON CONFLICT (id) DO UPDATE SET version = excluded.version,
                         body = excluded.body, changes_applied = changes_applied + 1",
                    (change.doc, change.version, &change.body),
                )?;
                Ok(())
            }),
        )
        .open(db)?;
    room.transaction(|tx| {
        tx.execute_batch(
            "CREATE TABLE IF NOT EXISTS documents (id INTEGER PRIMARY KEY,
                 version INTEGER NOT NULL, body TEXT NOT NULL, changes_applied INTEGER NOT NULL);
             CREATE TABLE IF NOT EXISTS version_gaps (change_id TEXT, doc INTEGER,
                 expected INTEGER, found INTEGER);",
        )?;
        Ok(())
    })?;
    Ok(room)
}

/// The device process (the example's own binary, run with `--device`):
/// resumes from the database, pulls until the last
/// change is stored, waits for the workers, and exits. Reports one line
/// per page on stdout for the parent.
fn device(db: &std::path::Path, addr: &str) -> Res<()> {
    let room = open(db)?;
    let mut cursor = room.resume_point(CONSUMER, SERVER)?;
    println!("RESUME {cursor}");
    while cursor < CHANGES {
        let after = cursor.saturating_sub(OVERLAP);
        let page = fetch(addr, after)?;
        let msgs = page
            .changes
            .iter()
            .map(|c| {
                Ok(Message::from_json(SERVER, format!("chg-{}", c.seq), c)?
                    .with_ordering_key(format!("doc-{}", c.doc))
                    .with_sequence(c.seq))
            })
            .collect::<Result<Vec<_>, serde_json::Error>>()?;
        if msgs.is_empty() {
            println!("PAGE after {after:>4}: cut before its first change");
            continue;
        }
        let receipts = room.receive_batch(CONSUMER, msgs)?;
        let (mut new, mut dup) = (0, 0);
        for receipt in &receipts {
            match receipt {
                Receipt::Accepted => new += 1,
                Receipt::Duplicate | Receipt::DuplicateBySequence { .. } => dup += 1,
                other => return Err(format!("unexpected receipt {other:?}").into()),
            }
        }
        // Stored: the cursor moves to the last change of the page (a cut
        // page's complete changes are stored too).
        cursor = cursor.max(page.changes.last().map_or(cursor, |c| c.seq));
        println!(
            "PAGE after {after:>4}: {:>3} changes, {new:>3} new, {dup:>3} duplicate{}",
            page.changes.len(),
            if page.cut { ", response CUT" } else { "" }
        );
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let counts = room
            .stats()?
            .inbox
            .get(CONSUMER)
            .copied()
            .unwrap_or_default();
        if counts.pending + counts.processing + counts.failed == 0 {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!("workers did not drain in 60 s: {counts:?}").into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    room.shutdown(Duration::from_secs(10))?;
    println!("DONE");
    Ok(())
}

/// The parent: runs the server, starts the device process, kills it three
/// times, lets the fourth finish, and checks the database.
fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    if let [_, role, db, addr] = args.as_slice() {
        if role == "--device" {
            return device(std::path::Path::new(db), addr);
        }
    }
    let tmp = tempfile::tempdir()?;
    let db = tmp.path().join("device.db");
    let (log, final_versions) = change_log();
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?.to_string();
    std::thread::Builder::new()
        .name("server".into())
        .spawn(move || serve(listener, log))?;
    println!(
        "postroom sync_receiver: {CHANGES} changes to {DOCUMENTS} documents, pages of {PAGE} \
         over HTTP from {addr}, {WORKERS} workers, database {}",
        db.display()
    );

    let started = Instant::now();
    let mut rng = Rng(7);
    let mut pages = 0;
    for run in 0..=KILLS {
        let mut child = Command::new(std::env::current_exe()?)
            .args(["--device", &db.to_string_lossy(), &addr])
            .stdout(Stdio::piped())
            .spawn()?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        // The last run goes to the end; the others are killed after a few
        // pages, at whatever instant that is.
        let kill_after = (run < KILLS).then(|| 1 + rng.below(4));
        let mut seen = 0;
        for line in BufReader::new(stdout).lines() {
            let line = line?;
            if let Some(from) = line.strip_prefix("RESUME ") {
                println!("  device process {}: resume_point = {from}", run + 1);
            } else if let Some(page) = line.strip_prefix("PAGE ") {
                pages += 1;
                seen += 1;
                println!("    page {pages:>2}, {page}");
            } else if line == "DONE" {
                println!(
                    "  device process {}: all changes stored and applied",
                    run + 1
                );
            }
            if kill_after == Some(seen) {
                std::thread::sleep(Duration::from_millis(rng.below(20)));
                child.kill()?; // SIGKILL
                println!("  device process {}: SIGKILL", run + 1);
                break;
            }
        }
        let status = child.wait()?;
        if kill_after.is_none() && !status.success() {
            return Err(format!("the last device process failed: {status}").into());
        }
    }
    let elapsed = started.elapsed();

    let room = open(&db)?;
    let stats = room.stats()?;
    let resume = room.resume_point(CONSUMER, SERVER)?;
    room.shutdown(Duration::from_secs(10))?;
    let counts = stats.inbox.get(CONSUMER).copied().unwrap_or_default();
    let check = rusqlite::Connection::open(&db)?;
    let gaps: i64 = check.query_row("SELECT count(*) FROM version_gaps", [], |r| r.get(0))?;
    let mut stmt = check.prepare("SELECT id, version, changes_applied FROM documents")?;
    let docs = stmt
        .query_map([], |r| {
            Ok((
                r.get::<_, u32>(0)?,
                r.get::<_, u32>(1)?,
                r.get::<_, u32>(2)?,
            ))
        })?
        .collect::<Result<Vec<_>, _>>()?;
    let wrong_versions = docs
        .iter()
        .filter(|&&(id, version, applied)| {
            final_versions.get(id as usize) != Some(&version) || applied != version
        })
        .count();
    let edited = final_versions.iter().filter(|&&v| v > 0).count();
    let watermark = stats
        .sequences
        .iter()
        .find(|w| w.consumer == CONSUMER && w.stream == SERVER);

    println!();
    let row = |what: &str, value: String| println!("{what:<44} {value:>10}");
    row("pages pulled (4 processes)", pages.to_string());
    row(
        "changes stored",
        (counts.completed + counts.dead).to_string(),
    );
    row(
        "changes applied by the workers",
        counts.completed.to_string(),
    );
    row("documents", docs.len().to_string());
    row("version gaps seen by the handler", gaps.to_string());
    row(
        "watermark of the server's changes",
        watermark.map_or("-".into(), |w| w.watermark.to_string()),
    );
    row("resume_point at the end", resume.to_string());
    row(
        "pulled and applied in",
        format!("{:.2} s", elapsed.as_secs_f64()),
    );
    println!();

    let checks = [
        (
            "every change stored and applied once",
            counts.completed == CHANGES && counts.dead == 0 && stats.conflicts == 0,
        ),
        ("edits of each document applied in order", gaps == 0),
        (
            "every document at its final version",
            wrong_versions == 0 && docs.len() == edited,
        ),
        (
            "the watermark and resume_point reached the last change",
            watermark.is_some_and(|w| w.watermark == CHANGES && w.missing.is_empty())
                && resume == CHANGES,
        ),
    ];
    let mut ok = true;
    for (what, passed) in checks {
        println!("  [{}] {what}", if passed { "ok" } else { "FAILED" });
        ok &= passed;
    }
    if !ok {
        return Err("sync checks failed".into());
    }
    Ok(())
}
