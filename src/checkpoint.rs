//! The checkpointer thread: gives the `-wal` file's disk space back.
//!
//! Copying the WAL into the database stays with SQLite's automatic
//! checkpoint on the writer connection (every 1000 pages, right after a
//! COMMIT). That is deliberate and measured: a checkpoint from another
//! connection can never finish while the writer keeps appending, so the WAL
//! is never restarted, every commit then extends the file, and each fsync
//! pays for the size change — single-caller latency went from ~260 µs to
//! ~380 µs (p50, synchronous=FULL) when copying moved to this thread.
//!
//! The automatic checkpoint reuses the WAL's space but never shrinks the
//! file, which after a burst (or a retention pass) can stay large. This
//! thread truncates it — `PASSIVE` first, then `TRUNCATE` only when that
//! copied everything and the engine has been idle for a tick, because
//! `TRUNCATE` makes new writers wait while it runs.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError};
use rusqlite::{Connection, OpenFlags};

use crate::writer::Counters;

/// How often the WAL size is looked at.
const TICK: Duration = Duration::from_millis(100);

/// The thread's body, until `stop` disconnects.
pub(crate) fn run(db: PathBuf, threshold: u64, counters: Arc<Counters>, stop: Receiver<()>) {
    let conn = match open(&db) {
        Ok(conn) => conn,
        Err(e) => {
            log::error!(
                "postroom checkpointer: cannot open the database: {e}; WAL not checkpointed"
            );
            return;
        }
    };
    let wal = wal_path(&db);
    let mut last_batches = counters.batches.load(Ordering::Relaxed);
    loop {
        match stop.recv_timeout(TICK) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
        }
        let batches = counters.batches.load(Ordering::Relaxed);
        let idle = batches == last_batches;
        last_batches = batches;
        let size = std::fs::metadata(&wal).map(|m| m.len()).unwrap_or(0);
        if size <= threshold {
            continue;
        }
        // Only when idle: copy whatever is left without blocking anyone,
        // then truncate a fully copied WAL, so TRUNCATE has nothing to do
        // while new writers wait on it.
        if idle && checkpoint(&conn, "PASSIVE").is_some_and(|(log, done)| log == done) {
            checkpoint(&conn, "TRUNCATE");
        }
    }
}

/// Runs one checkpoint; returns (frames in the WAL, frames checkpointed).
fn checkpoint(conn: &Connection, mode: &str) -> Option<(i64, i64)> {
    let result = conn.query_row(&format!("PRAGMA wal_checkpoint({mode})"), [], |r| {
        Ok((
            r.get::<_, i64>(0)?,
            r.get::<_, i64>(1)?,
            r.get::<_, i64>(2)?,
        ))
    });
    match result {
        Ok((busy, log_frames, done)) => {
            log::debug!(
                "postroom checkpointer: {mode}: busy {busy}, {done} of {log_frames} frames"
            );
            Some((log_frames, done))
        }
        Err(e) => {
            log::warn!("postroom checkpointer: {mode} checkpoint failed: {e}");
            None
        }
    }
}

/// At open, before any thread runs: copy back and truncate a WAL that a
/// previous process left large (a process killed young never reaches its
/// checkpointer's first tick, so crash loops would otherwise grow it). Waits
/// at most briefly for readers of other processes; best effort.
pub(crate) fn at_open(conn: &Connection, db: &Path, threshold: u64, busy_timeout: Duration) {
    let size = std::fs::metadata(wal_path(db))
        .map(|m| m.len())
        .unwrap_or(0);
    if size <= threshold {
        return;
    }
    let _ = conn.busy_timeout(Duration::from_millis(100));
    checkpoint(conn, "TRUNCATE");
    let _ = conn.busy_timeout(busy_timeout);
}

fn open(db: &Path) -> rusqlite::Result<Connection> {
    let conn = Connection::open_with_flags(
        db,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    // TRUNCATE waits this long for the writer at most, and only when idle.
    conn.busy_timeout(Duration::from_millis(20))?;
    Ok(conn)
}

pub(crate) fn wal_path(db: &Path) -> PathBuf {
    let mut p = db.as_os_str().to_owned();
    p.push("-wal");
    PathBuf::from(p)
}
