//! A consumer's brakes (`Builder::backlog_limit`): `receive` and
//! `receive_batch` store nothing while its backlog — received rows not yet
//! settled — is at its bound, and answer `Error::Backlogged`.
//!
//! Invariants:
//! * the estimate is the last exact count plus every message stored since:
//!   never below the backlog this engine made (processing only lowers it);
//! * a refusal rests on an exact count at most [`RECOUNT`] old (plus what
//!   was stored since): an estimate at the bound is counted again when its
//!   count is older, so a drained backlog is noticed within `RECOUNT`;
//! * an exact count (store::backlog, at most `limit` index entries of
//!   each kind) is made only when the estimate reaches the bound, at most
//!   once per `RECOUNT`: far from the bound a call costs no read;
//! * nothing is written to keep the count, and nothing is kept across
//!   restarts: the first call after open counts.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use rusqlite::Connection;

use crate::error::{Error, Result};
use crate::store::backlog;

/// How long an exact count at the bound stands before the next call counts
/// again: how late a drained backlog is noticed, at most.
pub(crate) const RECOUNT: Duration = Duration::from_millis(100);

/// One consumer's bound and what is known of its backlog.
#[derive(Debug)]
pub(crate) struct Brake {
    consumer: String,
    limit: u64,
    state: Mutex<Known>,
}

#[derive(Debug, Default)]
struct Known {
    /// The last exact count, and when it was made (`None`: never).
    counted: u64,
    at: Option<Instant>,
    /// Messages stored since that count.
    added: u64,
}

impl Brake {
    pub(crate) fn new(consumer: String, limit: u64) -> Brake {
        Brake {
            consumer,
            limit,
            state: Mutex::new(Known::default()),
        }
    }

    /// `Ok` when a call may store; `Error::Backlogged` when the backlog is
    /// at the bound. `conn` opens a read connection, only if a count is due.
    pub(crate) fn admit<C>(&self, conn: impl FnOnce() -> Result<C>) -> Result<()>
    where
        C: std::ops::Deref<Target = Connection>,
    {
        let mut known = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let estimate = known.counted.saturating_add(known.added);
        if known.at.is_some() && estimate < self.limit {
            return Ok(());
        }
        if known.at.is_none_or(|at| at.elapsed() >= RECOUNT) {
            let conn = conn()?;
            let counted = backlog::count(&conn, &self.consumer, self.limit)
                .map_err(|e| Error::sqlite("count the backlog", e))?;
            *known = Known {
                counted,
                at: Some(Instant::now()),
                added: 0,
            };
            if counted < self.limit {
                return Ok(());
            }
        }
        Err(Error::Backlogged {
            consumer: self.consumer.clone(),
            backlog: known.counted.saturating_add(known.added),
            limit: self.limit,
        })
    }

    /// `stored` messages of a call were stored.
    pub(crate) fn stored(&self, stored: u64) {
        let mut known = self.state.lock().unwrap_or_else(|p| p.into_inner());
        known.added = known.added.saturating_add(stored);
    }
}
