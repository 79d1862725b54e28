//! The quarantine as the operator sees it: listing and showing
//! conflicting deliveries (`admin`'s `conflicts_list` / `conflicts_show`,
//! whose types live here), each beside the stored message it collided
//! with. Invariant: read-only; the stored row is found through the key
//! table and checked against the key, so a reused row id never shows
//! another message.

use rusqlite::{params, Connection, OptionalExtension};

use crate::message::Headers;
use crate::store::inbox::{entry_from_row, InboxEntry, ENTRY_COLUMNS, ENTRY_WIDTH};
use crate::store::page::{limit_param, Page};
use crate::store::payload::{hex, Payload};
use crate::store::text::parse_headers;

/// A quarantined delivery without its payload, from [`conflicts_list`](crate::admin::conflicts_list).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct ConflictEntry {
    /// Row id in `postroom_conflicts` (the `conflict_id` of the outcome).
    pub id: i64,
    /// The consumer it was delivered to.
    pub consumer: String,
    /// The stream it came from.
    pub source: String,
    /// The reused message id.
    pub message_id: String,
    /// Digest of the stored message's payload, in hex.
    pub stored_hash: String,
    /// Digest of this delivery's payload, in hex.
    pub payload_hash: String,
    /// Size of this delivery's payload.
    pub payload_bytes: u64,
    /// First delivery of this payload under the id (unix ms).
    pub first_seen_at: i64,
    /// Latest delivery of it (unix ms).
    pub last_seen_at: i64,
    /// How many times it was delivered.
    pub deliveries: u64,
}

const CONFLICT_COLUMNS: &str = "id, consumer, source, message_id, stored_hash, payload_hash,
     length(payload), first_seen_at, last_seen_at, deliveries";

fn conflict_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<ConflictEntry> {
    // Lossy: one row whose text rotted is shown, not an error for all.
    let text = |idx| crate::store::text::lossy_text(r, idx).map(Option::unwrap_or_default);
    Ok(ConflictEntry {
        id: r.get(0)?,
        consumer: text(1)?,
        source: text(2)?,
        message_id: text(3)?,
        stored_hash: hex(&r.get::<_, Vec<u8>>(4)?),
        payload_hash: hex(&r.get::<_, Vec<u8>>(5)?),
        payload_bytes: count(r.get(6)?),
        first_seen_at: r.get(7)?,
        last_seen_at: r.get(8)?,
        deliveries: count(r.get(9)?),
    })
}

/// Quarantined deliveries, one [`Page`] of them (newest first by default).
pub(crate) fn list(conn: &Connection, page: Page) -> rusqlite::Result<Vec<ConflictEntry>> {
    let (after, order) = page.sql("id", 2, 1);
    let mut stmt = conn.prepare(&format!(
        "SELECT {CONFLICT_COLUMNS} FROM postroom_conflicts WHERE {after} {order}"
    ))?;
    let rows = stmt.query_map(
        params![limit_param(page.limit), page.after],
        conflict_from_row,
    )?;
    rows.collect::<rusqlite::Result<_>>()
}

/// One quarantined delivery in full, beside the stored message it
/// collided with, from [`conflicts_show`](crate::admin::conflicts_show).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct ConflictDetail {
    /// Everything [`conflicts_list`](crate::admin::conflicts_list) shows.
    #[serde(flatten)]
    pub entry: ConflictEntry,
    /// This delivery's headers.
    pub headers: Headers,
    /// This delivery's payload.
    pub payload: Payload,
    /// The stored inbox row under the same key, if retention has not
    /// deleted it.
    pub stored: Option<InboxEntry>,
    /// The stored row's payload, when kept.
    pub stored_payload: Option<Payload>,
}

/// The conflict with this id, in full; `None` when there is none. Two
/// reads: the caller runs it in one snapshot.
pub(crate) fn show(conn: &Connection, id: i64) -> rusqlite::Result<Option<ConflictDetail>> {
    let found = conn
        .query_row(
            &format!(
                "SELECT {CONFLICT_COLUMNS}, headers, payload FROM postroom_conflicts
                     WHERE id = ?1"
            ),
            [id],
            |r| {
                let headers: Option<String> = r.get(10)?;
                Ok(ConflictDetail {
                    entry: conflict_from_row(r)?,
                    headers: parse_headers(headers.as_deref()),
                    payload: Payload(crate::store::text::stored_bytes(r, 11)?.unwrap_or_default()),
                    stored: None,
                    stored_payload: None,
                })
            },
        )
        .optional()?;
    let Some(mut detail) = found else {
        return Ok(None);
    };
    let stored = conn
        .query_row(
            &format!(
                // The key too: a retired entry's inbox_id may since
                // have been reused by another message's row.
                "SELECT {ENTRY_COLUMNS}, payload FROM postroom_inbox
                     WHERE id = (SELECT inbox_id FROM postroom_inbox_keys
                                 WHERE consumer = ?1 AND source = ?2 AND message_id = ?3)
                       AND consumer = ?1 AND source = ?2 AND message_id = ?3"
            ),
            params![
                detail.entry.consumer,
                detail.entry.source,
                detail.entry.message_id
            ],
            |r| {
                Ok((
                    entry_from_row(r)?,
                    crate::store::text::stored_bytes(r, ENTRY_WIDTH)?,
                ))
            },
        )
        .optional()?;
    if let Some((entry, payload)) = stored {
        detail.stored = Some(entry);
        detail.stored_payload = payload.map(Payload);
    }
    Ok(Some(detail))
}

fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}
