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

/// The inbox rows of the message id a log line or a broker carries, of
/// one consumer and source or of every one (oldest row first): a seek per
/// (consumer, source) pair in the key table, never a scan of the inbox.
pub fn inbox_find(
    conn: &Connection,
    consumer: Option<&str>,
    source: Option<&str>,
    message_id: &str,
) -> Result<Vec<InboxEntry>> {
    snapshot(conn, || {
        inbox::find_by_message_id(conn, consumer, source, message_id)
            .map_err(sql("find inbox rows"))
    })
}

/// Makes a failed inbox row due now for the engine's workers (as a
/// redrive makes a dead one: an inline row is then the workers' to retry,
/// and its broker redelivery is answered from the row); its attempts stay
/// counted. False when `id` is not a failed row.
pub fn inbox_retry_now(conn: &Connection, id: i64, now_ms: i64) -> Result<bool> {
    crate::store::queue::retry_now(conn, id, now_ms).map_err(sql("retry now"))
}

/// Gives up on a pending or failed inbox row that no worker holds: it
/// becomes a dead letter with `reason` (payload kept, so a redrive brings
/// it back). False when `id` is not pending or failed.
pub fn inbox_cancel(conn: &Connection, id: i64, reason: &str, now_ms: i64) -> Result<bool> {
    crate::store::queue::cancel(conn, id, reason, now_ms).map_err(sql("cancel"))
}

/// The inbox row with this id, in full; `None` when there is none.
pub fn inbox_show(conn: &Connection, id: i64) -> Result<Option<InboxDetail>> {
    snapshot(conn, || {
        inbox::show(conn, id).map_err(sql("show inbox row"))
    })
}
