//! Operator functions over a plain [`rusqlite::Connection`]: what the
//! `postroom` command-line tool does, for your own tooling too.
//!
//! These work on a database **while an application has it open**: they
//! never open a [`Postroom`](crate::Postroom) engine and never touch the
//! engine's lock file (`<db>-postroom`). [`open_read`] and [`read`] give a
//! read-only connection that leaves every file as it was; [`open`] with
//! [`Access::ReadWrite`] one for mutations, after the checks the engine's own
//! open makes. Each mutation runs in its own short `BEGIN IMMEDIATE`
//! transaction, so it waits for — and is serialized with — the running
//! engine's writer.
//!
//! ```
//! # fn main() -> postroom::Result<()> {
//! # let dir = tempfile::tempdir().unwrap();
//! # let path = dir.path().join("app.db");
//! # postroom::Postroom::builder().open(&path)?.shutdown(std::time::Duration::from_secs(5))?;
//! use postroom::admin;
//!
//! let conn = admin::open(&path, admin::Access::ReadOnly)?;
//! let status = admin::status(&conn, &path)?;
//! assert_eq!(status.conflicts, 0);
//! print!("{}", admin::prometheus(&status));
//!
//! let report = admin::check(&conn, admin::CheckDepth::Quick)?;
//! assert!(report.is_ok());
//! # Ok(()) }
//! ```
//!
//! Times are unix milliseconds, as stored. Names and ids are always bound
//! as SQL parameters.

mod check;
mod cleanup;
mod conflicts;
mod dead;
mod inbox;
mod open;
mod outbox;
mod status;

use std::time::{Duration, Instant};

use rusqlite::{Connection, ErrorCode, Transaction, TransactionBehavior};

use crate::error::{Error, Result};
use crate::store::retention as store_retention;

pub use crate::store::conflicts::{ConflictDetail, ConflictEntry};
pub use crate::store::inbox::{InboxDetail, InboxEntry, InboxFilter};
pub use crate::store::outbox::{OutboxDetail, OutboxEntry, OutboxFilter, OutboxState};
pub use crate::store::page::Page;
pub use crate::store::payload::{Decoded, Payload};

/// How long [`open`] waits for another connection's lock (the engine's
/// writer) before a statement fails with [`Error::Busy`].
pub const DEFAULT_BUSY_TIMEOUT: Duration = crate::config::DEFAULT_BUSY_TIMEOUT;

/// Rows deleted per transaction by [`cleanup`] (as the engine's retention).
pub const CLEANUP_BATCH: usize = store_retention::BATCH;

/// The engine's default retention, 7 days: the dedupe horizon.
pub const DEFAULT_RETENTION: Duration = crate::config::DEFAULT_RETENTION;

/// At most this many findings of each kind (violations, warnings) are kept
/// in a [`CheckReport`]; the totals count all of them.
pub const MAX_FINDINGS: usize = 100;

pub use check::{check, CheckDepth, CheckReport, Finding, FindingKind};
pub use cleanup::{cleanup, CleanupMode, CleanupSummary, Retention};
pub use conflicts::{conflicts_discard, conflicts_list, conflicts_show};
pub use dead::{
    act_on_dead_letters, dead_letters, dead_select, discard, discard_outbox, outbox_dead_letters,
    redrive, redrive_outbox, BulkSummary, DeadFilter, DeadLetterAction,
};
pub use inbox::{inbox_cancel, inbox_find, inbox_list, inbox_retry_now, inbox_show};
pub use open::{
    now_ms, open, open_read, open_with_timeout, read, wal_damaged_frames, Access, ReadView,
};
pub use outbox::{outbox_list, outbox_show};
pub use status::{
    prometheus, sequences, sequences_prometheus, slow_handler, status, AttemptsBucket,
    ConsumerStatus, OutboxStatus, SlowHandler, StatusReport,
};

/// Runs `f` in one read transaction (one snapshot) unless the caller
/// already has a transaction open.
fn snapshot<T>(conn: &Connection, f: impl FnOnce() -> Result<T>) -> Result<T> {
    if !conn.is_autocommit() {
        return f();
    }
    let tx = Transaction::new_unchecked(conn, TransactionBehavior::Deferred)
        .map_err(|e| Error::sqlite("begin read transaction", e))?;
    let out = f()?;
    // Ending a read transaction cannot lose anything; a failure to end it
    // is still reported.
    tx.commit()
        .map_err(|e| Error::sqlite("end read transaction", e))?;
    Ok(out)
}

/// How often a mutation tries again for the write lock while another
/// writer holds it. SQLite's own busy handler backs off to 100 ms between
/// tries, and an engine that commits back to back leaves the lock free only
/// for moments in between, which those tries can miss for seconds
/// (docs/DESIGN.md, "Writes are short").
const WRITE_LOCK_RETRY: Duration = Duration::from_millis(1);

/// Runs `f` in its own `BEGIN IMMEDIATE` transaction: it waits (up to the
/// busy timeout, trying every [`WRITE_LOCK_RETRY`]) for the engine's
/// writer, then holds the write lock only for `f`. Rolled back when `f`
/// fails.
fn write<T>(
    conn: &Connection,
    op: &'static str,
    f: impl FnOnce(&Connection) -> rusqlite::Result<T>,
) -> Result<T> {
    let tx = begin_immediate(conn).map_err(|e| Error::sqlite(op, e))?;
    let out = f(&tx).map_err(|e| Error::sqlite(op, e))?;
    tx.commit().map_err(|e| Error::sqlite(op, e))?;
    Ok(out)
}

/// `BEGIN IMMEDIATE`, tried every [`WRITE_LOCK_RETRY`] until the
/// connection's busy timeout has passed; the timeout is set back after. A
/// connection without one (none set, or a busy handler of the caller's
/// own, which reads as 0) is left as it is: one try, through its handler.
fn begin_immediate(conn: &Connection) -> rusqlite::Result<Transaction<'_>> {
    let timeout_ms: i64 = conn.pragma_query_value(None, "busy_timeout", |r| r.get(0))?;
    let timeout = Duration::from_millis(u64::try_from(timeout_ms).unwrap_or(0));
    if timeout.is_zero() {
        return Transaction::new_unchecked(conn, TransactionBehavior::Immediate);
    }
    let deadline = Instant::now() + timeout;
    conn.busy_timeout(Duration::ZERO)?;
    let begun = loop {
        match Transaction::new_unchecked(conn, TransactionBehavior::Immediate) {
            Err(e)
                if e.sqlite_error_code() == Some(ErrorCode::DatabaseBusy)
                    && Instant::now() < deadline =>
            {
                std::thread::sleep(WRITE_LOCK_RETRY)
            }
            begun => break begun,
        }
    };
    conn.busy_timeout(timeout)?;
    begun
}

fn sql(op: &'static str) -> impl Fn(rusqlite::Error) -> Error {
    move |e| Error::sqlite(op, e)
}

fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// True for a character that reorders or hides the text around it
/// (Unicode's format characters, the line and paragraph separators): what
/// the CLI escapes besides control characters, the same list as the
/// engine's own log text.
pub fn invisible(c: char) -> bool {
    crate::escape::invisible(c)
}

/// Lets a running engine's writer have the lock at least half of the time.
fn pause_after(started: Instant) {
    std::thread::sleep(started.elapsed().max(Duration::from_millis(1)));
}
