//! When work next comes due, read from the data, so that the engine's
//! threads sleep until then instead of polling (issue 33: an idle engine
//! is asleep).
//!
//! Each function returns the earliest time (unix ms, the same clock as the
//! stored timestamps) strictly after `now` at which a row becomes due: a
//! row already due but not taken (its key busy, say) is left out, since
//! what frees it (a commit, a lease expiring) wakes its thread anyway, and
//! counting it would make the thread spin. Invariant: each read walks
//! every row its due query walked to find none due (the same partial
//! indexes; it runs only after that query found nothing), so it costs no
//! more than the query before it, and its answer is exact. It used to stop
//! at 1,000 rows and mark the answer partial, to be looked at again within
//! a second: a backlog the sink or a handler put off (an edge device
//! offline for hours) then woke the relay or the dispatcher, and the
//! writer, every second for as long as it waited. `partial` is now only a
//! failed read's answer (see the callers).

use std::time::Duration;

use rusqlite::{params, Connection};

use crate::clock;
use crate::store::retention::Keep;
use crate::store::sweep;

/// The earliest time something comes due.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct NextDue {
    /// Unix ms; `None`: nothing waits on the clock.
    pub at: Option<i64>,
    /// The read failed: a row may come due sooner than `at`.
    pub partial: bool,
}

impl NextDue {
    /// The earlier of the two.
    pub fn min(self, other: NextDue) -> NextDue {
        let at = match (self.at, other.at) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        NextDue {
            at,
            partial: self.partial || other.partial,
        }
    }

    /// How long from `now_ms` until then, at most `cap`, and at most
    /// `recheck` when the read was partial.
    pub fn wait(self, now_ms: i64, cap: Duration, recheck: Duration) -> Duration {
        let cap = if self.partial { cap.min(recheck) } else { cap };
        match self.at {
            Some(at) => {
                let ms = u64::try_from(at.saturating_sub(now_ms)).unwrap_or(0);
                Duration::from_millis(ms).min(cap)
            }
            None => cap,
        }
    }
}

/// `SELECT t FROM … LIMIT ?n` → the least `t > now`, and whether the
/// limit was reached.
fn earliest(
    conn: &Connection,
    rows: &str,
    args: &[&dyn rusqlite::ToSql],
) -> rusqlite::Result<NextDue> {
    // ?1 is now, ?2 the scan limit, ?3 on: the statement's own.
    let sql =
        format!("SELECT min(CASE WHEN t > ?1 THEN t END), count(*) >= ?2 FROM ({rows} LIMIT ?2)");
    conn.prepare_cached(&sql)?.query_row(args, |r| {
        Ok(NextDue {
            at: r.get(0)?,
            partial: r.get(1)?,
        })
    })
}

/// Queued rows of consumer `?3` without an ordering key (`postroom_inbox_due`,
/// named: statistics taken while the whole inbox was queued would have
/// SQLite scan the table through every row completed since; see
/// `queue::due_rows`).
const INBOX_UNKEYED: &str = "SELECT coalesce(next_attempt_at, 0) AS t
     FROM postroom_inbox INDEXED BY postroom_inbox_due
     WHERE consumer = ?3 AND queued = 1 AND status IN ('pending', 'failed')
       AND ordering_key IS NULL";
/// The heads of consumer `?3`'s ordering keys.
const INBOX_HEADS: &str = "SELECT coalesce(i.next_attempt_at, 0) AS t
     FROM postroom_inbox_heads h JOIN postroom_inbox i ON i.id = h.head_id
     WHERE h.consumer = ?3 AND i.queued = 1 AND i.status IN ('pending', 'failed')";
/// The outbox's heads (`postroom_outbox_ready`, named: statistics taken
/// while the whole outbox was pending would have SQLite scan the table
/// through every row sent since; see `outbox::fetch_due`).
const OUTBOX_HEADS: &str = "SELECT next_attempt_at AS t
     FROM postroom_outbox INDEXED BY postroom_outbox_ready
     WHERE status = 'pending' AND head = 1";
/// Keyed outbox rows waiting out a backoff (`postroom_outbox_waiting`,
/// named for the same reason).
const OUTBOX_WAITING: &str = "SELECT next_attempt_at AS t
     FROM postroom_outbox INDEXED BY postroom_outbox_waiting
     WHERE status = 'pending' AND key IS NOT NULL AND next_attempt_at > 0";

/// When `consumer`'s queued rows next come due: rows without a key from
/// `postroom_inbox_due`, keyed rows by their key's head (the only row of a
/// key that may run). See `queue::due_rows`.
pub(crate) fn inbox(conn: &Connection, consumer: &str, now_ms: i64) -> rusqlite::Result<NextDue> {
    let unkeyed = earliest(conn, INBOX_UNKEYED, params![now_ms, i64::MAX, consumer])?;
    let heads = earliest(conn, INBOX_HEADS, params![now_ms, i64::MAX, consumer])?;
    Ok(unkeyed.min(heads))
}

/// When pending outbox rows next come due: the heads (every pending row
/// without a key, and each key's first pending row: `postroom_outbox_ready`,
/// what the relay reads) and keyed rows waiting out a backoff
/// (`postroom_outbox_waiting`: a key's rows go as far as its first one
/// still waiting). See `outbox::fetch_due`.
pub(crate) fn outbox(conn: &Connection, now_ms: i64) -> rusqlite::Result<NextDue> {
    let heads = earliest(conn, OUTBOX_HEADS, params![now_ms, i64::MAX])?;
    let waiting = earliest(conn, OUTBOX_WAITING, params![now_ms, i64::MAX])?;
    Ok(heads.min(waiting))
}

/// When retention next has a row to delete: for completed inbox rows
/// what `sweep::due` reads, otherwise the oldest row of each kind it
/// deletes (one index step each, on the indexes its deletes use), plus how
/// long that kind is kept. The newest row of the inbox and of the outbox
/// is never deleted (see `queue::DELETE_DEAD`), so it is left out here
/// too, or a lone old row would be due forever. Rows a pass would delete
/// at `now_ms` give a time at or before it.
pub(crate) fn retention(conn: &Connection, keep: Keep) -> rusqlite::Result<Option<i64>> {
    let oldest = |sql: &str| -> rusqlite::Result<Option<i64>> {
        conn.prepare_cached(sql)?.query_row([], |r| r.get(0))
    };
    // Deletes take rows strictly before `now - keep`: one ms later.
    let after = |t: Option<i64>, keep: Duration| {
        t.map(|t| t.saturating_add(clock::millis(keep)).saturating_add(1))
    };
    let mut times = vec![
        after(sweep::due(conn)?, keep.completed),
        after(
            oldest(
                "SELECT min(sent_at) FROM postroom_outbox
                 WHERE status = 'sent' AND +seq < (SELECT max(seq) FROM postroom_outbox)",
            )?,
            keep.completed,
        ),
    ];
    if let Some(dead) = keep.dead {
        times.push(after(
            oldest(
                "SELECT min(updated_at) FROM postroom_inbox
                 WHERE status = 'dead' AND +id < (SELECT max(id) FROM postroom_inbox)",
            )?,
            dead,
        ));
    }
    if let Some(conflicts) = keep.conflicts {
        times.push(after(
            oldest("SELECT min(last_seen_at) FROM postroom_conflicts")?,
            conflicts,
        ));
    }
    Ok(times.into_iter().flatten().min())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::schema;

    /// More rows than the reads once stopped at.
    const ROWS: i64 = 1500;

    fn db() -> Connection {
        let mut conn = Connection::open_in_memory().unwrap();
        schema::migrate(&mut conn).unwrap();
        conn
    }

    /// Every due-time read goes through an index, with or without
    /// statistics: none may walk a table, whose retained rows (sent,
    /// completed) can number millions and are read on every sleep.
    /// (Schema 8 dropped the index the outbox read used; the read then
    /// walked the whole outbox.)
    #[test]
    fn due_reads_use_indexes() {
        let conn = db();
        for analyzed in [false, true] {
            if analyzed {
                conn.execute_batch("ANALYZE").unwrap();
            }
            for rows in [INBOX_UNKEYED, INBOX_HEADS, OUTBOX_HEADS, OUTBOX_WAITING] {
                let sql =
                    format!("EXPLAIN QUERY PLAN SELECT t FROM ({rows} LIMIT ?2) WHERE ?1 >= 0");
                let mut stmt = conn.prepare(&sql).unwrap();
                let n = stmt.parameter_count();
                let values: Vec<rusqlite::types::Value> = (0..n)
                    .map(|i| {
                        if i == 2 {
                            "c".to_string().into()
                        } else {
                            1000i64.into()
                        }
                    })
                    .collect();
                let plan: Vec<String> = stmt
                    .query_map(rusqlite::params_from_iter(values), |r| {
                        r.get::<_, String>(3)
                    })
                    .unwrap()
                    .map(Result::unwrap)
                    .collect();
                for step in &plan {
                    assert!(
                        !step.starts_with("SCAN postroom_") || step.contains("INDEX"),
                        "{rows}: walks a table ({analyzed}): {plan:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_wait_is_capped_and_never_negative() {
        let cap = Duration::from_secs(60);
        let second = Duration::from_secs(1);
        let none = NextDue::default();
        assert_eq!(none.wait(1000, cap, second), cap);
        let soon = NextDue {
            at: Some(3000),
            partial: false,
        };
        assert_eq!(soon.wait(1000, cap, second), Duration::from_secs(2));
        assert_eq!(soon.wait(5000, cap, second), Duration::ZERO);
        let partial = NextDue {
            at: None,
            partial: true,
        };
        assert_eq!(partial.min(soon).wait(1000, cap, second), second);
    }

    /// A queued row of `consumer`, `status`, due at `next` (NULL: now).
    fn inbox_row(
        conn: &Connection,
        consumer: &str,
        id: &str,
        key: Option<&str>,
        next: Option<i64>,
    ) {
        conn.execute(
            "INSERT INTO postroom_inbox (consumer, source, message_id, status, payload,
                 payload_hash, ordering_key, queued, next_attempt_at, received_at, updated_at)
             VALUES (?1, 's', ?2, iif(?4 IS NULL, 'pending', 'failed'), x'', zeroblob(32), ?3,
                 1, ?4, 0, 0)",
            params![consumer, id, key, next],
        )
        .unwrap();
    }

    #[test]
    fn the_inbox_is_due_at_its_earliest_future_row_unkeyed_or_head() {
        let conn = db();
        // Due now (taken, or waiting on a busy key): not a timer.
        inbox_row(&conn, "c", "now", None, None);
        inbox_row(&conn, "c", "later", None, Some(9_000));
        inbox_row(&conn, "c", "head", Some("k"), Some(5_000));
        // Behind its key's head: that head decides.
        inbox_row(&conn, "c", "behind", Some("k"), Some(2_000));
        inbox_row(&conn, "other", "soon", None, Some(1_500));
        let due = inbox(&conn, "c", 1_000).unwrap();
        assert_eq!(
            due,
            NextDue {
                at: Some(5_000),
                partial: false
            }
        );
        assert_eq!(inbox(&conn, "c", 6_000).unwrap().at, Some(9_000));
        assert_eq!(inbox(&conn, "c", 9_000).unwrap().at, None);
    }

    #[test]
    fn a_long_read_is_whole() {
        let conn = db();
        conn.execute_batch(&format!(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < {ROWS})
             INSERT INTO postroom_inbox (consumer, source, message_id, status, payload,
                 payload_hash, queued, next_attempt_at, received_at, updated_at)
             SELECT 'c', 's', 'm' || i, 'failed', x'', zeroblob(32), 1, 10000 + i, 0, 0 FROM n;"
        ))
        .unwrap();
        // The earliest is the last row in the index's order.
        conn.execute(
            "UPDATE postroom_inbox SET next_attempt_at = 5000 WHERE message_id = ?1",
            [format!("m{ROWS}")],
        )
        .unwrap();
        let due = inbox(&conn, "c", 0).unwrap();
        assert_eq!(
            due,
            NextDue {
                at: Some(5_000),
                partial: false
            }
        );
    }

    #[test]
    fn the_outbox_is_read_whole_never_partial() {
        let conn = db();
        // The earliest is the last row in seq order.
        conn.execute_batch(&format!(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < {ROWS})
             INSERT INTO postroom_outbox (message_id, topic, payload, status, next_attempt_at, created_at)
             SELECT 'o' || i, 't', x'', 'pending', iif(i = {ROWS}, 20000, 30000), 0 FROM n;"
        ))
        .unwrap();
        let due = outbox(&conn, 0).unwrap();
        assert_eq!(
            due,
            NextDue {
                at: Some(20_000),
                partial: false
            }
        );
    }

    #[test]
    fn retention_is_due_after_the_oldest_row_but_never_for_the_newest() {
        let conn = db();
        let keep = Keep {
            completed: Duration::from_secs(10),
            dead: None,
            conflicts: None,
        };
        let completed = |id: &str, at: i64| {
            conn.execute(
                "INSERT INTO postroom_inbox (consumer, source, message_id, status, payload,
                     payload_hash, received_at, updated_at, processed_at)
                 VALUES ('c', 's', ?1, 'completed', x'', zeroblob(32), 0, 0, ?2)",
                params![id, at],
            )
            .unwrap();
        };
        completed("a", 1_000);
        // The newest row is kept whatever its age (ids are not reused).
        assert_eq!(retention(&conn, keep).unwrap(), None);
        completed("b", 2_000);
        // Deletes take rows strictly before `now - keep`.
        assert_eq!(retention(&conn, keep).unwrap(), Some(11_001));
    }

    #[test]
    fn nothing_due_in_an_empty_database() {
        let conn = db();
        assert_eq!(inbox(&conn, "c", 0).unwrap(), NextDue::default());
        assert_eq!(outbox(&conn, 0).unwrap(), NextDue::default());
        let keep = Keep {
            completed: Duration::from_secs(1),
            dead: Some(Duration::from_secs(1)),
            conflicts: Some(Duration::from_secs(1)),
        };
        assert_eq!(retention(&conn, keep).unwrap(), None);
    }
}
