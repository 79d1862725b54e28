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
use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{mpsc, OnceLock};
use std::thread;
use std::time::Duration;

use common::*;
use postroom::{handler_fn, Durability, Message, Outcome, Postroom};

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
        other => panic!("unknown child role {other}"),
    }
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok()?.parse().ok()
}

fn durability() -> Durability {
    match std::env::var("POSTROOM_DURABILITY").as_deref() {
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
}

impl Disk {
    fn new(dbs: &[&Path]) -> Disk {
        Disk {
            dbs: dbs.iter().map(|db| db.to_path_buf()).collect(),
        }
    }

    fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
        let mut name = path.as_os_str().to_owned();
        name.push(suffix);
        PathBuf::from(name)
    }

    /// (database, WAL, engine marker file) of each database.
    fn tracked(&self) -> Vec<[PathBuf; 3]> {
        self.dbs
            .iter()
            .map(|db| {
                [
                    db.clone(),
                    Disk::with_suffix(db, "-wal"),
                    Disk::with_suffix(db, "-postroom"),
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
        ]
    }

    /// The files as they are now count as durable: called when no process
    /// has them open, after a clean close (which syncs what it wrote).
    fn settle(&self) {
        for file in self.tracked().iter().flatten() {
            let durable = Disk::with_suffix(file, ".durable");
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
                let durable = Disk::with_suffix(file, ".durable");
                let _ = std::fs::remove_file(Disk::with_suffix(file, ".durable.tmp"));
                if may_keep && rng.below(2) == 0 {
                    kept.push(file.file_name().unwrap().to_string_lossy().into_owned());
                } else if durable.exists() {
                    std::fs::copy(&durable, file).unwrap();
                } else if file.exists() {
                    std::fs::remove_file(file).unwrap();
                }
            }
            let _ = std::fs::remove_file(Disk::with_suffix(&db, "-shm"));
        }
        if kept.is_empty() {
            "everything back to its last fsync".to_owned()
        } else {
            format!("unsynced writes kept in {}", kept.join(", "))
        }
    }
}

/// What the children said, over all cycles so far.
#[derive(Default)]
struct Said {
    /// What followed `SEND `: messages handed to the engine.
    sent: BTreeSet<String>,
    /// What followed `ACK `: messages the engine said may be acknowledged.
    acked: BTreeSet<String>,
}

/// Runs `cuts` power cycles of child `role`: start it under the shim, let
/// it run up to `max_ms` after READY, SIGKILL it, cut the power, and hand
/// what the children said so far to `check`, which inspects the files
/// before the next child starts.
fn power_cycles(
    role: &str,
    disk: &Disk,
    rng: &mut Rng,
    cuts: u64,
    max_ms: u64,
    env: &[(&str, String)],
    mut check: impl FnMut(u64, &str, &Said),
) -> Said {
    let mut said = Said::default();
    let mut env = env.to_vec();
    env.extend(disk.env());
    for cut in 0..cuts {
        disk.settle();
        let mut child_env = env.clone();
        child_env.push(("POSTROOM_SEED", rng.next_u64().to_string()));
        let mut child = spawn_child(role, &disk.dbs[0], &child_env);
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = mpsc::channel();
        let reader = thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        loop {
            match lines.recv_timeout(Duration::from_secs(60)) {
                Ok(line) if line == "READY" => break,
                Ok(_) => {}
                Err(e) => panic!("{role} cut {cut}: the child never said READY ({e})"),
            }
        }
        thread::sleep(Duration::from_millis(rng.below(max_ms)));
        child.kill().unwrap();
        let status = child.wait().unwrap();
        assert_eq!(status.signal(), Some(9), "{role} cut {cut}: {status:?}");
        join_within(reader, 60, "the child's stdout reader");
        for line in lines.try_iter() {
            if let Some(id) = line.strip_prefix("SEND ") {
                said.sent.insert(id.to_owned());
            } else if let Some(id) = line.strip_prefix("ACK ") {
                said.acked.insert(id.to_owned());
            }
        }
        let what = disk.cut_power(rng);
        check(cut, &what, &said);
    }
    disk.settle();
    said
}

// ---------------------------------------------------------------------------
// One caller delivering inline.

fn stream_room(db: &Path) -> Postroom {
    Postroom::builder()
        .durability(durability())
        .max_attempts(1_000_000)
        .consumer("c", handler_fn(apply))
        .open(db)
        .unwrap()
}

fn stream_message(id: &str) -> Message {
    Message::new("s", id.to_owned(), format!("payload of {id}"))
}

/// Mostly new messages (a lost commit is then a lost message, not one
/// applied again later), one in four a repeat of one sent before. Says
/// `SEND id` before each delivery and `ACK id` once it may be acknowledged.
fn child_stream(db: &Path) {
    let seed = env_u64("POSTROOM_SEED").unwrap();
    let mut rng = Rng::new(seed);
    let room = stream_room(db);
    report("READY");
    let mut sent: Vec<String> = Vec::new();
    for n in 0..1_000_000u64 {
        let id = if sent.is_empty() || rng.below(4) != 0 {
            format!("m{seed:x}-{n}")
        } else {
            sent[rng.below(sent.len() as u64) as usize].clone()
        };
        report(&format!("SEND {id}"));
        let outcome = room.deliver("c", stream_message(&id)).unwrap();
        assert!(outcome.should_ack(), "{id}: {outcome:?}");
        report(&format!("ACK {id}"));
        sent.push(id);
    }
}

/// How many times each id was applied, by the `applied` table.
fn applied_counts(conn: &rusqlite::Connection) -> BTreeMap<String, i64> {
    let mut stmt = conn
        .prepare("SELECT message_id, count(*) FROM applied GROUP BY message_id")
        .unwrap();
    let rows = stmt
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    rows
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
        300,
        &[("POSTROOM_DURABILITY", durability.to_owned())],
        |cut, what, said| {
            let context = format!("seed {seed}, {durability}, cut {cut} ({what})");
            let missing = lost_after_cut(&db, said, &context);
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
    assert!(
        run.said.acked.len() as u64 >= cuts,
        "seed {seed}: only {} messages acknowledged in {cuts} cuts; the test proves little",
        run.said.acked.len()
    );
    assert!(run.lost.is_empty());
    redeliver_all(&run.db, &run.said.sent, seed);
    eprintln!(
        "power cuts, inline: {cuts} cuts survived, {} messages acknowledged, none lost, \
         {} sent",
        run.said.acked.len(),
        run.said.sent.len()
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
