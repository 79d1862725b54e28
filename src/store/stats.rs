//! Counts of what is in the database, read through a read-only connection.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use rusqlite::{Connection, OptionalExtension};

use crate::error::{Error, Result};
use crate::store::inbox::Status;

/// Inbox rows of one consumer, by status.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct StatusCounts {
    /// Stored, waiting for a worker.
    pub pending: u64,
    /// Claimed by a worker.
    pub processing: u64,
    /// Done.
    pub completed: u64,
    /// Waiting for a retry.
    pub failed: u64,
    /// Dead letters.
    pub dead: u64,
    /// Of `failed`, those waiting for a redelivery: rows no worker will
    /// retry (`queued = 0`), which only their sender's redelivery revives.
    /// An inline delivery that failed is one; so is a received message
    /// processed in the same transaction as its receipt when the process
    /// died in its handler (recovery counts the attempt, and the receipt
    /// never committed, so the sender was never told to stop sending it).
    pub waiting_for_redelivery: u64,
    /// `updated_at` (its last attempt, unix ms) of the oldest row waiting
    /// for a redelivery.
    pub oldest_waiting_for_redelivery_ms: Option<i64>,
}

impl StatusCounts {
    /// The count for one status.
    pub fn get(&self, status: Status) -> u64 {
        match status {
            Status::Pending => self.pending,
            Status::Processing => self.processing,
            Status::Completed => self.completed,
            Status::Failed => self.failed,
            Status::Dead => self.dead,
        }
    }

    fn slot(&mut self, status: Status) -> &mut u64 {
        match status {
            Status::Pending => &mut self.pending,
            Status::Processing => &mut self.processing,
            Status::Completed => &mut self.completed,
            Status::Failed => &mut self.failed,
            Status::Dead => &mut self.dead,
        }
    }

    /// All rows.
    pub fn total(&self) -> u64 {
        Status::ALL.iter().map(|&s| self.get(s)).sum()
    }
}

/// Outbox rows by status.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct OutboxCounts {
    /// Not yet handed to the sink (the backlog).
    pub pending: u64,
    /// Handed over, or discarded by an operator (`last_error` says so).
    pub sent: u64,
    /// Given up on.
    pub dead: u64,
}

/// A snapshot of the database's contents.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct Stats {
    /// Inbox rows per consumer, by status.
    pub inbox: BTreeMap<String, StatusCounts>,
    /// Outbox rows by status.
    pub outbox: OutboxCounts,
    /// `created_at` of the first pending outbox row in commit order (the
    /// oldest, unless the clock was set back meanwhile), in unix ms.
    pub oldest_pending_outbox_ms: Option<i64>,
    /// Rows in `postroom_conflicts`.
    pub conflicts: u64,
    /// Per consumer and sequence stream, for sequenced messages
    /// ([`Message::with_sequence`](crate::Message::with_sequence)): the
    /// watermark, the highest sequence stored and what is missing.
    pub sequences: Vec<crate::StreamWatermark>,
    /// Size of the database file, in bytes.
    pub db_bytes: u64,
    /// Size of the `-wal` file, in bytes (0 when absent).
    pub wal_bytes: u64,
    /// Write transactions this engine has committed since it was opened.
    pub batches_committed: u64,
    /// Jobs (deliveries, transactions) those commits carried; divided by
    /// `batches_committed` it is the average group-commit size.
    pub jobs_committed: u64,
    /// WAL frames (database pages) those commits appended: the pages each
    /// commit dirtied, summed; over the messages they carried, what one
    /// message costs the disk.
    pub wal_frames_written: u64,
    /// WAL copy-backs the checkpointer thread completed (its last pass,
    /// made with writes paused), since the engine was opened.
    pub wal_checkpoints: u64,
    /// WAL copy-backs the writer made inside callers' commits because the
    /// checkpointer was far behind (or gone). Growing: the disk cannot
    /// keep up, or a long read holds the WAL.
    pub wal_checkpoints_inline: u64,
    /// How long the checkpointer's paused passes held writes, in all, since
    /// the engine was opened: the time no commit could start for it.
    pub wal_paused: Duration,
    /// The longest of those passes.
    pub wal_paused_max: Duration,
    /// The writer's copy-backs that a reader (another connection's open
    /// read transaction) kept from completing; the WAL grows meanwhile.
    pub wal_checkpoints_blocked: u64,
    /// Handlers that held the writer past `slow_handler`.
    pub slow_handlers: u64,
}

/// Reads the counts. Cost: one pass over the inbox's status column.
pub(crate) fn read(conn: &Connection, db_path: &Path) -> Result<Stats> {
    let sql = |e| Error::sqlite("read stats", e);
    let mut stats = Stats::default();
    let mut stmt = conn
        .prepare_cached(
            // The same one pass: rows waiting for a redelivery are failed
            // rows that no worker owns (see `StatusCounts`).
            "SELECT consumer, status, count(*), sum(queued = 0),
                    min(CASE WHEN queued = 0 THEN updated_at END)
             FROM postroom_inbox GROUP BY consumer, status",
        )
        .map_err(sql)?;
    let mut rows = stmt.query([]).map_err(sql)?;
    while let Some(row) = rows.next().map_err(sql)? {
        let consumer: String = row.get(0).map_err(sql)?;
        let status: Status = row.get(1).map_err(sql)?;
        let n = count(row.get(2).map_err(sql)?);
        let counts = stats.inbox.entry(consumer).or_default();
        *counts.slot(status) += n;
        if status == Status::Failed {
            counts.waiting_for_redelivery = count(row.get(3).map_err(sql)?);
            counts.oldest_waiting_for_redelivery_ms = row.get(4).map_err(sql)?;
        }
    }
    let mut stmt = conn
        .prepare_cached("SELECT status, count(*) FROM postroom_outbox GROUP BY status")
        .map_err(sql)?;
    let mut rows = stmt.query([]).map_err(sql)?;
    while let Some(row) = rows.next().map_err(sql)? {
        let status: String = row.get(0).map_err(sql)?;
        let n = count(row.get(1).map_err(sql)?);
        match status.as_str() {
            "pending" => stats.outbox.pending = n,
            "sent" => stats.outbox.sent = n,
            "dead" => stats.outbox.dead = n,
            _ => {}
        }
    }
    stats.oldest_pending_outbox_ms = conn
        .query_row(
            // The first pending row in commit order: a head, found through
            // the relay's index in one step (schema version 8 has no index
            // of every pending row to take the minimum over).
            "SELECT created_at FROM postroom_outbox WHERE status = 'pending' AND head = 1
             ORDER BY seq LIMIT 1",
            [],
            |r| r.get(0),
        )
        .optional()
        .map_err(sql)?
        .flatten();
    stats.conflicts = count(
        conn.query_row("SELECT count(*) FROM postroom_conflicts", [], |r| r.get(0))
            .map_err(sql)?,
    );
    stats.sequences = crate::store::watermark::read_all(conn).map_err(sql)?;
    stats.db_bytes = file_len(db_path);
    stats.wal_bytes = file_len(&crate::store::wal_path(db_path));
    Ok(stats)
}

/// Per consumer, when its oldest unfinished (pending, processing or
/// failed) row was received.
pub(crate) fn oldest_unfinished(conn: &Connection) -> rusqlite::Result<Vec<(String, i64)>> {
    let mut stmt = conn.prepare(
        "SELECT consumer, min(received_at) FROM postroom_inbox
         WHERE status IN ('pending', 'processing', 'failed') GROUP BY consumer",
    )?;
    let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
    rows.collect()
}

/// Per consumer, how many `processing` rows hold a lease that passed
/// before `now` (or none).
pub(crate) fn expired_leases(conn: &Connection, now: i64) -> rusqlite::Result<Vec<(String, i64)>> {
    let mut stmt = conn.prepare(
        "SELECT consumer, count(*) FROM postroom_inbox
         WHERE status = 'processing' AND (lease_until IS NULL OR lease_until < ?1)
         GROUP BY consumer",
    )?;
    let rows = stmt.query_map([now], |r| Ok((r.get(0)?, r.get(1)?)))?;
    rows.collect()
}

/// Inbox rows per consumer and attempts made, in that order.
pub(crate) fn attempts(conn: &Connection) -> rusqlite::Result<Vec<(String, u32, i64)>> {
    let mut stmt = conn.prepare(
        "SELECT consumer, attempts, count(*) FROM postroom_inbox
         GROUP BY consumer, attempts ORDER BY consumer, attempts",
    )?;
    let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
    rows.collect()
}

fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}
