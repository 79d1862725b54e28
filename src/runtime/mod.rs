//! The engine's threads and the state they share: the writer (group
//! commit), the checkpointer (what `Durability::Normal` means on disk), the
//! workers and dispatcher, the relay and the reaper. Each is started by the
//! engine, named, and joined on shutdown against a deadline.

pub(crate) mod checkpoint;
pub(crate) mod reaper;
pub(crate) mod relay;
pub(crate) mod workers;
pub(crate) mod writer;

use r2d2_sqlite::SqliteConnectionManager;

use crate::error::{Error, Result};

/// The engine's read connections (`query_only`).
pub(crate) type Readers = r2d2::Pool<SqliteConnectionManager>;

/// A read connection from the pool; the pool's error as an I/O error.
pub(crate) fn read_connection(
    readers: &Readers,
) -> Result<r2d2::PooledConnection<SqliteConnectionManager>> {
    readers.get().map_err(|e| Error::Io {
        op: "get read connection",
        source: std::io::Error::other(e.to_string()),
    })
}
