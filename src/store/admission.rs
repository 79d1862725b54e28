//! The one admission rule: is a delivery of `msg` to `consumer` new, a
//! duplicate (by key and payload digest, or by its sequence number), a
//! conflict, or a message already stored and not yet settled? Inline
//! delivery (`delivery::deliver`), queued receipt ([`queue`](super::queue))
//! and the engine's read-side answer all ask here, so they cannot drift.
//!
//! Invariants:
//! * the sequence number is asked first: a number that settled or is held
//!   by another message decides before the key does (as `watermark` says);
//! * a key whose stored payload digest differs from this one is always a
//!   conflict, whatever the row's status;
//! * [`admit`] (write transactions) quarantines and logs every conflict
//!   the same way, once, in one place; [`peek`] (the read side) writes
//!   nothing and hands the conflict back unrecorded.

use rusqlite::Connection;

use crate::escape::Esc;
use crate::message::Message;
use crate::store::inbox::{self, Found, Key, Row};
use crate::store::watermark;

/// What the rule says about a delivery. `C` is what a conflict carries:
/// [`Unrecorded`] from [`peek`], the quarantined row's id from [`admit`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Admission<C> {
    /// The key is unknown: store it (or, inline, run it).
    New,
    /// Completed with this payload.
    Duplicate,
    /// Its sequence number settled before (its row is gone).
    DuplicateBySequence { sequence: u64 },
    /// A reused id with another payload, or a conflicting sequence number.
    Conflict(C),
    /// Stored with this payload and not answered from the key table alone:
    /// the caller decides by the row's status (inline runs or answers it; a receipt hands it to
    /// the workers).
    Stored { id: i64, row: Row },
}

/// A conflict [`peek`] found and did not record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Unrecorded {
    /// The stored (or number-holding) message's payload digest.
    pub stored_hash: [u8; 32],
    /// Why it conflicts: what the log line says after the message's name.
    pub why: String,
}

/// The rule, read-only: for the engine's read side, which answers only what
/// is settled and leaves everything else (conflicts included, since
/// quarantining writes) to the writer.
pub(crate) fn peek(
    conn: &Connection,
    consumer: &str,
    msg: &Message,
    hash: &[u8; 32],
) -> rusqlite::Result<Admission<Unrecorded>> {
    let found = inbox::find(conn, key(consumer, msg), hash)?;
    decide(conn, consumer, msg, hash, found)
}

/// The rule inside a write transaction: a retired key entry is cleared
/// first (the new row would need its key), and a conflict is quarantined
/// in `postroom_conflicts` and logged; its row's id is returned.
pub(crate) fn admit(
    conn: &Connection,
    consumer: &str,
    msg: &Message,
    hash: &[u8; 32],
    now_ms: i64,
) -> rusqlite::Result<Admission<i64>> {
    let found = inbox::find_live(conn, key(consumer, msg), hash)?;
    Ok(match decide(conn, consumer, msg, hash, found)? {
        Admission::New => Admission::New,
        Admission::Duplicate => Admission::Duplicate,
        Admission::DuplicateBySequence { sequence } => Admission::DuplicateBySequence { sequence },
        Admission::Stored { id, row } => Admission::Stored { id, row },
        Admission::Conflict(c) => {
            let id = inbox::quarantine(conn, consumer, msg, &c.stored_hash, hash, now_ms)?;
            log::warn!(
                "consumer {:?}: message {}/{}{}; quarantined as conflict {id}",
                Esc(consumer),
                Esc(&msg.source),
                Esc(&msg.id),
                Esc(&c.why)
            );
            Admission::Conflict(id)
        }
    })
}

/// The text a reused id's conflict is logged with (kept as it always was
/// on the inline path).
const REUSED: &str = " reused with a different payload";

fn key<'a>(consumer: &'a str, msg: &'a Message) -> Key<'a> {
    Key {
        consumer,
        source: &msg.source,
        message_id: &msg.id,
    }
}

fn decide(
    conn: &Connection,
    consumer: &str,
    msg: &Message,
    hash: &[u8; 32],
    found: Option<Found>,
) -> rusqlite::Result<Admission<Unrecorded>> {
    match watermark::check(conn, consumer, msg, hash, found.as_ref())? {
        watermark::Answer::New => {}
        watermark::Answer::Duplicate => {
            return Ok(Admission::DuplicateBySequence {
                sequence: msg.sequence.unwrap_or_default(),
            })
        }
        watermark::Answer::Conflict { stored_hash, why } => {
            return Ok(Admission::Conflict(Unrecorded {
                stored_hash,
                why: format!(": {why}"),
            }))
        }
    }
    Ok(match found {
        None => Admission::New,
        Some(Found::CompletedDuplicate) => Admission::Duplicate,
        Some(Found::Row { row, .. }) if row.payload_hash != *hash => {
            Admission::Conflict(Unrecorded {
                stored_hash: row.payload_hash,
                why: REUSED.to_string(),
            })
        }
        Some(Found::Row { id, row }) => Admission::Stored { id, row },
    })
}
