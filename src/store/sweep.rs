//! Retention of completed inbox rows as a walk in id order (schema version
//! 11). Before, an index of completed rows by completion time
//! (`postroom_inbox_done`) told retention where the old rows were, and
//! every message paid an entry in it: at one message per commit, a page of
//! its own per commit (issue 33). Rows complete in about the order they
//! were stored (inline ones as they are stored, queued ones soon after),
//! so retention walks the table's own order instead.
//!
//! A pass walks from a row id on, deletes every completed row processed
//! before the cutoff, steps over every other row (pending, processing,
//! failed, dead, and the completed rows [`find`] lists), and stops at the
//! first completed row processed at or after the cutoff, or at the newest
//! row of the inbox, which is never deleted (SQLite would give its id out
//! again). Each step reads at most [`READ`] rows and deletes at most the
//! caller's limit, in the caller's transaction.
//!
//! Values in `postroom_meta` let a pass start where the last one stopped
//! instead of at the table's first row:
//! * [`FRONTIER`] (F): the row id where the last pass stopped;
//! * [`SWEPT_AT`] (S): a time no later than the completion of any
//!   completed row below F: when the last pass that walked from the
//!   first row began, or the earliest completion it stepped over;
//! * [`STOPPED_AT`]: when the pass that stopped at F began, for the
//!   reaper's timer only ([`due`]).
//!
//! Invariant: every completed row with an id below F was processed at or
//! after S. A pass from the first row that stops at F saw each row below F
//! deleted, not yet completed (it completes later), or completed no
//! earlier than the S it notes; a pass from F moves F over rows it saw
//! likewise, and only while S is the one it began with. So a pass whose
//! cutoff is at or before S can delete nothing below F and starts at F;
//! once the cutoff passes S, it starts at the first row again (about once
//! per retention period while rows are left below F: a held key's
//! backlog, a row failed inline waiting for its redelivery, dead letters).
//!
//! What it rests on: every deletion checks the row itself (completed,
//! processed before the cutoff, not the newest), so no value can make
//! retention delete a row early. A wrong or missing value (a hand edit, a
//! clock set back below S while a row below F completes, an S from a
//! clock that ran ahead) can only make it delete rows later, or walk
//! further: an S in the future puts off the rows below F until then. A
//! missing F or S is a pass from the first row; a missing
//! [`STOPPED_AT`], a pass due at once.
//!
//! What the walk order changes: a completed row that a pass reaches while
//! it is too young holds the rows after it until it ages. Those rows were
//! stored after it, so each waits at most as long as that row took to
//! complete (a queued row that retried for an hour holds the inline rows
//! stored after it for that hour). A row that completed after a pass
//! stepped over it (a redriven dead letter) or that is stamped later than
//! the pass began holds nothing.

use rusqlite::types::Value;
use rusqlite::{params, Connection, OptionalExtension};

/// `postroom_meta` key: the row id where the last pass stopped.
pub(crate) const FRONTIER: &str = "retention_frontier";
/// `postroom_meta` key: when the last pass from the first row began.
pub(crate) const SWEPT_AT: &str = "retention_swept_at";
/// `postroom_meta` key: when the pass that stopped at [`FRONTIER`] began;
/// missing while a pass cut short moved it (see [`due`]).
pub(crate) const STOPPED_AT: &str = "retention_stopped_at";

/// Rows a step reads at most: deletions aside, about a millisecond.
pub(crate) const READ: usize = 1024;

/// Where a pass is, between the steps (each its own transaction).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Walk {
    /// Rows processed before this are deleted.
    cutoff: i64,
    /// When the pass began.
    began_at: i64,
    /// `None` before the first step, which reads it from `postroom_meta`.
    at: Option<At>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct At {
    /// The next row id to look at.
    next: i64,
    /// The pass walks from the first row (else from F).
    whole: bool,
    /// F when the pass began: a young completed row below it completed
    /// after an earlier pass stepped over it.
    frontier: i64,
    /// S when the pass began: a pass from F goes on only while it is
    /// unchanged (another pass from the first row may have moved F back).
    swept_at: Option<i64>,
    /// The earliest completion among the young rows below F that a pass
    /// from the first row stepped over: S is no later than it.
    young: Option<i64>,
}

impl Walk {
    /// A pass at `now_ms` deleting completed rows processed before
    /// `cutoff_ms`.
    pub(crate) fn new(cutoff_ms: i64, now_ms: i64) -> Self {
        Walk {
            cutoff: cutoff_ms,
            began_at: now_ms,
            at: None,
        }
    }
}

/// [`FRONTIER`] and [`SWEPT_AT`], each `None` when missing or not a
/// number.
fn state(conn: &Connection) -> rusqlite::Result<(Option<i64>, Option<i64>)> {
    Ok((read(conn, FRONTIER)?, read(conn, SWEPT_AT)?))
}

/// A number in `postroom_meta`; `None` when missing or not a number.
fn read(conn: &Connection, key: &str) -> rusqlite::Result<Option<i64>> {
    let value = conn
        .prepare_cached("SELECT value FROM postroom_meta WHERE key = ?1")?
        .query_row([key], |r| r.get::<_, Value>(0))
        .optional()?;
    Ok(match value {
        Some(Value::Integer(n)) => Some(n),
        Some(Value::Text(text)) => text.parse().ok(),
        _ => None,
    })
}

fn note(conn: &Connection, key: &str, value: i64) -> rusqlite::Result<()> {
    conn.prepare_cached(
        "INSERT INTO postroom_meta (key, value) VALUES (?1, ?2)
         ON CONFLICT (key) DO UPDATE SET value = excluded.value",
    )?
    .execute(params![key, value.to_string()])
    .map(drop)
}

/// Where a pass begins, and whether from the first row (see the module
/// doc).
fn start(conn: &Connection, cutoff: i64) -> rusqlite::Result<At> {
    let (frontier, swept_at) = state(conn)?;
    let whole = !matches!((frontier, swept_at), (Some(_), Some(s)) if cutoff <= s);
    let frontier = frontier.unwrap_or(i64::MIN);
    Ok(At {
        next: if whole { i64::MIN } else { frontier },
        whole,
        frontier,
        swept_at,
        young: None,
    })
}

/// What one step found from `at.next` on.
struct Found {
    /// Rows to delete: every one in `at.next..end` is completed, processed
    /// before the cutoff.
    deletable: usize,
    end: i64,
    /// The pass ends at `end` (a row too young, or the newest row), or
    /// goes on from there.
    stopped: bool,
}

/// Reads up to [`READ`] rows from `at.next` on, below the newest, for at
/// most `limit` rows to delete. Stepped over besides the rows not
/// completed:
/// * a completed row without a completion time, or with one that is not
///   an integer (only a hand edit makes one): it is never deleted, and
///   must neither hold every row after it nor fail every pass;
/// * a row completed at or after the pass began (during the pass, or
///   stamped by a clock that ran ahead): it cannot hold the rows after it
///   either, and S is no later than it;
/// * in a pass from the first row, a young row below F: it completed
///   after a pass stepped over it (a redriven dead letter, a retry that
///   took its time); S goes back to its completion time, so the pass
///   from the first row that can delete it comes when it can.
///
/// Only completed rows have their completion time read (`CASE`): the
/// payload before it is not read for the rows stepped over.
fn find(
    conn: &Connection,
    at: &mut At,
    cutoff: i64,
    began_at: i64,
    limit: usize,
) -> rusqlite::Result<Found> {
    let mut stmt = conn.prepare_cached(
        "SELECT id, CASE WHEN status <> 'completed' OR typeof(processed_at) <> 'integer'
                    THEN NULL ELSE processed_at END
         FROM postroom_inbox
         WHERE id >= ?1 AND id < (SELECT max(id) FROM postroom_inbox)
         ORDER BY id LIMIT ?2",
    )?;
    let mut rows = stmt.query(params![at.next, READ as i64])?;
    let (mut read, mut deletable, mut last) = (0, 0, None);
    while let Some(row) = rows.next()? {
        let id: i64 = row.get(0)?;
        match row.get::<_, Option<i64>>(1)? {
            None => {}
            Some(done) if done < cutoff => {
                if deletable == limit {
                    return Ok(Found {
                        deletable,
                        end: id,
                        stopped: false,
                    });
                }
                deletable += 1;
            }
            Some(done) if done >= began_at => {}
            Some(done) if at.whole && id < at.frontier => {
                at.young = Some(at.young.map_or(done, |y| y.min(done)));
            }
            Some(_) => {
                return Ok(Found {
                    deletable,
                    end: id,
                    stopped: true,
                })
            }
        }
        read += 1;
        last = Some(id);
    }
    match last {
        // `last` is below the newest id, so `last + 1` cannot overflow.
        Some(last) if read == READ => Ok(Found {
            deletable,
            end: last + 1,
            stopped: false,
        }),
        // Every row below the newest read: the pass stops at the newest.
        _ => {
            let newest: Option<i64> = conn
                .prepare_cached("SELECT max(id) FROM postroom_inbox")?
                .query_row([], |r| r.get(0))?;
            Ok(Found {
                deletable,
                end: newest.unwrap_or(at.next).max(at.next),
                stopped: true,
            })
        }
    }
}

/// One step of a pass, in the caller's transaction: deletes at most
/// `limit` rows and notes how far it got (see the module doc). Returns
/// the rows deleted, and the pass's next step (`None`: the pass is over).
pub(crate) fn step(
    conn: &Connection,
    walk: Walk,
    limit: usize,
) -> rusqlite::Result<(usize, Option<Walk>)> {
    let mut at = match walk.at {
        Some(at) => at,
        None => start(conn, walk.cutoff)?,
    };
    if !at.whole && read(conn, SWEPT_AT)? != at.swept_at {
        // Another pass (`postroom cleanup` beside the reaper) walked from
        // the first row meanwhile: F and S are its, and this pass's F
        // would not go with its S.
        return Ok((0, None));
    }
    let from = at.next;
    let found = find(conn, &mut at, walk.cutoff, walk.began_at, limit)?;
    let deleted = if found.deletable == 0 {
        0
    } else {
        conn.prepare_cached(
            "DELETE FROM postroom_inbox
             WHERE id >= ?1 AND id < ?2 AND status = 'completed' AND processed_at < ?3
               AND typeof(processed_at) = 'integer'",
        )?
        .execute(params![from, found.end, walk.cutoff])?
    };
    if found.stopped {
        note(conn, FRONTIER, found.end)?;
        note(conn, STOPPED_AT, walk.began_at)?;
        if at.whole {
            let swept_at = at.young.map_or(walk.began_at, |y| y.min(walk.began_at));
            note(conn, SWEPT_AT, swept_at)?;
        }
        return Ok((deleted, None));
    }
    if !at.whole {
        // Every row in `F..end` is deleted or was seen not completed
        // (or completed since the pass began): F may pass them, and a
        // pass cut short after this keeps what it did. The rows from
        // `end` on are not looked at yet: no time for them.
        note(conn, FRONTIER, found.end)?;
        conn.prepare_cached("DELETE FROM postroom_meta WHERE key = ?1")?
            .execute([STOPPED_AT])?;
    }
    at.next = found.end;
    Ok((
        deleted,
        Some(Walk {
            at: Some(at),
            ..walk
        }),
    ))
}

/// How many rows a pass at `now_ms` with this cutoff would delete, read
/// without writing: the same walk as [`step`]'s (`admin::cleanup`'s dry
/// run).
pub(crate) fn count(conn: &Connection, cutoff_ms: i64, now_ms: i64) -> rusqlite::Result<u64> {
    let mut at = start(conn, cutoff_ms)?;
    let mut total = 0u64;
    loop {
        let found = find(conn, &mut at, cutoff_ms, now_ms, usize::MAX)?;
        total += found.deletable as u64;
        if found.stopped {
            return Ok(total);
        }
        at.next = found.end;
    }
}

/// A new file's first pass, when its inbox has no rows and no [`FRONTIER`]
/// yet: it finds nothing and notes when it ran, so that the reaper's
/// timer ([`due`]) counts the first rows stored from then, instead of a
/// pass at once to find out where they are.
pub(crate) fn begin_empty(conn: &Connection, now_ms: i64) -> rusqlite::Result<()> {
    if read(conn, FRONTIER)?.is_some() {
        return Ok(());
    }
    let empty: bool = conn.query_row(
        "SELECT NOT EXISTS (SELECT 1 FROM postroom_inbox)",
        [],
        |r| r.get(0),
    )?;
    if !empty {
        return Ok(());
    }
    // One step over no rows: it stops, and notes F, S and the stop time.
    let tx = conn.unchecked_transaction()?;
    step(&tx, Walk::new(i64::MIN, now_ms), usize::MAX)?;
    tx.commit()
}

/// The completion time that a pass's cutoff must pass for it to have a
/// row to delete:
/// * the first row from F on (below the newest), if it is completed;
/// * if it is not: when the pass that stopped at F began
///   ([`STOPPED_AT`]). It stopped at the newest row (or at a completed
///   one since changed by hand), so every row from F on was stored, or
///   completes, after that. At once (`i64::MIN`) without one (a pass cut
///   short moved F over rows, and those after are not looked at yet);
/// * S, when a row other than a dead one is left below F (it completes
///   later than S), or more dead ones than one read looks at.
///
/// `None`: nothing to delete until a row is stored. Reads one row from F,
/// and at most [`READ`] from the first row.
pub(crate) fn due(conn: &Connection) -> rusqlite::Result<Option<i64>> {
    let (frontier, swept_at) = state(conn)?;
    let stopped_at = read(conn, STOPPED_AT)?;
    let frontier = frontier.unwrap_or(i64::MIN);
    let first: Option<(bool, Option<i64>)> = conn
        .prepare_cached(
            "SELECT status = 'completed',
                    iif(typeof(processed_at) = 'integer', processed_at, NULL)
             FROM postroom_inbox
             WHERE id >= ?1 AND id < (SELECT max(id) FROM postroom_inbox)
             ORDER BY id LIMIT 1",
        )?
        .query_row([frontier], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()?;
    let ahead = first.map(|first| match first {
        (true, Some(at)) => at,
        _ => stopped_at.unwrap_or(i64::MIN),
    });
    // Up to `READ` rows below F, in id order: dead letters kept for good
    // can number millions; past them, a pass from the first row once per
    // retention period is cheaper than reading them at every wake.
    let (below, dead): (i64, i64) = conn
        .prepare_cached(
            "SELECT count(*), count(*) FILTER (WHERE status = 'dead')
             FROM (SELECT status FROM postroom_inbox WHERE id < ?1 ORDER BY id LIMIT ?2)",
        )?
        .query_row(params![frontier, READ as i64], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })?;
    let behind = (dead < below || below == READ as i64).then(|| swept_at.unwrap_or(i64::MIN));
    Ok(match (ahead, behind) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::queue::tests::vm_ops;

    const CUTOFF: i64 = 10_000;

    fn db() -> Connection {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch(crate::store::schema::SCHEMA_SQL)
            .unwrap();
        conn
    }

    /// Stores rows in id order: `(status, processed_at)`.
    fn rows(conn: &Connection, rows: &[(&str, Option<i64>)]) {
        for (status, at) in rows {
            conn.execute(
                "INSERT INTO postroom_inbox (consumer, source, message_id, status, payload,
                     payload_hash, last_error, received_at, updated_at, processed_at,
                     lease_until, lease_token)
                 VALUES ('c', 's', lower(hex(randomblob(8))), ?1, x'', zeroblob(32),
                     iif(?1 IN ('failed', 'dead'), 'e', NULL), 0, 0, ?2, 1, 1)",
                params![status, at],
            )
            .unwrap();
        }
    }

    fn ids(conn: &Connection) -> Vec<i64> {
        conn.prepare("SELECT id FROM postroom_inbox ORDER BY id")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    }

    /// A whole pass at `now`, in steps of `limit`: rows deleted.
    fn pass(conn: &Connection, now: i64, limit: usize) -> usize {
        let (mut deleted, mut next) = (0, Some(Walk::new(now - 1000, now)));
        while let Some(walk) = next {
            let (n, after) = step(conn, walk, limit).unwrap();
            deleted += n;
            next = after;
        }
        deleted
    }

    #[test]
    fn a_pass_deletes_old_completed_rows_in_id_order_up_to_the_first_young_one() {
        let conn = db();
        let old = Some(CUTOFF - 1);
        rows(
            &conn,
            &[
                ("completed", old),          // 1: deleted
                ("pending", None),           // 2: stepped over
                ("dead", None),              // 3: stepped over
                ("processing", None),        // 4
                ("failed", None),            // 5
                ("completed", None),         // 6: a hand edit; stepped over
                ("completed", old),          // 7: deleted
                ("completed", Some(CUTOFF)), // 8: too young: the walk stops
                ("completed", old),          // 9: old, but after 8
                ("completed", old),          // 10: the newest, kept anyway
            ],
        );
        assert_eq!(count(&conn, CUTOFF, CUTOFF + 1000).unwrap(), 2);
        assert_eq!(pass(&conn, CUTOFF + 1000, usize::MAX), 2);
        assert_eq!(ids(&conn), [2, 3, 4, 5, 6, 8, 9, 10]);
        assert_eq!(state(&conn).unwrap(), (Some(8), Some(CUTOFF + 1000)));
        // Row 8 is the one to wait for, and nothing else.
        assert_eq!(due(&conn).unwrap(), Some(CUTOFF));
        // Once it ages, 8 and 9 go; the newest stays.
        assert_eq!(pass(&conn, CUTOFF + 1001, usize::MAX), 2);
        assert_eq!(ids(&conn), [2, 3, 4, 5, 6, 10]);
        assert_eq!(state(&conn).unwrap().0, Some(10));
    }

    /// Steps of any size, reads of [`READ`] rows across a backlog, and one
    /// step deleting everything delete the same rows, and a dry count
    /// says so first.
    #[test]
    fn steps_of_any_size_delete_what_one_step_deletes() {
        let layout: Vec<(&str, Option<i64>)> = (0..3 * READ + 7)
            .map(|i| match i % 5 {
                0 => ("pending", None),
                1 => ("dead", None),
                _ if i > 2 * READ + 3 && i % 7 == 0 => ("completed", Some(CUTOFF + 5)),
                _ => ("completed", Some(CUTOFF - 1)),
            })
            .collect();
        let mut outcome = None;
        for limit in [1, 7, 256, usize::MAX] {
            let conn = db();
            rows(&conn, &layout);
            let counted = count(&conn, CUTOFF, CUTOFF + 1000).unwrap();
            let deleted = pass(&conn, CUTOFF + 1000, limit);
            assert_eq!(counted, deleted as u64, "limit {limit}");
            assert!(deleted > READ, "the fixture deletes across reads");
            let now = (ids(&conn), state(&conn).unwrap());
            assert_eq!(
                *outcome.get_or_insert_with(|| now.clone()),
                now,
                "limit {limit}"
            );
        }
    }

    /// While a pass's cutoff is no later than the last walk from the first
    /// row, rows below the frontier cannot be old enough: a backlog there
    /// is not read again. Once the cutoff passes it, the rows that
    /// completed meanwhile are deleted, as if every pass had walked them.
    #[test]
    fn a_backlog_below_the_frontier_is_walked_once_per_retention_period() {
        let mut conn = db();
        let backlog = 3000;
        rows(&conn, &vec![("pending", None); backlog]);
        rows(&conn, &[("completed", Some(CUTOFF - 1)); 10]);
        // The first pass walks the backlog, deletes the ten but the newest.
        assert_eq!(pass(&conn, CUTOFF + 1000, usize::MAX), 9);
        assert_eq!(state(&conn).unwrap(), (Some(3010), Some(CUTOFF + 1000)));
        rows(&conn, &[("completed", Some(CUTOFF + 2000)); 5]);
        // The old newest row goes now that it is not the newest.
        let (deleted, ops) = vm_ops(&mut conn, |c| pass(c, CUTOFF + 2000, usize::MAX));
        assert_eq!(deleted, 1);
        let (_, whole) = vm_ops(&mut conn, |c| count(c, i64::MAX, i64::MAX).unwrap());
        assert!(
            ops * 20 < whole,
            "{ops} VM steps from the frontier, {whole} for a whole walk"
        );
        // Half the backlog completes later; a pass whose cutoff passes
        // their completion walks from the first row and deletes them.
        conn.execute(
            "UPDATE postroom_inbox SET status = 'completed', processed_at = ?1
             WHERE id <= 1500",
            [CUTOFF + 3000],
        )
        .unwrap();
        assert_eq!(due(&conn).unwrap(), Some(CUTOFF + 1000));
        // Rows 1-1500, then 3011-3014 (the newest, 3015, kept).
        assert_eq!(pass(&conn, CUTOFF + 4001, usize::MAX), 1500 + 4);
        assert_eq!(ids(&conn)[0], 1501);
    }

    /// A pass cut short between steps keeps what it did: one from the
    /// frontier moves the frontier as it goes; any later pass deletes
    /// exactly what an uncut one would have.
    #[test]
    fn a_pass_cut_short_loses_nothing() {
        let conn = db();
        rows(&conn, &[("dead", None), ("dead", None)]);
        // A whole walk at CUTOFF + 1000 stops at the newest, row 2.
        assert_eq!(pass(&conn, CUTOFF + 1000, usize::MAX), 0);
        assert_eq!(state(&conn).unwrap(), (Some(2), Some(CUTOFF + 1000)));
        rows(&conn, &vec![("pending", None); READ + 10]);
        rows(&conn, &[("completed", Some(CUTOFF - 1)); 3]);
        // Not yet past the last whole walk: from the frontier.
        let walk = Walk::new(CUTOFF + 500, CUTOFF + 1500);
        let (n, next) = step(&conn, walk, usize::MAX).unwrap();
        assert_eq!(n, 0);
        assert!(next.is_some(), "more than one read's worth of rows");
        assert_eq!(state(&conn).unwrap().0, Some(READ as i64 + 2));
        // Cut short here: the next pass goes on from there, and deletes
        // the old rows but the newest.
        assert_eq!(pass(&conn, CUTOFF + 1500, usize::MAX), 2);
        assert_eq!(pass(&conn, CUTOFF + 2001, usize::MAX), 0);
        assert_eq!(ids(&conn).len(), 2 + READ + 10 + 1);
    }

    /// A dead letter below the frontier, redriven and completed late,
    /// does not hold the rows after it: a walk from the first row steps
    /// over it, and S goes back to its completion, so that it goes once
    /// it is old (each redrive would otherwise stall retention for a
    /// retention period). Nor does a row stamped by a clock that ran
    /// ahead hold the rows after it.
    #[test]
    fn a_late_or_future_completion_holds_no_other_row() {
        let conn = db();
        let day = 1000; // `pass` keeps rows a day
        rows(&conn, &[("dead", None)]);
        rows(&conn, &[("completed", Some(CUTOFF - 1)); 5]);
        assert_eq!(pass(&conn, CUTOFF + day, usize::MAX), 4);
        assert_eq!(state(&conn).unwrap(), (Some(6), Some(CUTOFF + day)));
        // Row 1 redriven and completed at day 2.5; rows 7-9 at day 2.2,
        // one of them by a clock a year ahead.
        conn.execute(
            "UPDATE postroom_inbox SET status = 'completed', processed_at = ?1 WHERE id = 1",
            [CUTOFF + 2500],
        )
        .unwrap();
        rows(
            &conn,
            &[
                ("completed", Some(CUTOFF + 2200)),
                ("completed", Some(CUTOFF + 365 * day)),
                ("completed", Some(CUTOFF + 2200)),
                ("pending", None),
            ],
        );
        // Day 3 (cutoff day 2): a pass from the first row steps over row 1
        // (young, below F), deletes 6, and stops at 7 (young).
        assert_eq!(pass(&conn, CUTOFF + 3 * day, usize::MAX), 1);
        assert_eq!(ids(&conn), [1, 7, 8, 9, 10]);
        assert_eq!(state(&conn).unwrap(), (Some(7), Some(CUTOFF + 2500)));
        assert_eq!(due(&conn).unwrap(), Some(CUTOFF + 2200));
        // Day 3.5: rows 1, 7 and 9 go, 8 (from the future) is stepped
        // over; 10 is the newest.
        assert_eq!(pass(&conn, CUTOFF + 3501, usize::MAX), 3);
        assert_eq!(ids(&conn), [8, 10]);
    }

    /// A pass from the frontier ends, writing nothing, once another pass
    /// (an operator's `postroom cleanup` beside the reaper) walked from
    /// the first row: the frontier it would note goes with the old S.
    #[test]
    fn a_pass_from_the_frontier_yields_to_a_walk_from_the_first_row() {
        let conn = db();
        rows(&conn, &[("dead", None), ("dead", None)]);
        assert_eq!(pass(&conn, CUTOFF + 1000, usize::MAX), 0);
        rows(&conn, &vec![("pending", None); 2 * READ]);
        rows(&conn, &[("completed", Some(CUTOFF - 1)); 2]);
        let (_, next) = step(&conn, Walk::new(CUTOFF, CUTOFF + 1500), usize::MAX).unwrap();
        let frontier = state(&conn).unwrap().0;
        assert_eq!(frontier, Some(READ as i64 + 2));
        // The other pass, from the first row.
        assert_eq!(pass(&conn, CUTOFF + 3000, usize::MAX), 1);
        let theirs = state(&conn).unwrap();
        let (n, after) = step(&conn, next.unwrap(), usize::MAX).unwrap();
        assert_eq!((n, after), (0, None));
        assert_eq!(state(&conn).unwrap(), theirs);
    }

    /// Dead letters by the thousand below the frontier: the timer reads
    /// one read's worth, and then counts on a walk from the first row per
    /// retention period; a new file's first pass notes an empty inbox, so
    /// that its first rows are due a retention period after it.
    #[test]
    fn the_timer_reads_a_bounded_number_of_rows() {
        let conn = db();
        begin_empty(&conn, CUTOFF).unwrap();
        assert_eq!(due(&conn).unwrap(), None);
        rows(&conn, &[("pending", None), ("pending", None)]);
        assert_eq!(
            due(&conn).unwrap(),
            Some(CUTOFF),
            "stored after the empty pass"
        );
        // An existing file's inbox is not marked.
        conn.execute("DELETE FROM postroom_meta WHERE key = ?1", [FRONTIER])
            .unwrap();
        begin_empty(&conn, 0).unwrap();
        assert_eq!(state(&conn).unwrap(), (None, Some(CUTOFF)));
        // VM steps of the timer's read behind `dead` dead letters.
        let steps = |dead: usize| {
            let mut conn = db();
            rows(&conn, &vec![("dead", None); dead]);
            rows(&conn, &[("completed", Some(CUTOFF + 10)); 2]);
            assert_eq!(pass(&conn, CUTOFF + 1000, usize::MAX), 0);
            let (at, ops) = vm_ops(&mut conn, |c| due(c).unwrap());
            (at, ops)
        };
        let (few, few_ops) = steps(READ / 2);
        assert_eq!(few, Some(CUTOFF + 10), "dead letters alone are not due");
        let (many, many_ops) = steps(2 * READ);
        let (more, more_ops) = steps(8 * READ);
        assert_eq!(many, Some(CUTOFF + 10), "the next row");
        assert_eq!(more, many);
        assert!(
            more_ops < many_ops + many_ops / 4,
            "{more_ops} VM steps behind {} dead letters, {many_ops} behind {}",
            8 * READ,
            2 * READ
        );
        assert!(few_ops < many_ops);
    }

    /// A completion time that is not an integer (a hand edit: text, a
    /// real) is a row never deleted and stepped over, by the walk, its
    /// count and the timer alike: no pass fails on it, none stops at it.
    #[test]
    fn a_completion_time_of_another_type_fails_nothing() {
        let conn = db();
        rows(&conn, &[("completed", Some(CUTOFF - 1)); 6]);
        conn.execute_batch(
            "UPDATE postroom_inbox SET processed_at = 'soon' WHERE id = 2;
             UPDATE postroom_inbox SET processed_at = 1.5 WHERE id = 4;",
        )
        .unwrap();
        assert_eq!(count(&conn, CUTOFF, CUTOFF + 1000).unwrap(), 3);
        assert_eq!(pass(&conn, CUTOFF + 1000, usize::MAX), 3);
        assert_eq!(ids(&conn), [2, 4, 6]);
        // The timer reads row 2 first: a row a pass walks over.
        conn.execute("DELETE FROM postroom_meta WHERE key = ?1", [FRONTIER])
            .unwrap();
        assert_eq!(due(&conn).unwrap(), Some(CUTOFF + 1000));
    }

    /// Values in `postroom_meta` that are not numbers (a hand edit) are a
    /// pass from the first row, never a skipped row; a frontier past
    /// every row delays, never deletes early.
    #[test]
    fn hand_edited_positions_never_delete_early() {
        for (frontier, swept_at) in [("x", "y"), ("99999", "99999999"), ("-5", "")] {
            let conn = db();
            rows(
                &conn,
                &[
                    ("completed", Some(CUTOFF - 1)),
                    ("completed", Some(CUTOFF)),
                    ("completed", Some(CUTOFF - 1)),
                ],
            );
            conn.execute(
                "INSERT INTO postroom_meta (key, value) VALUES (?1, ?2), (?3, ?4)",
                params![FRONTIER, frontier, SWEPT_AT, swept_at],
            )
            .unwrap();
            let deleted = pass(&conn, CUTOFF + 1000, usize::MAX);
            assert!(deleted <= 1, "{frontier} {swept_at}: {deleted}");
            let left = ids(&conn);
            assert!(
                left.contains(&2) && left.contains(&3),
                "{frontier}: {left:?}"
            );
        }
    }

    /// Only dead rows below the frontier wait on nothing: retention is not
    /// due for them (an idle engine with dead letters stays asleep); a
    /// row brought back from the dead is.
    #[test]
    fn dead_rows_below_the_frontier_are_not_due_a_redriven_one_is() {
        let conn = db();
        rows(
            &conn,
            &[
                ("dead", None),
                ("completed", Some(CUTOFF - 1)),
                ("pending", None),
            ],
        );
        assert_eq!(pass(&conn, CUTOFF + 1000, usize::MAX), 1);
        assert_eq!(state(&conn).unwrap().0, Some(3));
        assert_eq!(due(&conn).unwrap(), None);
        conn.execute(
            "UPDATE postroom_inbox SET status = 'pending' WHERE id = 1",
            [],
        )
        .unwrap();
        assert_eq!(due(&conn).unwrap(), Some(CUTOFF + 1000));
        rows(&conn, &[("completed", Some(CUTOFF + 7))]);
        // Row 3, the newest when the pass stopped there, is not completed:
        // it and every row after it complete after that pass began.
        assert_eq!(due(&conn).unwrap(), Some(CUTOFF + 1000));
        conn.execute("DELETE FROM postroom_meta WHERE key = ?1", [STOPPED_AT])
            .unwrap();
        assert_eq!(due(&conn).unwrap(), Some(i64::MIN), "not known: at once");
    }

    /// The walk and its deletes read the table by row id ranges, with or
    /// without statistics: never a scan of the whole inbox.
    #[test]
    fn the_walk_reads_id_ranges() {
        let conn = db();
        rows(&conn, &vec![("completed", Some(1)); 50]);
        for analyzed in [false, true] {
            if analyzed {
                conn.execute_batch("ANALYZE").unwrap();
            }
            for sql in [
                "SELECT id, status = 'completed' AND processed_at IS NOT NULL, processed_at < ?2
                 FROM postroom_inbox
                 WHERE id >= ?1 AND id < (SELECT max(id) FROM postroom_inbox)
                 ORDER BY id LIMIT ?3",
                "DELETE FROM postroom_inbox
                 WHERE id >= ?1 AND id < ?2 AND status = 'completed' AND processed_at < ?3
                   AND typeof(processed_at) = 'integer'",
            ] {
                let plan: Vec<String> = conn
                    .prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
                    .unwrap()
                    .query_map([1, 2, 3], |r| r.get(3))
                    .unwrap()
                    .map(Result::unwrap)
                    .collect();
                let first = &plan[0];
                assert!(
                    first.contains("INTEGER PRIMARY KEY (rowid>? AND rowid<?)"),
                    "{analyzed}: {plan:?}"
                );
            }
        }
    }
}
