//! The reaper: on a timer, recovers expired leases and deletes what
//! retention allows: completed inbox rows, sent outbox rows, and dead
//! letters and conflicts when configured. (The WAL is the checkpointer's job.)
//!
//! Retention deletes in small batches, each a background writer job: it
//! runs only when no caller's job is waiting (or after being put off for
//! 25 ms), in a transaction of its own, so a million-row cleanup never holds
//! a delivery up for more than one batch. The deleted rows' key entries
//! follow in key order, during and at the end of the pass
//! ([`retired::retire`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError};

use crate::clock;
use crate::engine::{read_connection, Readers};
use crate::error::{Error, Result};
use crate::failpoint;
use crate::inbox;
use crate::outbox;
use crate::queue;
use crate::retired;
use crate::workers::{LeaseState, Shared};

/// Rows deleted per writer job: a few milliseconds of work, the longest a
/// delivery queued behind it waits.
const RETENTION_BATCH: usize = 256;

/// What one reaper pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct CleanupReport {
    /// `processing` rows whose lease had expired, now `failed` (or `dead`).
    pub leases_expired: u64,
    /// Completed inbox rows deleted by retention.
    pub inbox_deleted: u64,
    /// Their key entries deleted (in key order, after the rows): as many,
    /// plus any an earlier pass cut short left; fewer if a new delivery of
    /// the key took an entry over, or another process's pass deleted it
    /// first.
    pub keys_deleted: u64,
    /// Dead letters deleted by `dead_retention`.
    pub dead_deleted: u64,
    /// Sent outbox rows deleted by retention.
    pub outbox_deleted: u64,
    /// Quarantined deliveries deleted by `conflict_retention`.
    pub conflicts_deleted: u64,
}

/// The reaper thread's body: a pass every `reaper_interval` until `stop`
/// disconnects.
pub(crate) fn reap(shared: Arc<Shared>, readers: Readers, stop: Receiver<()>) {
    loop {
        match stop.recv_timeout(shared.config.reaper_interval) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
        }
        match run_once(&shared, &readers) {
            Ok(report) if report != CleanupReport::default() => {
                log::debug!("postroom reaper: {report:?}")
            }
            Ok(_) => {}
            Err(Error::Closed) => return,
            Err(e) => log::warn!("postroom reaper: {e}"),
        }
    }
}

/// One pass: expired leases, then retention.
pub(crate) fn run_once(shared: &Shared, readers: &Readers) -> Result<CleanupReport> {
    let mut report = CleanupReport {
        leases_expired: expire_leases(shared)?,
        ..CleanupReport::default()
    };
    if report.leases_expired > 0 {
        shared.wake();
    }
    let retention = shared.config.retention;
    (report.inbox_deleted, report.keys_deleted) = retired::retire(
        |max| delete_in_batches(shared, retention, queue::DELETE_COMPLETED, max),
        || drain_retired(shared, readers),
    )?;
    let all = |keep_for, sql| delete_in_batches(shared, keep_for, sql, u64::MAX).map(|(n, _)| n);
    report.outbox_deleted = all(retention, outbox::DELETE_SENT)?;
    if let Some(dead_retention) = shared.config.dead_retention {
        report.dead_deleted = all(dead_retention, queue::DELETE_DEAD)?;
    }
    if let Some(conflict_retention) = shared.config.conflict_retention {
        report.conflicts_deleted = all(conflict_retention, inbox::DELETE_CONFLICTS)?;
    }
    Ok(report)
}

/// Deletes the key entries of deleted rows (`retired.rs`): reads on a read
/// connection, deletes in background writer jobs.
fn drain_retired(shared: &Shared, readers: &Readers) -> Result<u64> {
    retired::drain(
        || {
            failpoint::hit("reaper.retired_keys")?;
            retired::read(&*read_connection(readers)?)
                .map_err(|e| Error::sqlite("read retired keys", e))
        },
        |batch| {
            if shared.stopping.load(std::sync::atomic::Ordering::Acquire) {
                return Err(Error::Closed);
            }
            failpoint::hit("reaper.retired_keys")?;
            shared.writer.submit_background(move |w| {
                retired::apply(w.conn, &batch).map_err(|e| Error::sqlite("delete retired keys", e))
            })
        },
    )
}

fn expire_leases(shared: &Shared) -> Result<u64> {
    let leases = Arc::clone(&shared.leases);
    let max_attempts = shared.config.max_attempts;
    shared.writer.submit(move |w| {
        let now = w.clock.now_ms();
        let instant = Instant::now();
        let mut expired = 0;
        for row in queue::leased(w.conn).map_err(|e| Error::sqlite("read leases", e))? {
            let due = match leases.state(row.row_id, row.token, instant) {
                LeaseState::Live => false,
                LeaseState::Expired => true,
                LeaseState::Unknown => row.lease_until.is_none_or(|until| until < now),
            };
            if due
                && queue::expire(
                    w.conn,
                    row.row_id,
                    row.token,
                    "lease expired",
                    max_attempts,
                    now,
                )
                .map_err(|e| Error::sqlite("expire lease", e))?
            {
                leases.remove(row.row_id, row.token);
                expired += 1;
            }
        }
        Ok(expired)
    })
}

/// Deletes what `sql` (one of retention's statements, see
/// `queue::delete_expired`) finds past `keep_for`, a batch per writer job,
/// until none is left (returns `(deleted, true)`) or at least `max` rows
/// were deleted (`(deleted, false)`).
fn delete_in_batches(
    shared: &Shared,
    keep_for: Duration,
    sql: &'static str,
    max: u64,
) -> Result<(u64, bool)> {
    let keep_ms = clock::millis(keep_for);
    let cutoff = shared.clock.now_ms().saturating_sub(keep_ms);
    let mut total = 0u64;
    loop {
        failpoint::hit("reaper.retention")?;
        let deleted = shared.writer.submit_background(move |w| {
            queue::delete_expired(w.conn, sql, cutoff, RETENTION_BATCH)
                .map_err(|e| Error::sqlite("retention", e))
        })?;
        total += deleted as u64;
        if deleted < RETENTION_BATCH || shared.stopping.load(std::sync::atomic::Ordering::Acquire) {
            return Ok((total, true));
        }
        if total >= max {
            return Ok((total, false));
        }
    }
}
