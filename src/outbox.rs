//! Outbox SQL as plain functions over a connection.

use std::sync::atomic::{AtomicU64, Ordering};

use rusqlite::{params, Connection};

use crate::handler::Cause;
use crate::message::{Headers, Outgoing};

/// Header naming the message that caused an outgoing one.
pub const CAUSATION_HEADER: &str = "causation-id";
/// Header carried along a chain of messages; starts as the first message's id.
pub const CORRELATION_HEADER: &str = "correlation-id";

/// Inserts one pending outbox row and returns its message id.
///
/// Without an explicit id, a message published while handling an inbox
/// message gets `blake3(consumer, source, id, n)` for the handler's `n`-th
/// publish: the same on every attempt, unique across messages. Only the
/// attempt that commits leaves rows, so the ids never collide within the
/// dedupe horizon.
pub(crate) fn insert(
    conn: &Connection,
    out: &Outgoing,
    cause: Option<Cause<'_>>,
    index: u32,
    now_ms: i64,
) -> rusqlite::Result<String> {
    let id = match (&out.id, cause) {
        (Some(id), _) => id.clone(),
        (None, Some(c)) => derived_id(c, index),
        (None, None) => random_id(),
    };
    let mut headers = out.headers.clone();
    if let Some(c) = cause {
        headers
            .entry(CAUSATION_HEADER.to_owned())
            .or_insert_with(|| c.msg.id.clone());
        let correlation = c.msg.header(CORRELATION_HEADER).unwrap_or(&c.msg.id);
        headers
            .entry(CORRELATION_HEADER.to_owned())
            .or_insert_with(|| correlation.to_owned());
    }
    conn.prepare_cached(
        "INSERT INTO postroom_outbox (message_id, topic, key, payload, headers, status, attempts,
             created_at, next_attempt_at, cause_consumer, cause_source, cause_message_id)
         VALUES (?1, ?2, ?3, ?4, ?5, 'pending', 0, ?6, ?6, ?7, ?8, ?9)",
    )?
    .execute(params![
        id,
        out.topic,
        out.key,
        out.payload,
        headers_json(&headers),
        now_ms,
        cause.map(|c| c.consumer),
        cause.map(|c| c.msg.source.as_str()),
        cause.map(|c| c.msg.id.as_str()),
    ])?;
    Ok(id)
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

fn derived_id(c: Cause<'_>, index: u32) -> String {
    digest_hex(
        b"postroom-outbox\0",
        &[c.consumer, &c.msg.source, &c.msg.id],
        &index.to_le_bytes(),
    )
}

/// 128 bits of `blake3(domain, parts…, extra)` as 32 hex digits. Parts are
/// length-prefixed, so `("a/b", "c")` and `("a", "b/c")` differ.
pub(crate) fn digest_hex(domain: &[u8], parts: &[&str], extra: &[u8]) -> String {
    let mut h = blake3::Hasher::new();
    h.update(domain);
    for part in parts {
        h.update(&(part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    h.update(extra);
    hex32(h.finalize().as_bytes())
}

fn random_id() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = blake3::Hasher::new();
    h.update(b"postroom-outbox-random\0");
    h.update(&std::process::id().to_le_bytes());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    h.update(&nanos.to_le_bytes());
    h.update(&COUNTER.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    hex32(h.finalize().as_bytes())
}

/// The first 16 bytes as 32 lowercase hex digits: 128 bits, plenty for ids.
fn hex32(bytes: &[u8; 32]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(32);
    for b in &bytes[..16] {
        let _ = write!(s, "{b:02x}");
    }
    s
}
