//! Dead letters: listing, redriving and discarding them, one by one or in
//! bulk. Invariant: each mutation is its own short `BEGIN IMMEDIATE`
//! transaction (a bulk one per batch), and one that finds no dead letter
//! changes nothing.

use std::time::Instant;

use rusqlite::Connection;
use serde::Serialize;

use crate::error::Result;
use crate::store::inbox;
use crate::store::outbox::{self, OutboxMessage};
use crate::store::queue::{self, DeadLetter};

use super::{pause_after, sql, write, CLEANUP_BATCH};
use crate::store::page::Page;

// ---------------------------------------------------------------- dead letters

/// Dead inbox messages, oldest first, of one consumer or all, at most
/// `limit`, with payloads (as [`Postroom::dead_letters`](crate::Postroom::dead_letters)).
pub fn dead_letters(
    conn: &Connection,
    consumer: Option<&str>,
    limit: usize,
) -> Result<Vec<DeadLetter>> {
    queue::dead_letters(conn, consumer, limit).map_err(sql("list dead letters"))
}

/// Dead outbox messages, oldest first, at most `limit` (as
/// [`Postroom::outbox_dead_letters`](crate::Postroom::outbox_dead_letters)).
pub fn outbox_dead_letters(conn: &Connection, limit: usize) -> Result<Vec<OutboxMessage>> {
    outbox::dead_letters(conn, limit).map_err(sql("list outbox dead letters"))
}

/// Sends the dead letter with row id `id` back to `pending`, attempts
/// reset, due at once whatever the engine's clock reads (`now_ms` stamps
/// `updated_at`): a running engine's workers pick it up at their next
/// poll. Returns false (changing nothing) when `id` is not a dead
/// letter. One `BEGIN IMMEDIATE` transaction.
pub fn redrive(conn: &Connection, id: i64, now_ms: i64) -> Result<bool> {
    write(conn, "redrive", |c| queue::redrive(c, id, now_ms))
}

/// Gives up on the dead letter with row id `id` for good: it becomes
/// `completed` without its effects (payload dropped, reason kept), so a
/// redelivery is a duplicate. Returns false (changing nothing) when `id` is
/// not a dead letter. One `BEGIN IMMEDIATE` transaction.
pub fn discard(conn: &Connection, id: i64, now_ms: i64) -> Result<bool> {
    write(conn, "discard", |c| queue::discard(c, id, now_ms))
}

/// Sends the dead outbox row `seq` back to the relay, attempts reset, due
/// at once whatever the engine's clock reads. Returns false (changing
/// nothing) when it is not a dead outbox row.
pub fn redrive_outbox(conn: &Connection, seq: i64) -> Result<bool> {
    write(conn, "redrive outbox row", |c| outbox::redrive(c, seq))
}

/// Gives up on the dead outbox row `seq`: it will not be sent. As
/// [`Postroom::discard_outbox`](crate::Postroom::discard_outbox): marked
/// `sent` without being handed over (payload dropped, reason kept), deleted
/// later by retention. Returns false (changing nothing) when it is not a
/// dead outbox row.
pub fn discard_outbox(conn: &Connection, seq: i64, now_ms: i64) -> Result<bool> {
    write(conn, "discard outbox row", |c| {
        outbox::discard(c, seq, now_ms)
    })
}

/// Which dead letters [`dead_select`] finds. Every filter is optional.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeadFilter {
    /// Dead outbox rows instead of inbox messages.
    pub outbox: bool,
    /// Only this consumer's (inbox only).
    pub consumer: Option<String>,
    /// Only those whose last error contains this text.
    pub error_contains: Option<String>,
    /// Only those that died at or after this time (unix ms); for outbox
    /// rows, that were committed at or after it.
    pub since_ms: Option<i64>,
    /// Only those that died (outbox: were committed) before this time.
    pub until_ms: Option<i64>,
}

/// Row ids (inbox) or `seq`s (outbox) of the dead letters matching
/// `filter`, one [`Page`] of them (a bulk action takes them all, oldest
/// first: [`Page::all`]).
pub fn dead_select(conn: &Connection, filter: &DeadFilter, page: Page) -> Result<Vec<i64>> {
    let found = if filter.outbox {
        if filter.consumer.is_some() {
            // Consumers are an inbox notion: no outbox row is any one's.
            return Ok(Vec::new());
        }
        outbox::dead_seqs(
            conn,
            filter.error_contains.as_deref(),
            (filter.since_ms, filter.until_ms),
            page,
        )
    } else {
        inbox::dead_ids(
            conn,
            filter.consumer.as_deref(),
            filter.error_contains.as_deref(),
            (filter.since_ms, filter.until_ms),
            page,
        )
    };
    found.map_err(sql("select dead letters"))
}

/// What [`act_on_dead_letters`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct BulkSummary {
    /// Dead letters redriven or discarded.
    pub done: u64,
    /// Ids that were no longer dead letters when their turn came (the
    /// engine or another operator got there first): left as they were.
    pub skipped: u64,
    /// Write transactions used.
    pub transactions: u64,
}

/// Rows per transaction of [`act_on_dead_letters`], as [`cleanup`]'s batches.
const BULK_BATCH: usize = CLEANUP_BATCH;

/// What [`act_on_dead_letters`] does to each dead letter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DeadLetterAction {
    /// As [`redrive`] / [`redrive_outbox`]: back to pending, attempts reset.
    Redrive,
    /// As [`discard`] / [`discard_outbox`]: given up for good.
    Discard,
}

impl DeadLetterAction {
    /// `"redrive"` or `"discard"`.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterAction::Redrive => "redrive",
            DeadLetterAction::Discard => "discard",
        }
    }
}

/// Redrives or discards each dead letter of `ids` (inbox row ids, or
/// outbox `seq`s with `outbox`), [`CLEANUP_BATCH`] per `BEGIN IMMEDIATE`
/// transaction, pausing between full batches like [`cleanup`](crate::admin::cleanup). An id that
/// is not (or no longer) a dead letter is left as it is and counted as
/// skipped. `progress` hears the count handled so far after each batch.
/// The ids are taken in ascending order whatever order they come in, so
/// that each ordering key's dead letters are redriven earliest first
/// across transactions too.
pub fn act_on_dead_letters(
    conn: &Connection,
    action: DeadLetterAction,
    outbox: bool,
    ids: &[i64],
    now_ms: i64,
    progress: &mut dyn FnMut(u64),
) -> Result<BulkSummary> {
    let mut summary = BulkSummary::default();
    // A redriven row is its key's head once no earlier row of the key is
    // unfinished: redriven newest first, a key's later row, redriven in an
    // earlier transaction, ran (by default order, where the dead row
    // before it does not hold it) before the earlier one was redriven.
    let mut ids = ids.to_vec();
    ids.sort_unstable();
    for batch in ids.chunks(BULK_BATCH) {
        let started = Instant::now();
        let done = write(conn, "act on dead letters", |c| {
            let mut done = 0;
            for &id in batch {
                let acted = match (action, outbox) {
                    (DeadLetterAction::Redrive, false) => queue::redrive(c, id, now_ms)?,
                    (DeadLetterAction::Redrive, true) => outbox::redrive(c, id)?,
                    (DeadLetterAction::Discard, false) => queue::discard(c, id, now_ms)?,
                    (DeadLetterAction::Discard, true) => outbox::discard(c, id, now_ms)?,
                };
                done += u64::from(acted);
            }
            Ok(done)
        })?;
        summary.transactions += 1;
        summary.done += done;
        summary.skipped += batch.len() as u64 - done;
        progress(summary.done + summary.skipped);
        if batch.len() == BULK_BATCH {
            pause_after(started);
        }
    }
    Ok(summary)
}
