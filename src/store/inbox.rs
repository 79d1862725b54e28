//! Inbox SQL as plain functions over a connection. No thread, no clock:
//! callers pass `now`, so tests and fuzz targets can drive them directly.
//! The operator's listing and showing of inbox rows (`admin`'s
//! `inbox_list` / `inbox_show`, whose types live here) are here too.

use std::fmt;
use std::str::FromStr;

use rusqlite::types::{FromSql, FromSqlError, FromSqlResult, ToSql, ToSqlOutput, ValueRef};
use rusqlite::{params, Connection, OptionalExtension};

use crate::error::{Error, Result};
use crate::message::{Headers, Message};
use crate::store::page::{limit_param, Page};
use crate::store::payload::{hex, Payload};
use crate::store::text::{headers_json, parse_headers};

/// The state of an inbox row.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Stored, waiting for a worker (queued mode).
    Pending,
    /// Claimed by a worker holding a lease.
    Processing,
    /// Processed; its effects are committed.
    Completed,
    /// The last attempt failed; retried once `next_attempt_at` has passed.
    Failed,
    /// Parked: rejected or out of attempts. Kept with payload and error.
    Dead,
}

impl Status {
    /// Every status, in lifecycle order.
    pub const ALL: [Status; 5] = [
        Status::Pending,
        Status::Processing,
        Status::Completed,
        Status::Failed,
        Status::Dead,
    ];

    /// The name stored in the database.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Pending => "pending",
            Status::Processing => "processing",
            Status::Completed => "completed",
            Status::Failed => "failed",
            Status::Dead => "dead",
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Status {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Status::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| {
                let valid: Vec<&str> = Status::ALL.iter().map(|st| st.as_str()).collect();
                format!("unknown inbox status {s:?} (one of: {})", valid.join(", "))
            })
    }
}

impl ToSql for Status {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(ToSqlOutput::Borrowed(ValueRef::Text(
            self.as_str().as_bytes(),
        )))
    }
}

impl FromSql for Status {
    fn column_result(value: ValueRef<'_>) -> FromSqlResult<Self> {
        value
            .as_str()?
            .parse()
            .map_err(|e: String| FromSqlError::Other(e.into()))
    }
}

/// The identity of an inbox row.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Key<'a> {
    pub consumer: &'a str,
    pub source: &'a str,
    pub message_id: &'a str,
}

/// What the delivery state machine needs to know about a stored row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Row {
    pub status: Status,
    pub payload_hash: [u8; 32],
    pub attempts: u32,
    pub last_error: Option<String>,
    pub next_attempt_at: Option<i64>,
    pub lease_until: Option<i64>,
    pub received_at: i64,
    /// The row's sequence and its stream (schema version 6), if any.
    pub seq: Option<i64>,
    pub seq_stream: Option<String>,
}

/// A stored message, as a delivery with digest `hash` finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Found {
    /// Completed with this payload: a duplicate, answered from the key
    /// table alone (its 16-byte digest prefix; schema.sql says why that
    /// is enough).
    CompletedDuplicate,
    /// Anything else: the row and its id.
    Row { id: i64, row: Row },
}

/// What the key table holds for a key, as [`lookup`] reads it.
enum Entry {
    None,
    Found(Found),
    /// A completed entry whose row retention deleted, waiting to be
    /// deleted itself (schema.sql, `postroom_retired_keys`), met with
    /// another payload: the message is forgotten.
    Retired,
}

impl Entry {
    /// What the callers see: a retired entry is no message, as after its
    /// deletion.
    fn found(self) -> Option<Found> {
        match self {
            Entry::Found(found) => Some(found),
            Entry::None | Entry::Retired => None,
        }
    }
}

/// Finds the message stored under `key`: one descent into the key table,
/// and a read of the row by id unless that answers it. A retired entry
/// met with another payload is `None`, as after its deletion.
pub(crate) fn find(
    conn: &Connection,
    key: Key<'_>,
    hash: &[u8; 32],
) -> rusqlite::Result<Option<Found>> {
    Ok(lookup(conn, key, hash)?.found())
}

/// [`find`] for a write transaction about to store the message if it is
/// new: a retired entry is deleted first (its key would refuse the new
/// row).
pub(crate) fn find_live(
    conn: &Connection,
    key: Key<'_>,
    hash: &[u8; 32],
) -> rusqlite::Result<Option<Found>> {
    let entry = lookup(conn, key, hash)?;
    if let Entry::Retired = entry {
        conn.prepare_cached(
            "DELETE FROM postroom_inbox_keys
             WHERE consumer = ?1 AND source = ?2 AND message_id = ?3 AND completed = 1",
        )?
        .execute(params![key.consumer, key.source, key.message_id])?;
    }
    Ok(entry.found())
}

fn lookup(conn: &Connection, key: Key<'_>, hash: &[u8; 32]) -> rusqlite::Result<Entry> {
    let entry: Option<(i64, Vec<u8>, bool)> = conn
        .prepare_cached(
            "SELECT inbox_id, digest, completed FROM postroom_inbox_keys
             WHERE consumer = ?1 AND source = ?2 AND message_id = ?3",
        )?
        .query_row(params![key.consumer, key.source, key.message_id], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })
        .optional()?;
    let Some((id, digest, completed)) = entry else {
        return Ok(Entry::None);
    };
    if completed && digest.as_slice() == &hash[..16] {
        return Ok(Entry::Found(Found::CompletedDuplicate));
    }
    Ok(match row(conn, id, key)? {
        Some(row) => Entry::Found(Found::Row { id, row }),
        None if completed => Entry::Retired,
        None => Entry::None,
    })
}

/// The inbox row the key table pointed to, if it still holds `key`.
/// Outside a transaction the two reads see different snapshots, and a row
/// id can be reused if the newest row is deleted (retention never does;
/// hand SQL can): the key check makes a stale id read as "not found"
/// rather than as another message's row.
fn row(conn: &Connection, inbox_id: i64, key: Key<'_>) -> rusqlite::Result<Option<Row>> {
    conn.prepare_cached(
        "SELECT status, payload_hash, attempts, last_error, next_attempt_at, lease_until,
                received_at, seq, seq_stream
         FROM postroom_inbox
         WHERE id = ?1 AND consumer = ?2 AND source = ?3 AND message_id = ?4",
    )?
    .query_row(
        params![inbox_id, key.consumer, key.source, key.message_id],
        |r| {
            let hash: Vec<u8> = r.get(1)?;
            Ok(Row {
                status: r.get(0)?,
                // The schema's CHECK guarantees 32 bytes; a damaged row that
                // somehow has another length compares unequal to every digest.
                payload_hash: hash.try_into().unwrap_or([0; 32]),
                attempts: r.get(2)?,
                last_error: r.get(3)?,
                next_attempt_at: r.get(4)?,
                lease_until: r.get(5)?,
                received_at: r.get(6)?,
                seq: r.get(7)?,
                seq_stream: r.get(8)?,
            })
        },
    )
    .optional()
}

/// Calls `found(table, id, what)` for every break of the key table's
/// invariant (schema.sql): an inbox row whose entry is missing or
/// disagrees with it, and an entry whose inbox row does not exist that is
/// not a retired completed key (`id` is then the entry's `inbox_id`).
pub(crate) fn key_mismatches(
    conn: &Connection,
    mut found: impl FnMut(&'static str, i64, &'static str),
) -> rusqlite::Result<()> {
    let mut stmt = conn.prepare(
        "SELECT i.id, k.inbox_id IS NULL FROM postroom_inbox i
         LEFT JOIN postroom_inbox_keys k
           ON k.consumer = i.consumer AND k.source = i.source AND k.message_id = i.message_id
         WHERE k.inbox_id IS NOT i.id
            OR k.digest IS NOT substr(i.payload_hash, 1, 16)
            OR k.completed IS NOT (i.status = 'completed')
         ORDER BY i.id",
    )?;
    let mut rows = stmt.query([])?;
    while let Some(r) = rows.next()? {
        let missing: bool = r.get(1)?;
        let what = if missing {
            "no entry in postroom_inbox_keys"
        } else {
            "its postroom_inbox_keys entry disagrees with it (inbox_id, digest or completed)"
        };
        found("postroom_inbox", r.get(0)?, what);
    }
    let mut stmt = conn.prepare(
        // A join, not `NOT IN (SELECT …)`: SQLite builds an automatic index
        // on the notes for the join, where the row-value NOT IN rescans
        // them for every key (quadratic).
        "SELECT k.inbox_id FROM postroom_inbox_keys k
         LEFT JOIN (SELECT DISTINCT consumer, source, message_id
                    FROM postroom_retired_keys) r
           ON r.consumer = k.consumer AND r.source = k.source AND r.message_id = k.message_id
         WHERE NOT EXISTS (SELECT 1 FROM postroom_inbox i
                           WHERE i.id = k.inbox_id AND i.consumer = k.consumer
                             AND i.source = k.source AND i.message_id = k.message_id)
           AND (k.completed = 0 OR r.consumer IS NULL)
         ORDER BY k.inbox_id",
    )?;
    let mut rows = stmt.query([])?;
    while let Some(r) = rows.next()? {
        found(
            "postroom_inbox_keys",
            r.get(0)?,
            "entry without its inbox row (and not a retired key waiting for retention)",
        );
    }
    Ok(())
}

/// The state an attempt leaves a row in.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Record<'a> {
    pub status: Status,
    pub attempts: u32,
    pub last_error: Option<&'a str>,
    pub next_attempt_at: Option<i64>,
    /// Whether to store the payload (failed and dead rows always do).
    pub keep_payload: bool,
}

/// The inbox row an attempt's result is written to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Target {
    /// A stored row, updated.
    Stored(i64),
    /// A row seen for the first time, inserted with this id ([`next_id`]).
    New(i64),
}

impl Target {
    /// Row `stored` if there is one, else a new row with [`next_id`].
    pub(crate) fn of(conn: &Connection, stored: Option<i64>) -> Result<Target> {
        match stored {
            Some(id) => Ok(Target::Stored(id)),
            None => next_id(conn)
                .map(Target::New)
                .map_err(|e| Error::sqlite("choose the new inbox row's id", e)),
        }
    }

    /// The row's id, stored or to be.
    pub(crate) fn id(self) -> i64 {
        match self {
            Target::Stored(id) | Target::New(id) => id,
        }
    }
}

/// The id a new inbox row is inserted with, explicitly, by every insert
/// of the engine: one past the highest. SQLite would choose the same, but
/// the handler's publishes derive their ids from it before the row exists
/// (`outbox::insert`), and past `i64::MAX` SQLite would choose an unused
/// id at random, perhaps one given out before. Ids are never given out
/// twice: retention keeps the newest row. A highest id of `i64::MAX` (only
/// a hand edit puts one there) leaves none to give: `SQLITE_CORRUPT`
/// (`Error::Corrupt`) naming it.
pub(crate) fn next_id(conn: &Connection) -> rusqlite::Result<i64> {
    let max: Option<i64> = conn
        .prepare_cached("SELECT max(id) FROM postroom_inbox")?
        .query_row([], |r| r.get(0))?;
    max.unwrap_or(0).checked_add(1).ok_or_else(|| {
        rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_CORRUPT),
            Some(format!(
                "postroom_inbox holds a row with id {}, put there by hand: no higher id is left \
                 for a new row; give that row a lower id, or delete it",
                i64::MAX
            )),
        )
    })
}

/// Writes the result of an attempt: inserts the row on first sight
/// ([`Target::New`]), or updates a stored one. Clears any lease. The
/// payload digest and `received_at` of an existing row are never changed.
pub(crate) fn record(
    conn: &Connection,
    row: Target,
    consumer: &str,
    msg: &Message,
    hash: &[u8; 32],
    rec: Record<'_>,
    now_ms: i64,
) -> rusqlite::Result<()> {
    let payload = rec.keep_payload.then_some(msg.payload.as_slice());
    let processed_at = (rec.status == Status::Completed).then_some(now_ms);
    match row {
        Target::Stored(id) => conn
            .prepare_cached(
                "UPDATE postroom_inbox SET status = ?2, payload = ?3, attempts = ?4,
                     last_error = ?5, updated_at = ?6, next_attempt_at = ?7, processed_at = ?8,
                     lease_until = NULL, lease_token = NULL
                 WHERE id = ?1",
            )?
            .execute(params![
                id,
                rec.status,
                payload,
                rec.attempts,
                rec.last_error,
                now_ms,
                rec.next_attempt_at,
                processed_at,
            ])?,
        Target::New(id) => conn
            .prepare_cached(
                "INSERT INTO postroom_inbox (id, consumer, source, message_id, status, payload,
                     payload_hash, headers, ordering_key, attempts, last_error, received_at,
                     updated_at, next_attempt_at, processed_at, seq, seq_stream)
                 VALUES (?16, ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?11, ?12, ?13, ?14,
                         ?15)",
            )?
            .execute(params![
                consumer,
                msg.source,
                msg.id,
                rec.status,
                payload,
                hash.as_slice(),
                headers_json(&msg.headers),
                msg.ordering_key,
                rec.attempts,
                rec.last_error,
                now_ms,
                rec.next_attempt_at,
                processed_at,
                msg.sequence.map(|seq| seq as i64),
                msg.sequence_stream(),
                id,
            ])?,
    };
    Ok(())
}

/// The error of a message dead-lettered for running out of attempts.
pub(crate) fn exhausted(attempts: u32, max_attempts: u32, last_error: &str) -> String {
    format!("attempts exhausted ({attempts} of {max_attempts}); last error: {last_error}")
}

/// Marks row `row_id` dead without running anything (its attempts were
/// already used up). Keeps the stored payload.
pub(crate) fn mark_dead(
    conn: &Connection,
    row_id: i64,
    error: &str,
    now_ms: i64,
) -> rusqlite::Result<()> {
    conn.prepare_cached(
        "UPDATE postroom_inbox SET status = 'dead', last_error = ?2, updated_at = ?3,
             next_attempt_at = NULL, lease_until = NULL, lease_token = NULL
         WHERE id = ?1",
    )?
    .execute(params![row_id, error, now_ms])?;
    Ok(())
}

/// Retention's delete of quarantined deliveries last seen before the cutoff
/// (`conflict_retention`).
pub(crate) const DELETE_CONFLICTS: &str = "DELETE FROM postroom_conflicts WHERE id IN (
     SELECT id FROM postroom_conflicts WHERE last_seen_at < ?1 LIMIT ?2)";

/// Deletes the quarantined delivery `id` (an operator looked at it).
/// Returns false when there is none. Its id is not given out again
/// (`AUTOINCREMENT`); a redelivery of its payload is quarantined anew.
pub(crate) fn discard_conflict(conn: &Connection, id: i64) -> rusqlite::Result<bool> {
    let n = conn
        .prepare_cached("DELETE FROM postroom_conflicts WHERE id = ?1")?
        .execute([id])?;
    Ok(n == 1)
}

/// Quarantines a delivery whose payload digest differs from the stored
/// one. Returns the conflict row's id; a repeat of the same conflicting
/// payload bumps its counter instead of adding a row.
pub(crate) fn quarantine(
    conn: &Connection,
    consumer: &str,
    msg: &Message,
    stored_hash: &[u8; 32],
    hash: &[u8; 32],
    now_ms: i64,
) -> rusqlite::Result<i64> {
    conn.prepare_cached(
        "INSERT INTO postroom_conflicts (consumer, source, message_id, stored_hash, payload_hash,
             payload, headers, first_seen_at, last_seen_at, deliveries)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?8, 1)
         ON CONFLICT (consumer, source, message_id, payload_hash) DO UPDATE SET
             last_seen_at = excluded.last_seen_at,
             deliveries = deliveries + 1
         RETURNING id",
    )?
    .query_row(
        params![
            consumer,
            msg.source,
            msg.id,
            stored_hash.as_slice(),
            hash.as_slice(),
            msg.payload,
            headers_json(&msg.headers),
            now_ms,
        ],
        |r| r.get(0),
    )
}

// The operator's view: listing and showing inbox rows.

/// Which inbox rows [`inbox_list`](crate::admin::inbox_list) returns. Every filter is optional; the
/// default [`Page`] is the newest 100.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InboxFilter {
    /// Only this consumer's rows.
    pub consumer: Option<String>,
    /// Only rows in this status.
    pub status: Option<Status>,
    /// Only rows from this source.
    pub source: Option<String>,
    /// Only rows received at or after this time (unix ms).
    pub since_ms: Option<i64>,
    /// Only rows received before this time (unix ms).
    pub until_ms: Option<i64>,
    /// Only rows waiting for a redelivery: failed, and no worker retries
    /// them (see [`InboxEntry::waiting_for_redelivery`]).
    pub waiting_for_redelivery: bool,
    /// Where a page starts: see [`Page`].
    pub page: Page,
}

/// An inbox row without its payload, as [`inbox_list`](crate::admin::inbox_list) returns it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct InboxEntry {
    /// Row id: what `inbox show`, `redrive` and `discard` take.
    pub id: i64,
    /// The consumer it was delivered to.
    pub consumer: String,
    /// The stream it came from.
    pub source: String,
    /// The message id.
    pub message_id: String,
    /// Its state.
    pub status: Status,
    /// Attempts made.
    pub attempts: u32,
    /// Its ordering key, if any.
    pub ordering_key: Option<String>,
    /// Stored payload size; `None` when the payload was not kept.
    pub payload_bytes: Option<u64>,
    /// The last failure (or the discard note).
    pub last_error: Option<String>,
    /// When it was first received (unix ms).
    pub received_at: i64,
    /// When the row last changed (unix ms).
    pub updated_at: i64,
    /// When a pending or failed row is next due: a time while it waits out
    /// a backoff, `None` when it is due at once (and for finished rows).
    pub next_attempt_at: Option<i64>,
    /// When it completed, if it did.
    pub processed_at: Option<i64>,
    /// A failed row that no worker will retry, waiting for its sender's
    /// redelivery: it was delivered inline (`deliver`), or it was received
    /// and processed in its receipt's own transaction when the process died
    /// in its handler (crash recovery counted the attempt; the receipt
    /// never committed, so the sender was never told to stop sending it).
    /// Only a redelivery (`deliver` or `receive` of the same message)
    /// revives it; retention never deletes it.
    pub waiting_for_redelivery: bool,
}

pub(crate) const ENTRY_COLUMNS: &str =
    "id, consumer, source, message_id, status, attempts, ordering_key,
     length(payload), last_error, received_at, updated_at, next_attempt_at, processed_at,
     status = 'failed' AND queued = 0";

/// How many columns [`ENTRY_COLUMNS`] selects: the index of the first
/// column a query adds after them.
pub(crate) const ENTRY_WIDTH: usize = 14;

pub(crate) fn entry_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<InboxEntry> {
    // Lossy: a row whose text does not decode is shown, not an error.
    let text = |idx| crate::store::text::lossy_text(r, idx).map(Option::unwrap_or_default);
    Ok(InboxEntry {
        id: r.get(0)?,
        consumer: text(1)?,
        source: text(2)?,
        message_id: text(3)?,
        status: r.get(4)?,
        attempts: r.get(5)?,
        ordering_key: crate::store::text::lossy_text(r, 6)?,
        payload_bytes: r
            .get::<_, Option<i64>>(7)?
            .map(|n| u64::try_from(n).unwrap_or(0)),
        last_error: crate::store::text::lossy_text(r, 8)?,
        received_at: r.get(9)?,
        updated_at: r.get(10)?,
        next_attempt_at: r.get(11)?,
        processed_at: r.get(12)?,
        waiting_for_redelivery: r.get(13)?,
    })
}

/// Inbox rows matching `filter`, one [`Page`] of them (newest first by
/// default).
pub(crate) fn list(conn: &Connection, filter: &InboxFilter) -> rusqlite::Result<Vec<InboxEntry>> {
    let (after, order) = filter.page.sql("id", 7, 6);
    let mut stmt = conn.prepare(&format!(
        "SELECT {ENTRY_COLUMNS} FROM postroom_inbox
             WHERE (?1 IS NULL OR consumer = ?1) AND (?2 IS NULL OR status = ?2)
               AND (?3 IS NULL OR source = ?3) AND (?4 IS NULL OR received_at >= ?4)
               AND (?5 IS NULL OR received_at < ?5)
               AND (?8 = 0 OR (status = 'failed' AND queued = 0)) AND {after}
             {order}"
    ))?;
    let rows = stmt.query_map(
        params![
            filter.consumer,
            filter.status,
            filter.source,
            filter.since_ms,
            filter.until_ms,
            limit_param(filter.page.limit),
            filter.page.after,
            filter.waiting_for_redelivery,
        ],
        entry_from_row,
    )?;
    rows.collect::<rusqlite::Result<_>>()
}

/// The inbox rows of `message_id` (the id a log line or a broker carries),
/// of one consumer and source or of every one, in row id order. Found
/// through the key table: a seek per (consumer, source) pair there is,
/// never a scan of the inbox.
pub(crate) fn find_by_message_id(
    conn: &Connection,
    consumer: Option<&str>,
    source: Option<&str>,
    message_id: &str,
) -> rusqlite::Result<Vec<InboxEntry>> {
    let consumers = given_or_every(consumer, |after| {
        conn.prepare_cached("SELECT min(consumer) FROM postroom_inbox_keys WHERE consumer > ?1")?
            .query_row([after], |r| r.get(0))
    })?;
    let mut found = Vec::new();
    for c in &consumers {
        let sources = given_or_every(source, |after| {
            conn.prepare_cached(
                "SELECT min(source) FROM postroom_inbox_keys WHERE consumer = ?1 AND source > ?2",
            )?
            .query_row([c.as_str(), after], |r| r.get(0))
        })?;
        for s in &sources {
            found.extend(entry_by_key(conn, c, s, message_id)?);
        }
    }
    found.sort_by_key(|e| e.id);
    Ok(found)
}

/// `given` alone, or every distinct value there is: "" first (`> ''`
/// passes over it; a seek that finds nothing costs what any other does),
/// then each value `next` finds after the last, one index seek each.
fn given_or_every(
    given: Option<&str>,
    mut next: impl FnMut(&str) -> rusqlite::Result<Option<String>>,
) -> rusqlite::Result<Vec<String>> {
    if let Some(value) = given {
        return Ok(vec![value.to_owned()]);
    }
    let mut every = vec![String::new()];
    loop {
        let last = every.last().map_or("", String::as_str);
        match next(last)? {
            Some(value) => every.push(value),
            None => return Ok(every),
        }
    }
}

/// The inbox row of one key (consumer, source, message id), without its
/// payload: a seek in the key table, one in the inbox. A key entry whose
/// row retention deleted finds nothing (ids are never given out twice).
pub(crate) fn entry_by_key(
    conn: &Connection,
    consumer: &str,
    source: &str,
    message_id: &str,
) -> rusqlite::Result<Option<InboxEntry>> {
    conn.prepare_cached(&format!(
        "SELECT {ENTRY_COLUMNS} FROM postroom_inbox WHERE id = (
             SELECT inbox_id FROM postroom_inbox_keys
             WHERE consumer = ?1 AND source = ?2 AND message_id = ?3)"
    ))?
    .query_row(params![consumer, source, message_id], entry_from_row)
    .optional()
}

/// One inbox row in full, from [`inbox_show`](crate::admin::inbox_show).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct InboxDetail {
    /// Everything [`inbox_list`](crate::admin::inbox_list) shows.
    #[serde(flatten)]
    pub entry: InboxEntry,
    /// The payload, when kept (failed and dead rows always keep theirs).
    pub payload: Option<Payload>,
    /// blake3 digest of the first payload accepted under this key, in hex.
    pub payload_hash: String,
    /// Whether the stored payload still matches `payload_hash` (`None`
    /// when no payload is kept).
    pub payload_hash_ok: Option<bool>,
    /// The message's headers.
    pub headers: Headers,
    /// Lease end (processing rows), unix ms.
    pub lease_until: Option<i64>,
    /// Lease token (processing rows).
    pub lease_token: Option<i64>,
    /// `seq` of the outbox rows its handler published (while kept).
    pub caused_outbox: Vec<i64>,
}

/// The inbox row with this id, in full; `None` when there is none. Two
/// reads: the caller runs it in one snapshot.
pub(crate) fn show(conn: &Connection, id: i64) -> rusqlite::Result<Option<InboxDetail>> {
    let found = conn
        .query_row(
            &format!(
                "SELECT {ENTRY_COLUMNS}, payload, payload_hash, headers, lease_until,
                            lease_token
                     FROM postroom_inbox WHERE id = ?1"
            ),
            [id],
            |r| {
                let payload = crate::store::text::stored_bytes(r, ENTRY_WIDTH)?;
                let hash: Vec<u8> = r.get(ENTRY_WIDTH + 1)?;
                let headers: Option<String> = r.get(ENTRY_WIDTH + 2)?;
                let payload_hash_ok = payload
                    .as_ref()
                    .map(|p| blake3::hash(p).as_bytes().as_slice() == hash.as_slice());
                Ok(InboxDetail {
                    entry: entry_from_row(r)?,
                    payload: payload.map(Payload),
                    payload_hash: hex(&hash),
                    payload_hash_ok,
                    headers: parse_headers(headers.as_deref()),
                    lease_until: r.get(ENTRY_WIDTH + 3)?,
                    lease_token: r.get(ENTRY_WIDTH + 4)?,
                    caused_outbox: Vec::new(),
                })
            },
        )
        .optional()?;
    let Some(mut detail) = found else {
        return Ok(None);
    };
    let mut stmt = conn.prepare(
        "SELECT seq FROM postroom_outbox
                 WHERE cause_consumer = ?1 AND cause_source = ?2 AND cause_message_id = ?3
                 ORDER BY seq",
    )?;
    detail.caused_outbox = stmt
        .query_map(
            params![
                detail.entry.consumer,
                detail.entry.source,
                detail.entry.message_id
            ],
            |r| r.get(0),
        )
        .and_then(|rows| rows.collect())?;
    Ok(Some(detail))
}

/// Row ids of the dead letters of `consumer` (or all) whose last error
/// contains `error_contains` (or any) and that died within `[since, until)`
/// (either end open), one [`Page`] of them.
pub(crate) fn dead_ids(
    conn: &Connection,
    consumer: Option<&str>,
    error_contains: Option<&str>,
    (since_ms, until_ms): (Option<i64>, Option<i64>),
    page: Page,
) -> rusqlite::Result<Vec<i64>> {
    let (after, order) = page.sql("id", 6, 5);
    let mut stmt = conn.prepare(&format!(
        "SELECT id FROM postroom_inbox INDEXED BY postroom_inbox_dead
         WHERE status = 'dead' AND (?1 IS NULL OR consumer = ?1)
           AND (?2 IS NULL OR instr(last_error, ?2) > 0)
           AND (?3 IS NULL OR updated_at >= ?3) AND (?4 IS NULL OR updated_at < ?4)
           AND {after}
         {order}"
    ))?;
    let rows = stmt.query_map(
        params![
            consumer,
            error_contains,
            since_ms,
            until_ms,
            limit_param(page.limit),
            page.after,
        ],
        |r| r.get(0),
    )?;
    rows.collect()
}
