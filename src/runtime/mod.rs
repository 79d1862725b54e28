//! The engine's threads and the state they share: the writer (group
//! commit), the checkpointer (what `Durability::Normal` means on disk), the
//! workers and dispatcher, the relay and the reaper. Each is started by the
//! engine, named, and joined on shutdown against a deadline.

pub(crate) mod checkpoint;
pub(crate) mod gauges;
pub(crate) mod reaper;
pub(crate) mod relay;
pub(crate) mod wal;
pub(crate) mod workers;
pub(crate) mod writer;

use std::time::Duration;

use rusqlite::{Connection, OpenFlags};

use crate::error::{Error, Result};

/// The engine's read connections (`query_only`).
pub(crate) type Readers = r2d2::Pool<ReadManager>;

/// Opens the read pool's connections: `query_only`, with the engine's busy
/// timeout. Written here rather than taken from `r2d2_sqlite` because that
/// crate pins one rusqlite minor version, and through `links = "sqlite3"`
/// an application on any other rusqlite could not add postroom at all.
#[derive(Debug)]
pub(crate) struct ReadManager {
    pub(crate) path: std::path::PathBuf,
    pub(crate) busy_timeout: Duration,
    /// The engine's: a reader can be the last connection to close, and
    /// then runs SQLite's checkpoint-on-close, which must sync as the
    /// writer's would (`fullfsync` on Apple systems).
    pub(crate) durability: crate::config::Durability,
    /// Set by [`close_readers`]: no connection is opened or kept after it.
    pub(crate) closed: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl r2d2::ManageConnection for ReadManager {
    type Connection = Connection;
    type Error = rusqlite::Error;

    fn connect(&self) -> std::result::Result<Connection, rusqlite::Error> {
        if self.closed.load(std::sync::atomic::Ordering::Acquire) {
            // Closed: a connection to no file, which `has_broken` drops as
            // it comes back (an error would have r2d2 retry, and log, for
            // as long as the pool lives).
            return Connection::open_in_memory();
        }
        let conn = Connection::open_with_flags(
            &self.path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        conn.busy_timeout(self.busy_timeout)?;
        crate::store::schema::set_durability(&conn, self.durability)?;
        conn.pragma_update(None, "query_only", true)?;
        Ok(conn)
    }

    fn is_valid(&self, conn: &mut Connection) -> std::result::Result<(), rusqlite::Error> {
        conn.execute_batch("")
    }

    fn has_broken(&self, _: &mut Connection) -> bool {
        self.closed.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// Closes every read connection the pool keeps, now, and each one still
/// checked out as it comes back: after `shutdown` the engine holds no
/// handle on the database (Windows refuses to delete or move a file that
/// is open, and an app removes its data directory right after shutdown).
pub(crate) fn close_readers(readers: &Readers, closed: &std::sync::atomic::AtomicBool) {
    closed.store(true, std::sync::atomic::Ordering::Release);
    // Each idle connection taken is dropped as it goes back: `has_broken`.
    while let Some(conn) = readers.try_get() {
        drop(conn);
    }
}

/// A read connection from the pool; the pool's error as an I/O error.
pub(crate) fn read_connection(readers: &Readers) -> Result<r2d2::PooledConnection<ReadManager>> {
    readers.get().map_err(|e| Error::Io {
        op: "get read connection",
        source: std::io::Error::other(e.to_string()),
    })
}
