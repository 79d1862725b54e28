//! Retention run from outside the engine (`postroom cleanup`): the
//! engine's own retention pass, in batches that each hold the write lock
//! briefly. Invariant: what is deleted and in which order is
//! `store::retention`'s, the same as the engine's reaper.

use std::time::{Duration, Instant};

use rusqlite::Connection;
use serde::Serialize;

use crate::error::{Error, Result};
use crate::store::inbox;
use crate::store::outbox;
use crate::store::queue;
use crate::store::retention as store_retention;
use crate::store::retired;
use crate::store::sweep;

use super::{pause_after, snapshot, sql, write, CLEANUP_BATCH};

/// How long [`cleanup`] keeps finished rows: the engine's `retention`,
/// `dead_retention` and `conflict_retention` settings, for running
/// retention from outside the engine (the CLI's `cleanup`). A bare
/// [`Duration`] converts into one that keeps dead letters and conflicts,
/// as the engine's defaults do.
///
/// ```
/// use std::time::Duration;
/// use postroom::admin::Retention;
///
/// let day = Duration::from_secs(24 * 3600);
/// let policy = Retention::new(7 * day).dead(Some(30 * day)).conflicts(Some(30 * day));
/// assert_eq!(policy.dead, Some(30 * day));
/// assert_eq!(Retention::from(7 * day).conflicts, None);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Retention {
    /// Completed inbox rows processed, and sent outbox rows sent, longer
    /// ago than this are deleted: the dedupe horizon.
    pub completed: Duration,
    /// Dead letters (inbox) that died longer ago than this are deleted;
    /// `None` (the default) keeps them.
    pub dead: Option<Duration>,
    /// Quarantined deliveries last seen longer ago than this are deleted;
    /// `None` (the default) keeps them.
    pub conflicts: Option<Duration>,
}

impl Retention {
    /// Deletes completed and sent rows older than `completed`; keeps dead
    /// letters and conflicts.
    pub fn new(completed: Duration) -> Self {
        Retention {
            completed,
            dead: None,
            conflicts: None,
        }
    }

    /// Also delete dead letters older than this (`None`: keep them).
    pub fn dead(mut self, dead: Option<Duration>) -> Self {
        self.dead = dead;
        self
    }

    /// Also delete conflicts last seen longer ago than this (`None`: keep
    /// them).
    pub fn conflicts(mut self, conflicts: Option<Duration>) -> Self {
        self.conflicts = conflicts;
        self
    }
}

impl From<Duration> for Retention {
    fn from(completed: Duration) -> Self {
        Retention::new(completed)
    }
}

/// What [`cleanup`] deleted, or would delete.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct CleanupSummary {
    /// Completed and sent rows finished before this time (unix ms) are past
    /// retention.
    pub cutoff_ms: i64,
    /// Dead letters that died before this time are past
    /// [`Retention::dead`]; `None` when it is `None`.
    pub dead_cutoff_ms: Option<i64>,
    /// Conflicts last seen before this time are past
    /// [`Retention::conflicts`]; `None` when it is `None`.
    pub conflicts_cutoff_ms: Option<i64>,
    /// True when nothing was deleted, only counted.
    pub dry_run: bool,
    /// Completed inbox rows deleted (or that would be).
    pub inbox_deleted: u64,
    /// Their key entries deleted, after the rows, in key order (0 for a
    /// dry run): as many, plus any an interrupted pass left; fewer if the
    /// engine's reaper deleted some first.
    pub keys_deleted: u64,
    /// Sent outbox rows deleted (or that would be).
    pub outbox_deleted: u64,
    /// Inbox dead letters deleted (or that would be); `None` when
    /// [`Retention::dead`] is `None`.
    pub dead_deleted: Option<u64>,
    /// Conflicts deleted (or that would be); `None` when
    /// [`Retention::conflicts`] is `None`.
    pub conflicts_deleted: Option<u64>,
    /// Write transactions used (0 for a dry run).
    pub transactions: u64,
}

/// Whether [`cleanup`] deletes or only counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CleanupMode {
    /// Delete what expired.
    Delete,
    /// Only count it, read-only.
    DryRun,
}

/// Applies retention as the engine's reaper does: completed inbox rows
/// processed, and sent outbox rows sent, before `now_ms - completed`
/// (retention walks the inbox in id order: a completed row it reaches
/// while too young holds the rows stored after it until it ages); with
/// [`Retention::dead`] / [`Retention::conflicts`], dead letters and
/// conflicts too. Pending, failed and processing rows are never touched,
/// nor the newest row of the inbox or the outbox (so no row id or `seq` is
/// given out twice). `retention` is a [`Retention`] or a bare [`Duration`]
/// (completed and sent rows only).
///
/// With [`CleanupMode::DryRun`], only counts, with the statements a run deletes with
/// (read-only). Otherwise deletes [`CLEANUP_BATCH`] rows per
/// `BEGIN IMMEDIATE` transaction, pausing between batches as long as the
/// batch took, so a running engine's writer gets the lock at least half of
/// the time.
pub fn cleanup(
    conn: &Connection,
    now_ms: i64,
    retention: impl Into<Retention>,
    mode: CleanupMode,
) -> Result<CleanupSummary> {
    let dry_run = mode == CleanupMode::DryRun;
    let retention = retention.into();
    let keep = store_retention::Keep {
        completed: retention.completed,
        dead: retention.dead,
        conflicts: retention.conflicts,
    };
    let cutoffs = keep.cutoffs(now_ms);
    let mut summary = CleanupSummary {
        cutoff_ms: cutoffs.completed,
        dead_cutoff_ms: cutoffs.dead,
        conflicts_cutoff_ms: cutoffs.conflicts,
        dry_run,
        inbox_deleted: 0,
        keys_deleted: 0,
        outbox_deleted: 0,
        dead_deleted: None,
        conflicts_deleted: None,
        transactions: 0,
    };
    if dry_run {
        return snapshot(conn, || {
            let expired = |statement, cutoff| {
                queue::count_expired(conn, statement, cutoff).map_err(sql("count expired rows"))
            };
            summary.inbox_deleted = sweep::count(conn, cutoffs.completed, cutoffs.now)
                .map_err(sql("count expired rows"))?;
            summary.outbox_deleted = expired(outbox::DELETE_SENT, cutoffs.completed)?;
            if let Some(c) = cutoffs.dead {
                summary.dead_deleted = Some(expired(queue::DELETE_DEAD, c)?);
            }
            if let Some(c) = cutoffs.conflicts {
                summary.conflicts_deleted = Some(expired(inbox::DELETE_CONFLICTS, c)?);
            }
            Ok(summary)
        });
    }
    let mut cleaner = Cleaner {
        conn,
        transactions: 0,
        started: Instant::now(),
    };
    let deleted = store_retention::run(cutoffs, &mut cleaner)?;
    summary.inbox_deleted = deleted.inbox;
    summary.keys_deleted = deleted.keys;
    summary.outbox_deleted = deleted.outbox;
    summary.dead_deleted = deleted.dead;
    summary.conflicts_deleted = deleted.conflicts;
    summary.transactions = cleaner.transactions;
    Ok(summary)
}

/// Retention on an operator's connection: each batch its own
/// `BEGIN IMMEDIATE`, with a pause after it as long as it took, so a
/// running engine's writer gets the lock at least half of the time.
struct Cleaner<'c> {
    conn: &'c Connection,
    transactions: u64,
    /// When the last batch began.
    started: Instant,
}

impl store_retention::Driver for Cleaner<'_> {
    type Error = Error;

    fn delete(&mut self, statement: &'static str, cutoff: i64) -> Result<usize> {
        self.started = Instant::now();
        self.transactions += 1;
        write(self.conn, "delete expired rows", |c| {
            queue::delete_expired(c, statement, cutoff, CLEANUP_BATCH)
        })
    }

    fn sweep(&mut self, walk: sweep::Walk) -> Result<(usize, Option<sweep::Walk>)> {
        self.started = Instant::now();
        self.transactions += 1;
        write(self.conn, "delete expired rows", |c| {
            sweep::step(c, walk, CLEANUP_BATCH)
        })
    }

    fn read_retired(&mut self) -> Result<Option<retired::Retired>> {
        retired::read(self.conn).map_err(sql("read retired keys"))
    }

    fn apply_retired(&mut self, batch: retired::Batch) -> Result<usize> {
        let started = Instant::now();
        self.transactions += 1;
        let n = write(self.conn, "delete retired keys", |c| {
            retired::apply(c, &batch)
        })?;
        pause_after(started);
        Ok(n)
    }

    fn between_batches(&mut self) -> bool {
        pause_after(self.started);
        true
    }
}
