//! Listing and showing inbox rows (the SQL and the row types are
//! `store::inbox`'s). Invariant: read-only; a show is one snapshot.

use rusqlite::Connection;

use crate::error::Result;
use crate::store::inbox;

use super::{snapshot, sql};
use crate::store::inbox::{InboxDetail, InboxEntry, InboxFilter};

/// Inbox rows matching `filter`, one [`Page`](crate::admin::Page) of them (newest first by
/// default).
pub fn inbox_list(conn: &Connection, filter: &InboxFilter) -> Result<Vec<InboxEntry>> {
    inbox::list(conn, filter).map_err(sql("list inbox"))
}

/// The inbox row with this id, in full; `None` when there is none.
pub fn inbox_show(conn: &Connection, id: i64) -> Result<Option<InboxDetail>> {
    snapshot(conn, || {
        inbox::show(conn, id).map_err(sql("show inbox row"))
    })
}
