//! The store: postroom's SQL as plain functions over a
//! `&rusqlite::Connection`, with `now` passed in; no threads, no engine.
//! Everything above (the state machines, the threads, the operator
//! functions) reads and writes the database through these.

pub(crate) mod admission;
pub(crate) mod backlog;
pub(crate) mod check;
pub(crate) mod conflicts;
pub(crate) mod due;
pub(crate) mod gauges;
pub(crate) mod identity;
pub(crate) mod inbox;
pub(crate) mod inflight;
pub(crate) mod outbox;
pub(crate) mod page;
pub(crate) mod payload;
pub(crate) mod queue;
pub(crate) mod retention;
pub(crate) mod retired;
pub(crate) mod schema;
pub(crate) mod stats;
pub(crate) mod strict;
pub(crate) mod sweep;
pub(crate) mod text;
pub(crate) mod watermark;

use std::path::{Path, PathBuf};

/// A file beside the database named after it: SQLite's `-wal` and
/// `-shm`, postroom's `-postroom`.
pub(crate) fn beside(db: &Path, suffix: &str) -> PathBuf {
    let mut p = db.as_os_str().to_owned();
    p.push(suffix);
    PathBuf::from(p)
}

/// The `-wal` file SQLite keeps beside `db`.
pub(crate) fn wal_path(db: &Path) -> PathBuf {
    beside(db, "-wal")
}
