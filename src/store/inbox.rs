//! Inbox SQL as plain functions over a connection. No thread, no clock:
//! callers pass `now`, so tests and fuzz targets can drive them directly.

use std::fmt;
use std::str::FromStr;

use rusqlite::types::{FromSql, FromSqlError, FromSqlResult, ToSql, ToSqlOutput, ValueRef};
use rusqlite::{params, Connection, OptionalExtension};

use crate::message::Message;
use crate::store::text::headers_json;

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
            .ok_or_else(|| format!("unknown inbox status {s:?}"))
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

/// Writes the result of an attempt: inserts the row on first sight
/// (`row_id` is `None`), or updates row `row_id`. Clears any lease. The
/// payload digest and `received_at` of an existing row are never changed.
pub(crate) fn record(
    conn: &Connection,
    row_id: Option<i64>,
    consumer: &str,
    msg: &Message,
    hash: &[u8; 32],
    rec: Record<'_>,
    now_ms: i64,
) -> rusqlite::Result<()> {
    let payload = rec.keep_payload.then_some(msg.payload.as_slice());
    let processed_at = (rec.status == Status::Completed).then_some(now_ms);
    if let Some(id) = row_id {
        conn.prepare_cached(
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
        ])?;
        return Ok(());
    }
    conn.prepare_cached(
        "INSERT INTO postroom_inbox (consumer, source, message_id, status, payload, payload_hash,
             headers, ordering_key, attempts, last_error, received_at, updated_at,
             next_attempt_at, processed_at, seq, seq_stream)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?11, ?12, ?13, ?14, ?15)",
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
    ])?;
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
