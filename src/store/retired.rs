//! Key entries of completed rows that retention deleted: deleted after
//! their rows, many at a time, in key order (schema.sql,
//! `postroom_retired_keys`, says why).
//!
//! A drain reads up to [`READ_LIMIT`] retired keys at once (outside any
//! write transaction), sorts them, deletes their entries [`DELETE_BATCH`]
//! per write transaction, then clears the notes it read, [`CLEAR_BATCH`]
//! per transaction. A crash part-way leaves notes, and the next drain
//! deletes what is left: deleting an entry twice is a no-op.

use std::cmp::Ordering;

use rusqlite::{params, Connection};

/// Retired keys read, sorted and deleted per round, and completed rows
/// deleted between drains. The more at once, the
/// more of them share a leaf of the key table: at a million keys, deleting
/// 256 in key order wrote 208 WAL pages with 10,240 pending and 54 with
/// 102,400; deleted with their rows, one by one, about 258.
const READ_LIMIT: usize = 131_072;

/// Bytes of key text read per round at most: with [`READ_LIMIT`], what
/// bounds a drain's memory, about 14 MiB (6 MiB of per-key overhead, 8 of
/// text; 46-byte keys take 12 MiB).
const READ_BYTES: usize = 8 << 20;

/// Key entries deleted per write transaction. In key order they share
/// leaves: at a million keys, 1,024 of them wrote 167 WAL pages, fewer
/// than the 277 of one 256-row retention batch that deleted its entries
/// too (schema 2). Under a caller that never pauses, a background job runs
/// about every 25 ms, so retention's speed is rows per job.
pub(crate) const DELETE_BATCH: usize = 1_024;

/// Notes cleared per write transaction: a range of `seq`, a few dozen
/// pages.
const CLEAR_BATCH: usize = 4_096;

/// A key of `postroom_inbox_keys`, its three parts in one allocation,
/// ordered as the table's primary key orders them (bytewise, part by part).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RetiredKey {
    text: Box<str>,
    consumer_end: usize,
    source_end: usize,
}

impl RetiredKey {
    fn new(consumer: &str, source: &str, message_id: &str) -> Self {
        let text = [consumer, source, message_id].concat().into_boxed_str();
        RetiredKey {
            text,
            consumer_end: consumer.len(),
            source_end: consumer.len() + source.len(),
        }
    }

    fn parts(&self) -> (&str, &str, &str) {
        (
            &self.text[..self.consumer_end],
            &self.text[self.consumer_end..self.source_end],
            &self.text[self.source_end..],
        )
    }
}

impl Ord for RetiredKey {
    fn cmp(&self, other: &Self) -> Ordering {
        self.parts().cmp(&other.parts())
    }
}

impl PartialOrd for RetiredKey {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Retired keys read in one round, sorted, and the highest `seq` read.
#[derive(Debug)]
pub(crate) struct Retired {
    pub keys: Vec<RetiredKey>,
    pub last_seq: i64,
}

/// One write transaction's share of a drain.
#[derive(Debug)]
pub(crate) enum Batch {
    /// Delete these key entries, if still retired.
    Delete(Vec<RetiredKey>),
    /// Clear up to [`CLEAR_BATCH`] notes with `seq` at most this: every
    /// key they name has had its `Delete` committed.
    Clear(i64),
}

/// The oldest retired keys, up to [`READ_LIMIT`] of them and
/// [`READ_BYTES`] of text, sorted; `None` when there are none.
pub(crate) fn read(conn: &Connection) -> rusqlite::Result<Option<Retired>> {
    let mut stmt = conn.prepare_cached(
        "SELECT seq, consumer, source, message_id FROM postroom_retired_keys
         ORDER BY seq LIMIT ?1",
    )?;
    let mut rows = stmt.query([i64::try_from(READ_LIMIT).unwrap_or(i64::MAX)])?;
    let mut keys = Vec::new();
    let mut last_seq = None;
    let mut bytes = 0;
    while let Some(r) = rows.next()? {
        let seq: i64 = r.get(0)?;
        last_seq = Some(seq);
        let parts = (
            r.get_ref(1)?.as_str(),
            r.get_ref(2)?.as_str(),
            r.get_ref(3)?.as_str(),
        );
        if let (Ok(consumer), Ok(source), Ok(message_id)) = parts {
            let key = RetiredKey::new(consumer, source, message_id);
            bytes += key.text.len();
            keys.push(key);
        } else {
            // Not the engine's (its keys are UTF-8 text): written by hand
            // SQL. Its entry stays, and `postroom check` reports it once
            // the note is cleared, rather than stopping retention here.
            log::warn!("postroom: retired key {seq} is not UTF-8 text; its key entry is kept");
        }
        if bytes >= READ_BYTES {
            break;
        }
    }
    keys.sort_unstable();
    Ok(last_seq.map(|last_seq| Retired { keys, last_seq }))
}

/// Applies one batch. Deletes only entries still retired: completed, with
/// no inbox row of their key at their `inbox_id` (an entry a new delivery
/// has since taken over points to its live row and stays). Returns entries
/// deleted, or notes cleared.
pub(crate) fn apply(conn: &Connection, batch: &Batch) -> rusqlite::Result<usize> {
    match batch {
        Batch::Delete(keys) => {
            let mut stmt = conn.prepare_cached(
                "DELETE FROM postroom_inbox_keys
                 WHERE consumer = ?1 AND source = ?2 AND message_id = ?3 AND completed = 1
                   AND NOT EXISTS (SELECT 1 FROM postroom_inbox i
                                   WHERE i.id = postroom_inbox_keys.inbox_id
                                     AND i.consumer = ?1 AND i.source = ?2
                                     AND i.message_id = ?3)",
            )?;
            let mut deleted = 0;
            for key in keys {
                let (consumer, source, message_id) = key.parts();
                deleted += stmt.execute(params![consumer, source, message_id])?;
            }
            Ok(deleted)
        }
        Batch::Clear(through) => conn
            .prepare_cached(CLEAR)?
            .execute(params![through, CLEAR_BATCH as i64]),
    }
}

/// Deletes the oldest notes with `seq <= ?1`, at most `?2` of them, as one
/// range of the rowid: up to the `?2`-th such note, or `?1` when there are
/// fewer. (`seq IN (SELECT … LIMIT ?2)` was the first form: with
/// statistics taken while few notes waited, SQLite scanned the whole table
/// for each batch instead of looking the rowids up.)
const CLEAR: &str = "DELETE FROM postroom_retired_keys
     WHERE seq <= coalesce(
         (SELECT seq FROM postroom_retired_keys WHERE seq <= ?1
          ORDER BY seq LIMIT 1 OFFSET ?2 - 1),
         ?1)";

/// Retention of completed inbox rows and, after them, their key entries:
/// `delete(max)` deletes expired rows until none is left (answering
/// `(deleted, true)`) or at least `max` were (`(deleted, false)`), and
/// `drain` deletes the entries, every [`READ_LIMIT`] rows (one read's
/// worth) and at the end, so a pass that runs to its end leaves none.
/// Returns rows and entries deleted.
pub(crate) fn retire<E>(
    mut delete: impl FnMut(u64) -> Result<(u64, bool), E>,
    mut drain: impl FnMut() -> Result<u64, E>,
) -> Result<(u64, u64), E> {
    let (mut rows, mut entries) = (0, 0);
    loop {
        let (deleted, done) = delete(READ_LIMIT as u64)?;
        rows += deleted;
        entries += drain()?;
        if done {
            return Ok((rows, entries));
        }
    }
}

/// Drains every retired key: `read` rounds until it finds none, each
/// written as batches through `write` (one transaction each): the
/// deletions, then the clearing. Returns key entries deleted.
pub(crate) fn drain<E>(
    mut read: impl FnMut() -> Result<Option<Retired>, E>,
    mut write: impl FnMut(Batch) -> Result<usize, E>,
) -> Result<u64, E> {
    let mut deleted = 0u64;
    while let Some(Retired { keys, last_seq }) = read()? {
        let mut keys = keys.into_iter().peekable();
        while keys.peek().is_some() {
            let batch: Vec<RetiredKey> = keys.by_ref().take(DELETE_BATCH).collect();
            deleted += write(Batch::Delete(batch))? as u64;
        }
        while write(Batch::Clear(last_seq))? == CLEAR_BATCH {}
    }
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `CLEAR` clears the oldest notes up to `through`, at most
    /// [`CLEAR_BATCH`] at a time, gaps in `seq` or not, by a rowid range
    /// even when the statistics say the table is small.
    #[test]
    fn clearing_takes_the_oldest_notes_by_a_rowid_range() {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch(crate::store::schema::SCHEMA_SQL)
            .unwrap();
        let notes = |n: usize| {
            conn.execute_batch(&format!(
                "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < {n})
                 INSERT INTO postroom_retired_keys (consumer, source, message_id)
                 SELECT 'c', 's', 'm' || i FROM n;"
            ))
            .unwrap()
        };
        notes(50);
        conn.execute_batch("ANALYZE").unwrap();
        notes(10_000);
        // Gaps: every third note below 3,000 is gone already.
        conn.execute_batch("DELETE FROM postroom_retired_keys WHERE seq < 3000 AND seq % 3 = 0")
            .unwrap();
        let plan: Vec<String> = conn
            .prepare(&format!("EXPLAIN QUERY PLAN {CLEAR}"))
            .unwrap()
            .query_map(params![6000, CLEAR_BATCH as i64], |r| r.get(3))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert!(
            plan.iter().all(|line| !line.starts_with("SCAN")),
            "{plan:?}"
        );
        let left = |conn: &Connection| -> (i64, i64) {
            conn.query_row(
                "SELECT count(*), min(seq) FROM postroom_retired_keys WHERE seq <= 6000",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap()
        };
        let (before, _) = left(&conn);
        let clear = || apply(&conn, &Batch::Clear(6000)).unwrap();
        assert_eq!(clear(), CLEAR_BATCH);
        let (after, oldest) = left(&conn);
        assert_eq!(after, before - CLEAR_BATCH as i64);
        let nth: i64 = conn
            .query_row(
                "SELECT count(*) FROM postroom_retired_keys WHERE seq < ?1",
                [oldest],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(nth, 0, "the oldest notes went first");
        assert_eq!(clear() as i64, after, "then the rest up to 6000");
        assert_eq!(clear(), 0);
        let beyond: i64 = conn
            .query_row("SELECT count(*) FROM postroom_retired_keys", [], |r| {
                r.get(0)
            })
            .unwrap();
        assert_eq!(beyond, 10_050 - 6000, "notes past 6000 stay");
    }

    #[test]
    fn keys_order_part_by_part_as_the_primary_key_does() {
        // Concatenated, "ab"+"c" and "a"+"bc" are the same text; as keys,
        // the first is greater (its consumer "ab" > "a").
        let mut keys = [
            RetiredKey::new("ab", "c", "1"),
            RetiredKey::new("a", "bc", "1"),
            RetiredKey::new("a", "b", "2"),
            RetiredKey::new("a", "b", "10"),
        ];
        keys.sort();
        let parts: Vec<_> = keys.iter().map(RetiredKey::parts).collect();
        assert_eq!(
            parts,
            [
                ("a", "b", "10"),
                ("a", "b", "2"),
                ("a", "bc", "1"),
                ("ab", "c", "1")
            ]
        );
    }
}
