//! Outbox SQL as plain functions over a connection.

use std::sync::atomic::{AtomicU64, Ordering};

use rusqlite::{params, Connection, OptionalExtension, Row};

use crate::message::{Headers, Message, Outgoing};
use crate::store::page::{limit_param, Page};
use crate::store::payload::Payload;
use crate::store::text::{headers_json, parse_headers};

/// Header naming the message that caused an outgoing one.
pub const CAUSATION_HEADER: &str = "causation-id";
/// Header carried along a chain of messages; starts as the first message's id.
pub const CORRELATION_HEADER: &str = "correlation-id";

/// The inbox message that caused a transaction.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cause<'a> {
    pub consumer: &'a str,
    pub msg: &'a Message,
    pub attempt: u32,
    /// `received_at` of the inbox row: the same on every attempt.
    pub received_at: i64,
    /// The inbox row's id: the same on every attempt, and another for a
    /// message received again after retention forgot it (ids are never
    /// given out twice: retention keeps the newest row). For a message
    /// seen for the first time, the id its row will be inserted with.
    pub inbox_id: i64,
}

/// Inserts one pending outbox row and returns its message id.
///
/// Without an explicit id, a message published while handling an inbox
/// message gets `blake3(consumer, source, id, received_at, inbox row id,
/// n)` for the handler's `n`-th publish: the same on every attempt of that
/// inbox row, and unique by construction, since no two inbox rows share an
/// id, so no index checks it. A message received again after retention
/// deleted its row is processed again under a new row, and its outbox rows
/// do not collide with the first processing's, which may still be waiting
/// to be sent. Outside a handler the id is generated (see [`random_id`]),
/// also unchecked. Only an id the application names
/// ([`Outgoing::with_id`]) is checked against the other named ones
/// (`postroom_outbox_named`): a duplicate fails this insert.
pub(crate) fn insert(
    conn: &Connection,
    out: &Outgoing,
    cause: Option<Cause<'_>>,
    index: u32,
    now_ms: i64,
) -> rusqlite::Result<String> {
    let id = match (&out.id, cause) {
        (Some(id), _) => id.clone(),
        (None, Some(c)) => derived_id(c, index),
        (None, None) => random_id(),
    };
    conn.prepare_cached(
        // `head` and `alone` set here (schema.sql): a new head fires no
        // trigger and costs no second write of its row. A keyed head is
        // `alone`, having no other pending row of its key; a row behind one
        // is neither, and the insert trigger clears its head's `alone`.
        // `VALUES`, with the probe written twice (the second finds the
        // first's page cached): `INSERT … SELECT` into a table with
        // triggers makes SQLite stage every row in a temporary table.
        "INSERT INTO postroom_outbox (message_id, topic, key, payload, headers, status, attempts,
             created_at, next_attempt_at, cause_consumer, cause_source, cause_message_id, head,
             alone, named)
         VALUES (?1, ?2, ?3, ?4, ?5, 'pending', 0, ?6, 0, ?7, ?8, ?9,
                 ?3 IS NULL OR NOT EXISTS (SELECT 1 FROM postroom_outbox
                                           WHERE key = ?3 AND status = 'pending'),
                 ?3 IS NOT NULL AND NOT EXISTS (SELECT 1 FROM postroom_outbox
                                                WHERE key = ?3 AND status = 'pending'),
                 ?10)",
    )?
    .execute(params![
        id,
        out.topic,
        out.key,
        out.payload,
        headers_json(&out.headers),
        now_ms,
        cause.map(|c| c.consumer),
        cause.map(|c| c.msg.source.as_str()),
        cause.map(|c| c.msg.id.as_str()),
        out.id.is_some(),
    ])?;
    Ok(id)
}

/// Adds the headers linking an outgoing message to the inbox message that
/// caused it, unless the handler set them: `causation-id` (that message's
/// id) and `correlation-id` (carried along from it, or started as its id).
pub(crate) fn add_causation(headers: &mut Headers, cause: Option<Cause<'_>>) {
    let Some(c) = cause else { return };
    headers
        .entry(CAUSATION_HEADER.to_owned())
        .or_insert_with(|| c.msg.id.clone());
    let correlation = c.msg.header(CORRELATION_HEADER).unwrap_or(&c.msg.id);
    headers
        .entry(CORRELATION_HEADER.to_owned())
        .or_insert_with(|| correlation.to_owned());
}

/// The id of the `index`-th publish of the inbox row `c` names. The
/// bytes after the key are 20 long (`received_at`, the row id, `index`),
/// where releases before schema 12 hashed 12 or 16 (without the row id):
/// no id derived now can equal one derived then.
fn derived_id(c: Cause<'_>, index: u32) -> String {
    let mut extra = [0u8; 20];
    extra[..8].copy_from_slice(&c.received_at.to_le_bytes());
    extra[8..16].copy_from_slice(&c.inbox_id.to_le_bytes());
    extra[16..].copy_from_slice(&index.to_le_bytes());
    digest_hex(
        b"postroom-outbox\0",
        &[c.consumer, &c.msg.source, &c.msg.id],
        &extra,
    )
}

/// 128 bits of `blake3(domain, parts…, extra)` as 32 hex digits. Parts are
/// length-prefixed, so `("a/b", "c")` and `("a", "b/c")` differ.
pub(crate) fn digest_hex(domain: &[u8], parts: &[&str], extra: &[u8]) -> String {
    let mut h = blake3::Hasher::new();
    h.update(domain);
    for part in parts {
        h.update(&(part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    h.update(extra);
    hex32(h.finalize().as_bytes())
}

/// An id for a message published outside a handler: 128 bits of blake3
/// over 64 random bits drawn once per process (std's `RandomState`, seeded
/// by the OS), the process id, the time in nanoseconds and a counter of
/// this process. Two ids of one process differ in the counter; two
/// processes never write one file at once (the engine's lock), and differ
/// in their random bits besides the time.
fn random_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    static PROCESS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let process = *PROCESS.get_or_init(|| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.finish()
    });
    let mut h = blake3::Hasher::new();
    h.update(b"postroom-outbox-random\0");
    h.update(&process.to_le_bytes());
    h.update(&std::process::id().to_le_bytes());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    h.update(&nanos.to_le_bytes());
    h.update(&COUNTER.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    hex32(h.finalize().as_bytes())
}

/// The first 16 bytes as 32 lowercase hex digits: 128 bits, plenty for ids.
fn hex32(bytes: &[u8; 32]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(32);
    for b in &bytes[..16] {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// The sequence stream [`InboxSink`](crate::InboxSink) files an upstream's outbox `seq`
/// under: `outbox:` and the upstream's instance id
/// ([`OutboxMessage::origin`]).
pub fn outbox_stream(origin: &str) -> String {
    format!("outbox:{origin}")
}

/// An outbox row as the relay hands it to a [`Sink`](crate::Sink).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct OutboxMessage {
    /// Commit order: rows of one key are handed over in increasing `seq`.
    pub seq: i64,
    /// Stable message id, the same on every re-send: what a downstream
    /// inbox deduplicates on.
    pub id: String,
    /// The topic it was published to.
    pub topic: String,
    /// The ordering key, if any.
    pub key: Option<String>,
    /// The payload bytes.
    pub payload: Vec<u8>,
    /// Headers, including `causation-id` and `correlation-id` for messages
    /// published by a handler.
    pub headers: Headers,
    /// Hand-overs that failed before this one.
    pub attempts: u32,
    /// When it was committed (unix ms).
    pub created_at: i64,
    /// Why it last failed, for dead or retried rows.
    pub last_error: Option<String>,
    /// The instance id of the database whose outbox holds it (made when
    /// the file is created, kept by a copy): `seq` numbers messages within
    /// it. A downstream postroom uses it as the sequence stream of `seq`
    /// ([`InboxSink`](crate::InboxSink) does), so that it keeps one
    /// watermark per upstream database.
    pub origin: String,
    /// Every `seq` of `origin` below this one has been handed over
    /// (`sent`, or discarded by an operator) when the batch was read:
    /// none is pending or dead. [`InboxSink`](crate::InboxSink) starts a
    /// downstream stream it is the first to number there, so that an
    /// upstream with history does not leave the downstream watermark
    /// waiting at 1 for rows handed over before.
    pub unsettled_from: i64,
}

/// The columns [`from_row`] reads. The last two are the database's
/// instance id and the lowest `seq` still pending or dead, each through
/// its own index (uncorrelated subqueries: SQLite reads them once per
/// statement; the lowest pending row is always a head). Named with
/// `INDEXED BY`, as in [`fetch_due`]: see there why.
const COLUMNS: &str =
    "seq, message_id, topic, key, payload, headers, attempts, created_at, last_error,
     coalesce((SELECT value FROM postroom_meta WHERE key = 'instance_id'), ''),
     min(coalesce((SELECT min(seq) FROM postroom_outbox INDEXED BY postroom_outbox_ready
                   WHERE status = 'pending' AND head = 1),
                  9223372036854775807),
         coalesce((SELECT min(seq) FROM postroom_outbox INDEXED BY postroom_outbox_dead
                   WHERE status = 'dead'),
                  9223372036854775807))";

/// A row as stored, with the first column that did not decode (read
/// lossily, see [`crate::store::text::stored_text`]).
fn from_row(r: &Row<'_>) -> rusqlite::Result<(OutboxMessage, Option<&'static str>)> {
    let mut damage = None;
    let mut text = |idx, column| crate::store::text::stored_text(r, idx, column, &mut damage);
    let msg = OutboxMessage {
        seq: r.get(0)?,
        id: text(1, "message_id")?.unwrap_or_default(),
        topic: text(2, "topic")?.unwrap_or_default(),
        key: text(3, "key")?,
        payload: crate::store::text::stored_bytes(r, 4)?.unwrap_or_default(),
        headers: text(5, "headers")?
            .and_then(|h| serde_json::from_str(&h).ok())
            .unwrap_or_default(),
        attempts: r.get(6)?,
        created_at: r.get(7)?,
        last_error: crate::store::text::lossy_text(r, 8)?,
        origin: crate::store::text::lossy_text(r, 9)?.unwrap_or_default(),
        unsettled_from: r.get(10)?,
    };
    Ok((msg, damage))
}

/// Due pending rows in commit order, at most `limit`, skipping any row
/// whose key has an earlier pending row still waiting out a backoff; each
/// with the first column that did not decode, if one did not.
///
/// O(limit) whatever a key's backlog (issue 32), in one statement (one
/// snapshot): the first `limit` due heads in commit order
/// (`postroom_outbox_ready`: a row without a key, or a key's lowest
/// pending row; a key held back by its head costs one row, however many
/// wait behind it), a head without a key as it is, a keyed head with its
/// key's rows read from it up to `limit` of them and stopped before the
/// first one still waiting (`postroom_outbox_waiting`). A keyed head
/// marked `alone` has no row behind it: it is taken as it is, like a head
/// without a key, and its key's rows are not read (schema version 10: the
/// probes cost a random page each, read again after every commit of
/// another connection). No row of the first `limit` due rows is missed: a
/// row's head is due and comes no later than the row, so the heads before
/// it are due rows before it.
///
/// The heads are read `INDEXED BY postroom_outbox_ready`: statistics
/// taken while every row was pending (`PRAGMA optimize` when an engine
/// shuts down with a backlog) tell SQLite the index holds the whole table,
/// and it then scans the table from its first row instead, through every
/// row sent since, on every batch: a drain quadratic in its backlog. The
/// engine refuses a file missing the index, so naming it cannot fail.
pub(crate) fn fetch_due(
    conn: &Connection,
    now_ms: i64,
    limit: usize,
) -> rusqlite::Result<Vec<(OutboxMessage, Option<&'static str>)>> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {COLUMNS} FROM postroom_outbox r WHERE r.seq IN (
             SELECT seq FROM (
                 SELECT seq, key, alone FROM postroom_outbox INDEXED BY postroom_outbox_ready
                 WHERE status = 'pending' AND head = 1 AND next_attempt_at <= ?1
                 ORDER BY seq LIMIT ?2)
             WHERE key IS NULL OR alone = 1
             UNION ALL
             SELECT o.seq FROM (
                 SELECT seq, key, alone FROM postroom_outbox INDEXED BY postroom_outbox_ready
                 WHERE status = 'pending' AND head = 1 AND next_attempt_at <= ?1
                 ORDER BY seq LIMIT ?2) k
             JOIN postroom_outbox o ON k.alone = 0 AND o.key = k.key AND o.status = 'pending'
             WHERE o.seq <= coalesce(
                     (SELECT seq FROM postroom_outbox
                      WHERE key = k.key AND status = 'pending'
                      ORDER BY seq LIMIT 1 OFFSET ?2 - 1),
                     9223372036854775807)
               AND o.seq < coalesce(
                     (SELECT min(seq) FROM postroom_outbox
                      WHERE key = k.key AND status = 'pending' AND next_attempt_at > 0
                        AND next_attempt_at > ?1),
                     9223372036854775807))
         ORDER BY r.seq LIMIT ?2"
    ))?;
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let rows = stmt.query_map(params![now_ms, limit], from_row)?;
    rows.collect()
}

pub(crate) fn mark_sent(conn: &Connection, seq: i64, now_ms: i64) -> rusqlite::Result<bool> {
    let marked = conn
        .prepare_cached(
            "UPDATE postroom_outbox SET status = 'sent', sent_at = ?2, attempts = attempts + 1
             WHERE seq = ?1 AND status = 'pending'",
        )?
        .execute(params![seq, now_ms])?;
    Ok(marked == 1)
}

/// Counts a failed hand-over: retried at `next_attempt_at`, or dead when
/// it was the last attempt (or `dead` is set). True when it is now dead.
pub(crate) fn mark_failed(
    conn: &Connection,
    seq: i64,
    error: &str,
    next_attempt_at: i64,
    max_attempts: u32,
    dead: bool,
) -> rusqlite::Result<bool> {
    let status: Option<String> = conn
        .prepare_cached(
            "UPDATE postroom_outbox
             SET attempts = attempts + 1, last_error = ?2, next_attempt_at = ?3,
                 status = CASE WHEN ?5 OR attempts + 1 >= ?4 THEN 'dead' ELSE 'pending' END
             WHERE seq = ?1 AND status = 'pending'
             RETURNING status",
        )?
        .query_row(
            params![seq, error, next_attempt_at, max_attempts, dead],
            |r| r.get(0),
        )
        .optional()?;
    Ok(status.as_deref() == Some("dead"))
}

/// Puts a pending row off until `next_attempt_at` without counting an
/// attempt: its destination was unreachable (`SendResult::Unavailable`).
pub(crate) fn mark_unavailable(
    conn: &Connection,
    seq: i64,
    error: &str,
    next_attempt_at: i64,
) -> rusqlite::Result<()> {
    conn.prepare_cached(
        "UPDATE postroom_outbox SET last_error = ?2, next_attempt_at = ?3
         WHERE seq = ?1 AND status = 'pending'",
    )?
    .execute(params![seq, error, next_attempt_at])?;
    Ok(())
}

/// Retention's delete of rows sent before the cutoff, never the newest row
/// (see `queue::DELETE_DEAD`, and for the unary `+`): a `seq` is never
/// given out twice by retention.
pub(crate) const DELETE_SENT: &str = "DELETE FROM postroom_outbox WHERE seq IN (
     SELECT seq FROM postroom_outbox WHERE status = 'sent' AND sent_at < ?1
       AND +seq < (SELECT max(seq) FROM postroom_outbox) LIMIT ?2)";

/// Found through `postroom_outbox_dead`, in its order.
pub(crate) fn dead_letters_sql() -> String {
    format!("SELECT {COLUMNS} FROM postroom_outbox WHERE status = 'dead' ORDER BY seq LIMIT ?1")
}

/// Dead outbox rows, oldest first.
pub(crate) fn dead_letters(
    conn: &Connection,
    limit: usize,
) -> rusqlite::Result<Vec<OutboxMessage>> {
    let mut stmt = conn.prepare_cached(&dead_letters_sql())?;
    let rows = stmt.query_map([i64::try_from(limit).unwrap_or(i64::MAX)], |r| {
        from_row(r).map(|(msg, _)| msg)
    })?;
    rows.collect()
}

/// Sends a dead outbox row back to the relay, attempts reset, due at once
/// (`next_attempt_at` 0, see schema.sql).
pub(crate) fn redrive(conn: &Connection, seq: i64) -> rusqlite::Result<bool> {
    let n = conn
        .prepare_cached(
            "UPDATE postroom_outbox SET status = 'pending', attempts = 0, next_attempt_at = 0
             WHERE seq = ?1 AND status = 'dead'",
        )?
        .execute([seq])?;
    Ok(n == 1)
}

/// Gives up on a dead outbox row: it becomes `sent` without being handed
/// over (payload dropped, the reason kept in `last_error`), and retention
/// removes it like any sent row. Deleting it at once could give its `seq`
/// out again when it is the newest row (see [`DELETE_SENT`]). Returns false
/// when `seq` is not a dead outbox row.
pub(crate) fn discard(conn: &Connection, seq: i64, now_ms: i64) -> rusqlite::Result<bool> {
    let n = conn
        .prepare_cached(
            "UPDATE postroom_outbox
             SET status = 'sent', payload = x'', sent_at = ?2, next_attempt_at = ?2,
                 last_error = 'discarded by operator; last error: ' || coalesce(last_error, '')
             WHERE seq = ?1 AND status = 'dead'",
        )?
        .execute(params![seq, now_ms])?;
    Ok(n == 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::queue::tests::{both_ways, vm_ops, with_statistics_if_asked};

    const NOW: i64 = 1_000_000_000;

    /// The head of key `doc-1` (pending, retried in an hour when `held`,
    /// else due), `behind` pending rows of `doc-1` behind it, then one row
    /// of each of keys `k0`..`k9` and ten rows without a key, all due.
    fn backlog_fixture(behind: usize, held: bool) -> Connection {
        with_statistics_if_asked(backlog_rows(behind, held))
    }

    fn backlog_rows(behind: usize, held: bool) -> Connection {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch(crate::store::schema::SCHEMA_SQL)
            .unwrap();
        conn.execute(
            "INSERT INTO postroom_outbox (message_id, topic, key, payload, status, attempts,
                 created_at, next_attempt_at)
             VALUES ('head', 't', 'doc-1', x'', 'pending', ?1, 1, ?2)",
            params![i64::from(held), if held { NOW + 3_600_000 } else { 0 }],
        )
        .unwrap();
        conn.execute(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1)
             INSERT INTO postroom_outbox (message_id, topic, key, payload, status, created_at,
                 next_attempt_at)
             SELECT 'b' || i, 't', 'doc-1', x'', 'pending', 2, 0 FROM n WHERE ?1 > 0",
            [behind as i64],
        )
        .unwrap();
        conn.execute_batch(
            "WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < 19)
             INSERT INTO postroom_outbox (message_id, topic, key, payload, status, created_at,
                 next_attempt_at)
             SELECT 'o' || i, 't', iif(i < 10, 'k' || i, NULL), x'', 'pending', 3, 0 FROM n",
        )
        .unwrap();
        conn
    }

    /// Ids `fetch_due` returns (at most `limit`), in its order, and the VM
    /// instructions it took.
    fn due_ids(conn: &mut Connection, limit: usize) -> (Vec<String>, u64) {
        let (rows, ops) = vm_ops(conn, |c| fetch_due(c, NOW, limit).unwrap());
        (rows.into_iter().map(|(m, _)| m.id).collect(), ops)
    }

    fn others() -> Vec<String> {
        (0..20).map(|i| format!("o{i}")).collect()
    }

    /// The relay's due query is O(1) in a held key's backlog: 100,000 rows
    /// behind a head whose destination is unavailable for an hour cost it
    /// no more than none do (issue 32: another key's row waited 185–342
    /// ms at 300,000).
    #[test]
    fn a_held_keys_backlog_costs_the_relay_query_nothing() {
        both_ways(|| {
            let (few, few_ops) = due_ids(&mut backlog_fixture(0, true), 256);
            let (many, many_ops) = due_ids(&mut backlog_fixture(100_000, true), 256);
            assert_eq!(few, others());
            assert_eq!(many, others());
            assert!(
                many_ops <= 2 * few_ops + 5_000,
                "relay query: {few_ops} VM steps with no backlog, {many_ops} with 100,000 held rows"
            );
        });
    }

    /// A due key with a long backlog: a batch takes its rows in order, up
    /// to the limit, at a cost that does not grow with the backlog.
    #[test]
    fn a_due_keys_backlog_is_read_a_batch_at_a_time() {
        both_ways(|| {
            let (few, few_ops) = due_ids(&mut backlog_fixture(300, false), 256);
            let (many, many_ops) = due_ids(&mut backlog_fixture(100_000, false), 256);
            let mut expected = vec!["head".to_owned()];
            expected.extend((1..256).map(|i| format!("b{i}")));
            assert_eq!(few, expected);
            assert_eq!(many, expected);
            assert!(
                many_ops <= 2 * few_ops + 5_000,
                "relay query: {few_ops} VM steps with 300 rows of the key, {many_ops} with 100,000"
            );
        });
    }

    /// A row of a key waiting out a backoff behind a due head holds back
    /// the rows after it, not those before; other keys go on.
    #[test]
    fn a_waiting_row_behind_a_due_head_holds_back_only_what_follows_it() {
        both_ways(|| {
            let mut conn = backlog_fixture(5, false);
            conn.execute(
                "UPDATE postroom_outbox SET next_attempt_at = ?1, attempts = 1 WHERE message_id = 'b3'",
                [NOW + 1],
            )
            .unwrap();
            let (ids, _) = due_ids(&mut conn, 256);
            let mut expected: Vec<String> = ["head", "b1", "b2"].map(String::from).to_vec();
            expected.extend(others());
            assert_eq!(ids, expected);
        });
    }

    /// Stores `id` as the engine does (no cause: its id given).
    fn publish(conn: &Connection, id: &str, key: Option<&str>) {
        let mut out = Outgoing::new("t", id.as_bytes().to_vec()).with_id(id);
        if let Some(key) = key {
            out = out.with_key(key);
        }
        insert(conn, &out, None, 0, NOW).unwrap();
    }

    /// Pending rows marked `alone`, by id, and what `postroom check` finds
    /// wrong with the marks.
    fn alone(conn: &Connection) -> (Vec<String>, Vec<String>) {
        let marked = conn
            .prepare(
                "SELECT message_id FROM postroom_outbox
                 WHERE alone = 1 AND status = 'pending' ORDER BY seq",
            )
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        let mut wrong = Vec::new();
        crate::store::schema::alone_mismatches(conn, |key, seq| wrong.push(format!("{key}/{seq}")))
            .unwrap();
        (marked, wrong)
    }

    fn set(conn: &Connection, sql: &str) {
        assert_eq!(conn.execute(sql, []).unwrap(), 1, "{sql}");
    }

    /// A keyed head the engine stores with no other pending row of its key
    /// is `alone` until a row of its key is stored or comes back behind it
    /// or is moved behind it; a row that becomes a head later never is.
    /// Whatever the marks, the relay's batches hold the same rows in the
    /// same order.
    #[test]
    fn a_lone_head_is_marked_until_its_key_has_another_pending_row() {
        let mut conn = Connection::open_in_memory().unwrap();
        conn.execute_batch(crate::store::schema::SCHEMA_SQL)
            .unwrap();
        publish(&conn, "a1", Some("a"));
        publish(&conn, "b1", Some("b"));
        publish(&conn, "n1", None);
        publish(&conn, "c1", Some("c"));
        assert_eq!(
            alone(&conn),
            (vec!["a1".into(), "b1".into(), "c1".into()], vec![])
        );
        let all = |conn: &mut Connection| due_ids(conn, 100).0;
        assert_eq!(all(&mut conn), ["a1", "b1", "n1", "c1"]);

        publish(&conn, "a2", Some("a")); // stored behind a lone head
        assert_eq!(alone(&conn), (vec!["b1".into(), "c1".into()], vec![]));
        assert_eq!(all(&mut conn), ["a1", "b1", "n1", "c1", "a2"]);

        set(
            &conn,
            "UPDATE postroom_outbox SET status = 'sent' WHERE message_id = 'a1'",
        );
        // a2 is the head now, found by the trigger: not marked.
        assert_eq!(alone(&conn), (vec!["b1".into(), "c1".into()], vec![]));
        assert_eq!(all(&mut conn), ["b1", "n1", "c1", "a2"]);

        set(
            &conn,
            "UPDATE postroom_outbox SET status = 'dead' WHERE message_id = 'b1'",
        );
        publish(&conn, "b2", Some("b")); // the only pending row of b: alone
        set(
            &conn,
            "UPDATE postroom_outbox SET status = 'pending' WHERE message_id = 'b1'",
        );
        // b1 redriven: the head again, before b2, and neither is alone.
        assert_eq!(alone(&conn), (vec!["c1".into()], vec![]));
        assert_eq!(all(&mut conn), ["b1", "n1", "c1", "a2", "b2"]);

        publish(&conn, "d1", Some("d"));
        set(
            &conn,
            "UPDATE postroom_outbox SET key = 'c' WHERE message_id = 'd1'",
        );
        // Moved behind c1 by hand: c1 is not alone any more.
        assert_eq!(alone(&conn), (vec![], vec![]));
        assert_eq!(all(&mut conn), ["b1", "n1", "c1", "a2", "b2", "d1"]);

        // A mark a hand edit left on a row behind a head never comes into
        // force: the row is promoted unmarked.
        publish(&conn, "e1", Some("e"));
        set(
            &conn,
            "UPDATE postroom_outbox SET alone = 0 WHERE message_id = 'e1'",
        );
        conn.execute(
            "INSERT INTO postroom_outbox (message_id, topic, key, payload, status, created_at,
                 next_attempt_at, alone)
             VALUES ('e2', 't', 'e', x'', 'pending', 1, 0, 1)",
            [],
        )
        .unwrap();
        set(
            &conn,
            "UPDATE postroom_outbox SET status = 'sent' WHERE message_id = 'e1'",
        );
        assert_eq!(alone(&conn).0, Vec::<String>::new());
        set(
            &conn,
            "UPDATE postroom_outbox SET status = 'sent' WHERE message_id = 'e2'",
        );

        // A mark set by hand where it is wrong: `postroom check` names it,
        // and the relay still never hands a row over before its head.
        set(
            &conn,
            "UPDATE postroom_outbox SET alone = 1 WHERE message_id = 'c1'",
        );
        let c1: i64 = conn
            .query_row(
                "SELECT seq FROM postroom_outbox WHERE message_id = 'c1'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(alone(&conn), (vec!["c1".into()], vec![format!("c/{c1}")]));
        assert_eq!(all(&mut conn), ["b1", "n1", "c1", "a2", "b2"]);
    }

    /// `n` rows of keys of their own stored as the engine stores them,
    /// then statistics taken (`PRAGMA optimize` at shutdown runs ANALYZE)
    /// while all were pending, then all but the last `left` sent.
    fn drained_after_statistics(n: usize, left: usize) -> Connection {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch(crate::store::schema::SCHEMA_SQL)
            .unwrap();
        for i in 0..n {
            publish(&conn, &format!("m{i}"), Some(&format!("k{i}")));
        }
        conn.execute_batch("ANALYZE").unwrap();
        conn.execute(
            "UPDATE postroom_outbox SET status = 'sent', sent_at = 1
             WHERE seq <= (SELECT max(seq) FROM postroom_outbox) - ?1",
            [left as i64],
        )
        .unwrap();
        conn
    }

    /// Statistics taken while the whole outbox was pending (a relay that
    /// shut down with a backlog) say the heads' index holds every row: the
    /// relay's statements must still read heads through it, not scan the
    /// table from its first row, past every row sent since (the relay
    /// drain fell to 0.65x its floor: each batch read the whole table).
    #[test]
    fn the_relay_reads_heads_through_their_index_whatever_the_statistics() {
        let (_, fresh_ops) = due_ids(&mut drained_after_statistics(100, 100), 100);
        let mut drained = drained_after_statistics(5_000, 100);
        let (ids, ops) = due_ids(&mut drained, 100);
        let expected: Vec<String> = (4_900..5_000).map(|i| format!("m{i}")).collect();
        assert_eq!(ids, expected);
        assert!(
            ops <= 2 * fresh_ops,
            "relay query: {fresh_ops} VM steps for 100 pending rows, {ops} after 4,900 sent"
        );
        let (_, fresh_ops) = vm_ops(&mut drained_after_statistics(100, 100), |c| {
            crate::store::due::outbox(c, NOW).unwrap()
        });
        let (_, ops) = vm_ops(&mut drained, |c| crate::store::due::outbox(c, NOW).unwrap());
        assert!(
            ops <= 2 * fresh_ops,
            "relay's next due time: {fresh_ops} VM steps for 100 pending rows, {ops} after 4,900 sent"
        );
    }

    /// A lone head costs the relay's query no read of its key's rows:
    /// 100 heads of their own keys take a third fewer VM steps marked than
    /// unmarked (the marks cleared, as on a file migrated from version 9;
    /// 6,706 against 11,130 when written).
    #[test]
    fn lone_heads_are_read_without_their_keys_rows() {
        let mut conn = Connection::open_in_memory().unwrap();
        conn.execute_batch(crate::store::schema::SCHEMA_SQL)
            .unwrap();
        for i in 0..200 {
            publish(&conn, &format!("m{i}"), Some(&format!("k{i}")));
        }
        let (marked, marked_ops) = due_ids(&mut conn, 100);
        conn.execute("UPDATE postroom_outbox SET alone = 0", [])
            .unwrap();
        let (unmarked, unmarked_ops) = due_ids(&mut conn, 100);
        let expected: Vec<String> = (0..100).map(|i| format!("m{i}")).collect();
        assert_eq!(marked, expected);
        assert_eq!(unmarked, expected);
        assert!(
            marked_ops * 3 < unmarked_ops * 2,
            "relay query: {marked_ops} VM steps with lone heads, {unmarked_ops} without the marks"
        );
    }
}

// The operator's view: listing and showing outbox rows.

/// An outbox row's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OutboxState {
    /// Waiting for the relay (possibly backing off after a failed send).
    Pending,
    /// Handed to the sink (or discarded by an operator).
    Sent,
    /// Out of attempts or refused by the sink: the relay skips it.
    Dead,
}

impl OutboxState {
    /// The name stored in the database.
    pub fn as_str(self) -> &'static str {
        match self {
            OutboxState::Pending => "pending",
            OutboxState::Sent => "sent",
            OutboxState::Dead => "dead",
        }
    }
}

impl std::fmt::Display for OutboxState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for OutboxState {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        [OutboxState::Pending, OutboxState::Sent, OutboxState::Dead]
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| format!("unknown outbox status {s:?} (pending, sent or dead)"))
    }
}

impl rusqlite::types::FromSql for OutboxState {
    fn column_result(value: rusqlite::types::ValueRef<'_>) -> rusqlite::types::FromSqlResult<Self> {
        value
            .as_str()?
            .parse()
            .map_err(|e: String| rusqlite::types::FromSqlError::Other(e.into()))
    }
}

/// Which outbox rows [`outbox_list`](crate::admin::outbox_list) returns. Every filter is optional.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutboxFilter {
    /// Only rows in this state.
    pub status: Option<OutboxState>,
    /// Only this topic.
    pub topic: Option<String>,
    /// Only this ordering key.
    pub key: Option<String>,
    /// Only rows committed at or after this time (unix ms).
    pub since_ms: Option<i64>,
    /// Only rows committed before this time (unix ms).
    pub until_ms: Option<i64>,
    /// Where a page starts (by `seq`).
    pub page: Page,
}

/// An outbox row without its payload, from [`outbox_list`](crate::admin::outbox_list).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct OutboxEntry {
    /// Commit order; what `outbox show` and `dead redrive --outbox` take.
    pub seq: i64,
    /// The stable message id a downstream deduplicates on.
    pub message_id: String,
    /// The topic.
    pub topic: String,
    /// The ordering key, if any.
    pub key: Option<String>,
    /// Its state.
    pub status: OutboxState,
    /// Hand-overs that failed (sent rows: plus the one that succeeded).
    pub attempts: u32,
    /// Payload size in bytes.
    pub payload_bytes: u64,
    /// Why it last failed.
    pub last_error: Option<String>,
    /// When it was committed (unix ms).
    pub created_at: i64,
    /// When a pending row is next tried: `None` when due now.
    pub next_attempt_at: Option<i64>,
    /// When it was sent.
    pub sent_at: Option<i64>,
    /// The inbox message whose handler published it: consumer, source and
    /// message id.
    pub caused_by: Option<[String; 3]>,
}

const OUTBOX_COLUMNS: &str = "seq, message_id, topic, key, status, attempts, length(payload),
     last_error, created_at, next_attempt_at, sent_at, cause_consumer, cause_source,
     cause_message_id";

fn outbox_entry_from_row(r: &rusqlite::Row<'_>, now: i64) -> rusqlite::Result<OutboxEntry> {
    let text = |idx| crate::store::text::lossy_text(r, idx).map(Option::unwrap_or_default);
    let status: OutboxState = r.get(4)?;
    let next: i64 = r.get(9)?;
    let cause = (
        crate::store::text::lossy_text(r, 11)?,
        crate::store::text::lossy_text(r, 12)?,
        crate::store::text::lossy_text(r, 13)?,
    );
    Ok(OutboxEntry {
        seq: r.get(0)?,
        message_id: text(1)?,
        topic: text(2)?,
        key: crate::store::text::lossy_text(r, 3)?,
        status,
        attempts: r.get(5)?,
        payload_bytes: u64::try_from(r.get::<_, i64>(6)?).unwrap_or(0),
        last_error: crate::store::text::lossy_text(r, 7)?,
        created_at: r.get(8)?,
        next_attempt_at: (status == OutboxState::Pending && next > now).then_some(next),
        sent_at: r.get(10)?,
        caused_by: match cause {
            (Some(c), Some(s), Some(m)) => Some([c, s, m]),
            _ => None,
        },
    })
}

/// Outbox rows matching `filter`, one [`Page`] of them (newest first by
/// default).
pub(crate) fn list(
    conn: &Connection,
    filter: &OutboxFilter,
    now: i64,
) -> rusqlite::Result<Vec<OutboxEntry>> {
    let (after, order) = filter.page.sql("seq", 7, 6);
    let mut stmt = conn.prepare(&format!(
        "SELECT {OUTBOX_COLUMNS} FROM postroom_outbox
             WHERE (?1 IS NULL OR status = ?1) AND (?2 IS NULL OR topic = ?2)
               AND (?3 IS NULL OR key = ?3) AND (?4 IS NULL OR created_at >= ?4)
               AND (?5 IS NULL OR created_at < ?5) AND {after}
             {order}"
    ))?;
    let rows = stmt.query_map(
        params![
            filter.status.map(OutboxState::as_str),
            filter.topic,
            filter.key,
            filter.since_ms,
            filter.until_ms,
            limit_param(filter.page.limit),
            filter.page.after,
        ],
        |r| outbox_entry_from_row(r, now),
    )?;
    rows.collect::<rusqlite::Result<_>>()
}

/// One outbox row in full, from [`outbox_show`](crate::admin::outbox_show).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct OutboxDetail {
    /// Everything [`outbox_list`](crate::admin::outbox_list) shows.
    #[serde(flatten)]
    pub entry: OutboxEntry,
    /// The headers.
    pub headers: Headers,
    /// The payload (empty once discarded).
    pub payload: Payload,
    /// For a pending row with a key: the earlier pending row of its key
    /// that holds it back while that row waits out a backoff (the relay
    /// hands a key's rows over in `seq` order). `None` when nothing holds
    /// it back.
    pub held_back_by: Option<OutboxEntry>,
    /// Pending rows of the same key after this one, which it holds back
    /// while it waits out a backoff.
    pub holding_back: u64,
}

/// The outbox row `seq` in full, with what holds it back; `None` when
/// there is none. Several reads: the caller runs it in one snapshot.
pub(crate) fn show(
    conn: &Connection,
    seq: i64,
    now: i64,
) -> rusqlite::Result<Option<OutboxDetail>> {
    let found = conn
        .query_row(
            &format!(
                "SELECT {OUTBOX_COLUMNS}, headers, payload FROM postroom_outbox WHERE seq = ?1"
            ),
            [seq],
            |r| {
                let headers = crate::store::text::lossy_text(r, 14)?;
                Ok(OutboxDetail {
                    entry: outbox_entry_from_row(r, now)?,
                    headers: parse_headers(headers.as_deref()),
                    payload: Payload(crate::store::text::stored_bytes(r, 15)?.unwrap_or_default()),
                    held_back_by: None,
                    holding_back: 0,
                })
            },
        )
        .optional()?;
    let Some(mut detail) = found else {
        return Ok(None);
    };
    let (Some(key), OutboxState::Pending) = (&detail.entry.key, detail.entry.status) else {
        return Ok(Some(detail));
    };
    // The relay's own rule (outbox::fetch_due): held back while an
    // earlier pending row of the key is not yet due.
    detail.held_back_by = conn
        .query_row(
            &format!(
                "SELECT {OUTBOX_COLUMNS} FROM postroom_outbox
                     WHERE key = ?1 AND seq < ?2 AND status = 'pending' AND next_attempt_at > ?3
                     ORDER BY seq LIMIT 1"
            ),
            params![key, seq, now],
            |r| outbox_entry_from_row(r, now),
        )
        .optional()?;
    if detail.entry.next_attempt_at.is_some() {
        let n: i64 = conn.query_row(
            "SELECT count(*) FROM postroom_outbox
                     WHERE key = ?1 AND seq > ?2 AND status = 'pending'",
            params![key, seq],
            |r| r.get(0),
        )?;
        detail.holding_back = u64::try_from(n).unwrap_or(0);
    }
    Ok(Some(detail))
}

/// `seq`s of the dead outbox rows whose last error contains
/// `error_contains` (or any) and that were committed within
/// `[since, until)` (either end open), one [`Page`] of them.
pub(crate) fn dead_seqs(
    conn: &Connection,
    error_contains: Option<&str>,
    (since_ms, until_ms): (Option<i64>, Option<i64>),
    page: Page,
) -> rusqlite::Result<Vec<i64>> {
    let (after, order) = page.sql("seq", 5, 4);
    let mut stmt = conn.prepare(&format!(
        "SELECT seq FROM postroom_outbox
         WHERE status = 'dead' AND (?1 IS NULL OR instr(last_error, ?1) > 0)
           AND (?2 IS NULL OR created_at >= ?2) AND (?3 IS NULL OR created_at < ?3)
           AND {after}
         {order}"
    ))?;
    let rows = stmt.query_map(
        params![
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
