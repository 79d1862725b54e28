//! The live gauges (crate docs, "Metrics"): each consumer's backlog and
//! the age of its oldest row, rows waiting for a retry, dead letters and
//! the oldest's age, rows waiting for a redelivery and the oldest's age,
//! the watermarks' gaps, and the WAL's size; kept by the
//! checkpointer thread's watch (`checkpoint::Watch`), which already looks
//! at `PRAGMA data_version` at most once a `WATCH`.
//!
//! Invariants:
//! * the database is read for them only when `data_version` says it
//!   changed since the last check (a commit of this engine or of another
//!   process), and at start: at most once a `WATCH` (1.25 s), never while
//!   nothing changes. What one read costs is bounded per consumer (see
//!   `store::gauges`): a busy engine pays at most that once a `WATCH`, an
//!   idle one nothing;
//! * between reads, the ages still grow: at each check (no wakeup of its
//!   own, no read) they are set again from the times the last read found,
//!   against the engine's clock, and the WAL's size is looked at (one
//!   `stat`) and set when it changed (an idle truncation changes it
//!   without a commit). An age gauge would otherwise stay at its last
//!   value while an idle engine's dead letter grew old;
//! * the gauges are set whether or not a recorder is installed: the
//!   `metrics` facade cannot tell cheaply, and without one a set costs a
//!   key built and dropped.

use std::path::PathBuf;
use std::time::Duration;

use rusqlite::Connection;

use crate::store::gauges::ConsumerGauges;
use crate::telemetry;

/// What the last read found, and what was last set.
pub(crate) struct Gauges {
    /// The registered consumers, in the order `read` answers them.
    consumers: Vec<String>,
    /// Per consumer, as last read (unix ms): its oldest pending row's
    /// `received_at`, its oldest dead letter's `updated_at`, and the last
    /// attempt of its oldest row waiting for a redelivery, with how many
    /// wait.
    oldest: Vec<Oldest>,
    wal: PathBuf,
    wal_bytes: Option<u64>,
    /// The last read failed (logged once until one succeeds).
    failing: bool,
    /// Reads made, for the unit tests.
    #[cfg(test)]
    reads: u64,
}

impl Gauges {
    /// Gauges for the engine's `consumers` over the database at `db`.
    pub fn new(consumers: Vec<String>, db: &std::path::Path) -> Gauges {
        Gauges {
            oldest: vec![Oldest::default(); consumers.len()],
            consumers,
            wal: crate::store::wal_path(db),
            wal_bytes: None,
            failing: false,
            #[cfg(test)]
            reads: 0,
        }
    }

    /// Reads every gauge and sets it: at start, and after a change of the
    /// data. `now_ms` is the engine's clock. One read transaction, so the
    /// counts are of one snapshot (held for the few index reads only).
    pub fn refresh(&mut self, conn: &Connection, now_ms: i64) {
        #[cfg(test)]
        {
            self.reads += 1;
        }
        self.wal_size();
        let read = conn
            .unchecked_transaction()
            .and_then(|tx| crate::store::gauges::read(&tx, &self.consumers));
        let gauges = match read {
            Ok(gauges) => {
                self.failing = false;
                gauges
            }
            Err(e) => {
                if !self.failing {
                    log::warn!(
                        "postroom: reading the live gauges failed: {e}; they keep their last \
                         values until a read succeeds (tried again after the next change)"
                    );
                }
                self.failing = true;
                return;
            }
        };
        for (i, (consumer, g)) in self.consumers.iter().zip(&gauges).enumerate() {
            let ConsumerGauges {
                backlog,
                waiting_for_retry,
                dead,
                watermark_gaps,
                oldest_pending_ms,
                oldest_dead_ms,
                waiting_for_redelivery,
                oldest_redelivery_ms,
            } = *g;
            telemetry::consumer_counts(consumer, backlog, waiting_for_retry, dead, watermark_gaps);
            self.oldest[i] = Oldest {
                pending: oldest_pending_ms,
                dead: oldest_dead_ms,
                redelivery: oldest_redelivery_ms,
                waiting_for_redelivery,
            };
            self.oldest[i].set(consumer, now_ms, true);
        }
    }

    /// At a check that found nothing changed: the ages of what the last
    /// read found, and the WAL's size if it changed. Reads nothing.
    pub fn tick(&mut self, now_ms: i64) {
        for (consumer, oldest) in self.consumers.iter().zip(&self.oldest) {
            oldest.set(consumer, now_ms, false);
        }
        self.wal_size();
    }

    fn wal_size(&mut self) {
        let bytes = std::fs::metadata(&self.wal).map_or(0, |m| m.len());
        if self.wal_bytes != Some(bytes) {
            self.wal_bytes = Some(bytes);
            telemetry::wal_bytes(bytes);
        }
    }

    /// Reads made so far.
    #[cfg(test)]
    pub fn reads(&self) -> u64 {
        self.reads
    }
}

/// One consumer's oldest rows as last read (unix ms), and how many wait
/// for a redelivery.
#[derive(Debug, Clone, Copy, Default)]
struct Oldest {
    pending: Option<i64>,
    dead: Option<i64>,
    redelivery: Option<i64>,
    waiting_for_redelivery: u64,
}

impl Oldest {
    /// Sets the ages against `now_ms`: always after a read (`read`), else
    /// only those with a row to age.
    fn set(&self, consumer: &str, now_ms: i64, read: bool) {
        if read || self.pending.is_some() || self.dead.is_some() {
            telemetry::consumer_ages(
                consumer,
                self.pending.map(|at| age(at, now_ms)),
                self.dead.map(|at| age(at, now_ms)),
            );
        }
        if read || self.redelivery.is_some() {
            telemetry::waiting_for_redelivery(
                consumer,
                self.waiting_for_redelivery,
                self.redelivery.map(|at| age(at, now_ms)),
            );
        }
    }
}

/// From `at` to `now_ms`; 0 for a time ahead of the clock (set back).
fn age(at: i64, now_ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(now_ms.saturating_sub(at)).unwrap_or(0))
}
