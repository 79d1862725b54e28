//! Key entries of completed rows that retention deleted: deleted after
//! their rows, many at a time, in key order (schema.sql,
//! `postroom_retired_keys`, says why).
//!
//! A drain reads up to [`READ_LIMIT`] retired keys at once (outside any
//! write transaction: on a read connection), sorts them, deletes their
//! entries [`DELETE_BATCH`] per write transaction, and clears the keys it
//! read with the last batch. A crash part-way leaves the keys noted, and
//! the next drain deletes what is left: deleting an entry twice is a no-op.

use std::cmp::Ordering;

use rusqlite::{params, Connection};

/// Retired keys read, sorted and deleted per round: about 90 bytes of
/// memory each for a 46-byte key, 12 MiB at most. The more at once, the
/// more of them share a leaf of the key table: at a million keys, deleting
/// 256 in key order wrote 208 WAL pages with 10,240 pending and 54 with
/// 102,400; deleted with their rows, one by one, about 258.
pub(crate) const READ_LIMIT: usize = 131_072;

/// Key entries deleted per write transaction: a few milliseconds.
pub(crate) const DELETE_BATCH: usize = 256;

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

/// One write transaction's share of a drain: entries to delete, and, with
/// the round's last batch, the `seq` through which to clear the notes.
#[derive(Debug)]
pub(crate) struct Batch {
    pub keys: Vec<RetiredKey>,
    pub clear_through: Option<i64>,
}

/// The oldest `limit` retired keys, sorted; `None` when there are none.
pub(crate) fn read(conn: &Connection, limit: usize) -> rusqlite::Result<Option<Retired>> {
    let mut stmt = conn.prepare_cached(
        "SELECT seq, consumer, source, message_id FROM postroom_retired_keys
         ORDER BY seq LIMIT ?1",
    )?;
    let mut rows = stmt.query([i64::try_from(limit).unwrap_or(i64::MAX)])?;
    let mut keys = Vec::new();
    let mut last_seq = None;
    while let Some(r) = rows.next()? {
        last_seq = Some(r.get::<_, i64>(0)?);
        keys.push(RetiredKey::new(
            r.get_ref(1)?.as_str()?,
            r.get_ref(2)?.as_str()?,
            r.get_ref(3)?.as_str()?,
        ));
    }
    keys.sort_unstable();
    Ok(last_seq.map(|last_seq| Retired { keys, last_seq }))
}

/// Deletes the batch's key entries that are still retired — completed, with
/// no inbox row of their key at their `inbox_id` — then clears the notes if
/// asked. An entry a new delivery has since taken over points to its live
/// row and stays. Returns entries deleted.
pub(crate) fn apply(conn: &Connection, batch: &Batch) -> rusqlite::Result<usize> {
    let mut stmt = conn.prepare_cached(
        "DELETE FROM postroom_inbox_keys
         WHERE consumer = ?1 AND source = ?2 AND message_id = ?3 AND completed = 1
           AND NOT EXISTS (SELECT 1 FROM postroom_inbox i
                           WHERE i.id = postroom_inbox_keys.inbox_id AND i.consumer = ?1
                             AND i.source = ?2 AND i.message_id = ?3)",
    )?;
    let mut deleted = 0;
    for key in &batch.keys {
        let (consumer, source, message_id) = key.parts();
        deleted += stmt.execute(params![consumer, source, message_id])?;
    }
    if let Some(seq) = batch.clear_through {
        conn.prepare_cached("DELETE FROM postroom_retired_keys WHERE seq <= ?1")?
            .execute([seq])?;
    }
    Ok(deleted)
}

/// Drains every retired key: `read` rounds of [`READ_LIMIT`] until it
/// finds none, each written as batches through `write` (one transaction
/// each). Returns key entries deleted.
pub(crate) fn drain<E>(
    mut read: impl FnMut() -> Result<Option<Retired>, E>,
    mut write: impl FnMut(Batch) -> Result<usize, E>,
) -> Result<u64, E> {
    let mut deleted = 0u64;
    while let Some(Retired { keys, last_seq }) = read()? {
        let mut keys = keys.into_iter().peekable();
        loop {
            let batch: Vec<RetiredKey> = keys.by_ref().take(DELETE_BATCH).collect();
            let last = keys.peek().is_none();
            deleted += write(Batch {
                keys: batch,
                clear_through: last.then_some(last_seq),
            })? as u64;
            if last {
                break;
            }
        }
    }
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use super::*;

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
