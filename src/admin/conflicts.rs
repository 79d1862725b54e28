//! Quarantined deliveries: listing, showing and discarding them (the SQL
//! and the row types are `store::conflicts`'). Invariant: a discard is one
//! short `BEGIN IMMEDIATE` transaction; a show is one snapshot.

use rusqlite::Connection;

use crate::error::Result;
use crate::store::conflicts;
use crate::store::inbox;

use super::{snapshot, sql, write};
use crate::store::conflicts::{ConflictDetail, ConflictEntry};
use crate::store::page::Page;

/// Quarantined deliveries, one [`Page`] of them (newest first by default).
pub fn conflicts_list(conn: &Connection, page: Page) -> Result<Vec<ConflictEntry>> {
    conflicts::list(conn, page).map_err(sql("list conflicts"))
}

/// The conflict with this id, in full; `None` when there is none.
pub fn conflicts_show(conn: &Connection, id: i64) -> Result<Option<ConflictDetail>> {
    snapshot(conn, || {
        conflicts::show(conn, id).map_err(sql("show conflict"))
    })
}

/// Deletes the conflict `id`, its payload with it: an operator looked at it
/// and is done. Returns false (changing nothing) when there is none. Its id
/// is never given to a later conflict; a redelivery of the same payload is
/// quarantined anew. One `BEGIN IMMEDIATE` transaction.
pub fn conflicts_discard(conn: &Connection, id: i64) -> Result<bool> {
    write(conn, "discard conflict", |c| inbox::discard_conflict(c, id))
}
