//! Strict order (`Builder::strict_order`): what holds a strict consumer's
//! ordering key, and which consumers the last engine opened strict.
//!
//! Invariants:
//! * a key of a strict consumer is held while it has a dead row: no row of
//!   the key with a higher id runs (the queued due query in
//!   `queue::due_rows`, inline `deliver` through [`inline_held`]); a dead
//!   row is found through `postroom_inbox_dead_keys` (schema version 9),
//!   which lists dead keyed rows only, so the probe costs one index step
//!   whatever the inbox holds;
//! * what releases a key is a change of its dead row's status or the row's
//!   deletion (redrive, discard, `postroom cleanup`, a hand edit; `open`
//!   refuses `dead_retention` with strict order): nothing
//!   here keeps state that could go stale;
//! * `postroom_meta` lists the strict consumers of the last engine that
//!   opened the file (`strict_order:<consumer>` keys), for the operator's
//!   tools, which run without the builder; the engine itself goes by its
//!   builder, never by these rows.

use std::collections::BTreeSet;

use rusqlite::OptionalExtension;
use rusqlite::{params, Connection, TransactionBehavior};

/// Prefix of the `postroom_meta` keys naming strict consumers.
const META_PREFIX: &str = "strict_order:";

/// The consumers the last engine opened with strict order, from
/// `postroom_meta`.
pub(crate) fn recorded(conn: &Connection) -> rusqlite::Result<BTreeSet<String>> {
    // ';' sorts right after ':': a range on the primary key.
    let mut stmt = conn.prepare_cached(
        "SELECT substr(key, 14) FROM postroom_meta
         WHERE key >= 'strict_order:' AND key < 'strict_order;'",
    )?;
    let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
    rows.collect()
}

/// Records `consumers` as the strict ones in `postroom_meta`, replacing
/// what was there; writes nothing when that is already so (an engine
/// without strict consumers opening a file that never had any reads one
/// index step and writes nothing).
pub(crate) fn record(conn: &mut Connection, consumers: &BTreeSet<String>) -> rusqlite::Result<()> {
    if recorded(conn)? == *consumers {
        return Ok(());
    }
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    tx.execute(
        "DELETE FROM postroom_meta WHERE key >= 'strict_order:' AND key < 'strict_order;'",
        [],
    )?;
    for consumer in consumers {
        tx.execute(
            "INSERT INTO postroom_meta (key, value) VALUES (?1, '1')",
            [format!("{META_PREFIX}{consumer}")],
        )?;
    }
    tx.commit()
}

/// Whether an inline delivery of `consumer`'s message with ordering key
/// `key` must wait: its key has a dead row, or a row still unfinished,
/// received before it (`row_id`: its stored row; `None`: a new message,
/// after every row). One step down `postroom_inbox_dead_keys` and one
/// into `postroom_inbox_heads`.
pub(crate) fn inline_held(
    conn: &Connection,
    consumer: &str,
    key: &str,
    row_id: Option<i64>,
) -> rusqlite::Result<bool> {
    conn.prepare_cached(
        "SELECT EXISTS (SELECT 1 FROM postroom_inbox
                        WHERE consumer = ?1 AND ordering_key = ?2 AND status = 'dead'
                          AND ordering_key IS NOT NULL AND id < ?3)
             OR EXISTS (SELECT 1 FROM postroom_inbox_heads
                        WHERE consumer = ?1 AND ordering_key = ?2 AND head_id < ?3)",
    )?
    .query_row(params![consumer, key, row_id.unwrap_or(i64::MAX)], |r| {
        r.get(0)
    })
}

/// The unfinished row at the head of `consumer`'s key `key`, when it is
/// ahead of the message `(source, id)`: that message has no row yet (it is
/// new), or a later one. `None` when the key has no unfinished row, or the
/// head is the message itself, or the message's row is older (a redelivery
/// of one already settled). See the intakes' use in `hop::Lander`. One
/// probe of `postroom_inbox_heads`, one of the key table, one of the inbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KeyHead {
    pub source: String,
    pub message_id: String,
    pub status: String,
    /// When it is due again (a failed row), in unix ms.
    pub next_attempt_at: Option<i64>,
    /// Its last change, in unix ms.
    pub updated_at: i64,
}

pub(crate) fn head_ahead_of(
    conn: &Connection,
    consumer: &str,
    key: &str,
    source: &str,
    id: &str,
) -> rusqlite::Result<Option<KeyHead>> {
    conn.prepare_cached(
        "SELECT i.source, i.message_id, i.status, i.next_attempt_at, i.updated_at
         FROM postroom_inbox_heads AS h JOIN postroom_inbox AS i ON i.id = h.head_id
         WHERE h.consumer = ?1 AND h.ordering_key = ?2
           AND coalesce((SELECT k.inbox_id FROM postroom_inbox_keys AS k
                         WHERE k.consumer = ?1 AND k.source = ?3 AND k.message_id = ?4),
                        9223372036854775807) > h.head_id",
    )?
    .query_row(params![consumer, key, source, id], |r| {
        Ok(KeyHead {
            source: r.get(0)?,
            message_id: r.get(1)?,
            status: r.get(2)?,
            next_attempt_at: r.get(3)?,
            updated_at: r.get(4)?,
        })
    })
    .optional()
}

/// A strict consumer's held keys, for `postroom status`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Held {
    /// Keys with a dead row.
    pub keys: u64,
    /// When the oldest of those dead rows died (its `updated_at`).
    pub oldest_dead_ms: Option<i64>,
}

/// `consumer`'s keys held by a dead row (whether or not a later row of the
/// key waits yet: the next one would). Dead rows are few; read through
/// `postroom_inbox_dead_keys`.
pub(crate) fn held(conn: &Connection, consumer: &str) -> rusqlite::Result<Held> {
    conn.prepare_cached(
        "SELECT count(DISTINCT ordering_key), min(updated_at) FROM postroom_inbox
         WHERE consumer = ?1 AND status = 'dead' AND ordering_key IS NOT NULL",
    )?
    .query_row([consumer], |r| {
        Ok(Held {
            keys: u64::try_from(r.get::<_, i64>(0)?).unwrap_or(0),
            oldest_dead_ms: r.get(1)?,
        })
    })
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

    /// A row of consumer `c`, key `key`, in `status`, updated at `at`.
    fn row(conn: &Connection, id: &str, key: Option<&str>, status: &str, at: i64) -> i64 {
        conn.execute(
            "INSERT INTO postroom_inbox (consumer, source, message_id, status, payload,
                 payload_hash, ordering_key, last_error, received_at, updated_at, queued)
             VALUES ('c', 's', ?1, ?2, x'', zeroblob(32), ?3, 'e', 0, ?4, 1)",
            params![id, status, key, at],
        )
        .unwrap();
        conn.last_insert_rowid()
    }

    #[test]
    fn the_record_lists_the_strict_consumers_and_replaces_the_last() {
        let mut conn = db();
        assert!(recorded(&conn).unwrap().is_empty());
        let set = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<BTreeSet<_>>();
        // A name with the prefix's neighbours in it is kept whole.
        record(&mut conn, &set(&["docs", "a:b;c"])).unwrap();
        assert_eq!(recorded(&conn).unwrap(), set(&["a:b;c", "docs"]));
        record(&mut conn, &set(&["other"])).unwrap();
        assert_eq!(recorded(&conn).unwrap(), set(&["other"]));
        record(&mut conn, &BTreeSet::new()).unwrap();
        assert!(recorded(&conn).unwrap().is_empty());
        // Nothing else in the meta table is touched.
        let version: i64 = conn
            .query_row(
                "SELECT count(*) FROM postroom_meta WHERE key = 'schema_version'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(version, 1);
    }

    #[test]
    fn a_dead_or_unfinished_earlier_row_holds_an_inline_delivery() {
        let conn = db();
        row(&conn, "k-1", Some("k"), "completed", 1);
        let dead = row(&conn, "k-2", Some("k"), "dead", 5);
        assert!(inline_held(&conn, "c", "k", None).unwrap());
        assert!(!inline_held(&conn, "c", "k", Some(dead)).unwrap());
        assert!(!inline_held(&conn, "c", "j", None).unwrap());
        assert!(!inline_held(&conn, "other", "k", None).unwrap());
        let pending = row(&conn, "j-1", Some("j"), "pending", 6);
        assert!(inline_held(&conn, "c", "j", None).unwrap());
        // A row is not held by itself.
        assert!(!inline_held(&conn, "c", "j", Some(pending)).unwrap());
        assert_eq!(
            held(&conn, "c").unwrap(),
            Held {
                keys: 1,
                oldest_dead_ms: Some(5)
            }
        );
        row(&conn, "k-3", Some("k"), "dead", 3);
        row(&conn, "i-1", Some("i"), "dead", 9);
        row(&conn, "u-1", None, "dead", 1);
        assert_eq!(
            held(&conn, "c").unwrap(),
            Held {
                keys: 2,
                oldest_dead_ms: Some(3)
            }
        );
    }

    /// The probes go through the partial index of dead keyed rows, with or
    /// without statistics: never a walk of the inbox.
    #[test]
    fn the_probes_use_the_dead_keys_index() {
        let conn = db();
        for analyzed in [false, true] {
            if analyzed {
                conn.execute_batch("ANALYZE").unwrap();
            }
            let mut stmt = conn
                .prepare(
                    "EXPLAIN QUERY PLAN SELECT 1 FROM postroom_inbox
                     WHERE consumer = ?1 AND ordering_key = ?2 AND status = 'dead'
                       AND ordering_key IS NOT NULL AND id < ?3",
                )
                .unwrap();
            let plan: Vec<String> = stmt
                .query_map(params!["c", "k", 5], |r| r.get(3))
                .unwrap()
                .map(Result::unwrap)
                .collect();
            assert!(
                plan.iter().any(|p| p.contains("postroom_inbox_dead_keys")),
                "{plan:?}"
            );
        }
    }
}
