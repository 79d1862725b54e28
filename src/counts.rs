//! `postroom_counts`: how many inbox and outbox rows there are per consumer,
//! status and attempts. Triggers keep it (schema.sql); this module counts
//! the rows themselves, to fill it when a file is migrated and to check it.

use rusqlite::Connection;

/// The rows as the triggers count them: `(tbl, consumer, status, attempts,
/// n)`. The outbox counts under consumer '' with attempts 0.
const ACTUAL: &str = "SELECT 'inbox' AS tbl, consumer, status, attempts, count(*) AS n
         FROM postroom_inbox GROUP BY consumer, status, attempts
     UNION ALL
     SELECT 'outbox', '', status, 0, count(*) FROM postroom_outbox GROUP BY status";

/// Replaces the counts with the rows' own. One pass over both tables.
pub(crate) fn recount(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute("DELETE FROM postroom_counts", [])?;
    conn.execute(
        &format!("INSERT INTO postroom_counts (tbl, consumer, status, attempts, n) {ACTUAL}"),
        [],
    )?;
    Ok(())
}

/// A count that disagrees with the rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Mismatch {
    /// `"inbox"` or `"outbox"`.
    pub table: String,
    /// The consumer ('' for the outbox).
    pub consumer: String,
    pub status: String,
    pub attempts: i64,
    /// What `postroom_counts` says (0 when it has no row).
    pub counted: i64,
    /// How many rows there are.
    pub rows: i64,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} rows of consumer {:?}, status {}, attempts {}: counted {}, found {}",
            self.table, self.consumer, self.status, self.attempts, self.counted, self.rows
        )
    }
}

/// Every count that disagrees with the rows. One pass over both tables.
pub(crate) fn mismatches(conn: &Connection) -> rusqlite::Result<Vec<Mismatch>> {
    let mut stmt = conn.prepare(&format!(
        "WITH actual AS ({ACTUAL})
         SELECT coalesce(a.tbl, c.tbl), coalesce(a.consumer, c.consumer),
                coalesce(a.status, c.status), coalesce(a.attempts, c.attempts),
                coalesce(c.n, 0), coalesce(a.n, 0)
         FROM actual a FULL JOIN postroom_counts c
           ON c.tbl = a.tbl AND c.consumer = a.consumer AND c.status = a.status
          AND c.attempts = a.attempts
         WHERE coalesce(c.n, 0) <> coalesce(a.n, 0)
         ORDER BY 1, 2, 3, 4"
    ))?;
    let rows = stmt.query_map([], |r| {
        Ok(Mismatch {
            table: r.get(0)?,
            consumer: r.get(1)?,
            status: r.get(2)?,
            attempts: r.get(3)?,
            counted: r.get(4)?,
            rows: r.get(5)?,
        })
    })?;
    rows.collect()
}
