//! A consumer's backlog as its brakes see it (`Builder::backlog_limit`):
//! the rows stored for queued processing that have not settled — pending,
//! failed and waiting for a retry, or being processed.
//!
//! Invariants:
//! * counted through the partial indexes that already list those rows
//!   (nothing is written to keep a count: a delivery pays nothing for it);
//! * never more than `cap` rows of each index are read, so a count costs
//!   at most about the bound it is compared with, whatever the backlog.

use rusqlite::{params, Connection};

/// The rows of `consumer` waiting for or in queued processing, counted up
/// to `cap` (a larger backlog answers `cap`).
pub(crate) fn count(conn: &Connection, consumer: &str, cap: u64) -> rusqlite::Result<u64> {
    let limit = i64::try_from(cap).unwrap_or(i64::MAX);
    let n: i64 = conn
        .prepare_cached(COUNT)?
        .query_row(params![consumer, limit], |r| r.get(0))?;
    Ok(u64::try_from(n).unwrap_or(0).min(cap))
}

/// Unkeyed rows due or waiting for a retry (`postroom_inbox_due`), keyed
/// rows not settled (`postroom_inbox_ordering`), and unkeyed rows being
/// processed (`postroom_inbox_leased`: a few per worker).
const COUNT: &str = "SELECT
    (SELECT count(*) FROM (SELECT 1 FROM postroom_inbox
        WHERE consumer = ?1 AND queued = 1 AND status IN ('pending', 'failed')
          AND ordering_key IS NULL
        LIMIT ?2))
  + (SELECT count(*) FROM (SELECT 1 FROM postroom_inbox
        WHERE consumer = ?1 AND ordering_key IS NOT NULL
          AND status IN ('pending', 'processing', 'failed') AND queued = 1
        LIMIT ?2))
  + (SELECT count(*) FROM (SELECT 1 FROM postroom_inbox
        WHERE status = 'processing' AND ordering_key IS NULL AND consumer = ?1
        LIMIT ?2))";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::schema;

    fn db() -> Connection {
        let mut conn = Connection::open_in_memory().unwrap();
        schema::migrate(&mut conn).unwrap();
        conn
    }

    fn row(conn: &Connection, consumer: &str, id: &str, status: &str, key: Option<&str>) {
        conn.execute(
            "INSERT INTO postroom_inbox (consumer, source, message_id, status, payload_hash,
                 ordering_key, received_at, updated_at, queued, lease_until)
             VALUES (?1, 's', ?2, ?3, zeroblob(32), ?4, 0, 0, 1,
                     CASE WHEN ?3 = 'processing' THEN 1 END)",
            params![consumer, id, status, key],
        )
        .unwrap();
    }

    #[test]
    fn counts_unsettled_queued_rows_of_one_consumer_up_to_the_cap() {
        let conn = db();
        let statuses = ["pending", "failed", "processing", "completed", "dead"];
        for (i, status) in statuses.iter().enumerate() {
            row(&conn, "c", &format!("u{i}"), status, None);
            row(&conn, "c", &format!("k{i}"), status, Some("doc"));
            row(&conn, "other", &format!("o{i}"), status, None);
        }
        // Pending, failed and processing, keyed and not.
        assert_eq!(count(&conn, "c", 100).unwrap(), 6);
        assert_eq!(count(&conn, "other", 100).unwrap(), 3);
        assert_eq!(count(&conn, "nobody", 100).unwrap(), 0);
        assert_eq!(count(&conn, "c", 2).unwrap(), 2);
        // A row an inline delivery left failed is not the workers' backlog.
        conn.execute("UPDATE postroom_inbox SET queued = 0", [])
            .unwrap();
        assert_eq!(count(&conn, "c", 100).unwrap(), 1, "the processing row");
    }

    /// The count walks indexes, never the inbox, whose retained rows can
    /// number millions; with and without statistics.
    #[test]
    fn the_count_uses_indexes() {
        let conn = db();
        for analyzed in [false, true] {
            if analyzed {
                conn.execute_batch("ANALYZE").unwrap();
            }
            let plan: Vec<String> = conn
                .prepare(&format!("EXPLAIN QUERY PLAN {COUNT}"))
                .unwrap()
                .query_map(params!["c", 10], |r| r.get::<_, String>(3))
                .unwrap()
                .map(Result::unwrap)
                .collect();
            for step in &plan {
                assert!(
                    !step.starts_with("SCAN postroom_") || step.contains("INDEX"),
                    "walks a table ({analyzed}): {plan:?}"
                );
            }
        }
    }
}
