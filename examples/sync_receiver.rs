//! An offline-first device receiving changes from a server, in queued mode.
//!
//! The server (simulated in-process) pages through its change log in
//! batches of 500. The device stores each batch with one `receive_batch`
//! (one transaction, one fsync) and acknowledges it; worker threads apply
//! the changes to a `documents` table afterwards. The network is bad:
//!
//! * the connection drops mid-batch: the device has stored the changes it
//!   got, the server never hears an ack and resends the whole batch;
//! * an ack is lost on the way back: the server resends a batch the device
//!   stored completely;
//! * the server resumes 100 changes before the last acknowledged one (the
//!   safety margin sync protocols keep for clock skew), so consecutive
//!   batches overlap.
//!
//! Every repeat is answered `Receipt::Duplicate` and stored once. Each
//! change carries the server's change number as its sequence
//! (`Message::with_sequence`), so the device's watermark reaches the last
//! change once all are applied, and a resend weeks later, after retention,
//! would still be recognised (`Receipt::DuplicateBySequence`). Each
//! change carries its document id as ordering key, so four workers apply
//! edits of different documents in parallel and edits of one document one
//! at a time, in the order received. Each change also carries the version
//! it was made on; the handler compares it with the stored version and
//! records any mismatch — with the ordering key there must be none.
//!
//! ```text
//! cargo run --example sync_receiver
//! ```
//!
//! What to look for: the batch lines (new vs duplicate per batch, the
//! drops and lost acks), then the table: every change applied once, every
//! document at its final version, no version gap. The exit status is
//! non-zero when a check fails.

use std::time::{Duration, Instant};

use postroom::{handler_fn, Message, Postroom, Receipt};
use rusqlite::OptionalExtension;
use serde::{Deserialize, Serialize};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const CONSUMER: &str = "sync";
const DOCUMENTS: u32 = 120;
const CHANGES: usize = 6000;
const BATCH: usize = 500;
/// How far before its last acknowledged change the server resumes.
const OVERLAP: usize = 100;
const WORKERS: usize = 4;

/// One edit of one document, made on version `prev`, producing `version`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Change {
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
fn change_log(rng: &mut Rng) -> Res<(Vec<Message>, Vec<u32>)> {
    let mut versions = vec![0u32; DOCUMENTS as usize];
    let mut log = Vec::with_capacity(CHANGES);
    for seq in 0..CHANGES {
        let doc = rng.below(u64::from(DOCUMENTS)) as u32;
        let prev = versions[doc as usize];
        versions[doc as usize] = prev + 1;
        let change = Change {
            doc,
            prev,
            version: prev + 1,
            body: format!("doc {doc} edited (change {seq})"),
        };
        log.push(
            Message::from_json("server", format!("chg-{seq}"), &change)?
                .with_ordering_key(format!("doc-{doc}"))
                // The server's change counter, from 1.
                .with_sequence(seq as u64 + 1),
        );
    }
    Ok((log, versions))
}

fn open(db: &std::path::Path) -> postroom::Result<Postroom> {
    Postroom::builder()
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
        .open(db)
}

/// What a send attempt ran into.
enum Network {
    Fine,
    /// The connection dropped after this many changes reached the device.
    DropsAfter(usize),
    /// The device stored everything; its ack never reached the server.
    AckLost,
}

#[derive(Default)]
struct Tally {
    batches: u64,
    sent: u64,
    accepted: u64,
    duplicates: u64,
    conflicts: u64,
    drops: u64,
    acks_lost: u64,
}

fn main() -> Res<()> {
    let tmp = tempfile::tempdir()?;
    let db = tmp.path().join("device.db");
    let mut rng = Rng(2024);
    let (log, final_versions) = change_log(&mut rng)?;
    println!(
        "postroom sync_receiver: {CHANGES} changes to {DOCUMENTS} documents, \
         batches of {BATCH}, {WORKERS} workers, database {}",
        db.display()
    );

    let room = open(&db)?;
    room.transaction(|tx| {
        tx.execute_batch(
            "CREATE TABLE documents (id INTEGER PRIMARY KEY, version INTEGER NOT NULL,
                                     body TEXT NOT NULL, changes_applied INTEGER NOT NULL);
             CREATE TABLE version_gaps (change_id TEXT, doc INTEGER, expected INTEGER,
                                        found INTEGER);",
        )?;
        Ok(())
    })?;

    let started = Instant::now();
    let mut tally = Tally::default();
    // The server's cursor: every change before it is acknowledged.
    let mut acked_upto = 0usize;
    while acked_upto < CHANGES {
        let start = acked_upto.saturating_sub(OVERLAP);
        let end = (start + BATCH).min(CHANGES);
        // Every fourth send is cut off part-way, every seventh loses its ack.
        let network = match tally.batches + 1 {
            n if n % 4 == 0 => Network::DropsAfter(1 + rng.below((end - start) as u64) as usize),
            n if n % 7 == 0 => Network::AckLost,
            _ => Network::Fine,
        };
        let arrived = match network {
            Network::DropsAfter(n) => &log[start..start + n],
            _ => &log[start..end],
        };
        tally.batches += 1;
        tally.sent += arrived.len() as u64;
        // What reached the device is stored and durable, whatever happens
        // to the connection afterwards.
        let receipts = room.receive_batch(CONSUMER, arrived.iter().cloned())?;
        let (mut new, mut dup) = (0, 0);
        for receipt in &receipts {
            match receipt {
                Receipt::Accepted => new += 1,
                Receipt::Duplicate | Receipt::DuplicateBySequence { .. } => dup += 1,
                _ => tally.conflicts += 1,
            }
        }
        tally.accepted += new;
        tally.duplicates += dup;
        let what = match network {
            Network::Fine => {
                acked_upto = end;
                "acked".to_string()
            }
            Network::DropsAfter(n) => {
                tally.drops += 1;
                format!("OFFLINE after {n} of {}: resend", end - start)
            }
            Network::AckLost => {
                tally.acks_lost += 1;
                "ack LOST: resend".to_string()
            }
        };
        println!(
            "  batch {:>2}: changes {start:>4}..{end:<4} {new:>3} new {dup:>3} duplicate  {what}",
            tally.batches
        );
    }
    let received = started.elapsed();

    // The server is done; the workers may not be. Wait for them to drain.
    let deadline = Instant::now() + Duration::from_secs(45);
    let counts = loop {
        let counts = room
            .stats()?
            .inbox
            .get(CONSUMER)
            .copied()
            .unwrap_or_default();
        if counts.pending + counts.processing + counts.failed == 0 {
            break counts;
        }
        if Instant::now() > deadline {
            return Err(format!("workers did not drain in 45 s: {counts:?}").into());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let elapsed = started.elapsed();
    let stats = room.stats()?;
    room.shutdown(Duration::from_secs(10))?;

    let check = rusqlite::Connection::open(&db)?;
    let gaps: i64 = check.query_row("SELECT count(*) FROM version_gaps", [], |r| r.get(0))?;
    let mut wrong_versions = 0;
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
    for &(id, version, applied) in &docs {
        let expected = final_versions.get(id as usize).copied();
        if expected != Some(version) || applied != version {
            wrong_versions += 1;
        }
    }
    let edited = final_versions.iter().filter(|&&v| v > 0).count();

    println!();
    let row = |what: &str, value: String| println!("{what:<44} {value:>10}");
    row(
        "batches sent (receive_batch calls)",
        tally.batches.to_string(),
    );
    row(
        "  cut off mid-batch (device offline)",
        tally.drops.to_string(),
    );
    row("  stored but ack lost", tally.acks_lost.to_string());
    row("changes sent (repeats included)", tally.sent.to_string());
    row(
        "changes stored (Receipt::Accepted)",
        tally.accepted.to_string(),
    );
    row(
        "duplicates absorbed (Receipt::Duplicate)",
        tally.duplicates.to_string(),
    );
    row(
        "changes applied by the workers",
        counts.completed.to_string(),
    );
    row("documents", docs.len().to_string());
    row("version gaps seen by the handler", gaps.to_string());
    row(
        "final versions all correct",
        if wrong_versions == 0 { "yes" } else { "NO" }.to_string(),
    );
    let watermark = stats
        .sequences
        .iter()
        .find(|w| w.consumer == CONSUMER && w.stream == "server");
    row(
        "watermark of the server's changes",
        watermark.map_or("-".into(), |w| w.watermark.to_string()),
    );
    row(
        "group commits / jobs (engine)",
        format!("{}/{}", stats.batches_committed, stats.jobs_committed),
    );
    row("received in", format!("{:.2} s", received.as_secs_f64()));
    row(
        "received and applied in",
        format!("{:.2} s", elapsed.as_secs_f64()),
    );
    println!();

    let checks = [
        (
            "every change stored once",
            tally.accepted == CHANGES as u64 && tally.conflicts == 0,
        ),
        (
            "every change applied once",
            counts.completed == CHANGES as u64 && counts.dead == 0,
        ),
        ("edits of each document applied in order", gaps == 0),
        (
            "every document at its final version",
            wrong_versions == 0 && docs.len() == edited,
        ),
        (
            "the watermark reached the last change",
            watermark.is_some_and(|w| w.watermark == CHANGES as u64 && w.missing.is_empty()),
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
