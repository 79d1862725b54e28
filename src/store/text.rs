//! How text is stored and read back: TEXT columns that may have rotted,
//! and headers as a JSON object.

use rusqlite::types::ValueRef;

use crate::message::Headers;

/// A stored TEXT column, `None` for NULL. A value that is not valid UTF-8
/// text (bit rot, a hand edit) is read lossily and the column named in
/// `damage`, so the caller dead-letters the row: failing the read instead
/// would fail every claim or relay batch that reaches the row, for good.
pub(crate) fn stored_text(
    r: &rusqlite::Row<'_>,
    idx: usize,
    column: &'static str,
    damage: &mut Option<&'static str>,
) -> rusqlite::Result<Option<String>> {
    let bytes = match r.get_ref(idx)? {
        ValueRef::Null => return Ok(None),
        ValueRef::Text(bytes) => bytes,
        ValueRef::Blob(bytes) => {
            damage.get_or_insert(column);
            bytes
        }
        ValueRef::Integer(i) => {
            damage.get_or_insert(column);
            return Ok(Some(i.to_string()));
        }
        ValueRef::Real(f) => {
            damage.get_or_insert(column);
            return Ok(Some(f.to_string()));
        }
    };
    Ok(Some(match std::str::from_utf8(bytes) {
        Ok(text) => text.to_owned(),
        Err(_) => {
            damage.get_or_insert(column);
            String::from_utf8_lossy(bytes).into_owned()
        }
    }))
}

/// A stored BLOB column (a payload), `None` for NULL. A value SQLite holds
/// as another type (a hand edit or another tool wrote TEXT, a number) is read
/// as its bytes, as `CAST(.. AS BLOB)` would: the payload's digest then
/// decides, and failing the read instead would fail every batch that
/// reaches the row, holding up every other row of its consumer.
pub(crate) fn stored_bytes(r: &rusqlite::Row<'_>, idx: usize) -> rusqlite::Result<Option<Vec<u8>>> {
    Ok(match r.get_ref(idx)? {
        ValueRef::Null => None,
        ValueRef::Blob(bytes) | ValueRef::Text(bytes) => Some(bytes.to_vec()),
        ValueRef::Integer(i) => Some(i.to_string().into_bytes()),
        ValueRef::Real(f) => Some(f.to_string().into_bytes()),
    })
}

/// [`stored_text`] for listings, which show a damaged value lossily
/// (U+FFFD for each bad byte) rather than fail.
pub(crate) fn lossy_text(r: &rusqlite::Row<'_>, idx: usize) -> rusqlite::Result<Option<String>> {
    stored_text(r, idx, "", &mut None)
}

/// Why a row [`stored_text`] found damaged is dead-lettered.
pub(crate) fn undecodable(column: &str) -> String {
    format!("stored {column} is not valid UTF-8 text (corrupted)")
}

/// Headers as stored: a JSON object, or NULL when there are none.
pub(crate) fn headers_json(headers: &Headers) -> Option<String> {
    if headers.is_empty() {
        None
    } else {
        // A map of strings to strings always serializes.
        serde_json::to_string(headers).ok()
    }
}

/// Stored headers (a JSON object), or none when absent or unreadable: an
/// operator's view shows what it can rather than failing on one row.
pub(crate) fn parse_headers(text: Option<&str>) -> Headers {
    text.and_then(|t| serde_json::from_str(t).ok())
        .unwrap_or_default()
}
