//! The checkpointer thread: keeps the `-wal` file small without making
//! the writer pay for it.
//!
//! SQLite's automatic checkpoint runs inside the COMMIT that crosses the
//! threshold, so the delivery that happens to commit then waits for pages to
//! be copied and the database file fsynced (tens of milliseconds). The
//! writer connection therefore runs with `wal_autocheckpoint=0`, and this
//! thread checkpoints from a connection of its own: `PASSIVE` while writes
//! go on (it never blocks the writer), and `TRUNCATE` (which does block new
//! writers while it waits) only once the engine has been idle for a tick.
//!
//! Invariant: whenever the WAL exceeds `checkpoint_wal_bytes`, a checkpoint
//! is attempted within one tick, so the WAL stays bounded by what the
//! writer can append in a tick plus what readers pin.

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
        // Copy first, without blocking anyone; truncate only an idle, fully
        // copied WAL, so TRUNCATE has nothing left to do while new writers
        // wait on it.
        if checkpoint(&conn, "PASSIVE").is_some_and(|(log, done)| log == done) && idle {
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
