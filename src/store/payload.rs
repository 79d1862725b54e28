//! A stored payload as the operator functions hand it out: the exact
//! bytes, and how they serialize (JSON) and decode. Invariant: the bytes
//! are never changed; every view of them (JSON text embedded as stored,
//! UTF-8 text, hex) is computed from them and says which it is.

use std::fmt::Write as _;

use serde::ser::SerializeStruct;
use serde::{Serialize, Serializer};

/// A stored payload. Serializes (JSON) as `{"bytes": n, "base64": "…",
/// "encoding": "json" | "text" | "binary", "value": …}`: `base64` is the
/// exact stored bytes (what a replay should send); `value` is the payload's
/// own JSON text, embedded as stored (not reparsed: large numbers and
/// duplicate keys survive), a string when it is other UTF-8 text, and
/// `null` for binary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payload(pub Vec<u8>);

/// How a [`Payload`] is shown.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Decoded {
    /// The payload parses as JSON.
    Json(serde_json::Value),
    /// Not JSON, but valid UTF-8.
    Text(String),
    /// Neither: lowercase hex digits.
    Hex(String),
}

impl Payload {
    /// The raw bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// How it is shown and serialized: `"json"` when it is valid JSON,
    /// `"text"` when other UTF-8, else `"binary"`. Checked without building
    /// a value (no copy, no lossy numbers).
    pub fn encoding(&self) -> &'static str {
        encoding_of(self.parts())
    }

    /// The payload as text when it is UTF-8, and as JSON text when it is
    /// valid JSON: what [`Payload::encoding`] (so the CLI's rendering) and
    /// the serialization all go by.
    fn parts(&self) -> (Option<&str>, Option<&serde_json::value::RawValue>) {
        let text = std::str::from_utf8(&self.0).ok();
        (text, text.and_then(|t| serde_json::from_str(t).ok()))
    }

    /// JSON if it parses, else UTF-8 text, else hex.
    pub fn decode(&self) -> Decoded {
        if let Ok(value) = serde_json::from_slice::<serde_json::Value>(&self.0) {
            Decoded::Json(value)
        } else if let Ok(text) = std::str::from_utf8(&self.0) {
            Decoded::Text(text.to_owned())
        } else {
            Decoded::Hex(hex(&self.0))
        }
    }
}

fn encoding_of(parts: (Option<&str>, Option<&serde_json::value::RawValue>)) -> &'static str {
    match parts {
        (_, Some(_)) => "json",
        (Some(_), None) => "text",
        (None, None) => "binary",
    }
}

impl Serialize for Payload {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use base64::Engine as _;
        let mut st = s.serialize_struct("Payload", 4)?;
        st.serialize_field("bytes", &self.0.len())?;
        st.serialize_field(
            "base64",
            &base64::engine::general_purpose::STANDARD.encode(&self.0),
        )?;
        let parts = self.parts();
        st.serialize_field("encoding", encoding_of(parts))?;
        // The stored JSON text itself, not a reparse: numbers past f64,
        // duplicate keys and key order come out as they were stored.
        match parts {
            (_, Some(raw)) => st.serialize_field("value", raw)?,
            (Some(text), None) => st.serialize_field("value", text)?,
            (None, None) => st.serialize_field("value", &())?,
        }
        st.end()
    }
}

/// Lowercase hex digits of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}
