//! Queued-mode SQL as plain functions over a connection: storing received
//! messages, claiming due rows with a lease, fencing by lease token,
//! reaping expired leases, retention, and dead-letter operations.
//!
//! Lease invariants:
//! * a row is `processing` only with a `lease_token` and `lease_until`;
//! * claiming counts the attempt (`attempts + 1`) in the same statement, so
//!   an attempt that dies with its process is counted when it is reaped;
//! * only the holder of the current `lease_token` may complete a row, so a
//!   worker whose lease was reaped and re-claimed cannot complete it twice.

use crate::config::KeyOrder;
use crate::escape::Esc;
use rusqlite::{params, Connection, OptionalExtension};

use crate::message::{Headers, Message, Receipt};
use crate::store::admission::{self, Admission};
use crate::store::inbox;
use crate::store::text::headers_json;

/// Stores a received message as `pending` unless its key is known: then it
/// is a duplicate (same payload digest) or a conflict (quarantined).
pub(crate) fn receive(
    conn: &Connection,
    consumer: &str,
    msg: &Message,
    hash: &[u8; 32],
    now_ms: i64,
) -> rusqlite::Result<Receipt> {
    store(conn, consumer, msg, hash, None, now_ms)
}

#[cfg_attr(not(feature = "mqtt"), allow(dead_code))] // used by the MQTT intake
/// Stores a message an intake could not hand on as it is straight into the
/// dead letters (`dead`, no attempt made, `reason` as its `last_error`,
/// workers' once redriven), unless its key is known: then, as for
/// [`receive`], a duplicate or a conflict. `msg` must already be storable
/// (`config::storable`); `hash` is the digest of the payload as it came.
/// A sequenced one settles its number (the watermark triggers), so the
/// stream's watermark passes it.
pub(crate) fn receive_dead(
    conn: &Connection,
    consumer: &str,
    msg: &Message,
    hash: &[u8; 32],
    reason: &str,
    now_ms: i64,
) -> rusqlite::Result<Receipt> {
    store(conn, consumer, msg, hash, Some(reason), now_ms)
}

/// [`receive`], or with `dead` [`receive_dead`].
fn store(
    conn: &Connection,
    consumer: &str,
    msg: &Message,
    hash: &[u8; 32],
    dead: Option<&str>,
    now_ms: i64,
) -> rusqlite::Result<Receipt> {
    let row_id = match admission::admit(conn, consumer, msg, hash, now_ms)? {
        Admission::Duplicate => return Ok(Receipt::Duplicate),
        Admission::DuplicateBySequence { sequence } => {
            return Ok(Receipt::DuplicateBySequence { sequence })
        }
        Admission::Conflict(conflict_id) => return Ok(Receipt::Conflict { conflict_id }),
        Admission::Stored { id, .. } => id,
        Admission::New => {
            // With its id chosen as every engine insert does (`next_id`).
            let id = inbox::next_id(conn)?;
            conn.prepare_cached(
                "INSERT INTO postroom_inbox (consumer, source, message_id, status, payload,
                     payload_hash, headers, ordering_key, attempts, received_at, updated_at,
                     next_attempt_at, queued, seq, seq_stream, last_error, id)
                 VALUES (?1, ?2, ?3, CASE WHEN ?11 IS NULL THEN 'pending' ELSE 'dead' END, ?4, ?5,
                     ?6, ?7, 0,
                     ?8, ?8, NULL, 1, ?9, ?10, ?11, ?12)",
            )?
            .execute(params![
                consumer,
                msg.source,
                msg.id,
                msg.payload,
                hash.as_slice(),
                headers_json(&msg.headers),
                msg.ordering_key,
                now_ms,
                msg.sequence.map(|seq| seq as i64),
                msg.sequence_stream(),
                dead,
                id,
            ])?;
            return Ok(Receipt::Accepted);
        }
    };
    // The caller will ack this receipt, so the workers must own the message
    // from now on even if an inline delivery left it unfinished (its broker
    // will not redeliver an acked message).
    conn.prepare_cached(
        "UPDATE postroom_inbox SET queued = 1
         WHERE id = ?1 AND queued = 0 AND status IN ('pending', 'failed')",
    )?
    .execute([row_id])?;
    Ok(Receipt::Duplicate)
}

/// A row claimed for processing.
#[derive(Debug, Clone)]
pub(crate) struct Claimed {
    pub row_id: i64,
    pub token: i64,
    pub consumer: String,
    pub msg: Message,
    pub hash: [u8; 32],
    /// This attempt's number: counted in the row by a claim, about to be
    /// by [`due`]'s processing.
    pub attempt: u32,
    /// The row's `received_at`.
    pub received_at: i64,
}

/// The rows [`claim`] and [`due`] may take: `consumer`'s pending rows, and
/// failed rows whose backoff has passed, skipping any row whose ordering key
/// has an earlier unfinished row or any row in progress (a redriven head
/// must not run beside its successor), in receive order. `?1` consumer, `?2`
/// limit, `?3` now.
///
/// O(1) in any key's backlog (issue 32): rows without a key come from
/// `postroom_inbox_due`, which holds only those; rows with a key from
/// `postroom_inbox_heads`, one row per key (its lowest unfinished id, the
/// only one that may run), so a head held back by a backoff costs one step
/// however many rows wait behind it. The two arms are each in id order and
/// SQLite merges them, reading no further than the limit. A head runs only
/// when no row of its key is in progress (`postroom_inbox_busy`; the
/// `ordering_key IS NOT NULL` lets SQLite prove that partial index
/// applies).
///
/// `due_rows!(strict)` ([`KeyOrder::DeadHolds`]) also skips a head whose
/// key has a dead row with a lower id: one more step per head, down
/// `postroom_inbox_dead_keys` (dead keyed rows only). A redriven row is
/// pending again with its own id, so it is its key's head, and runs first.
///
/// `INDEXED BY postroom_inbox_due`: statistics taken while every row was
/// queued and pending (`PRAGMA optimize` when an engine shuts down with a
/// backlog) tell SQLite that index holds the whole table, and it then
/// scans the table from its first row instead, through every row
/// completed since, on every batch: a drain quadratic in its backlog
/// (`the_due_rows_are_read_through_their_index_whatever_the_statistics`).
/// The engine refuses a file missing the index, so naming it cannot fail.
macro_rules! due_rows {
    () => {
        due_rows!(@ "")
    };
    (strict) => {
        due_rows!(@ "
           AND NOT EXISTS (
               SELECT 1 FROM postroom_inbox d
               WHERE d.consumer = h.consumer AND d.ordering_key = h.ordering_key
                 AND d.status = 'dead' AND d.ordering_key IS NOT NULL AND d.id < h.head_id)")
    };
    (@ $held:literal) => {
        concat!(
            "SELECT i.id FROM postroom_inbox i INDEXED BY postroom_inbox_due
         WHERE i.consumer = ?1 AND i.queued = 1 AND i.status IN ('pending', 'failed')
           AND i.ordering_key IS NULL AND coalesce(i.next_attempt_at, 0) <= ?3
         UNION ALL
         SELECT i.id FROM postroom_inbox_heads h JOIN postroom_inbox i ON i.id = h.head_id
         WHERE h.consumer = ?1 AND i.queued = 1 AND i.status IN ('pending', 'failed')
           AND coalesce(i.next_attempt_at, 0) <= ?3
           AND NOT EXISTS (
               SELECT 1 FROM postroom_inbox o
               WHERE o.consumer = h.consumer AND o.ordering_key = h.ordering_key
                 AND o.status = 'processing' AND o.ordering_key IS NOT NULL)",
            $held,
            "
         ORDER BY 1
         LIMIT ?2"
        )
    };
}

/// The columns [`claim`] and [`due`] read of each row, in [`decode`]'s order.
macro_rules! due_columns {
    () => {
        "id, source, message_id, payload, payload_hash, headers, ordering_key, attempts,
         received_at, last_error, seq, seq_stream"
    };
}

/// What [`claim`] and [`due`] read: up to `limit` due rows of
/// `consumer` at `now_ms`, its keys ordered by `order`, rows past
/// `max_attempts` dead-lettered.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Due<'a> {
    pub consumer: &'a str,
    pub order: KeyOrder,
    pub limit: usize,
    pub now_ms: i64,
    pub max_attempts: u32,
}

/// Claims up to `limit` due rows of `consumer` (see [`due_rows`]) with a
/// lease, counting their attempt, for steps that run outside the writer's
/// transaction (effectful consumers). A row that already used
/// `max_attempts` (the cap was lowered since) is dead-lettered instead of
/// claimed. Keys in `due.order`.
pub(crate) fn claim(
    conn: &Connection,
    due: Due<'_>,
    lease_until: i64,
    token: i64,
) -> rusqlite::Result<Vec<Claimed>> {
    macro_rules! claim_sql {
        ($($order:tt)?) => {
            concat!(
                "UPDATE postroom_inbox
         SET status = 'processing', attempts = attempts + 1, lease_until = ?4,
             lease_token = ?5, updated_at = ?3
         WHERE id IN (",
                due_rows!($($order)?),
                ") RETURNING ",
                due_columns!()
            )
        };
    }
    let Due {
        consumer,
        order,
        limit,
        now_ms,
        max_attempts,
    } = due;
    let mut stmt = conn.prepare_cached(match order {
        KeyOrder::DeadReleases => claim_sql!(),
        KeyOrder::DeadHolds => claim_sql!(strict),
    })?;
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let rows = stmt.query(params![consumer, limit, now_ms, lease_until, token])?;
    // RETURNING gives the rows in no set order.
    let mut read = decode(rows, consumer, token, 0)?;
    read.sort_by_key(|(c, _, _)| c.row_id);
    triage(conn, read, max_attempts, now_ms)
}

/// Up to `limit` due rows of `consumer` (see [`due_rows`]), read without
/// claiming them: for processing inside the writer's transaction, where no
/// lease is needed (nothing else writes while it runs) and the attempt is
/// counted by the result the transaction records. Each row's `attempt` is
/// the one about to run, `token` 0. Rows that must not run are
/// dead-lettered as [`claim`] does.
pub(crate) fn due(conn: &Connection, due: Due<'_>) -> rusqlite::Result<Vec<Claimed>> {
    macro_rules! due_sql {
        ($($order:tt)?) => {
            concat!(
                "SELECT ",
                due_columns!(),
                " FROM postroom_inbox WHERE id IN (",
                due_rows!($($order)?),
                ") ORDER BY id"
            )
        };
    }
    let Due {
        consumer,
        order,
        limit,
        now_ms,
        max_attempts,
    } = due;
    let mut stmt = conn.prepare_cached(match order {
        KeyOrder::DeadReleases => due_sql!(),
        KeyOrder::DeadHolds => due_sql!(strict),
    })?;
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let rows = stmt.query(params![consumer, limit, now_ms])?;
    let read = decode(rows, consumer, 0, 1)?;
    drop(stmt);
    triage(conn, read, max_attempts, now_ms)
}

/// A row read by [`claim`] or [`due`], with its last error (for a row past
/// a lowered cap) and the first column that did not decode.
type Read = (Claimed, Option<String>, Option<&'static str>);

/// Reads [`due_columns`] rows; `next_attempt` is added to the stored
/// attempts to give the attempt about to run (0: a claim counted it).
fn decode(
    mut rows: rusqlite::Rows<'_>,
    consumer: &str,
    token: i64,
    next_attempt: u32,
) -> rusqlite::Result<Vec<Read>> {
    let mut read = Vec::new();
    while let Some(r) = rows.next()? {
        let hash: Vec<u8> = r.get(4)?;
        let mut damage = None;
        let mut text = |idx, column| crate::store::text::stored_text(r, idx, column, &mut damage);
        let msg = Message {
            source: text(1, "source")?.unwrap_or_default(),
            id: text(2, "message_id")?.unwrap_or_default(),
            payload: crate::store::text::stored_bytes(r, 3)?.unwrap_or_default(),
            headers: parse_headers(text(5, "headers")?.as_deref()),
            ordering_key: text(6, "ordering_key")?,
            sequence: r
                .get::<_, Option<i64>>(10)?
                .and_then(|seq| u64::try_from(seq).ok()),
            sequence_stream: text(11, "seq_stream")?,
        };
        let attempts: u32 = r.get(7)?;
        let row = Claimed {
            row_id: r.get(0)?,
            token,
            consumer: consumer.to_owned(),
            msg,
            hash: hash.try_into().unwrap_or([0; 32]),
            attempt: attempts.saturating_add(next_attempt),
            received_at: r.get(8)?,
        };
        read.push((row, crate::store::text::lossy_text(r, 9)?, damage));
    }
    Ok(read)
}

/// Dead-letters the rows that must not run (a column that does not decode,
/// a payload that does not match its digest, attempts used up under a
/// lowered cap) and returns the others, in the order read.
fn triage(
    conn: &Connection,
    read: Vec<Read>,
    max_attempts: u32,
    now_ms: i64,
) -> rusqlite::Result<Vec<Claimed>> {
    let mut sound = Vec::with_capacity(read.len());
    for (c, last_error, damage) in read {
        let (attempts, error) = if let Some(column) = damage {
            // Never hand a handler a message that is not the one received.
            log::error!(
                "postroom: row {} ({}): {}; dead-lettered",
                c.row_id,
                Esc(&c.consumer),
                crate::store::text::undecodable(column)
            );
            (c.attempt, crate::store::text::undecodable(column))
        } else if c.attempt > max_attempts {
            // Not an attempt: the attempt about to run is not counted.
            let used = c.attempt - 1;
            log::warn!(
                "consumer {:?}: message {}/{} dead: {used} attempts used, max_attempts is now \
                 {max_attempts}",
                Esc(&c.consumer),
                Esc(&c.msg.source),
                Esc(&c.msg.id)
            );
            let last = last_error.unwrap_or_default();
            (used, inbox::exhausted(used, max_attempts, &last))
        } else if blake3::hash(&c.msg.payload).as_bytes() != &c.hash {
            // Never hand a handler a payload that is not the one received:
            // bit rot, a damaged page, a hand edit.
            log::error!(
                "postroom: row {} ({}/{}/{}): stored payload does not match its digest; \
                 dead-lettered",
                c.row_id,
                Esc(&c.consumer),
                Esc(&c.msg.source),
                Esc(&c.msg.id)
            );
            let reason = "stored payload does not match its digest (corrupted)";
            (c.attempt, reason.to_owned())
        } else {
            sound.push(c);
            continue;
        };
        conn.prepare_cached(
            "UPDATE postroom_inbox SET status = 'dead', attempts = ?2, last_error = ?3,
                 lease_until = NULL, lease_token = NULL, updated_at = ?4
             WHERE id = ?1",
        )?
        .execute(params![c.row_id, attempts, error, now_ms])?;
    }
    Ok(sound)
}

/// True when row `row_id` is still pending or failed with `attempts`
/// attempts used: nothing has run or counted it since it was read.
pub(crate) fn still_due(conn: &Connection, row_id: i64, attempts: u32) -> rusqlite::Result<bool> {
    conn.prepare_cached(
        "SELECT 1 FROM postroom_inbox
         WHERE id = ?1 AND attempts = ?2 AND status IN ('pending', 'failed')",
    )?
    .query_row(params![row_id, attempts], |_| Ok(()))
    .optional()
    .map(|r| r.is_some())
}

/// Puts a due row off until `until` without counting an attempt, if it is
/// still due with `attempts` attempts used.
pub(crate) fn hold_back(
    conn: &Connection,
    row_id: i64,
    attempts: u32,
    until: i64,
) -> rusqlite::Result<()> {
    conn.prepare_cached(
        "UPDATE postroom_inbox SET next_attempt_at = ?3
         WHERE id = ?1 AND attempts = ?2 AND status IN ('pending', 'failed')",
    )?
    .execute(params![row_id, attempts, until])?;
    Ok(())
}

/// True when `token` still holds the lease on the row.
pub(crate) fn lease_held(conn: &Connection, row_id: i64, token: i64) -> rusqlite::Result<bool> {
    conn.prepare_cached(
        "SELECT 1 FROM postroom_inbox WHERE id = ?1 AND status = 'processing' AND lease_token = ?2",
    )?
    .query_row(params![row_id, token], |_| Ok(()))
    .optional()
    .map(|r| r.is_some())
}

/// Gives back a claim whose attempt does not count (its step never
/// started): the row returns to what it was, the attempt uncounted.
pub(crate) fn release(conn: &Connection, row_id: i64, token: i64) -> rusqlite::Result<bool> {
    let n = conn
        .prepare_cached(
            "UPDATE postroom_inbox
             SET status = CASE WHEN attempts <= 1 AND last_error IS NULL THEN 'pending'
                               ELSE 'failed' END,
                 attempts = max(attempts - 1, 0), lease_until = NULL, lease_token = NULL
             WHERE id = ?1 AND status = 'processing' AND lease_token = ?2",
        )?
        .execute(params![row_id, token])?;
    Ok(n == 1)
}

/// A row in `processing`, as the reaper sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Leased {
    pub row_id: i64,
    pub token: Option<i64>,
    pub lease_until: Option<i64>,
}

pub(crate) fn leased(conn: &Connection) -> rusqlite::Result<Vec<Leased>> {
    let mut stmt = conn.prepare_cached(
        "SELECT id, lease_token, lease_until FROM postroom_inbox WHERE status = 'processing'",
    )?;
    let rows = stmt.query_map([], |r| {
        Ok(Leased {
            row_id: r.get(0)?,
            token: r.get(1)?,
            lease_until: r.get(2)?,
        })
    })?;
    rows.collect()
}

/// Ends a lease that will not be completed: the row becomes `failed`, due
/// at once (its attempt was counted when claimed), or `dead` when that was
/// its last attempt. Returns whether the row was still held by `token`.
pub(crate) fn expire(
    conn: &Connection,
    row_id: i64,
    token: Option<i64>,
    error: &str,
    max_attempts: u32,
    now_ms: i64,
) -> rusqlite::Result<bool> {
    let n = conn
        .prepare_cached(
            "UPDATE postroom_inbox
             SET status = CASE WHEN attempts >= ?3 THEN 'dead' ELSE 'failed' END,
                 last_error = ?4, next_attempt_at = NULL, updated_at = ?5,
                 lease_until = NULL, lease_token = NULL
             WHERE id = ?1 AND status = 'processing' AND lease_token IS ?2",
        )?
        .execute(params![row_id, token, max_attempts, error, now_ms])?;
    Ok(n == 1)
}

/// Runs one of retention's batch deletes ([`DELETE_DEAD`],
/// `outbox::DELETE_SENT`, `inbox::DELETE_CONFLICTS`; completed inbox rows
/// are `store::sweep`'s):
/// `sql` takes the cutoff (unix ms) as `?1` and the batch size as `?2`, and
/// has the shape `DELETE FROM t WHERE k IN (SELECT k FROM t WHERE … LIMIT
/// ?2)`, which [`count_expired`] relies on.
pub(crate) fn delete_expired(
    conn: &Connection,
    sql: &str,
    cutoff_ms: i64,
    limit: usize,
) -> rusqlite::Result<usize> {
    conn.prepare_cached(sql)?
        .execute(params![cutoff_ms, i64::try_from(limit).unwrap_or(i64::MAX)])
}

/// Counts every row `sql` (one of retention's batch deletes, see
/// [`delete_expired`]) would delete before `cutoff_ms`, by running its own
/// subquery without a limit: a dry run counts exactly what a run deletes.
pub(crate) fn count_expired(conn: &Connection, sql: &str, cutoff_ms: i64) -> rusqlite::Result<u64> {
    let (_, subquery) = sql
        .split_once(" IN (")
        .expect("retention deletes are DELETE … WHERE k IN (SELECT …)");
    // `subquery` ends with the `)` closing `IN (`; LIMIT -1 is no limit.
    let n: i64 = conn
        .prepare_cached(&format!("SELECT count(*) FROM ({subquery}"))?
        .query_row(params![cutoff_ms, -1], |r| r.get(0))?;
    Ok(u64::try_from(n).unwrap_or(0))
}

/// Dead rows that died (last updated) before the cutoff
/// (`dead_retention`), through `postroom_inbox_dead`.
///
/// Retention never deletes the newest row of a table, whatever its age:
/// SQLite gives a new row the highest id plus one, so deleting the newest
/// rows would give their ids out again (this, `store::sweep` for completed
/// rows, and `outbox::DELETE_SENT`, which keeps the newest `seq` the same
/// way). The unary `+` keeps SQLite from answering `id < max` with a rowid
/// range scan of the whole table once statistics exist: the plan must stay
/// on the partial index (`retention_statements_use_their_indexes_with_statistics`).
pub(crate) const DELETE_DEAD: &str = "DELETE FROM postroom_inbox WHERE id IN (
     SELECT id FROM postroom_inbox
     WHERE status = 'dead' AND updated_at < ?1
       AND +id < (SELECT max(id) FROM postroom_inbox) LIMIT ?2)";

/// A dead-lettered inbox message.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct DeadLetter {
    /// Row id in `postroom_inbox`: what `redrive` and `discard` take.
    pub id: i64,
    /// The consumer it was delivered to.
    pub consumer: String,
    /// The message, with its payload, headers and ordering key.
    pub message: Message,
    /// Attempts made.
    pub attempts: u32,
    /// Why it died.
    pub last_error: Option<String>,
    /// When it was first received (unix ms).
    pub received_at: i64,
    /// When it died (unix ms).
    pub updated_at: i64,
}

/// `+id`: sort the few dead rows found through `postroom_inbox_dead`, not
/// walk the whole table in id order looking for them (which SQLite chose
/// without statistics, reading every row when fewer than the limit are
/// dead).
const DEAD_LETTERS: &str =
    "SELECT id, consumer, source, message_id, payload, headers, ordering_key,
        attempts, last_error, received_at, updated_at, seq, seq_stream
     FROM postroom_inbox
     WHERE status = 'dead' AND (?1 IS NULL OR consumer = ?1)
     ORDER BY +id LIMIT ?2";

/// Dead letters, oldest first, optionally of one consumer.
pub(crate) fn dead_letters(
    conn: &Connection,
    consumer: Option<&str>,
    limit: usize,
) -> rusqlite::Result<Vec<DeadLetter>> {
    let mut stmt = conn.prepare_cached(DEAD_LETTERS)?;
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let rows = stmt.query_map(params![consumer, limit], |r| {
        // Lossy: a row dead-lettered because its text did not decode must
        // still be listed.
        let text = |idx| crate::store::text::lossy_text(r, idx).map(Option::unwrap_or_default);
        Ok(DeadLetter {
            id: r.get(0)?,
            consumer: text(1)?,
            message: Message {
                source: text(2)?,
                id: text(3)?,
                payload: crate::store::text::stored_bytes(r, 4)?.unwrap_or_default(),
                headers: parse_headers(crate::store::text::lossy_text(r, 5)?.as_deref()),
                ordering_key: crate::store::text::lossy_text(r, 6)?,
                sequence: r
                    .get::<_, Option<i64>>(11)?
                    .and_then(|seq| u64::try_from(seq).ok()),
                sequence_stream: crate::store::text::lossy_text(r, 12)?,
            },
            attempts: r.get(7)?,
            last_error: crate::store::text::lossy_text(r, 8)?,
            received_at: r.get(9)?,
            updated_at: r.get(10)?,
        })
    })?;
    rows.collect()
}

/// Sends a dead letter back to `pending` with its attempts reset, for the
/// workers to process (even one first delivered inline: its broker has
/// been told to ack it). Returns false when `row_id` is not a dead letter.
pub(crate) fn redrive(conn: &Connection, row_id: i64, now_ms: i64) -> rusqlite::Result<bool> {
    let n = conn
        .prepare_cached(
            "UPDATE postroom_inbox
             SET status = 'pending', attempts = 0, next_attempt_at = NULL, updated_at = ?2,
                 queued = 1
             WHERE id = ?1 AND status = 'dead'",
        )?
        .execute(params![row_id, now_ms])?;
    Ok(n == 1)
}

/// Gives up on a dead letter for good: it becomes `completed` without its
/// effects (payload dropped, the reason kept in `last_error`), so a
/// redelivery is answered `Duplicate` instead of running it again, and
/// retention removes it like any completed row. Returns false when
/// `row_id` is not a dead letter.
pub(crate) fn discard(conn: &Connection, row_id: i64, now_ms: i64) -> rusqlite::Result<bool> {
    let n = conn
        .prepare_cached(
            "UPDATE postroom_inbox
             SET status = 'completed', payload = NULL, processed_at = ?2, updated_at = ?2,
                 next_attempt_at = NULL,
                 last_error = 'discarded by operator; last error: ' || coalesce(last_error, '')
             WHERE id = ?1 AND status = 'dead'",
        )?
        .execute(params![row_id, now_ms])?;
    Ok(n == 1)
}

/// Makes a failed row due now, for the workers (`queued = 1`, as a redrive:
/// an inline row's broker redelivery is then answered from the row, and
/// the workers run it). Its attempts stay counted. Due at once is a NULL
/// `next_attempt_at`, never "now" (schema.sql: a clock set back, or
/// another process's clock, must not hold it). Returns false when
/// `row_id` is not failed.
pub(crate) fn retry_now(conn: &Connection, row_id: i64, now_ms: i64) -> rusqlite::Result<bool> {
    let n = conn
        .prepare_cached(
            "UPDATE postroom_inbox SET next_attempt_at = NULL, updated_at = ?2, queued = 1
             WHERE id = ?1 AND status = 'failed'",
        )?
        .execute(params![row_id, now_ms])?;
    Ok(n == 1)
}

/// Gives up on a row that is not finished and that no worker holds
/// (pending or failed): it becomes a dead letter, payload kept, with
/// `reason` and its last error; redrive brings it back (under strict
/// order it holds its key, as any dead letter does). Returns false when
/// `row_id` is not pending or failed.
pub(crate) fn cancel(
    conn: &Connection,
    row_id: i64,
    reason: &str,
    now_ms: i64,
) -> rusqlite::Result<bool> {
    let n = conn
        .prepare_cached(
            "UPDATE postroom_inbox
             SET status = 'dead', next_attempt_at = NULL, updated_at = ?3,
                 last_error = 'cancelled by operator: ' || ?2
                     || coalesce('; last error: ' || last_error, '')
             WHERE id = ?1 AND status IN ('pending', 'failed')",
        )?
        .execute(params![row_id, reason, now_ms])?;
    Ok(n == 1)
}

fn parse_headers(text: Option<&str>) -> Headers {
    text.and_then(|t| serde_json::from_str(t).ok())
        .unwrap_or_default()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// What `EXPLAIN QUERY PLAN` says of `sql`, one line per step.
    fn plan(conn: &Connection, sql: &str) -> String {
        let mut stmt = conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
        let values = [1000, 256];
        let bound = &values[..stmt.parameter_count()];
        let rows = stmt
            .query_map(rusqlite::params_from_iter(bound), |r| r.get::<_, String>(3))
            .unwrap();
        rows.map(Result::unwrap).collect::<Vec<_>>().join("; ")
    }

    /// Retention's statements must find expired rows through their partial
    /// indexes even once statistics exist (`PRAGMA optimize` at shutdown
    /// runs ANALYZE): the "keep the newest row" bound on the row id must
    /// not turn them into a rowid scan of the whole table, run by every
    /// reaper pass inside the writer; nor may `dead_retention`'s scan the
    /// inbox for dead rows (it did before schema version 5).
    #[test]
    fn retention_statements_use_their_indexes_with_statistics() {
        let conn = retention_fixture();
        conn.execute_batch("ANALYZE").unwrap();
        for (sql, index) in [
            (DELETE_DEAD, "postroom_inbox_dead"),
            (crate::store::outbox::DELETE_SENT, "postroom_outbox_sent"),
            (
                crate::store::inbox::DELETE_CONFLICTS,
                "postroom_conflicts_seen",
            ),
        ] {
            let plan = plan(&conn, sql);
            assert!(plan.contains(index), "{sql}: {plan}");
        }
    }

    /// The dead-letter listings (the engine's `dead_letters`, the CLI's
    /// `dead list`) read the few dead rows through their indexes, with or
    /// without statistics, instead of every row of the table.
    #[test]
    fn dead_letter_listings_use_their_indexes() {
        let conn = retention_fixture();
        for analyzed in [false, true] {
            if analyzed {
                conn.execute_batch("ANALYZE").unwrap();
            }
            let inbox = plan(&conn, DEAD_LETTERS);
            assert!(inbox.contains("postroom_inbox_dead"), "{inbox}");
            let outbox = plan(&conn, &crate::store::outbox::dead_letters_sql());
            assert!(outbox.contains("postroom_outbox_dead"), "{outbox}");
        }
    }

    /// A dry run (`admin::cleanup`) counts with `count_expired`: it must
    /// count exactly what the delete deletes, for each statement.
    #[test]
    fn count_expired_counts_what_the_delete_deletes() {
        let conn = retention_fixture();
        for sql in [
            DELETE_DEAD,
            crate::store::outbox::DELETE_SENT,
            crate::store::inbox::DELETE_CONFLICTS,
        ] {
            let counted = count_expired(&conn, sql, 1500).unwrap();
            let deleted = delete_expired(&conn, sql, 1500, usize::MAX).unwrap();
            assert_eq!(counted, deleted as u64, "{sql}");
            assert!(counted > 100, "{sql}: the fixture has rows to delete");
        }
    }

    /// SQLite VM instructions `f` runs on `conn`, every statement counted
    /// (a progress handler called at each instruction): deterministic, unlike
    /// wall time on a busy machine.
    pub(crate) fn vm_ops<T>(conn: &mut Connection, f: impl FnOnce(&Connection) -> T) -> (T, u64) {
        use std::sync::atomic::{AtomicU64, Ordering};
        use std::sync::Arc;
        let count = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&count);
        conn.progress_handler(
            1,
            Some(move || {
                counter.fetch_add(1, Ordering::Relaxed);
                false
            }),
        )
        .unwrap();
        let out = f(conn);
        conn.progress_handler(0, None::<fn() -> bool>).unwrap();
        (out, count.load(Ordering::Relaxed))
    }

    const NOW: i64 = 1_000_000_000;

    /// Consumer `c`: the head of key `doc-1` (failed, due in an hour when
    /// `held`, else pending), `behind` pending rows of `doc-1` behind it,
    /// then one pending row of each of keys `k0`..`k9` and ten pending rows
    /// without a key. Every row queued.
    fn backlog_fixture(behind: usize, held: bool) -> Connection {
        with_statistics_if_asked(backlog_rows(behind, held))
    }

    /// `conn` with statistics when [`both_ways`] is on its second run
    /// (`PRAGMA optimize` at shutdown runs ANALYZE): a plan must stay on
    /// the heads either way.
    pub(crate) fn with_statistics_if_asked(conn: Connection) -> Connection {
        if ANALYZED.with(|a| a.get()) {
            conn.execute_batch("ANALYZE").unwrap();
        }
        conn
    }

    thread_local! {
        static ANALYZED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    /// Runs `test` without statistics, then with.
    pub(crate) fn both_ways(test: impl Fn()) {
        for analyzed in [false, true] {
            ANALYZED.with(|a| a.set(analyzed));
            test();
        }
    }

    fn backlog_rows(behind: usize, held: bool) -> Connection {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch(crate::store::schema::SCHEMA_SQL)
            .unwrap();
        let (status, next, error) = if held {
            ("failed", Some(NOW + 3_600_000), Some("retry after 1 h"))
        } else {
            ("pending", None, None)
        };
        conn.execute(
            "INSERT INTO postroom_inbox (consumer, source, message_id, status, payload,
                 payload_hash, ordering_key, attempts, last_error, received_at, updated_at,
                 next_attempt_at, queued)
             VALUES ('c', 's', 'head', ?1, x'', ?2, 'doc-1', ?3, ?4, 1, 1, ?5, 1)",
            params![
                status,
                blake3::hash(b"").as_bytes().as_slice(),
                i64::from(held),
                error,
                next
            ],
        )
        .unwrap();
        conn.execute(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1)
             INSERT INTO postroom_inbox (consumer, source, message_id, status, payload,
                 payload_hash, ordering_key, received_at, updated_at, queued)
             SELECT 'c', 's', 'b' || i, 'pending', x'', ?2, 'doc-1', 2, 2, 1 FROM n
             WHERE ?1 > 0",
            params![behind as i64, blake3::hash(b"").as_bytes().as_slice()],
        )
        .unwrap();
        conn.execute(
            "WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < 19)
             INSERT INTO postroom_inbox (consumer, source, message_id, status, payload,
                 payload_hash, ordering_key, received_at, updated_at, queued)
             SELECT 'c', 's', 'o' || i, 'pending', x'', ?1, iif(i < 10, 'k' || i, NULL), 3, 3, 1
             FROM n",
            [blake3::hash(b"").as_bytes().as_slice()],
        )
        .unwrap();
        conn
    }

    /// Message ids `due` returns, in its order, and the VM instructions it
    /// took.
    fn due_ids(conn: &mut Connection) -> (Vec<String>, u64) {
        due_ids_in(conn, KeyOrder::DeadReleases)
    }

    /// [`due_ids`] for a consumer whose keys are ordered by `order`.
    fn due_ids_in(conn: &mut Connection, order: KeyOrder) -> (Vec<String>, u64) {
        let due_now = Due {
            consumer: "c",
            order,
            limit: 256,
            now_ms: NOW,
            max_attempts: 10,
        };
        let (rows, ops) = vm_ops(conn, |c| due(c, due_now).unwrap());
        (rows.into_iter().map(|r| r.msg.id).collect(), ops)
    }

    /// `n` queued pending rows of consumer `c` without a key, statistics
    /// taken (`PRAGMA optimize` at shutdown runs ANALYZE) while all were
    /// pending, then all but the last `left` completed.
    fn drained_after_statistics(n: i64, left: i64) -> Connection {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch(crate::store::schema::SCHEMA_SQL)
            .unwrap();
        conn.execute(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1)
             INSERT INTO postroom_inbox (consumer, source, message_id, status, payload,
                 payload_hash, received_at, updated_at, queued)
             SELECT 'c', 's', 'm' || i, 'pending', x'', ?2, 1, 1, 1 FROM n",
            params![n, blake3::hash(b"").as_bytes().as_slice()],
        )
        .unwrap();
        conn.execute_batch("ANALYZE").unwrap();
        conn.execute(
            "UPDATE postroom_inbox SET status = 'completed', processed_at = 2 WHERE id <= ?1",
            [n - left],
        )
        .unwrap();
        conn
    }

    /// Statistics taken while the whole inbox was queued and pending (an
    /// engine that shut down with a backlog) say `postroom_inbox_due`
    /// holds every row: the workers' due query and the dispatcher's next
    /// due time must still read through it, not scan the table from its
    /// first row past every row completed since (10 times the VM steps at
    /// 4,900 completed rows, growing with them, before they named it).
    #[test]
    fn the_due_rows_are_read_through_their_index_whatever_the_statistics() {
        let (_, fresh_ops) = due_ids(&mut drained_after_statistics(100, 100));
        let mut drained = drained_after_statistics(5_000, 100);
        let (ids, ops) = due_ids(&mut drained);
        let expected: Vec<String> = (4_901..=5_000).map(|i| format!("m{i}")).collect();
        assert_eq!(ids, expected);
        assert!(
            ops <= 2 * fresh_ops,
            "due query: {fresh_ops} VM steps for 100 pending rows, {ops} after 4,900 completed"
        );
        let next_due = |c: &Connection| crate::store::due::inbox(c, "c", NOW).unwrap();
        let (_, fresh_ops) = vm_ops(&mut drained_after_statistics(100, 100), next_due);
        let (_, ops) = vm_ops(&mut drained, next_due);
        assert!(
            ops <= 2 * fresh_ops,
            "next due time: {fresh_ops} VM steps for 100 pending rows, {ops} after 4,900 completed"
        );
    }

    /// [`backlog_fixture`] with the head of `doc-1` dead: the key's next
    /// row (`b1`) is its head.
    fn dead_head_fixture(behind: usize) -> Connection {
        let conn = backlog_rows(behind, false);
        conn.execute(
            "UPDATE postroom_inbox SET status = 'dead', last_error = 'gave up'
             WHERE message_id = 'head'",
            [],
        )
        .unwrap();
        with_statistics_if_asked(conn)
    }

    /// Strict order (issue 36): a dead row holds the rows of its key
    /// behind it, and no other key's, at a cost that does not grow with
    /// the held backlog; by default the key's next row runs. A redriven
    /// row runs before the rows behind it, in either order.
    #[test]
    fn a_dead_row_holds_its_key_under_strict_order_only() {
        both_ways(|| {
            let mut released = vec!["b1".to_owned()];
            released.extend(others());
            let (ids, _) = due_ids_in(&mut dead_head_fixture(5), KeyOrder::DeadReleases);
            assert_eq!(ids, released, "by default a dead row releases its key");
            let (few, few_ops) = due_ids_in(&mut dead_head_fixture(1), KeyOrder::DeadHolds);
            let (many, many_ops) = due_ids_in(&mut dead_head_fixture(100_000), KeyOrder::DeadHolds);
            assert_eq!(few, others());
            assert_eq!(many, others());
            println!("strict due query: {few_ops} VM steps at 1 held row, {many_ops} at 100,000");
            assert!(
                many_ops <= 2 * few_ops + 5_000,
                "strict due query: {few_ops} VM steps with 1 row held, {many_ops} with 100,000"
            );
            // Claims (effectful consumers) the same.
            let mut conn = dead_head_fixture(5);
            let due_now = Due {
                consumer: "c",
                order: KeyOrder::DeadHolds,
                limit: 256,
                now_ms: NOW,
                max_attempts: 10,
            };
            let claimed = claim(&conn, due_now, NOW + 60_000, 7).unwrap();
            let ids: Vec<String> = claimed.into_iter().map(|r| r.msg.id).collect();
            assert_eq!(ids, others());
            // Redriven, the dead row is its key's head again, and runs first.
            let id: i64 = conn
                .query_row(
                    "SELECT id FROM postroom_inbox WHERE message_id = 'head'",
                    [],
                    |r| r.get(0),
                )
                .unwrap();
            conn.execute(
                "UPDATE postroom_inbox SET status = 'completed' WHERE id > ?1",
                [id],
            )
            .unwrap();
            assert!(redrive(&conn, id, NOW).unwrap());
            for order in [KeyOrder::DeadHolds, KeyOrder::DeadReleases] {
                let (ids, _) = due_ids_in(&mut conn, order);
                assert_eq!(ids, ["head"], "{order:?}");
            }
        });
    }

    /// The strict due query's probe for a dead row goes down
    /// `postroom_inbox_dead_keys`, with or without statistics.
    #[test]
    fn the_strict_due_query_probes_the_dead_keys_index() {
        both_ways(|| {
            let conn = dead_head_fixture(10);
            let mut stmt = conn
                .prepare(concat!("EXPLAIN QUERY PLAN ", due_rows!(strict)))
                .unwrap();
            let plan: Vec<String> = stmt
                .query_map(params!["c", 256, NOW], |r| r.get(3))
                .unwrap()
                .map(Result::unwrap)
                .collect();
            assert!(
                plan.iter().any(|p| p.contains("postroom_inbox_dead_keys")),
                "{plan:?}"
            );
        });
    }

    /// The other keys' rows, and the unkeyed ones, in receive order.
    fn others() -> Vec<String> {
        (0..20).map(|i| format!("o{i}")).collect()
    }

    /// Finding due rows is O(1) in a held key's backlog: 100,000 rows
    /// waiting behind a head that retries in an hour cost the due query
    /// (run by the writer on every queued batch) no more than none do
    /// (issue 32: it rescanned the backlog, 210 ms per batch at 300,000).
    #[test]
    fn a_held_keys_backlog_costs_the_due_query_nothing() {
        both_ways(|| {
            let (few, few_ops) = due_ids(&mut backlog_fixture(0, true));
            let (many, many_ops) = due_ids(&mut backlog_fixture(100_000, true));
            assert_eq!(few, others());
            assert_eq!(many, others());
            assert!(
                many_ops <= 2 * few_ops + 5_000,
                "due query: {few_ops} VM steps with no backlog, {many_ops} with 100,000 held rows"
            );
            // The same for claims (effectful consumers).
            let claim_ops = |behind| {
                let mut conn = backlog_fixture(behind, true);
                let (rows, ops) = vm_ops(&mut conn, |c| {
                    let due = Due {
                        consumer: "c",
                        order: KeyOrder::DeadReleases,
                        limit: 256,
                        now_ms: NOW,
                        max_attempts: 10,
                    };
                    claim(c, due, NOW + 60_000, 7).unwrap()
                });
                assert_eq!(
                    rows.into_iter().map(|r| r.msg.id).collect::<Vec<_>>(),
                    others()
                );
                ops
            };
            let (few_ops, many_ops) = (claim_ops(0), claim_ops(100_000));
            assert!(
                many_ops <= 2 * few_ops + 5_000,
                "claim: {few_ops} VM steps with no backlog, {many_ops} with 100,000 held rows"
            );
        });
    }

    /// A key whose head is due, with a long backlog behind it, costs the
    /// due query no more than a short one: only its head is a candidate.
    #[test]
    fn a_due_keys_backlog_costs_the_due_query_nothing() {
        both_ways(|| {
            let mut expected = vec!["head".to_owned()];
            expected.extend(others());
            let (few, few_ops) = due_ids(&mut backlog_fixture(1, false));
            let (many, many_ops) = due_ids(&mut backlog_fixture(100_000, false));
            assert_eq!(few, expected);
            assert_eq!(many, expected);
            assert!(
                many_ops <= 2 * few_ops + 5_000,
                "due query: {few_ops} VM steps with 1 row behind the head, {many_ops} with 100,000"
            );
        });
    }

    /// 2,000 rows in each table retention deletes from, stamped 1 to 2,000;
    /// every tenth inbox row dead.
    fn retention_fixture() -> Connection {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch(crate::store::schema::SCHEMA_SQL)
            .unwrap();
        conn.execute_batch(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 2000)
             INSERT INTO postroom_inbox (consumer, source, message_id, status, payload,
                 payload_hash, last_error, received_at, updated_at, processed_at)
             SELECT 'c', 's', 'm' || i, iif(i % 10 = 0, 'dead', 'completed'), x'',
                 zeroblob(32), iif(i % 10 = 0, 'no', NULL), i, i, iif(i % 10 = 0, NULL, i)
             FROM n;
             WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 2000)
             INSERT INTO postroom_outbox (message_id, topic, payload, status, created_at,
                 next_attempt_at, sent_at)
             SELECT 'o' || i, 't', x'', 'sent', i, i, i FROM n;
             WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 2000)
             INSERT INTO postroom_conflicts (consumer, source, message_id, stored_hash,
                 payload_hash, payload, first_seen_at, last_seen_at)
             SELECT 'c', 's', 'm' || i, zeroblob(32), zeroblob(32), x'', i, i FROM n;",
        )
        .unwrap();
        conn
    }
}
