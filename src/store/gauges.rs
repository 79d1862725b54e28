//! What the live gauges show (crate docs, "Metrics"), read per consumer
//! through the indexes that already list the rows, never by scanning the
//! inbox (which [`stats::read`](crate::store::stats) does, too costly to
//! run on every change).
//!
//! Invariants:
//! * every read walks a partial index or a primary key, and each walk
//!   stops at a bound: one refresh reads, per consumer, at most
//!   [`COUNT_CAP`] entries of each of the backlog's three indexes,
//!   [`RETRY_SCAN`] rows of the due index and of the heads, at most
//!   [`COUNT_CAP`] entries of `postroom_inbox_redelivery`, one row for
//!   each oldest, and one row per sequence stream (plus, for a stream
//!   with a gap, its listed settled sequences: at most 4096); and for all
//!   consumers together at most [`DEAD_CAP`] dead rows;
//! * a count that reaches its bound answers the bound: a gauge at the
//!   bound reads "at least";
//! * nothing is written (no counter kept up to date by the delivery path:
//!   a delivery pays nothing for the gauges).

use rusqlite::{params, Connection};

use crate::store::backlog;

/// Most rows a backlog is counted up to, per index (unkeyed rows are
/// counted in the due index alone, without reading the inbox's rows).
pub(crate) const COUNT_CAP: u64 = 100_000;
/// Most rows of the due index and of the ordering heads read, per
/// consumer, to count the rows waiting for a retry. A failed row is
/// retried in receive order, so those rows sit near the front of the
/// due index (ahead of the rows never tried).
pub(crate) const RETRY_SCAN: u64 = 1_000;
/// Most dead rows read, for all consumers together (each is a row read
/// through `postroom_inbox_dead`, whose entries do not hold the consumer).
pub(crate) const DEAD_CAP: u64 = 10_000;

/// One consumer's gauges, as read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ConsumerGauges {
    /// Queued rows not settled (pending, waiting for a retry, being
    /// processed), up to [`COUNT_CAP`] per index: [`backlog::count`].
    pub backlog: u64,
    /// `received_at` of the oldest of those, unix ms.
    pub oldest_pending_ms: Option<i64>,
    /// Of the backlog, rows that failed and wait for their retry, among
    /// the first [`RETRY_SCAN`] of the due index and of the heads.
    pub waiting_for_retry: u64,
    /// Rows that failed inline and wait for their sender's redelivery (no
    /// worker retries them), up to [`COUNT_CAP`].
    pub waiting_for_redelivery: u64,
    /// `updated_at` (their last attempt) of the oldest of those, unix ms.
    pub oldest_redelivery_ms: Option<i64>,
    /// Dead letters, among the oldest [`DEAD_CAP`] of all consumers.
    pub dead: u64,
    /// `updated_at` (when it died) of the oldest dead letter, unix ms.
    pub oldest_dead_ms: Option<i64>,
    /// Sequences at or below each stream's highest that have not settled
    /// (never arrived, or stored and not yet completed or dead), summed
    /// over the consumer's sequence streams: the watermarks' gaps.
    pub watermark_gaps: u64,
}

/// Reads the gauges of each of `consumers`, in their order.
pub(crate) fn read(
    conn: &Connection,
    consumers: &[String],
) -> rusqlite::Result<Vec<ConsumerGauges>> {
    if consumers.is_empty() {
        // An outbox-only engine: no dead letter is anyone's gauge.
        return Ok(Vec::new());
    }
    let dead = dead(conn)?;
    consumers
        .iter()
        .map(|consumer| {
            let mut g = ConsumerGauges {
                backlog: backlog::count(conn, consumer, COUNT_CAP)?,
                ..ConsumerGauges::default()
            };
            if g.backlog > 0 {
                g.oldest_pending_ms = oldest_pending(conn, consumer)?;
                g.waiting_for_retry = waiting_for_retry(conn, consumer)?;
            }
            if let Some(&(_, n, oldest)) = dead.iter().find(|d| d.0 == *consumer) {
                g.dead = n;
                g.oldest_dead_ms = oldest;
            }
            (g.waiting_for_redelivery, g.oldest_redelivery_ms) =
                waiting_for_redelivery(conn, consumer)?;
            g.watermark_gaps = watermark_gaps(conn, consumer)?;
            Ok(g)
        })
        .collect()
}

/// The oldest unsettled queued row's `received_at`: the first entry of the
/// due index (unkeyed rows, in receive order), the first queued head of
/// the ordering keys (each key's oldest unfinished row), and unkeyed rows
/// being processed (`postroom_inbox_leased`: a few per worker).
const OLDEST_PENDING: &str = "SELECT
    (SELECT received_at FROM postroom_inbox
        WHERE consumer = ?1 AND queued = 1 AND status IN ('pending', 'failed')
          AND ordering_key IS NULL
        ORDER BY id LIMIT 1),
    (SELECT i.received_at FROM postroom_inbox_heads h
        JOIN postroom_inbox i ON i.id = h.head_id
        WHERE h.consumer = ?1 AND i.queued = 1
        ORDER BY h.head_id LIMIT 1),
    (SELECT min(received_at) FROM postroom_inbox
        WHERE status = 'processing' AND ordering_key IS NULL AND consumer = ?1)";

fn oldest_pending(conn: &Connection, consumer: &str) -> rusqlite::Result<Option<i64>> {
    conn.prepare_cached(OLDEST_PENDING)?
        .query_row(params![consumer], |r| {
            let firsts: [Option<i64>; 3] = [r.get(0)?, r.get(1)?, r.get(2)?];
            Ok(firsts.into_iter().flatten().min())
        })
}

/// Failed queued rows among the first `?2` of the due index, and among the
/// first `?2` heads (a failed keyed row holds its key, so it is its head).
const WAITING_FOR_RETRY: &str = "SELECT
    (SELECT count(*) FROM (SELECT status FROM postroom_inbox
        WHERE consumer = ?1 AND queued = 1 AND status IN ('pending', 'failed')
          AND ordering_key IS NULL
        ORDER BY id LIMIT ?2) WHERE status = 'failed')
  + (SELECT count(*) FROM (SELECT i.status, i.queued FROM postroom_inbox_heads h
        JOIN postroom_inbox i ON i.id = h.head_id
        WHERE h.consumer = ?1
        ORDER BY h.head_id LIMIT ?2) WHERE status = 'failed' AND queued = 1)";

fn waiting_for_retry(conn: &Connection, consumer: &str) -> rusqlite::Result<u64> {
    let n: i64 = conn
        .prepare_cached(WAITING_FOR_RETRY)?
        .query_row(params![consumer, RETRY_SCAN as i64], |r| r.get(0))?;
    Ok(u64::try_from(n).unwrap_or(0))
}

/// Rows waiting for a redelivery, the oldest first (their last attempt),
/// up to `?2` of them, through `postroom_inbox_redelivery`: how many, and
/// the first's `updated_at`.
const WAITING_FOR_REDELIVERY: &str = "SELECT count(*), min(updated_at) FROM (
        SELECT updated_at FROM postroom_inbox
        WHERE consumer = ?1 AND status = 'failed' AND queued = 0
        ORDER BY updated_at LIMIT ?2)";

fn waiting_for_redelivery(
    conn: &Connection,
    consumer: &str,
) -> rusqlite::Result<(u64, Option<i64>)> {
    conn.prepare_cached(WAITING_FOR_REDELIVERY)?.query_row(
        params![consumer, COUNT_CAP as i64],
        |r| {
            let n: i64 = r.get(0)?;
            Ok((u64::try_from(n).unwrap_or(0), r.get(1)?))
        },
    )
}

/// The oldest `?1` dead rows in the order they died (`postroom_inbox_dead`),
/// by consumer: how many, and when the first died.
const DEAD: &str = "SELECT consumer, count(*), min(updated_at) FROM (
        SELECT consumer, updated_at FROM postroom_inbox
        WHERE status = 'dead' ORDER BY updated_at LIMIT ?1)
    GROUP BY consumer";

fn dead(conn: &Connection) -> rusqlite::Result<Vec<(String, u64, Option<i64>)>> {
    let mut stmt = conn.prepare_cached(DEAD)?;
    let rows = stmt.query_map(params![DEAD_CAP as i64], |r| {
        let n: i64 = r.get(1)?;
        Ok((r.get(0)?, u64::try_from(n).unwrap_or(0), r.get(2)?))
    })?;
    rows.collect()
}

/// Per stream of consumer `?1` (its primary key's prefix) whose highest
/// stored sequence is above its watermark: the sequences between them, less
/// those settled above the watermark (listed, at most 4096, counted
/// through their primary key; past that bound in runs, at most 4096 runs;
/// past both, `unrecorded`). A stream without a gap reads its one row and
/// nothing else.
const WATERMARK_GAPS: &str = "SELECT coalesce(sum(max(0,
        w.highest - w.settled_below + 1 - w.unrecorded
        - (SELECT count(*) FROM postroom_watermark_settled s
           WHERE s.consumer = w.consumer AND s.stream = w.stream)
        - (SELECT coalesce(sum(r.hi - r.lo + 1), 0) FROM postroom_watermark_runs r
           WHERE r.consumer = w.consumer AND r.stream = w.stream))), 0)
    FROM postroom_watermarks w
    WHERE w.consumer = ?1 AND w.highest >= w.settled_below";

fn watermark_gaps(conn: &Connection, consumer: &str) -> rusqlite::Result<u64> {
    let n: i64 = conn
        .prepare_cached(WATERMARK_GAPS)?
        .query_row(params![consumer], |r| r.get(0))?;
    Ok(u64::try_from(n).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::schema;

    fn db() -> Connection {
        let mut conn = Connection::open_in_memory().unwrap();
        schema::migrate(&mut conn).unwrap();
        conn
    }

    /// A row as the engine stores it: `at` is its received_at and
    /// updated_at; `seq` numbers it in stream "s".
    fn row(
        conn: &Connection,
        consumer: &str,
        id: &str,
        status: &str,
        key: Option<&str>,
        at: i64,
        seq: Option<i64>,
    ) {
        conn.execute(
            "INSERT INTO postroom_inbox (consumer, source, message_id, status, payload_hash,
                 ordering_key, received_at, updated_at, queued, lease_until, lease_token,
                 processed_at, payload, last_error, seq, seq_stream)
             VALUES (?1, 's', ?2, ?3, zeroblob(32), ?4, ?5, ?5, 1,
                     CASE WHEN ?3 = 'processing' THEN 1 END,
                     CASE WHEN ?3 = 'processing' THEN 1 END,
                     CASE WHEN ?3 = 'completed' THEN ?5 END,
                     x'00', CASE WHEN ?3 IN ('failed', 'dead') THEN 'e' END,
                     ?6, CASE WHEN ?6 IS NOT NULL THEN 's' END)",
            params![consumer, id, status, key, at, seq],
        )
        .unwrap();
    }

    fn consumers(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn reads_each_consumers_backlog_retries_dead_letters_and_their_oldest() {
        let conn = db();
        // Received in id order, as the engine stores them, but for the
        // keyed row (the oldest).
        row(&conn, "c", "p1", "pending", None, 300, None);
        row(&conn, "c", "f1", "failed", None, 500, None);
        row(&conn, "c", "k1", "failed", Some("doc"), 200, None);
        row(&conn, "c", "k2", "pending", Some("doc"), 600, None);
        row(&conn, "c", "done", "completed", None, 100, None);
        row(&conn, "c", "d1", "dead", None, 700, None);
        row(&conn, "c", "d2", "dead", None, 400, None);
        row(&conn, "other", "o1", "dead", None, 50, None);
        let g = read(&conn, &consumers(&["c", "other", "nobody"])).unwrap();
        assert_eq!(
            g[0],
            ConsumerGauges {
                backlog: 4,
                oldest_pending_ms: Some(200),
                waiting_for_retry: 2,
                dead: 2,
                oldest_dead_ms: Some(400),
                watermark_gaps: 0,
                waiting_for_redelivery: 0,
                oldest_redelivery_ms: None,
            }
        );
        assert_eq!(
            g[1],
            ConsumerGauges {
                dead: 1,
                oldest_dead_ms: Some(50),
                ..ConsumerGauges::default()
            }
        );
        assert_eq!(g[2], ConsumerGauges::default());

        // An inline delivery's failed row is no worker's backlog (it
        // waits for its sender's redelivery).
        conn.execute(
            "UPDATE postroom_inbox SET queued = 0 WHERE message_id = 'k1'",
            [],
        )
        .unwrap();
        let g = read(&conn, &consumers(&["c"])).unwrap();
        assert_eq!((g[0].backlog, g[0].waiting_for_retry), (3, 1));
        assert_eq!(g[0].oldest_pending_ms, Some(300));
        // It waits for its redelivery, since its last attempt.
        assert_eq!(
            (g[0].waiting_for_redelivery, g[0].oldest_redelivery_ms),
            (1, Some(200))
        );
    }

    #[test]
    fn a_gap_in_a_sequence_stream_counts_its_missing_numbers() {
        let conn = db();
        // 1, 2 and 5 settled, 6 stored and pending: 3 and 4 never came.
        for seq in [1, 2, 5] {
            row(
                &conn,
                "c",
                &format!("m{seq}"),
                "completed",
                None,
                0,
                Some(seq),
            );
        }
        row(&conn, "c", "m6", "pending", None, 0, Some(6));
        let g = read(&conn, &consumers(&["c"])).unwrap();
        assert_eq!(g[0].watermark_gaps, 3, "3, 4 and 6 have not settled");
        row(&conn, "c", "m3", "completed", None, 0, Some(3));
        row(&conn, "c", "m4", "dead", None, 0, Some(4));
        conn.execute(
            "UPDATE postroom_inbox SET status = 'completed', processed_at = 0
                      WHERE message_id = 'm6'",
            [],
        )
        .unwrap();
        let g = read(&conn, &consumers(&["c"])).unwrap();
        assert_eq!(g[0].watermark_gaps, 0);
    }

    /// Not a check: what one read costs at its bounds (a backlog past
    /// [`COUNT_CAP`], dead letters past [`DEAD_CAP`], 300-byte payloads),
    /// all in memory. `cargo test --lib store::gauges -- --ignored
    /// --nocapture`.
    #[test]
    #[ignore = "a measurement"]
    fn measure_one_read_at_the_bounds() {
        let conn = db();
        conn.execute_batch("BEGIN").unwrap();
        for i in 0..150_000 {
            let status = if i % 100 == 0 { "failed" } else { "pending" };
            row(&conn, "c", &format!("p{i}"), status, None, i, None);
        }
        for i in 0..20_000 {
            row(&conn, "c", &format!("d{i}"), "dead", None, i, None);
        }
        conn.execute_batch("UPDATE postroom_inbox SET payload = zeroblob(300); COMMIT; ANALYZE")
            .unwrap();
        let names = consumers(&["c"]);
        let started = std::time::Instant::now();
        let runs = 20;
        for _ in 0..runs {
            let g = read(&conn, &names).unwrap();
            assert_eq!((g[0].backlog, g[0].dead), (COUNT_CAP, DEAD_CAP));
        }
        println!("one read: {:?}", started.elapsed() / runs);
    }

    /// Every read walks indexes or primary keys, never the inbox (whose
    /// retained rows can number millions); with and without statistics.
    #[test]
    fn the_reads_use_indexes() {
        let conn = db();
        for analyzed in [false, true] {
            if analyzed {
                conn.execute_batch("ANALYZE").unwrap();
            }
            for (sql, args) in [
                (OLDEST_PENDING, 1),
                (WAITING_FOR_RETRY, 2),
                (WAITING_FOR_REDELIVERY, 2),
                (DEAD, 1),
                (WATERMARK_GAPS, 1),
            ] {
                let mut stmt = conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
                let step = |r: &rusqlite::Row<'_>| r.get::<_, String>(3);
                let plan: Vec<String> = if args == 1 {
                    stmt.query_map(params![10], step)
                        .unwrap()
                        .map(Result::unwrap)
                        .collect()
                } else {
                    stmt.query_map(params!["c", 10], step)
                        .unwrap()
                        .map(Result::unwrap)
                        .collect()
                };
                // Tables are aliased in the joins: any `SCAN` but of a
                // subquery's rows must walk an index.
                for step in &plan {
                    let table_scan = step.starts_with("SCAN ")
                        && !step.contains("INDEX")
                        && !step.contains("subquery")
                        && !step.contains("CONSTANT ROW");
                    assert!(!table_scan, "walks a table ({analyzed}): {plan:?}\n{sql}");
                }
            }
        }
    }
}
