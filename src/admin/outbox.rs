//! Listing and showing outbox rows (the SQL and the row types are
//! `store::outbox`'s). Invariant: read-only; a show is one snapshot, at
//! one reading of the clock.

use rusqlite::Connection;

use crate::error::Result;
use crate::store::outbox;

use super::open::now_ms;
use super::{snapshot, sql};
use crate::store::outbox::{OutboxDetail, OutboxEntry, OutboxFilter};

/// Outbox rows matching `filter`, one [`Page`](crate::admin::Page) of them (newest first by
/// default).
pub fn outbox_list(conn: &Connection, filter: &OutboxFilter) -> Result<Vec<OutboxEntry>> {
    outbox::list(conn, filter, now_ms()).map_err(sql("list outbox"))
}

/// The outbox row `seq` in full, with what holds it back; `None` when
/// there is none.
pub fn outbox_show(conn: &Connection, seq: i64) -> Result<Option<OutboxDetail>> {
    let now = now_ms();
    snapshot(conn, || {
        outbox::show(conn, seq, now).map_err(sql("show outbox row"))
    })
}
