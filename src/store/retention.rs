//! Retention as one pass, driven by the engine's reaper and by
//! `admin::cleanup` alike: what is deleted, in which order, in batches of
//! [`BATCH`] rows, each batch a transaction of its own (the driver decides
//! how it gets the write lock and what it does between batches).
//!
//! Order: completed inbox rows, walked in id order ([`sweep`]), with their
//! key entries following in key order during and at the end of that step
//! ([`retired::retire`]); sent outbox rows; dead letters (when kept for a
//! limited time); conflicts (likewise). Invariant: pending, failed and
//! processing rows are never deleted, nor the newest row of the inbox or
//! the outbox (see the statements' own comments).

use std::time::Duration;

use crate::clock;
use crate::store::{inbox, outbox, queue, retired, sweep};

/// Rows deleted per transaction: a few milliseconds of work, the longest a
/// delivery waits behind one.
pub(crate) const BATCH: usize = 256;

/// How long each kind of finished row is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Keep {
    /// Completed inbox rows and sent outbox rows.
    pub completed: Duration,
    /// Dead letters; `None` keeps them.
    pub dead: Option<Duration>,
    /// Conflicts; `None` keeps them.
    pub conflicts: Option<Duration>,
}

/// The times before which rows are past retention, for a pass at `now_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cutoffs {
    /// When the pass runs.
    pub now: i64,
    pub completed: i64,
    pub dead: Option<i64>,
    pub conflicts: Option<i64>,
}

impl Keep {
    pub fn cutoffs(&self, now_ms: i64) -> Cutoffs {
        let cutoff = |keep: Duration| now_ms.saturating_sub(clock::millis(keep));
        Cutoffs {
            now: now_ms,
            completed: cutoff(self.completed),
            dead: self.dead.map(cutoff),
            conflicts: self.conflicts.map(cutoff),
        }
    }
}

/// What one pass deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Deleted {
    pub inbox: u64,
    pub keys: u64,
    pub outbox: u64,
    /// `None` when dead letters are kept.
    pub dead: Option<u64>,
    /// `None` when conflicts are kept.
    pub conflicts: Option<u64>,
}

/// How a pass reaches the database.
pub(crate) trait Driver {
    type Error;
    /// Runs `queue::delete_expired(sql, cutoff, BATCH)` in a transaction
    /// of its own; returns the rows deleted.
    fn delete(&mut self, sql: &'static str, cutoff: i64) -> Result<usize, Self::Error>;
    /// Runs `sweep::step(walk, BATCH)` in a transaction of its own.
    fn sweep(&mut self, walk: sweep::Walk) -> Result<(usize, Option<sweep::Walk>), Self::Error>;
    /// Reads the key entries of deleted rows ([`retired::read`]).
    fn read_retired(&mut self) -> Result<Option<retired::Retired>, Self::Error>;
    /// Applies one batch of them in a transaction of its own.
    fn apply_retired(&mut self, batch: retired::Batch) -> Result<usize, Self::Error>;
    /// Called after each full batch: pause, or say to stop (`false`).
    fn between_batches(&mut self) -> bool;
}

/// Runs one retention pass.
pub(crate) fn run<D: Driver>(cutoffs: Cutoffs, d: &mut D) -> Result<Deleted, D::Error> {
    let mut deleted = Deleted::default();
    let mut next = Some(sweep::Walk::new(cutoffs.completed, cutoffs.now));
    (deleted.inbox, deleted.keys) = {
        // Both closures need the driver, one at a time.
        let d = std::cell::RefCell::new(&mut *d);
        retired::retire(
            |max| walk(*d.borrow_mut(), &mut next, max),
            || {
                retired::drain(
                    || d.borrow_mut().read_retired(),
                    |batch| d.borrow_mut().apply_retired(batch),
                )
            },
        )?
    };
    // A batch short of `BATCH` was the last.
    let mut all = |sql, cutoff| {
        batches(d, u64::MAX, |d| {
            d.delete(sql, cutoff).map(|n| (n, n == BATCH))
        })
        .map(|(n, _)| n)
    };
    deleted.outbox = all(outbox::DELETE_SENT, cutoffs.completed)?;
    if let Some(cutoff) = cutoffs.dead {
        deleted.dead = Some(all(queue::DELETE_DEAD, cutoff)?);
    }
    if let Some(cutoff) = cutoffs.conflicts {
        deleted.conflicts = Some(all(inbox::DELETE_CONFLICTS, cutoff)?);
    }
    Ok(deleted)
}

/// Walks the inbox from `next` ([`sweep::step`]), as [`batches`] says;
/// `next` is where to go on when it stops at `max`.
fn walk<D: Driver>(
    d: &mut D,
    next: &mut Option<sweep::Walk>,
    max: u64,
) -> Result<(u64, bool), D::Error> {
    batches(d, max, |d| {
        let Some(walk) = next.take() else {
            return Ok((0, false));
        };
        let (n, after) = d.sweep(walk)?;
        *next = after;
        Ok((n, next.is_some()))
    })
}

/// Runs `step` (one transaction: rows deleted, and whether any may be
/// left) until none is left (`(deleted, true)`), the driver says stop
/// (likewise), or at least `max` rows were deleted (`(deleted, false)`).
fn batches<D: Driver>(
    d: &mut D,
    max: u64,
    mut step: impl FnMut(&mut D) -> Result<(usize, bool), D::Error>,
) -> Result<(u64, bool), D::Error> {
    let mut total = 0u64;
    loop {
        let (n, more) = step(d)?;
        total += n as u64;
        if !more || !d.between_batches() {
            return Ok((total, true));
        }
        if total >= max {
            return Ok((total, false));
        }
    }
}
