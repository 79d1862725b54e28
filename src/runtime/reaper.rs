//! The reaper: recovers expired leases and deletes what retention allows:
//! completed inbox rows, sent outbox rows, and dead letters and conflicts
//! when configured. (The WAL is the checkpointer's job.) Its timer comes
//! from the data: it sleeps until the next lease expires or the next row
//! passes retention, and an idle engine's reaper does not wake at all
//! (see [`reap`]).
//!
//! Retention is `store::retention`'s pass, each batch a background writer
//! job: it runs only when no caller's job is waiting (or after being put
//! off), in a transaction of its own, so a million-row cleanup never holds
//! a delivery up for more than one batch.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use r2d2::ManageConnection;
use rusqlite::Connection;

use crate::error::{Error, Result};
use crate::failpoint;
use crate::runtime::workers::{LeaseState, Shared};
use crate::runtime::{read_connection, ReadManager, Readers};
use crate::store::{due, queue, retention, retired, sweep};

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

/// The reaper thread's body, until `stop` disconnects: asleep until its
/// next pass is due, which is when a lease expires or a row passes
/// retention (read from the data after each pass, and again whenever it
/// is woken: a claim it may not have counted, a commit of another
/// process, a step of the wall clock), but never sooner than
/// `reaper_interval` after the last pass.
pub(crate) fn reap(shared: Arc<Shared>, readers: Readers, stop: Receiver<()>) {
    let interval = shared.config.reaper_interval;
    // Its own connection for reading its timers, closed when the thread
    // ends: a pooled one would stay open after shutdown (until the engine
    // is dropped), and it is read at every wake. Without one (out of file
    // descriptors, say), the pool's.
    let own = ReadManager {
        path: shared.path.clone(),
        busy_timeout: shared.config.busy_timeout,
        durability: shared.config.durability,
        closed: Arc::default(),
    }
    .connect()
    .map_err(|e| log::warn!("postroom reaper: opening its connection: {e}; using the pool's"))
    .ok();
    let mut last_pass = Instant::now();
    loop {
        let due = match next_pass(&shared, own.as_ref(), &readers) {
            Ok(due) => due,
            Err(e) => {
                // Cannot tell: look again as the reaper used to, on its
                // interval.
                log::warn!("postroom reaper: reading when the next pass is due: {e}");
                Some(Instant::now())
            }
        };
        let at = due.map(|due| due.max(last_pass + interval));
        let timer = match at {
            Some(at) => crossbeam_channel::at(at),
            None => crossbeam_channel::never(),
        };
        crossbeam_channel::select! {
            recv(stop) -> _ => return,
            recv(shared.reaper_wake_rx) -> _ => continue,
            recv(timer) -> _ => {}
        }
        last_pass = Instant::now();
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

/// The furthest ahead the reaper's timer is set.
const FAR: Duration = Duration::from_secs(24 * 3600);

/// When the next pass is due, on the monotonic clock: the earliest lease
/// to expire (a lease this process holds by its own deadline, any other by
/// its stored `lease_until`) or row past retention; `None`: nothing waits
/// on the clock. Sets [`Shared::reaper_armed`] when that is no later than
/// a lease claimed from now on would expire, so the dispatcher need not
/// wake the reaper for it (cleared before reading: a claim committed
/// meanwhile is either read here or wakes the reaper).
fn next_pass(
    shared: &Shared,
    own: Option<&Connection>,
    readers: &Readers,
) -> Result<Option<Instant>> {
    shared.reaper_armed.store(false, Ordering::SeqCst);
    let pooled;
    let conn = match own {
        Some(conn) => conn,
        None => {
            pooled = read_connection(readers)?;
            &*pooled
        }
    };
    let now_ms = shared.clock.now_ms();
    let now = Instant::now();
    // A stored time far off (a hand edit) is looked at again within a day:
    // an `Instant` cannot hold every i64 of milliseconds.
    let after_ms = |at_ms: i64| {
        let ms = u64::try_from(at_ms.saturating_sub(now_ms)).unwrap_or(0);
        now + Duration::from_millis(ms).min(FAR)
    };
    let mut next: Option<Instant> = None;
    let mut earliest = |at: Instant| next = Some(next.map_or(at, |n| n.min(at)));
    for row in queue::leased(conn).map_err(|e| Error::sqlite("read leases", e))? {
        match shared.leases.deadline(row.row_id, row.token) {
            Some(deadline) => earliest(deadline),
            // Expired once `lease_until < now` (see `reap`): one ms after
            // it, or a pass landing on that very ms expires nothing and the
            // next waits `reaper_interval`.
            None => earliest(after_ms(
                row.lease_until.unwrap_or(now_ms).saturating_add(1),
            )),
        }
    }
    let keep = retention::Keep {
        completed: shared.config.retention,
        dead: shared.config.dead_retention,
        conflicts: shared.config.conflict_retention,
    };
    if let Some(at) = due::retention(conn, keep).map_err(|e| Error::sqlite("read retention", e))? {
        earliest(after_ms(at));
    }
    if next.is_some_and(|at| at <= now + shared.config.lease) {
        shared.reaper_armed.store(true, Ordering::SeqCst);
    }
    Ok(next)
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
    let keep = retention::Keep {
        completed: shared.config.retention,
        dead: shared.config.dead_retention,
        conflicts: shared.config.conflict_retention,
    };
    let deleted = retention::run(
        keep.cutoffs(shared.clock.now_ms()),
        &mut Reaper { shared, readers },
    )?;
    report.inbox_deleted = deleted.inbox;
    report.keys_deleted = deleted.keys;
    report.outbox_deleted = deleted.outbox;
    report.dead_deleted = deleted.dead.unwrap_or(0);
    report.conflicts_deleted = deleted.conflicts.unwrap_or(0);
    Ok(report)
}

/// Retention through the writer: each batch a background job (it runs
/// only when no caller's job waits, or after being put off), key entries
/// read on a read connection.
struct Reaper<'a> {
    shared: &'a Shared,
    readers: &'a Readers,
}

impl retention::Driver for Reaper<'_> {
    type Error = Error;

    fn delete(&mut self, sql: &'static str, cutoff: i64) -> Result<usize> {
        failpoint::hit("reaper.retention")?;
        self.shared.writer.submit_background(move |w| {
            queue::delete_expired(w.conn, sql, cutoff, retention::BATCH)
                .map_err(|e| Error::sqlite("retention", e))
        })
    }

    fn sweep(&mut self, walk: sweep::Walk) -> Result<(usize, Option<sweep::Walk>)> {
        failpoint::hit("reaper.retention")?;
        self.shared.writer.submit_background(move |w| {
            sweep::step(w.conn, walk, retention::BATCH).map_err(|e| Error::sqlite("retention", e))
        })
    }

    fn read_retired(&mut self) -> Result<Option<retired::Retired>> {
        failpoint::hit("reaper.retired_keys")?;
        retired::read(&*read_connection(self.readers)?)
            .map_err(|e| Error::sqlite("read retired keys", e))
    }

    fn apply_retired(&mut self, batch: retired::Batch) -> Result<usize> {
        if self.stopping() {
            return Err(Error::Closed);
        }
        failpoint::hit("reaper.retired_keys")?;
        self.shared.writer.submit_background(move |w| {
            retired::apply(w.conn, &batch).map_err(|e| Error::sqlite("delete retired keys", e))
        })
    }

    fn between_batches(&mut self) -> bool {
        !self.stopping()
    }
}

impl Reaper<'_> {
    fn stopping(&self) -> bool {
        self.shared
            .stopping
            .load(std::sync::atomic::Ordering::Acquire)
    }
}

fn expire_leases(shared: &Shared) -> Result<u64> {
    let leases = Arc::clone(&shared.leases);
    let max_attempts = shared.config.max_attempts;
    shared.writer.submit_uncounted(move |w| {
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
