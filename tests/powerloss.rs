//! Power-loss tests: a child process (this test binary, re-executed) runs
//! under an `LD_PRELOAD` shim (`tests/fixtures/powerloss.c`, compiled here
//! with `cc`) that copies each tracked file aside whenever it is fsynced.
//! The parent SIGKILLs the child at a random moment and puts those copies
//! back: the files a power cut at that instant would have left, where a
//! SIGKILL alone leaves everything written in the kernel's page cache. Then
//! it checks what `Durability::Full` promises: every message acknowledged
//! before the cut is there, applied once, and the file passes `postroom
//! check`. The next child starts from those files, as a device does after
//! it reboots, so the cuts accumulate.
//!
//! Each cut also keeps, at random, either the database file as the kernel
//! had it (a checkpoint's unsynced page writes reached the disk) or as it
//! was at its last fsync, and likewise the engine's marker file (written
//! without fsync by design). The WAL always goes back to its last fsync:
//! that is where an acknowledged commit that was not durable would be lost.
//!
//! The same harness run with `Durability::Normal`, which fsyncs only at
//! checkpoints, must lose acknowledged messages, or the shim is not
//! dropping anything and the Full tests prove nothing.
//!
//! `POSTROOM_POWER_CUTS` sets the number of cuts per test (default 40);
//! `POSTROOM_SEED` replays a run. Linux only (`/proc/self/fd`,
//! `LD_PRELOAD`).
#![cfg(target_os = "linux")]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use postroom::{handler_fn, Durability, InboxSink, Message, Outcome, Postroom};
use std::sync::Arc;

/// Entry point of the child processes. Not a test: it only does something
/// when started by `spawn_child`, and is ignored otherwise.
#[test]
#[ignore = "entry point for child processes of the power-loss tests"]
fn child_main() {
    let Some((role, db)) = child_role() else {
        return;
    };
    report("");
    match role.as_str() {
        "stream" => child_stream(&db),
        "queued" => child_queued(&db),
        "relay" => child_relay(&db),
        "trickle" => child_trickle(&db),
        other => panic!("unknown child role {other}"),
    }
}

fn durability() -> Durability {
    durability_from("POSTROOM_DURABILITY")
}

fn durability_from(var: &str) -> Durability {
    match std::env::var(var).as_deref() {
        Ok("normal") => Durability::Normal,
        _ => Durability::Full,
    }
}

/// The shim, compiled once per test binary run.
fn shim() -> &'static Path {
    static SHIM: OnceLock<PathBuf> = OnceLock::new();
    SHIM.get_or_init(|| {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/powerloss.c");
        let out = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("powerloss-{}.so", std::process::id()));
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_owned());
        let status = Command::new(&cc)
            .args(["-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o"])
            .arg(&out)
            .arg(&src)
            .args(["-ldl", "-lpthread"])
            .status()
            .unwrap_or_else(|e| {
                panic!("the power-loss tests compile a C shim and need a C compiler ({cc}): {e}")
            });
        assert!(status.success(), "{cc} failed to build {}", src.display());
        out
    })
}

/// The files of one or more databases, as a power cut treats them.
struct Disk {
    dbs: Vec<PathBuf>,
    /// Where the shim says it loaded, or why it gave up.
    log: PathBuf,
}

impl Disk {
    fn new(dbs: &[&Path]) -> Disk {
        Disk {
            dbs: dbs.iter().map(|db| db.to_path_buf()).collect(),
            log: with_suffix(dbs[0], ".shim.log"),
        }
    }

    /// (database, WAL, engine marker file) of each database.
    fn tracked(&self) -> Vec<[PathBuf; 3]> {
        self.dbs
            .iter()
            .map(|db| {
                [
                    db.clone(),
                    with_suffix(db, "-wal"),
                    with_suffix(db, "-postroom"),
                ]
            })
            .collect()
    }

    /// The environment that puts a child under the shim.
    fn env(&self) -> Vec<(&'static str, String)> {
        let files: Vec<String> = self
            .tracked()
            .iter()
            .flatten()
            .map(|f| f.to_str().expect("utf-8 temp path").to_owned())
            .collect();
        vec![
            ("LD_PRELOAD", shim().to_str().unwrap().to_owned()),
            ("POSTROOM_POWERLOSS_FILES", files.join(":")),
            (
                "POSTROOM_POWERLOSS_LOG",
                self.log.to_str().unwrap().to_owned(),
            ),
        ]
    }

    /// What is on disk now counts as durable: called when no process has
    /// the files open (after a cut, what it left is what the disk holds).
    fn settle(&self) {
        for file in self.tracked().iter().flatten() {
            let durable = with_suffix(file, ".durable");
            if file.exists() {
                std::fs::copy(file, &durable).unwrap();
            } else if durable.exists() {
                std::fs::remove_file(&durable).unwrap();
            }
        }
    }

    /// Leaves the files as a power cut at this instant would: each goes
    /// back to its content at its last fsync (or at `settle`), except that
    /// the database and the marker file may keep their unsynced writes.
    /// The shared-memory index does not survive a reboot.
    fn cut_power(&self, rng: &mut Rng) -> String {
        let mut kept = Vec::new();
        for [db, wal, marker] in self.tracked() {
            for (file, may_keep) in [(&db, true), (&wal, false), (&marker, true)] {
                let durable = with_suffix(file, ".durable");
                let _ = std::fs::remove_file(with_suffix(file, ".durable.tmp"));
                if may_keep && rng.below(2) == 0 {
                    kept.push(file.file_name().unwrap().to_string_lossy().into_owned());
                } else if durable.exists() {
                    std::fs::copy(&durable, file).unwrap();
                } else if file.exists() {
                    std::fs::remove_file(file).unwrap();
                }
            }
            let _ = std::fs::remove_file(with_suffix(&db, "-shm"));
        }
        if kept.is_empty() {
            "everything back to its last fsync".to_owned()
        } else {
            format!("unsynced writes kept in {}", kept.join(", "))
        }
    }

    /// Copies of the databases (each with its WAL) in a scratch directory,
    /// for the checks: opening the files themselves would recover and
    /// checkpoint their WAL, and the next child would never find one to
    /// recover.
    fn copies(&self) -> (tempfile::TempDir, Vec<PathBuf>) {
        let scratch = tempfile::tempdir().unwrap();
        let copies = self
            .dbs
            .iter()
            .map(|db| {
                let copy = scratch.path().join(db.file_name().unwrap());
                std::fs::copy(db, &copy).unwrap();
                let wal = with_suffix(db, "-wal");
                if wal.exists() {
                    std::fs::copy(&wal, with_suffix(&copy, "-wal")).unwrap();
                }
                copy
            })
            .collect();
        (scratch, copies)
    }
}

/// What the children said, over all cycles so far.
#[derive(Default)]
struct Said {
    /// What followed `SEND `: messages handed to the engine.
    sent: BTreeSet<String>,
    /// What followed `ACK `: messages the engine said may be acknowledged.
    acked: BTreeSet<String>,
    /// When the parent read each first `ACK`.
    acked_at: BTreeMap<String, Instant>,
    /// When the last child was killed.
    cut_at: Option<Instant>,
    /// WAL copy-backs the children's checkpointers completed, as they last
    /// reported them (`CHECKPOINTS n`), summed.
    checkpoints: u64,
    /// Children in which the first database was fsynced, which only a
    /// checkpoint does (at open, idle, or on the WAL hook).
    synced_db: u64,
}

/// Kills the child however the test ends.
struct Running(std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs `cuts` power cycles of child `role`: start it under the shim, let
/// it run for a time in `run_ms` (milliseconds after READY), SIGKILL it, cut the power, and hand
/// what the children said so far, with copies of the databases as the cut
/// left them, to `check`.
fn power_cycles(
    role: &str,
    disk: &Disk,
    rng: &mut Rng,
    cuts: u64,
    run_ms: std::ops::Range<u64>,
    env: &[(&str, String)],
    mut check: impl FnMut(u64, &str, &Said, &[PathBuf]),
) -> Said {
    let mut said = Said::default();
    let mut env = env.to_vec();
    env.extend(disk.env());
    let durable_db = with_suffix(&disk.dbs[0], ".durable");
    for cut in 0..cuts {
        disk.settle();
        let settled = std::fs::read(&durable_db).unwrap();
        let mut child_env = env.clone();
        child_env.push(("POSTROOM_SEED", rng.next_u64().to_string()));
        let mut child = Running(spawn_child(role, &disk.dbs[0], &child_env));
        let pid = child.0.id();
        let lines = lines_of(&mut child.0);
        let shim_said = || std::fs::read_to_string(&disk.log).unwrap_or_default();
        wait_for_or(&lines, "READY", || {
            format!("({role} cut {cut}; the shim's log: {})", shim_said())
        });
        thread::sleep(Duration::from_millis(
            run_ms.start + rng.below(run_ms.end - run_ms.start),
        ));
        child.0.kill().unwrap();
        said.cut_at = Some(Instant::now());
        let status = child.0.wait().unwrap();
        assert!(
            shim_said().contains(&format!("loaded {pid}\n")),
            "{role} cut {cut}: the shim was not loaded into the child: {}",
            shim_said()
        );
        assert_eq!(
            status.signal(),
            Some(9),
            "{role} cut {cut}: {status:?}; the shim's log: {}",
            shim_said()
        );
        let mut checkpoints = 0;
        // Ends with the dead child's stdout.
        for (at, line) in lines.iter() {
            if let Some(id) = line.strip_prefix("SEND ") {
                said.sent.insert(id.to_owned());
            } else if let Some(id) = line.strip_prefix("ACK ") {
                said.acked.insert(id.to_owned());
                said.acked_at.entry(id.to_owned()).or_insert(at);
            } else if let Some(n) = line.strip_prefix("CHECKPOINTS ") {
                checkpoints = n.parse().unwrap();
            }
        }
        said.checkpoints += checkpoints;
        if std::fs::read(&durable_db).unwrap() != settled {
            said.synced_db += 1;
        }
        let what = disk.cut_power(rng);
        let (_scratch, copies) = disk.copies();
        check(cut, &what, &said, &copies);
    }
    disk.settle();
    said
}

/// Fails a run too thin to prove anything: fewer acknowledgements than
/// cuts, or no cut that landed on a database a checkpoint had written.
fn assert_worked(said: &Said, cuts: u64, seed: u64) {
    assert!(
        said.acked.len() as u64 >= cuts,
        "seed {seed}: only {} acknowledgements in {cuts} cuts; the test proves little",
        said.acked.len()
    );
    assert!(
        said.synced_db > 0,
        "seed {seed}: no child synced the database (no checkpoint); the test proves little"
    );
}

/// Between bursts of work the children go quiet for a while and report
/// their checkpointer's count: idle is when the checkpointer truncates the
/// WAL, and the count shows the cuts landed on files it had worked on.
fn pause_and_report(room: &Postroom, n: u64) {
    if n % 40 == 39 {
        thread::sleep(Duration::from_millis(150));
        let stats = room.stats().unwrap();
        report(&format!(
            "CHECKPOINTS {}",
            stats.wal_checkpoints + stats.wal_checkpoints_inline
        ));
    }
}

/// Settings every room here shares: a reaper that runs often, and a WAL
/// threshold picked per child (from `POSTROOM_SEED`): small, so every open
/// and every idle pause copies the WAL back and truncates it, or the
/// default 4 MiB, so the WAL grows across children until the writer's
/// 1000-frame hook sets the checkpointer's passes going.
fn base() -> postroom::Builder {
    let wal_bytes = match env_u64("POSTROOM_SEED").map(|seed| seed % 3) {
        Some(0) => 128 * 1024,
        Some(1) => 1024 * 1024,
        _ => 4 * 1024 * 1024,
    };
    Postroom::builder()
        .durability(durability())
        .checkpoint_wal_bytes(wal_bytes)
        .reaper_interval(Duration::from_millis(50))
        .max_attempts(1_000_000)
}

// ---------------------------------------------------------------------------
// One caller delivering inline.

fn stream_room(db: &Path) -> Postroom {
    base().consumer("c", handler_fn(apply)).open(db).unwrap()
}

fn stream_message(id: &str) -> Message {
    Message::new("s", id.to_owned(), format!("payload of {id}"))
}

fn child_stream(db: &Path) {
    deliver_forever(&stream_room(db), 'm');
}

/// Delivers to consumer `c` until killed, saying `SEND id` before each
/// delivery ([`pick_id`]) and `ACK id` once it may be acknowledged.
fn deliver_forever(room: &Postroom, prefix: char) {
    let seed = env_u64("POSTROOM_SEED").unwrap();
    let mut rng = Rng::new(seed);
    report("READY");
    let mut sent: Vec<String> = Vec::new();
    for n in 0..1_000_000u64 {
        let id = pick_id(&mut rng, &format!("{prefix}{seed:x}"), n, &sent);
        report(&format!("SEND {id}"));
        let outcome = room.deliver("c", stream_message(&id)).unwrap();
        assert!(outcome.should_ack(), "{id}: {outcome:?}");
        report(&format!("ACK {id}"));
        sent.push(id);
        pause_and_report(room, n);
    }
}

/// The rows of a two-column query, first column as the key.
fn map_of<V: rusqlite::types::FromSql>(
    conn: &rusqlite::Connection,
    sql: &str,
) -> BTreeMap<String, V> {
    let mut stmt = conn.prepare(sql).unwrap();
    let rows = stmt
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    rows
}

/// How many times each id was applied, by the `applied` table.
fn applied_counts(conn: &rusqlite::Connection) -> BTreeMap<String, i64> {
    map_of(
        conn,
        "SELECT message_id, count(*) FROM applied GROUP BY message_id",
    )
}

/// A fresh database with the domain table, closed cleanly.
fn prepared_db(dir: &Path, name: &str) -> PathBuf {
    let db = dir.canonicalize().unwrap().join(name);
    let room = Postroom::builder().open(&db).unwrap();
    create_domain(&room);
    room.shutdown(Duration::from_secs(10)).unwrap();
    db
}

/// What the stream's power cycles found.
struct StreamRun {
    said: Said,
    /// Acknowledged messages found missing right after some cut.
    lost: BTreeSet<String>,
    db: PathBuf,
    _dir: tempfile::TempDir,
}

/// Checks, after a cut, that nothing was applied twice or without being
/// sent, and returns the acknowledged ids that are not applied.
fn lost_after_cut(db: &Path, said: &Said, context: &str) -> Vec<String> {
    let conn = raw(db);
    integrity_ok(&conn);
    let applied = applied_counts(&conn);
    for (id, n) in &applied {
        assert_eq!(*n, 1, "{context}: {id} applied {n} times");
        assert!(
            said.sent.contains(id),
            "{context}: {id} applied, never sent"
        );
    }
    said.acked
        .iter()
        .filter(|id| !applied.contains_key(*id))
        .cloned()
        .collect()
}

fn run_stream(durability: &str, cuts: u64, seed: u64) -> StreamRun {
    let dir = tempfile::tempdir().unwrap();
    let db = prepared_db(dir.path(), "app.db");
    let disk = Disk::new(&[&db]);
    let mut rng = Rng::new(seed);
    let mut lost = BTreeSet::new();
    let said = power_cycles(
        "stream",
        &disk,
        &mut rng,
        cuts,
        0..600,
        &[("POSTROOM_DURABILITY", durability.to_owned())],
        |cut, what, said, copies| {
            let context = format!("seed {seed}, {durability}, cut {cut} ({what})");
            let missing = lost_after_cut(&copies[0], said, &context);
            if durability == "full" {
                assert!(
                    missing.is_empty(),
                    "{context}: acknowledged, then lost: {missing:?}"
                );
            }
            lost.extend(missing);
        },
    );
    StreamRun {
        said,
        lost,
        db,
        _dir: dir,
    }
}

/// Redelivers every message sent until it may be acknowledged, then checks
/// that each was applied exactly once and the file is sound.
fn redeliver_all(db: &Path, sent: &BTreeSet<String>, seed: u64) {
    let room = stream_room(db);
    for id in sent {
        let outcome = room.deliver("c", stream_message(id)).unwrap();
        assert!(
            matches!(outcome, Outcome::Processed { .. } | Outcome::Duplicate),
            "seed {seed}: {id}: {outcome:?}"
        );
    }
    room.shutdown(Duration::from_secs(10)).unwrap();
    let conn = raw(db);
    integrity_ok(&conn);
    let applied = applied_counts(&conn);
    assert_eq!(
        applied.keys().collect::<BTreeSet<_>>(),
        sent.iter().collect::<BTreeSet<_>>(),
        "seed {seed}: applied after redelivery vs sent"
    );
    assert!(
        applied.values().all(|n| *n == 1),
        "seed {seed}: {applied:?}"
    );
}

#[test]
fn power_cuts_while_delivering_lose_nothing_acknowledged_at_full_durability() {
    let cuts = env_u64("POSTROOM_POWER_CUTS").unwrap_or(40);
    let seed = seed();
    eprintln!("power cuts, inline: {cuts} cuts, POSTROOM_SEED={seed}");
    let run = run_stream("full", cuts, seed);
    assert_worked(&run.said, cuts, seed);
    assert!(run.lost.is_empty());
    redeliver_all(&run.db, &run.said.sent, seed);
    eprintln!(
        "power cuts, inline: {cuts} cuts survived, {} messages acknowledged, none lost, \
         {} sent, {} children synced the database, {} paused checkpoint passes",
        run.said.acked.len(),
        run.said.sent.len(),
        run.said.synced_db,
        run.said.checkpoints
    );
}

/// The harness's own check: at `Normal`, commits are fsynced only at
/// checkpoints, so cuts must lose acknowledged messages. If none are lost
/// the shim drops nothing, and the Full test above cannot fail.
#[test]
fn the_harness_catches_the_losses_normal_durability_allows() {
    let seed = seed();
    eprintln!("power cuts, normal: POSTROOM_SEED={seed}");
    let run = run_stream("normal", 8, seed);
    assert!(
        !run.lost.is_empty(),
        "seed {seed}: 8 power cuts at Normal durability lost nothing acknowledged \
         ({} acknowledged): the shim is not dropping unsynced writes",
        run.said.acked.len()
    );
    // Normal loses the last commits, never consistency: after redelivery
    // everything sent is applied once.
    redeliver_all(&run.db, &run.said.sent, seed);
    eprintln!(
        "power cuts, normal: {} of {} acknowledged messages lost over 8 cuts, as Normal allows",
        run.lost.len(),
        run.said.acked.len()
    );
}

/// A new id most of the time (a lost commit is then a lost message, not
/// one applied again later), one in four a repeat of one sent before.
fn pick_id(rng: &mut Rng, prefix: &str, n: u64, sent: &[String]) -> String {
    if sent.is_empty() || rng.below(4) != 0 {
        format!("{prefix}-{n}")
    } else {
        sent[rng.below(sent.len() as u64) as usize].clone()
    }
}

// ---------------------------------------------------------------------------
// Queued mode: receipts acknowledged in batches while two workers claim,
// run and complete what was received.

fn queued_room(db: &Path) -> Postroom {
    base()
        .workers(2)
        .poll_interval(Duration::from_millis(5))
        .backoff(Duration::from_millis(1), Duration::from_millis(1))
        .consumer("q", handler_fn(apply))
        .open(db)
        .unwrap()
}

fn child_queued(db: &Path) {
    let seed = env_u64("POSTROOM_SEED").unwrap();
    let mut rng = Rng::new(seed);
    let room = queued_room(db);
    report("READY");
    let mut sent: Vec<String> = Vec::new();
    for n in 0..1_000_000u64 {
        let batch: Vec<String> = (0..rng.below(8) + 1)
            .map(|i| pick_id(&mut rng, &format!("q{seed:x}-{n}"), i, &sent))
            .collect();
        for id in &batch {
            report(&format!("SEND {id}"));
        }
        let receipts = room
            .receive_batch("q", batch.iter().map(|id| stream_message(id)))
            .unwrap();
        for (id, receipt) in batch.iter().zip(receipts) {
            assert!(receipt.should_ack(), "{id}: {receipt:?}");
            report(&format!("ACK {id}"));
        }
        sent.extend(batch);
        pause_and_report(&room, n);
    }
}

/// The ids `consumer` has an inbox row for, whatever its status.
fn stored(conn: &rusqlite::Connection, consumer: &str) -> BTreeSet<String> {
    column(
        conn,
        &format!("SELECT message_id FROM postroom_inbox WHERE consumer = '{consumer}'"),
    )
}

/// Waits (at most two minutes) until `conn`'s inbox has nothing left to do.
fn drained(conn: &rusqlite::Connection, what: &str) {
    eventually(120, what, || {
        count(
            conn,
            "SELECT count(*) FROM postroom_inbox WHERE status != 'completed'",
        ) == 0
    });
}

#[test]
fn power_cuts_while_workers_run_lose_no_acknowledged_receipt() {
    let cuts = env_u64("POSTROOM_POWER_CUTS").unwrap_or(40);
    let seed = seed();
    eprintln!("power cuts, queued: {cuts} cuts, POSTROOM_SEED={seed}");
    let dir = tempfile::tempdir().unwrap();
    let db = prepared_db(dir.path(), "app.db");
    let disk = Disk::new(&[&db]);
    let mut rng = Rng::new(seed);
    let mut applied_at_cuts = 0;
    let said = power_cycles(
        "queued",
        &disk,
        &mut rng,
        cuts,
        0..600,
        &[],
        |cut, what, said, copies| {
            let context = format!("seed {seed}, cut {cut} ({what})");
            // Applied at most once, only what was sent; every acknowledged
            // receipt stored (not necessarily run yet).
            lost_after_cut(&copies[0], said, &context);
            let conn = raw(&copies[0]);
            applied_at_cuts = applied_counts(&conn).len();
            let stored = stored(&conn, "q");
            let missing: Vec<_> = said.acked.difference(&stored).collect();
            assert!(
                missing.is_empty(),
                "{context}: acknowledged receipts lost: {missing:?}"
            );
        },
    );
    assert!(
        applied_at_cuts > 0,
        "seed {seed}: the workers applied nothing before the last cut; the test proves little"
    );
    assert_worked(&said, cuts, seed);

    // Recovery: receive everything sent again, let the workers finish.
    let room = queued_room(&db);
    let sent: Vec<String> = said.sent.iter().cloned().collect();
    for chunk in sent.chunks(200) {
        room.receive_batch("q", chunk.iter().map(|id| stream_message(id)))
            .unwrap();
    }
    let conn = raw(&db);
    drained(&conn, &format!("seed {seed}: every message completed"));
    room.shutdown(Duration::from_secs(10)).unwrap();
    integrity_ok(&conn);
    let applied = applied_counts(&conn);
    assert_eq!(
        applied.keys().collect::<BTreeSet<_>>(),
        said.sent.iter().collect::<BTreeSet<_>>(),
        "seed {seed}: applied after recovery vs sent"
    );
    assert!(applied.values().all(|n| *n == 1), "seed {seed}");
    eprintln!(
        "power cuts, queued: {cuts} cuts survived, {} receipts acknowledged, none lost; \
         {applied_at_cuts} applied before the last cut, {} in all, each once; {} children synced the database, {} paused checkpoint passes",
        said.acked.len(),
        applied.len(),
        said.synced_db,
        said.checkpoints
    );
}

// ---------------------------------------------------------------------------
// The relay: service A's outbox delivered into service B's inbox, both
// files losing power together.

fn b_path(db: &Path) -> PathBuf {
    db.with_file_name("b.db")
}

/// A's and B's files in `dir`, cut together.
fn two_services(dir: &Path) -> (PathBuf, PathBuf, Disk) {
    let a = prepared_db(dir, "a.db");
    let b = prepared_db(dir, "b.db");
    assert_eq!(b, b_path(&a));
    let disk = Disk::new(&[&a, &b]);
    (a, b, disk)
}

/// Service B: records each message it gets; publishes nothing.
fn downstream(db: &Path) -> Arc<Postroom> {
    let room = base()
        .poll_interval(Duration::from_millis(5))
        .consumer("b", handler_fn(record_as_b))
        .open(db)
        .unwrap();
    Arc::new(room)
}

/// Service A: applies and publishes; its relay delivers into B's inbox.
/// Its durability may differ from B's (`POSTROOM_A_DURABILITY`).
fn upstream(db: &Path, b: &Arc<Postroom>) -> Postroom {
    let durability = match std::env::var("POSTROOM_A_DURABILITY") {
        Ok(_) => durability_from("POSTROOM_A_DURABILITY"),
        Err(_) => durability(),
    };
    base()
        .durability(durability)
        .relay_poll(Duration::from_millis(10))
        .relay_batch(16)
        .consumer("c", handler_fn(apply))
        .sink(InboxSink::new(Arc::clone(b), "b"))
        .open(db)
        .unwrap()
}

fn child_relay(db: &Path) {
    let b = downstream(&b_path(db));
    deliver_forever(&upstream(db, &b), 'r');
}

/// A's outbox: (message id, sent?).
fn outbox(conn: &rusqlite::Connection) -> BTreeMap<String, bool> {
    map_of(
        conn,
        "SELECT message_id, status = 'sent' FROM postroom_outbox",
    )
}

/// Checks the two files against each other after a cut: B stored only
/// rows A's outbox holds, applied each at most once, and holds every row A
/// marked sent (the sink receives into B's inbox; B's workers apply).
/// Returns (outbox rows, rows marked sent).
fn relay_consistent(a: &Path, b: &Path, context: &str) -> (usize, usize) {
    let (a_conn, b_conn) = (raw(a), raw(b));
    integrity_ok(&b_conn);
    let outbox = outbox(&a_conn);
    let in_b = stored(&b_conn, "b");
    for (id, n) in applied_counts(&b_conn) {
        assert_eq!(n, 1, "{context}: {id} applied {n} times in B");
        assert!(
            in_b.contains(&id),
            "{context}: B applied {id}, never stored"
        );
    }
    for id in &in_b {
        assert!(
            outbox.contains_key(id),
            "{context}: B stored {id}, which A's outbox does not hold"
        );
    }
    for (id, sent) in &outbox {
        assert!(
            !sent || in_b.contains(id),
            "{context}: A marked {id} sent, B does not have it"
        );
    }
    (outbox.len(), outbox.values().filter(|sent| **sent).count())
}

/// At `Normal`, A's commits are not yet fsynced when its relay reads them
/// (it is woken at COMMIT). A power cut may take them back from A, so the
/// relay must not hand them over before they are synced: B would hold an
/// effect A never had, and A's redelivered message would publish it again
/// under a new id. A at `Normal`, B at `Full`: after every cut, B holds
/// only rows A kept, and every row A kept as sent.
#[test]
fn at_normal_durability_the_relay_hands_over_only_what_a_power_cut_keeps() {
    let cuts = env_u64("POSTROOM_POWER_CUTS").map_or(20, |n| (n / 2).max(1));
    let seed = seed();
    eprintln!("power cuts, relay from a Normal upstream: {cuts} cuts, POSTROOM_SEED={seed}");
    let dir = tempfile::tempdir().unwrap();
    let (_, _, disk) = two_services(dir.path());
    let mut rng = Rng::new(seed);
    let (mut sent_at_cuts, mut lost_in_a) = (0, 0);
    power_cycles(
        "relay",
        &disk,
        &mut rng,
        cuts,
        0..600,
        &[("POSTROOM_A_DURABILITY", "normal".to_owned())],
        |cut, what, said, copies| {
            let context = format!("seed {seed}, A normal, cut {cut} ({what})");
            lost_in_a += lost_after_cut(&copies[0], said, &context).len();
            sent_at_cuts += relay_consistent(&copies[0], &copies[1], &context).1;
        },
    );
    assert!(
        sent_at_cuts > 0,
        "seed {seed}: the relay marked nothing sent before any cut; the test proves little"
    );
    eprintln!(
        "power cuts, relay from a Normal upstream: {cuts} cuts; {sent_at_cuts} rows marked sent \
         at the cuts (summed), all in B; {lost_in_a} acknowledged messages lost by A (allowed \
         at Normal), none of them in B"
    );
}

#[test]
fn power_cuts_around_the_relay_lose_nothing_between_two_databases() {
    let cuts = env_u64("POSTROOM_POWER_CUTS").unwrap_or(40);
    let seed = seed();
    eprintln!("power cuts, relay: {cuts} cuts, POSTROOM_SEED={seed}");
    let dir = tempfile::tempdir().unwrap();
    let (a, b, disk) = two_services(dir.path());
    let mut rng = Rng::new(seed);
    let mut sent_at_cuts = 0;
    let said = power_cycles(
        "relay",
        &disk,
        &mut rng,
        cuts,
        0..600,
        &[],
        |cut, what, said, copies| {
            let context = format!("seed {seed}, cut {cut} ({what})");
            let missing = lost_after_cut(&copies[0], said, &context);
            assert!(
                missing.is_empty(),
                "{context}: acknowledged, then lost in A: {missing:?}"
            );
            sent_at_cuts = relay_consistent(&copies[0], &copies[1], &context).1;
        },
    );
    assert!(
        sent_at_cuts > 0,
        "seed {seed}: the relay marked nothing sent before the last cut; the test proves little"
    );
    assert_worked(&said, cuts, seed);

    // Recovery: both engines up until A's outbox is all sent.
    let b_room = downstream(&b);
    let a_room = upstream(&a, &b_room);
    let a_conn = raw(&a);
    eventually(120, &format!("seed {seed}: A's outbox all sent"), || {
        count(
            &a_conn,
            "SELECT count(*) FROM postroom_outbox WHERE status != 'sent'",
        ) == 0
    });
    drained(&raw(&b), &format!("seed {seed}: B completed everything"));
    a_room.shutdown(Duration::from_secs(10)).unwrap();
    drop(a_room);
    Arc::try_unwrap(b_room)
        .unwrap_or_else(|_| panic!("A's relay still holds B"))
        .shutdown(Duration::from_secs(10))
        .unwrap();
    let (rows, _) = relay_consistent(&a, &b, &format!("seed {seed}, after recovery"));
    assert_eq!(
        applied_counts(&raw(&b)).len(),
        rows,
        "seed {seed}: every outbox row applied in B"
    );
    eprintln!(
        "power cuts, relay: {cuts} cuts survived, {} messages acknowledged, {sent_at_cuts} \
         outbox rows sent before the last cut, {rows} in all, each applied once downstream; \
         {} children synced the database, {} paused checkpoint passes",
        said.acked.len(),
        said.synced_db,
        said.checkpoints
    );
}

// ---------------------------------------------------------------------------
// Normal durability's window: a slow trickle of commits, which never fills
// the WAL to the writer's checkpoint hook, must still reach the disk.

fn child_trickle(db: &Path) {
    let seed = env_u64("POSTROOM_SEED").unwrap();
    let room = stream_room(db);
    report("READY");
    for n in 0..1_000_000u64 {
        let id = format!("t{seed:x}-{n}");
        report(&format!("SEND {id}"));
        let outcome = room.deliver("c", stream_message(&id)).unwrap();
        assert!(outcome.should_ack(), "{id}: {outcome:?}");
        report(&format!("ACK {id}"));
        // ~80 WAL frames a second: the writer's 1000-frame hook would take
        // over ten seconds to fire.
        thread::sleep(Duration::from_millis(100));
    }
}

/// At `Normal` a power cut may lose the last commits, but only about the
/// last second's: the checkpointer syncs the WAL at most a second after a
/// commit. Acknowledged more than 2.5 s before the cut must be on disk.
#[test]
fn at_normal_durability_a_power_cut_loses_at_most_the_last_seconds() {
    const OLD_ENOUGH: Duration = Duration::from_millis(2500);
    let seed = seed();
    eprintln!("power cuts, normal trickle: POSTROOM_SEED={seed}");
    let dir = tempfile::tempdir().unwrap();
    let db = prepared_db(dir.path(), "app.db");
    let disk = Disk::new(&[&db]);
    let mut rng = Rng::new(seed);
    let (mut old, mut lost_young) = (0, 0);
    // Acknowledged by an earlier child: judged at its own cut.
    let mut earlier: Option<Instant> = None;
    let said = power_cycles(
        "trickle",
        &disk,
        &mut rng,
        3,
        3500..4500,
        &[("POSTROOM_DURABILITY", "normal".to_owned())],
        |cut, what, said, copies| {
            let context = format!("seed {seed}, normal trickle, cut {cut} ({what})");
            let cut_at = said.cut_at.unwrap();
            let this_child = |at: &Instant| earlier.is_none_or(|earlier| *at > earlier);
            let missing: Vec<String> = lost_after_cut(&copies[0], said, &context)
                .into_iter()
                .filter(|id| this_child(&said.acked_at[id]))
                .collect();
            for id in &missing {
                let age = cut_at - said.acked_at[id];
                assert!(
                    age < OLD_ENOUGH,
                    "{context}: {id}, acknowledged {age:?} before the cut, was lost"
                );
            }
            lost_young += missing.len();
            old += said
                .acked_at
                .values()
                .filter(|at| this_child(at) && cut_at - **at >= OLD_ENOUGH)
                .count();
            earlier = Some(cut_at);
        },
    );
    assert!(
        old > 0,
        "seed {seed}: nothing was acknowledged long enough before a cut"
    );
    eprintln!(
        "power cuts, normal trickle: 3 cuts, {} acknowledged, {lost_young} lost (all acknowledged \
         less than {OLD_ENOUGH:?} before their cut)",
        said.acked.len()
    );
}
