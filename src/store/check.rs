//! The reads `postroom check` (`admin::check`) is built on: SQLite's own
//! integrity check, and every row the engine's invariants speak about,
//! handed to the caller one at a time; and whether a file has postroom's
//! tables at all (what `admin`'s open checks first). Invariant: read-only,
//! and nothing here judges: the caller decides what is a violation, what a
//! warning.

use rusqlite::{Connection, OptionalExtension};

use crate::store::inbox::Status;
use crate::store::schema;
use crate::store::text::stored_bytes;
use crate::store::watermark::{MAX_LISTED_SEQUENCES, MAX_SETTLED_RUNS};

/// `PRAGMA integrity_check` (`full`) or `quick_check`, at most 100 lines;
/// `["ok"]` when the file is sound.
pub(crate) fn integrity(conn: &Connection, full: bool) -> rusqlite::Result<Vec<String>> {
    let pragma = if full {
        "integrity_check"
    } else {
        "quick_check"
    };
    let mut stmt = conn.prepare(&format!("PRAGMA {pragma}(100)"))?;
    let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
    rows.collect()
}

/// A break of a sequence watermark invariant (docs/DESIGN.md "Sequence
/// watermarks").
pub(crate) struct WatermarkBreak {
    /// A violation, rather than a warning (a row the watermark passed
    /// while it had not settled: a redriven dead letter, say).
    pub violation: bool,
    /// The table it is about.
    pub table: &'static str,
    pub consumer: String,
    pub stream: String,
    /// What is wrong, in words.
    pub what: String,
}

/// Each watermark query: (SQL returning consumer, stream, what; a violation).
const WATERMARK_CHECKS: [(&str, bool); 8] = [
    (
        "SELECT consumer, stream, 'settled_below is ' || settled_below || ', below 1'
         FROM postroom_watermarks WHERE settled_below < 1 OR unrecorded < 0",
        true,
    ),
    (
        "SELECT s.consumer, s.stream,
                'sequence ' || s.seq || ' is listed, but its stream has no watermark'
         FROM postroom_watermark_settled s
         WHERE NOT EXISTS (SELECT 1 FROM postroom_watermarks w
                           WHERE w.consumer = s.consumer AND w.stream = s.stream)",
        true,
    ),
    (
        "SELECT s.consumer, s.stream,
                'sequence ' || s.seq || ' is listed, but the watermark is '
                || (w.settled_below - 1) || CASE WHEN s.seq = w.settled_below
                THEN ' (it should have moved past it)' ELSE ' (above it)' END
         FROM postroom_watermark_settled s
         JOIN postroom_watermarks w ON w.consumer = s.consumer AND w.stream = s.stream
         WHERE s.seq <= w.settled_below",
        true,
    ),
    (
        "SELECT s.consumer, s.stream,
                'sequence ' || max(s.seq) || ' is listed, above the highest stored, '
                || coalesce(w.highest, 'none')
         FROM postroom_watermark_settled s
         JOIN postroom_watermarks w ON w.consumer = s.consumer AND w.stream = s.stream
         GROUP BY s.consumer, s.stream
         HAVING max(s.seq) > coalesce(w.highest, 0)",
        true,
    ),
    (
        "SELECT r.consumer, r.stream,
                'settled run ' || r.lo || '-' || r.hi || ' is kept, but the watermark is '
                || coalesce(w.settled_below - 1, 'missing')
         FROM postroom_watermark_runs r
         LEFT JOIN postroom_watermarks w ON w.consumer = r.consumer AND w.stream = r.stream
         WHERE w.settled_below IS NULL OR r.lo <= w.settled_below
            OR r.hi > coalesce(w.highest, 0)",
        true,
    ),
    (
        "SELECT r.consumer, r.stream,
                'settled runs ' || r.lo || '-' || r.hi || ' and ' || n.lo || '-' || n.hi
                || ' overlap or touch (they should be one)'
         FROM postroom_watermark_runs r
         JOIN postroom_watermark_runs n ON n.consumer = r.consumer AND n.stream = r.stream
              AND n.lo = (SELECT min(lo) FROM postroom_watermark_runs m
                          WHERE m.consumer = r.consumer AND m.stream = r.stream
                            AND m.lo > r.lo)
         WHERE n.lo <= r.hi + 1",
        true,
    ),
    (
        "SELECT s.consumer, s.stream,
                'sequence ' || s.seq || ' is listed and in the settled run '
                || r.lo || '-' || r.hi
         FROM postroom_watermark_settled s
         JOIN postroom_watermark_runs r ON r.consumer = s.consumer AND r.stream = s.stream
              AND r.lo <= s.seq AND r.hi >= s.seq",
        true,
    ),
    (
        "SELECT i.consumer, i.seq_stream,
                'inbox row ' || i.id || ' (sequence ' || i.seq || ') is ' || i.status
                || ' below the watermark ' || (w.settled_below - 1)
                || ': a redriven dead letter, or the watermark passed a message that \
                never settled'
         FROM postroom_inbox i
         JOIN postroom_watermarks w ON w.consumer = i.consumer AND w.stream = i.seq_stream
         WHERE i.seq IS NOT NULL AND i.seq < w.settled_below
           AND i.status NOT IN ('completed', 'dead')",
        false,
    ),
];

/// Calls `found` for every break of the watermarks' invariants.
pub(crate) fn watermark_breaks(
    conn: &Connection,
    mut found: impl FnMut(WatermarkBreak),
) -> rusqlite::Result<()> {
    for (query, violation) in WATERMARK_CHECKS {
        let mut stmt = conn.prepare(query)?;
        let mut rows = stmt.query([])?;
        while let Some(r) = rows.next()? {
            found(WatermarkBreak {
                violation,
                table: "postroom_watermarks",
                consumer: r.get(0)?,
                stream: r.get(1)?,
                what: r.get(2)?,
            });
        }
    }
    let runs = MAX_SETTLED_RUNS as i64;
    let mut stmt = conn.prepare(
        "SELECT consumer, stream, count(*) FROM postroom_watermark_runs
         GROUP BY consumer, stream HAVING count(*) > ?1",
    )?;
    let mut rows = stmt.query([runs])?;
    while let Some(r) = rows.next()? {
        let n: i64 = r.get(2)?;
        found(WatermarkBreak {
            violation: true,
            table: "postroom_watermark_runs",
            consumer: r.get(0)?,
            stream: r.get(1)?,
            what: format!("{n} settled runs kept, above the bound of {runs}"),
        });
    }
    let bound = MAX_LISTED_SEQUENCES as i64 + 1;
    let mut stmt = conn.prepare(
        // Within the listing's window: a file migrated from schema 12
        // (which bounded the listing by count) may also hold older entries
        // farther up.
        "SELECT s.consumer, s.stream, count(*) FROM postroom_watermark_settled s
         JOIN postroom_watermarks w ON w.consumer = s.consumer AND w.stream = s.stream
         WHERE s.seq - w.settled_below < ?2
         GROUP BY s.consumer, s.stream HAVING count(*) > ?1",
    )?;
    let mut rows = stmt.query([bound, MAX_LISTED_SEQUENCES as i64])?;
    while let Some(r) = rows.next()? {
        let n: i64 = r.get(2)?;
        found(WatermarkBreak {
            violation: true,
            table: "postroom_watermark_settled",
            consumer: r.get(0)?,
            stream: r.get(1)?,
            what: format!("{n} sequences listed, above the bound of {bound}"),
        });
    }
    Ok(())
}

/// The file identity recorded beside the instance id, if any.
pub(crate) fn recorded_identity(conn: &Connection) -> rusqlite::Result<Option<String>> {
    conn.query_row(
        "SELECT value FROM postroom_meta WHERE key = ?1",
        [schema::FILE_IDENTITY_KEY],
        |r| r.get(0),
    )
    .optional()
}

/// An inbox row as the checks read it.
pub(crate) struct InboxRow {
    pub id: i64,
    pub status: Status,
    pub payload: Option<Vec<u8>>,
    pub payload_hash: Vec<u8>,
    pub last_error: Option<String>,
    pub processed_at: Option<i64>,
    pub lease_until: Option<i64>,
    pub lease_token: Option<i64>,
}

/// Calls `f` for every inbox row, in id order.
pub(crate) fn inbox_rows(conn: &Connection, mut f: impl FnMut(InboxRow)) -> rusqlite::Result<()> {
    let mut stmt = conn.prepare(
        "SELECT id, status, payload, payload_hash, last_error, processed_at, lease_until,
                lease_token
         FROM postroom_inbox ORDER BY id",
    )?;
    let mut rows = stmt.query([])?;
    while let Some(r) = rows.next()? {
        f(InboxRow {
            id: r.get(0)?,
            status: r.get(1)?,
            payload: stored_bytes(r, 2)?,
            payload_hash: r.get(3)?,
            last_error: r.get(4)?,
            processed_at: r.get(5)?,
            lease_until: r.get(6)?,
            lease_token: r.get(7)?,
        });
    }
    Ok(())
}

/// Calls `f(id, payload, payload_hash)` for every quarantined delivery, in
/// id order.
pub(crate) fn conflict_rows(
    conn: &Connection,
    mut f: impl FnMut(i64, Vec<u8>, Vec<u8>),
) -> rusqlite::Result<()> {
    let mut stmt =
        conn.prepare("SELECT id, payload, payload_hash FROM postroom_conflicts ORDER BY id")?;
    let mut rows = stmt.query([])?;
    while let Some(r) = rows.next()? {
        f(r.get(0)?, r.get(1)?, r.get(2)?);
    }
    Ok(())
}

/// An outbox row as the checks read it, with the inbox row whose handler
/// published it (when that row is still stored and was received before
/// the outbox row was written).
pub(crate) struct OutboxRow {
    pub seq: i64,
    pub status: String,
    pub sent_at: Option<i64>,
    pub last_error: Option<String>,
    /// The causing inbox row's id and status.
    pub cause: Option<(i64, Status)>,
}

/// Calls `f` for every outbox row, in `seq` order.
pub(crate) fn outbox_rows(conn: &Connection, mut f: impl FnMut(OutboxRow)) -> rusqlite::Result<()> {
    let mut stmt = conn.prepare(
        "SELECT o.seq, o.status, o.sent_at, o.last_error, i.id, i.status
         FROM postroom_outbox o
         LEFT JOIN postroom_inbox_keys k
           ON k.consumer = o.cause_consumer AND k.source = o.cause_source
          AND k.message_id = o.cause_message_id
         LEFT JOIN postroom_inbox i
           ON i.id = k.inbox_id AND i.consumer = k.consumer AND i.source = k.source
          AND i.message_id = k.message_id AND i.received_at <= o.created_at
         ORDER BY o.seq",
    )?;
    let mut rows = stmt.query([])?;
    while let Some(r) = rows.next()? {
        let cause = match r.get::<_, Option<i64>>(4)? {
            Some(id) => Some((id, r.get(5)?)),
            None => None,
        };
        f(OutboxRow {
            seq: r.get(0)?,
            status: r.get(1)?,
            sent_at: r.get(2)?,
            last_error: r.get(3)?,
            cause,
        });
    }
    Ok(())
}

/// Calls `f(seq, first)` for every outbox row whose message id an earlier
/// row (`first`, the lowest `seq` with it) holds too. Sorts every id: a
/// check's cost, never the engine's.
pub(crate) fn duplicate_outbox_ids(
    conn: &Connection,
    mut f: impl FnMut(i64, i64),
) -> rusqlite::Result<()> {
    let mut stmt = conn.prepare(
        "SELECT seq, first FROM (
             SELECT seq, min(seq) OVER (PARTITION BY message_id) AS first
             FROM postroom_outbox)
         WHERE seq > first ORDER BY seq",
    )?;
    let mut rows = stmt.query([])?;
    while let Some(r) = rows.next()? {
        f(r.get(0)?, r.get(1)?);
    }
    Ok(())
}

/// The tables postroom's schema creates; a file without all of them is not
/// a postroom database.
const TABLES: [&str; 6] = [
    "postroom_meta",
    "postroom_inbox",
    "postroom_inbox_keys",
    "postroom_retired_keys",
    "postroom_outbox",
    "postroom_conflicts",
];

/// Which of the schema's tables the file lacks (none for a postroom
/// database).
pub(crate) fn missing_tables(conn: &Connection) -> rusqlite::Result<Vec<&'static str>> {
    let mut missing = Vec::new();
    for table in TABLES {
        let found: bool = conn.query_row(
            "SELECT count(*) > 0 FROM sqlite_master WHERE type = 'table' AND name = ?1",
            [table],
            |r| r.get(0),
        )?;
        if !found {
            missing.push(table);
        }
    }
    Ok(missing)
}
