//! Sequence watermarks (schema.sql, `postroom_watermarks`): what a
//! sequenced message's number says when its row cannot answer, the
//! operator's reset of a stream, and the per-stream listing for stats.
//!
//! The watermark itself is advanced by triggers in the transaction that
//! settles a row, whatever path settles it; nothing here writes it except
//! [`reset`].

use rusqlite::{params, Connection, OptionalExtension};

use crate::message::Message;
use crate::store::inbox::{Found, Key};

/// A settled sequence above the watermark is listed (with its message's
/// key and digest) when it is at most this far above it, so a stream
/// lists at most this many (the triggers in schema.sql hold the same
/// number, as a distance: the bound costs no count).
pub const MAX_LISTED_SEQUENCES: u64 = 4096;

/// How many runs of settled sequences a stream keeps past the listing's
/// bound at most (schema.sql, `postroom_watermark_runs`; the triggers hold
/// the same number). A run is one stretch of settled sequences, however
/// long: one sequence stuck below a million settled costs one.
pub const MAX_SETTLED_RUNS: u64 = 4096;

/// How many missing ranges [`StreamWatermark::missing`] names at most.
pub const MAX_MISSING_RANGES: usize = 16;

/// What a sequenced message's number says about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Answer {
    /// Nothing: the normal path decides.
    New,
    /// It settled before (its row is gone).
    Duplicate,
    /// Its number is held by another message, or by this one under other
    /// numbers: quarantine it. `stored_hash` is the other message's
    /// payload digest.
    Conflict { stored_hash: [u8; 32], why: String },
}

/// What a delivery's sequence number says, given what the key table
/// found for it (`found`, from [`inbox::find`](crate::store::inbox) or
/// `find_live`): for a message with a row, [`against_row`]; without,
/// [`against_stream`]. A message without a sequence gets [`Answer::New`]
/// without a statement.
pub(crate) fn check(
    conn: &Connection,
    consumer: &str,
    msg: &Message,
    hash: &[u8; 32],
    found: Option<&Found>,
) -> rusqlite::Result<Answer> {
    if msg.sequence.is_none() {
        return Ok(Answer::New);
    }
    let key = Key {
        consumer,
        source: &msg.source,
        message_id: &msg.id,
    };
    Ok(match found {
        // The key table answered without the row: read its number.
        Some(Found::CompletedDuplicate) => match stored(conn, key)? {
            Some((seq, stream, stored)) => against_row(msg, (seq, stream.as_deref()), &stored),
            None => Answer::New,
        },
        Some(Found::Row { row, .. }) if row.payload_hash == *hash => {
            against_row(msg, (row.seq, row.seq_stream.as_deref()), &row.payload_hash)
        }
        // Another payload: the key's own conflict, as without a number.
        Some(Found::Row { .. }) => Answer::New,
        None => against_stream(conn, consumer, msg, hash)?,
    })
}

/// The stored message's sequence against the delivery's, for a message
/// whose row is still there (`stored` is that row's `(seq, stream)`): a
/// row numbered otherwise is a sender that numbered one message twice (a
/// counter reset). A row or a delivery without a number says nothing.
pub(crate) fn against_row(
    msg: &Message,
    stored: (Option<i64>, Option<&str>),
    stored_hash: &[u8; 32],
) -> Answer {
    let (Some(seq), Some(stream)) = (msg.sequence, msg.sequence_stream()) else {
        return Answer::New;
    };
    match stored {
        (Some(stored_seq), Some(stored_stream))
            if stored_seq != seq as i64 || stored_stream != stream =>
        {
            Answer::Conflict {
                stored_hash: *stored_hash,
                why: format!(
                    "stored with sequence {stored_seq} of stream {stored_stream:?}, delivered \
                     with sequence {seq} of stream {stream:?} (did the sender's counter reset?)"
                ),
            }
        }
        _ => Answer::New,
    }
}

/// A stored row's sequence, stream and payload digest.
pub(crate) type Stored = (Option<i64>, Option<String>, [u8; 32]);

/// The `(seq, stream)` and digest of the row stored under `key`, if any
/// (for a completed duplicate the key table answered without the row).
pub(crate) fn stored(conn: &Connection, key: Key<'_>) -> rusqlite::Result<Option<Stored>> {
    conn.prepare_cached(
        "SELECT i.seq, i.seq_stream, i.payload_hash FROM postroom_inbox_keys k
         JOIN postroom_inbox i ON i.id = k.inbox_id
         WHERE k.consumer = ?1 AND k.source = ?2 AND k.message_id = ?3",
    )?
    .query_row(params![key.consumer, key.source, key.message_id], |r| {
        let hash: Vec<u8> = r.get(2)?;
        Ok((r.get(0)?, r.get(1)?, hash.try_into().unwrap_or([0; 32])))
    })
    .optional()
}

/// What the number of a sequenced message without a row says: a retained
/// row of another key holding the number is a conflict; a number below
/// the watermark is a duplicate; one listed settled above it is a
/// duplicate with the same key and payload, else a conflict.
pub(crate) fn against_stream(
    conn: &Connection,
    consumer: &str,
    msg: &Message,
    hash: &[u8; 32],
) -> rusqlite::Result<Answer> {
    let (Some(seq), Some(stream)) = (msg.sequence, msg.sequence_stream()) else {
        return Ok(Answer::New);
    };
    let seq = seq as i64;
    let holder: Option<(String, String, Vec<u8>)> = conn
        .prepare_cached(
            "SELECT source, message_id, payload_hash FROM postroom_inbox
             WHERE consumer = ?1 AND seq_stream = ?2 AND seq = ?3 AND seq IS NOT NULL
             LIMIT 1",
        )?
        .query_row(params![consumer, stream, seq], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })
        .optional()?;
    if let Some((source, id, stored)) = holder {
        // The caller found no row under this message's key.
        return Ok(Answer::Conflict {
            stored_hash: stored.try_into().unwrap_or([0; 32]),
            why: format!(
                "sequence {seq} of stream {stream:?} is held by message {source}/{id} (did the \
                 sender's counter reset?)"
            ),
        });
    }
    let below: Option<i64> = conn
        .prepare_cached(
            "SELECT settled_below FROM postroom_watermarks WHERE consumer = ?1 AND stream = ?2",
        )?
        .query_row(params![consumer, stream], |r| r.get(0))
        .optional()?;
    let Some(below) = below else {
        return Ok(Answer::New);
    };
    if seq < below {
        return Ok(Answer::Duplicate);
    }
    // In a run of settled sequences: as below the watermark (a run keeps
    // no key or digest).
    let in_run: bool = conn
        .prepare_cached(
            "SELECT count(*) > 0 FROM (SELECT hi FROM postroom_watermark_runs
                 WHERE consumer = ?1 AND stream = ?2 AND lo <= ?3 ORDER BY lo DESC LIMIT 1)
             WHERE hi >= ?3",
        )?
        .query_row(params![consumer, stream, seq], |r| r.get(0))?;
    if in_run {
        return Ok(Answer::Duplicate);
    }
    let listed: Option<(String, String, Vec<u8>)> = conn
        .prepare_cached(
            "SELECT source, message_id, payload_hash FROM postroom_watermark_settled
             WHERE consumer = ?1 AND stream = ?2 AND seq = ?3",
        )?
        .query_row(params![consumer, stream, seq], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })
        .optional()?;
    Ok(match listed {
        None => Answer::New,
        Some((source, id, stored)) if source == msg.source && id == msg.id => {
            if stored.as_slice() == hash.as_slice() {
                Answer::Duplicate
            } else {
                Answer::Conflict {
                    stored_hash: stored.try_into().unwrap_or([0; 32]),
                    why: format!(
                        "sequence {seq} of stream {stream:?} settled with another payload"
                    ),
                }
            }
        }
        Some((source, id, stored)) => Answer::Conflict {
            stored_hash: stored.try_into().unwrap_or([0; 32]),
            why: format!(
                "sequence {seq} of stream {stream:?} settled as message {source}/{id} (did the \
                 sender's counter reset?)"
            ),
        },
    })
}

/// Starts `consumer`'s `stream` afresh (a sender whose counter was reset:
/// a new epoch): its next sequence is `next`, nothing above is listed
/// settled, and its retained rows lose their numbers (they still
/// deduplicate by key), so the new epoch's numbers conflict with nothing
/// of the old one. Returns whether the stream was known.
pub(crate) fn reset(
    conn: &Connection,
    consumer: &str,
    stream: &str,
    next: u64,
) -> rusqlite::Result<bool> {
    let next = i64::try_from(next).unwrap_or(i64::MAX);
    let known = conn
        .prepare_cached(
            "UPDATE postroom_watermarks SET settled_below = ?3, highest = NULL, unrecorded = 0
             WHERE consumer = ?1 AND stream = ?2",
        )?
        .execute(params![consumer, stream, next])?
        == 1;
    if !known {
        conn.prepare_cached(
            "INSERT INTO postroom_watermarks (consumer, stream, settled_below)
             VALUES (?1, ?2, ?3)",
        )?
        .execute(params![consumer, stream, next])?;
    }
    conn.prepare_cached(
        "DELETE FROM postroom_watermark_settled WHERE consumer = ?1 AND stream = ?2",
    )?
    .execute(params![consumer, stream])?;
    conn.prepare_cached("DELETE FROM postroom_watermark_runs WHERE consumer = ?1 AND stream = ?2")?
        .execute(params![consumer, stream])?;
    conn.prepare_cached(
        "UPDATE postroom_inbox SET seq = NULL, seq_stream = NULL
         WHERE consumer = ?1 AND seq_stream = ?2 AND seq IS NOT NULL",
    )?
    .execute(params![consumer, stream])?;
    Ok(known)
}

/// Creates `consumer`'s `stream` with `next` as its next sequence, unless
/// the stream exists.
pub(crate) fn start(
    conn: &Connection,
    consumer: &str,
    stream: &str,
    next: u64,
) -> rusqlite::Result<()> {
    let next = i64::try_from(next).unwrap_or(i64::MAX);
    conn.prepare_cached(
        "INSERT OR IGNORE INTO postroom_watermarks (consumer, stream, settled_below)
         VALUES (?1, ?2, ?3)",
    )?
    .execute(params![consumer, stream, next])?;
    Ok(())
}

/// One stream's watermark, as [`Stats::sequences`](crate::Stats) and the
/// CLI show it.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct StreamWatermark {
    /// The consumer.
    pub consumer: String,
    /// The sequence stream (the source, unless the sender named a stream).
    pub stream: String,
    /// Every sequence up to this one has settled (completed or dead); 0
    /// while sequence 1 (or the start a reset set) has not.
    pub watermark: u64,
    /// The highest sequence stored.
    pub highest: Option<u64>,
    /// Settled sequences listed above the watermark (those at most
    /// [`MAX_LISTED_SEQUENCES`] above it), each with its message's key and
    /// digest.
    pub listed: u64,
    /// Settled sequences above the watermark past the listing's bound,
    /// kept as runs (at most [`MAX_SETTLED_RUNS`] runs, of any length).
    pub in_runs: u64,
    /// How many runs hold `in_runs`.
    pub runs: u64,
    /// Settled sequences past both bounds, kept nowhere: the watermark
    /// cannot pass them, and their redeliveries after retention are taken
    /// as new. Non-zero: reset the stream
    /// ([`Postroom::reset_sequence`](crate::Postroom::reset_sequence)).
    pub unrecorded: u64,
    /// Ranges of sequences up to `highest` that have not settled — never
    /// arrived, or stored and not yet completed or dead — lowest first, at
    /// most 16 (`missing_more` says more were left off).
    pub missing: Vec<(u64, u64)>,
    /// True when `missing` was cut short.
    pub missing_more: bool,
}

impl StreamWatermark {
    /// `missing` as an operator reads it: `41-45, 50`, with `, …` when cut
    /// short; empty when nothing is missing.
    pub fn missing_text(&self) -> String {
        let mut parts: Vec<String> = self
            .missing
            .iter()
            .map(|&(lo, hi)| {
                if lo == hi {
                    lo.to_string()
                } else {
                    format!("{lo}-{hi}")
                }
            })
            .collect();
        if self.missing_more {
            parts.push("…".into());
        }
        parts.join(", ")
    }
}

/// Every stream's watermark, by consumer and stream. Reads each stream's
/// listed sequences (at most 4096 each).
pub(crate) fn read_all(conn: &Connection) -> rusqlite::Result<Vec<StreamWatermark>> {
    let mut streams = Vec::new();
    // A file not yet migrated to version 6 (the CLI reads it as it is).
    let present: bool = conn
        .prepare_cached(
            "SELECT count(*) > 0 FROM sqlite_master
             WHERE type = 'table' AND name = 'postroom_watermarks'",
        )?
        .query_row([], |r| r.get(0))?;
    if !present {
        return Ok(streams);
    }
    let mut stmt = conn.prepare_cached(
        "SELECT consumer, stream, settled_below, highest, unrecorded FROM postroom_watermarks
         ORDER BY consumer, stream",
    )?;
    let mut rows = stmt.query([])?;
    while let Some(r) = rows.next()? {
        let below: i64 = r.get(2)?;
        let highest: Option<i64> = r.get(3)?;
        let unrecorded: i64 = r.get(4)?;
        streams.push(StreamWatermark {
            consumer: r.get(0)?,
            stream: r.get(1)?,
            watermark: u64::try_from(below.saturating_sub(1)).unwrap_or(0),
            highest: highest.and_then(|h| u64::try_from(h).ok()),
            unrecorded: u64::try_from(unrecorded).unwrap_or(0),
            ..StreamWatermark::default()
        });
    }
    // Listed sequences as one-long runs, with the runs, in order.
    let mut settled = conn.prepare_cached(
        "SELECT seq, seq, 1 FROM postroom_watermark_settled WHERE consumer = ?1 AND stream = ?2
         UNION ALL
         SELECT lo, hi, 0 FROM postroom_watermark_runs WHERE consumer = ?1 AND stream = ?2
         ORDER BY 1",
    )?;
    for w in &mut streams {
        let spans = settled
            .query_map(params![w.consumer, w.stream], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, i64>(1)?,
                    r.get::<_, bool>(2)?,
                ))
            })?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        let mut next = w.watermark + 1;
        let mut gaps = Vec::new();
        let mut spans: Vec<(u64, u64)> = spans
            .into_iter()
            .filter_map(|(lo, hi, listed)| {
                let (lo, hi) = (u64::try_from(lo).ok()?, u64::try_from(hi).ok()?);
                if listed {
                    w.listed += 1;
                } else {
                    w.runs += 1;
                    w.in_runs += hi - lo + 1;
                }
                Some((lo, hi))
            })
            .collect();
        // `highest` closes the last gap; it may be settled itself.
        if let Some(h) = w.highest {
            spans.push((h + 1, h + 1));
        }
        for (lo, hi) in spans {
            if lo > next {
                gaps.push((next, lo - 1));
            }
            next = next.max(hi + 1);
        }
        // `highest` itself may be listed: the chained end then adds nothing.
        w.missing_more = gaps.len() > MAX_MISSING_RANGES;
        gaps.truncate(MAX_MISSING_RANGES);
        w.missing = gaps;
    }
    Ok(streams)
}

/// How many sequences above a stream's watermark
/// [`Postroom::resume_point`](crate::Postroom::resume_point) walks at
/// most. Past it the answer stops short (a puller pulls some again; each
/// repeat is a duplicate), and the walk stays one bounded index range:
/// at most this many rows and listed sequences are read.
pub const RESUME_WALK: u64 = 65_536;

/// The sequence a puller of `consumer`'s `stream` resumes after: every
/// sequence at or below it has settled (at or under the watermark, or
/// listed settled above it) or is stored in a queued row (received: the
/// workers process it whatever happens to the puller). A row taken inline
/// that has not settled does not count: its sender must deliver it again.
/// 0 for a stream with nothing of the kind (or unknown).
///
/// Walks the stream's rows and listed sequences upward from the watermark
/// (two index ranges, merged) to the first sequence that is neither, at
/// most [`RESUME_WALK`] steps: never past a sequence that is not held, so
/// a puller that resumes here loses nothing, and at worst pulls again what
/// it has. Invariants: one snapshot (a watermark read apart from the rows
/// could be another epoch's, after a reset, and walk over rows it does not
/// number); every row of the range is read, held or not, so the walk stops
/// at the first row not held instead of scanning past it for a held one.
pub(crate) fn resume_point(
    conn: &Connection,
    consumer: &str,
    stream: &str,
) -> rusqlite::Result<u64> {
    // One read transaction for the three statements (rolled back on drop:
    // it writes nothing). A caller already in one reads in it.
    let _snapshot = if conn.is_autocommit() {
        Some(conn.unchecked_transaction()?)
    } else {
        None
    };
    let settled_below: Option<i64> = conn
        .prepare_cached(
            "SELECT settled_below FROM postroom_watermarks WHERE consumer = ?1 AND stream = ?2",
        )?
        .query_row(params![consumer, stream], |r| r.get(0))
        .optional()?;
    let Some(mut next) = settled_below else {
        return Ok(0);
    };
    let walk = i64::try_from(RESUME_WALK).unwrap_or(i64::MAX);
    let mut stored_stmt = conn.prepare_cached(
        "SELECT seq, queued = 1 OR status IN ('completed', 'dead') FROM postroom_inbox
         WHERE consumer = ?1 AND seq_stream = ?2 AND seq IS NOT NULL AND seq >= ?3
         ORDER BY seq LIMIT ?4",
    )?;
    let mut listed_stmt = conn.prepare_cached(
        "SELECT seq, 1 FROM postroom_watermark_settled
         WHERE consumer = ?1 AND stream = ?2 AND seq >= ?3
         ORDER BY seq LIMIT ?4",
    )?;
    let mut runs_stmt = conn.prepare_cached(
        "SELECT lo, hi FROM postroom_watermark_runs
         WHERE consumer = ?1 AND stream = ?2 AND lo >= ?3
         ORDER BY lo LIMIT ?4",
    )?;
    let mut runs = runs_stmt.query(params![consumer, stream, next, walk])?;
    let mut run = next_run(&mut runs)?;
    let mut stored = stored_stmt.query(params![consumer, stream, next, walk])?;
    let mut listed = listed_stmt.query(params![consumer, stream, next, walk])?;
    let mut a = next_seq(&mut stored)?;
    let mut b = next_seq(&mut listed)?;
    for _ in 0..RESUME_WALK {
        // A run starting here: all of it settled, passed in one step.
        while let Some((lo, hi)) = run.filter(|&(lo, _)| lo <= next) {
            if lo == next {
                next = hi.saturating_add(1);
            }
            run = next_run(&mut runs)?;
        }
        // A sequence can be both stored and listed (settled, still
        // retained), or stored twice (a conflict's row): it is held if any
        // of them holds it. Rows below `next` were looked at already.
        let mut held = false;
        while let Some((seq, holds)) = a.filter(|&(seq, _)| seq <= next) {
            held |= seq == next && holds;
            a = next_seq(&mut stored)?;
        }
        while let Some((seq, _)) = b.filter(|&(seq, _)| seq <= next) {
            held |= seq == next;
            b = next_seq(&mut listed)?;
        }
        if !held {
            break;
        }
        match next.checked_add(1) {
            Some(n) => next = n,
            None => break,
        }
    }
    Ok(u64::try_from(next - 1).unwrap_or(0))
}

/// The next `(lo, hi)` of a walk's runs.
fn next_run(rows: &mut rusqlite::Rows<'_>) -> rusqlite::Result<Option<(i64, i64)>> {
    rows.next()?.map(|r| Ok((r.get(0)?, r.get(1)?))).transpose()
}

/// The next `(seq, held)` of a walk's range.
fn next_seq(rows: &mut rusqlite::Rows<'_>) -> rusqlite::Result<Option<(i64, bool)>> {
    rows.next()?.map(|r| Ok((r.get(0)?, r.get(1)?))).transpose()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The triggers hold the bounds as literals: they must be these.
    #[test]
    fn the_schema_holds_the_bounds() {
        let sql = crate::store::schema::SCHEMA_SQL;
        let listed = format!("NEW.seq - w.settled_below < {MAX_LISTED_SEQUENCES};");
        assert_eq!(sql.matches(&listed).count(), 2);
        let runs = format!(
            "(SELECT count(*) FROM postroom_watermark_runs\n           \
             WHERE consumer = NEW.consumer AND stream = NEW.seq_stream) < {MAX_SETTLED_RUNS};"
        );
        assert_eq!(sql.matches(&runs).count(), 2);
    }

    fn inbox_row(conn: &Connection, seq: i64, status: &str, queued: bool) {
        conn.prepare_cached(
            "INSERT INTO postroom_inbox (consumer, source, message_id, status, payload,
                 payload_hash, received_at, updated_at, processed_at, last_error, queued,
                 seq, seq_stream)
             VALUES ('c', 's', ?1 || '-' || ?2, ?3, x'', zeroblob(32), 1, 1, 1, 'e', ?4, ?2,
                 's')",
        )
        .unwrap()
        .execute(params![status, seq, status, queued])
        .unwrap();
    }

    /// `resume_point`'s walk stops at the first sequence not held; what
    /// lies above it (here 50,000 rows of an inline consumer whose
    /// deliveries failed) is not read: one bounded range, not a scan of
    /// the stream. (Its stored rows were read through a filter on status,
    /// so finding the first held row above a gap scanned every row.)
    #[test]
    fn resume_point_reads_a_bounded_range_whatever_lies_above_a_gap() {
        let mut conn = Connection::open_in_memory().unwrap();
        conn.execute_batch(crate::store::schema::SCHEMA_SQL)
            .unwrap();
        let rows: i64 = 50_000;
        conn.execute_batch("BEGIN").unwrap();
        for seq in 1..=rows {
            inbox_row(&conn, seq, "failed", false);
        }
        conn.execute_batch("COMMIT").unwrap();
        // Warm: the schema is read, the statements prepared.
        assert_eq!(resume_point(&conn, "c", "s").unwrap(), 0);
        let ops = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counted = std::sync::Arc::clone(&ops);
        conn.progress_handler(
            100,
            Some(move || {
                counted.fetch_add(100, std::sync::atomic::Ordering::Relaxed);
                false
            }),
        )
        .unwrap();
        assert_eq!(resume_point(&conn, "c", "s").unwrap(), 0);
        let ops = ops.load(std::sync::atomic::Ordering::Relaxed);
        assert!(
            ops < 10_000,
            "{ops} VM steps for a gap at the watermark, over {rows} rows above it"
        );
    }

    /// The watermark and the rows above it are read in one snapshot. Here
    /// the stream is reset (a new epoch, from 1) and refilled while the
    /// watermark is read: the new epoch holds 1..=50 and 101..=200, so the
    /// answer is 50 (or, read before the reset, 100); never 200 — the old
    /// epoch's watermark walked over the new epoch's rows, as if 51..=100
    /// were held.
    #[test]
    fn resume_point_reads_one_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("app.db");
        let mut conn = Connection::open(&path).unwrap();
        conn.execute_batch("PRAGMA journal_mode = WAL").unwrap();
        conn.execute_batch(crate::store::schema::SCHEMA_SQL)
            .unwrap();
        for seq in 1..=100 {
            inbox_row(&conn, seq, "completed", true);
        }
        assert_eq!(resume_point(&conn, "c", "s").unwrap(), 100);
        let other = Connection::open(&path).unwrap();
        let mut done = false;
        conn.progress_handler(
            1,
            Some(move || {
                if !std::mem::replace(&mut done, true) {
                    other.execute_batch("BEGIN").unwrap();
                    reset(&other, "c", "s", 1).unwrap();
                    for seq in (1..=50).chain(101..=200) {
                        inbox_row(&other, seq, "pending", true);
                    }
                    other.execute_batch("COMMIT").unwrap();
                }
                false
            }),
        )
        .unwrap();
        let answer = resume_point(&conn, "c", "s").unwrap();
        conn.progress_handler(0, None::<fn() -> bool>).unwrap();
        assert!(
            answer == 50 || answer == 100,
            "resume_point answered {answer}: 51..=100 of the new epoch are not held"
        );
        assert_eq!(resume_point(&conn, "c", "s").unwrap(), 50);
    }

    #[test]
    fn missing_ranges_read_as_an_operator_writes_them() {
        let mut w = StreamWatermark {
            missing: vec![(41, 45), (50, 50)],
            ..StreamWatermark::default()
        };
        assert_eq!(w.missing_text(), "41-45, 50");
        w.missing_more = true;
        assert_eq!(w.missing_text(), "41-45, 50, …");
        assert_eq!(StreamWatermark::default().missing_text(), "");
    }
}
