//! One engine per database, whatever is deleted beside it, and a lock
//! released is released. Real processes: a second engine is started as a
//! child process of this test binary, and the app's "other thread" really
//! forks and execs (`std::process::Command`).

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use common::*;
use postroom::{EffectContext, EffectHandler, Error, Failure, Message, Postroom, Tx};

/// Entry point of the child processes. Not a test: it only does something
/// when started by `spawn_child`, and is ignored otherwise.
#[test]
#[ignore = "entry point for child processes of the lock tests"]
fn child_main() {
    let Some((role, db)) = child_role() else {
        return;
    };
    report("");
    assert_eq!(role, "second-engine", "unknown child role");
    let effects = Arc::new(AtomicU32::new(0));
    let opened = Postroom::builder()
        .workers(2)
        .poll_interval(Duration::from_millis(5))
        .effectful_consumer(
            "c",
            Counting {
                effects: Arc::clone(&effects),
            },
        )
        .open(&db);
    match opened {
        Err(Error::AlreadyOpen { .. }) => report("REFUSED"),
        Err(e) => report(&format!("ERROR {e}")),
        Ok(room) => {
            report("OPENED");
            // Long enough for its recovery and workers to act on the
            // first engine's claim (that is the harm).
            thread::sleep(Duration::from_secs(2));
            report(&format!("EFFECTS {}", effects.load(Ordering::SeqCst)));
            let _ = room.shutdown(Duration::from_secs(5));
        }
    }
    report("DONE");
}

/// The second engine's effect: counts, runs nothing else.
struct Counting {
    effects: Arc<AtomicU32>,
}

impl EffectHandler for Counting {
    type Output = ();
    fn effect(&self, _: &EffectContext<'_>, _: &Message) -> Result<(), Failure> {
        self.effects.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn apply(&self, tx: &mut Tx<'_>, msg: &Message, _: ()) -> Result<(), Failure> {
        tx.execute(
            "INSERT INTO applied (consumer, message_id, payload) VALUES ('c', ?1, 'second')",
            [msg.id()],
        )?;
        Ok(())
    }
}

/// The first engine's effect: blocks until the test lets it go, so its
/// claim is in progress (row `processing`, lease held) meanwhile.
struct Blocking {
    started: Mutex<Option<std::sync::mpsc::SyncSender<()>>>,
    release: Mutex<std::sync::mpsc::Receiver<()>>,
    effects: Arc<AtomicU32>,
}

impl EffectHandler for Blocking {
    type Output = ();
    fn effect(&self, _: &EffectContext<'_>, _: &Message) -> Result<(), Failure> {
        self.effects.fetch_add(1, Ordering::SeqCst);
        if let Some(started) = self.started.lock().unwrap().take() {
            let _ = started.send(());
        }
        let _ = self
            .release
            .lock()
            .unwrap()
            .recv_timeout(Duration::from_secs(120));
        Ok(())
    }
    fn apply(&self, tx: &mut Tx<'_>, msg: &Message, _: ()) -> Result<(), Failure> {
        tx.execute(
            "INSERT INTO applied (consumer, message_id, payload) VALUES ('c', ?1, 'first')",
            [msg.id()],
        )?;
        Ok(())
    }
}

/// Runs a second engine on `db` in a child process; what it said.
fn second_engine_in_a_child(db: &Path) -> Vec<String> {
    let mut child = spawn_child("second-engine", db, &[]);
    let lines = lines_of(&mut child);
    let said = wait_for(&lines, "DONE");
    wait_or_kill(&mut child, 60, "the second engine");
    // Only the protocol's lines (libtest prints its own).
    said.into_iter()
        .filter(|l| {
            ["REFUSED", "OPENED", "EFFECTS", "ERROR"]
                .iter()
                .any(|w| l.starts_with(w))
        })
        .collect()
}

/// Deletes every file beside the database while the first engine runs
/// with an effect in progress, then starts a second engine: it must be
/// refused, in another process and in this one, and the effect must run
/// once. `also_sqlites` deletes `-wal` and `-shm` too (a cleanup script
/// that removes "stale" files).
fn second_engine_after_deleting(suffixes: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    let (started_tx, started_rx) = std::sync::mpsc::sync_channel(1);
    let (release_tx, release_rx) = std::sync::mpsc::channel();
    let effects = Arc::new(AtomicU32::new(0));
    let room = Postroom::builder()
        .workers(1)
        .poll_interval(Duration::from_millis(5))
        .lease(Duration::from_secs(120))
        .effectful_consumer(
            "c",
            Blocking {
                started: Mutex::new(Some(started_tx)),
                release: Mutex::new(release_rx),
                effects: Arc::clone(&effects),
            },
        )
        .open(&db)
        .unwrap();
    create_domain(&room);
    room.receive("c", Message::new("s", "m", "x")).unwrap();
    started_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the first engine's effect started");
    // Lease tokens are unique across processes: not 1, 2, … in each.
    let token = count(
        &raw(&db),
        "SELECT lease_token FROM postroom_inbox WHERE status = 'processing'",
    );
    assert_ne!(
        token, 1,
        "the first claim's lease token is 1, as in every process"
    );

    for suffix in suffixes {
        let path = with_suffix(&db, suffix);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            // Windows: the engine file (held without shared delete by the
            // engine) and SQLite's `-wal` and `-shm` cannot be removed while
            // open; the engine's lock stands on that.
            Err(e) if cfg!(windows) && e.raw_os_error() == Some(32) => {}
            Err(e) => panic!("remove {}: {e}", path.display()),
        }
    }
    let said = second_engine_in_a_child(&db);
    let in_process = Postroom::builder().workers(0).open(&db);
    release_tx.send(()).unwrap();
    assert_eq!(
        said,
        vec!["REFUSED".to_string()],
        "a second engine (another process) was let in after {suffixes:?} were deleted"
    );
    assert!(
        matches!(in_process, Err(Error::AlreadyOpen { .. })),
        "a second engine in this process was let in: {in_process:?}"
    );
    if suffixes == ["-postroom"] {
        let conn = raw(&db);
        eventually(60, "the first engine's claim completed", || {
            inbox_row(&conn, "c", "s", "m").is_some_and(|r| r.0 == "completed")
        });
        assert_eq!(applied_count(&conn, "m"), 1);
    }
    assert_eq!(effects.load(Ordering::SeqCst), 1);
    let _ = room.shutdown(Duration::from_secs(30));
}

#[test]
fn deleting_the_engine_file_does_not_let_a_second_engine_in() {
    second_engine_after_deleting(&["-postroom"]);
}

#[test]
fn deleting_every_file_beside_the_database_does_not_let_a_second_engine_in() {
    second_engine_after_deleting(&["-postroom", "-wal", "-shm"]);
}

/// A lock the engine released is released: a child process forked by
/// another thread of the app between the engine's open and its shutdown
/// (and not yet exec'd) does not keep it.
#[test]
fn a_reopen_right_after_shutdown_is_never_refused_while_the_app_spawns_processes() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    let stop = Arc::new(AtomicBool::new(false));
    let spawned = Arc::new(AtomicU32::new(0));
    let spawner = {
        let stop = Arc::clone(&stop);
        let spawned = Arc::clone(&spawned);
        thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let status = if cfg!(windows) {
                    std::process::Command::new("cmd")
                        .args(["/C", "exit 0"])
                        .status()
                } else {
                    std::process::Command::new("true").status()
                };
                assert!(status.is_ok_and(|s| s.success()));
                spawned.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let mut refused = 0;
    for _ in 0..100 {
        match Postroom::builder().open(&db) {
            Ok(room) => {
                room.shutdown(Duration::from_secs(30)).unwrap();
            }
            Err(Error::AlreadyOpen { .. }) => refused += 1,
            Err(e) => panic!("open failed: {e}"),
        }
    }
    stop.store(true, Ordering::Relaxed);
    join_within(spawner, 60, "the spawning thread");
    println!(
        "{} processes spawned meanwhile",
        spawned.load(Ordering::Relaxed)
    );
    assert!(spawned.load(Ordering::Relaxed) > 0);
    assert_eq!(refused, 0, "reopens refused as AlreadyOpen");
}

/// The database file's lock is taken through a descriptor the process
/// never closes: closing any descriptor of a file drops every POSIX lock
/// the process holds on it, so an engine that closed its own would take
/// away the read lock of the app's connection on the same file (SQLite
/// then believes it holds a lock it does not).
// Reads /proc/locks: Linux only.
#[cfg(target_os = "linux")]
#[test]
fn an_engine_never_drops_the_apps_own_sqlite_locks_on_the_database() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    Postroom::builder()
        .open(&db)
        .unwrap()
        .shutdown(Duration::from_secs(10))
        .unwrap();
    let meta = std::fs::metadata(&db).unwrap();
    let id = format!(
        "{:02x}:{:02x}:{}",
        rustix::fs::major(meta.dev()),
        rustix::fs::minor(meta.dev()),
        meta.ino()
    );
    let pid = std::process::id().to_string();
    // `11: POSIX  ADVISORY  READ 1234 fe:00:5678 1073741826 1073742335`
    let posix_locks_held = || {
        std::fs::read_to_string("/proc/locks")
            .unwrap()
            .lines()
            .filter(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                f.get(1) == Some(&"POSIX")
                    && f.get(4) == Some(&pid.as_str())
                    && f.get(5) == Some(&id.as_str())
            })
            .count()
    };
    // The app's own connection, in a read transaction: SQLite holds a
    // shared POSIX lock on the database file for it.
    let app = raw(&db);
    app.execute_batch("BEGIN").unwrap();
    count(&app, "SELECT count(*) FROM postroom_inbox");
    assert!(posix_locks_held() > 0, "the app's read lock");
    for _ in 0..3 {
        Postroom::builder()
            .open(&db)
            .unwrap()
            .shutdown(Duration::from_secs(10))
            .unwrap();
        assert!(
            posix_locks_held() > 0,
            "the engine's open and shutdown dropped the app's SQLite lock on the database"
        );
    }
    app.execute_batch("COMMIT").unwrap();
}
