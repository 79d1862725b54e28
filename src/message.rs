//! The values that cross the API: incoming [`Message`]s, outgoing
//! [`Outgoing`] messages, the [`Outcome`] of a delivery and the [`Failure`]
//! a handler returns.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Message headers: names to values, kept in name order.
pub type Headers = BTreeMap<String, String>;

/// An incoming message, identified by `(source, id)` within a consumer.
///
/// `source` names the stream it came from (a topic, a queue, a peer device),
/// so that two streams may reuse the same ids. The id must be stable across
/// redeliveries: it is what deduplication keys on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub(crate) source: String,
    pub(crate) id: String,
    pub(crate) payload: Vec<u8>,
    #[serde(default)]
    pub(crate) headers: Headers,
    #[serde(default)]
    pub(crate) ordering_key: Option<String>,
    /// The sequence number and, when it is not `source`, the stream it
    /// numbers (see [`Message::with_sequence`]).
    pub(crate) sequence: Option<u64>,
    pub(crate) sequence_stream: Option<String>,
}

/// The largest sequence number a message may carry: the database stores
/// sequences as signed 64-bit integers and the watermark one past them.
pub const MAX_SEQUENCE: u64 = (i64::MAX - 1) as u64;

impl Message {
    /// A message with raw payload bytes. A zero-length payload is allowed
    /// (a tombstone, a ping); see the crate docs for the limits.
    pub fn new(
        source: impl Into<String>,
        id: impl Into<String>,
        payload: impl Into<Vec<u8>>,
    ) -> Self {
        Message {
            source: source.into(),
            id: id.into(),
            payload: payload.into(),
            headers: Headers::new(),
            ordering_key: None,
            sequence: None,
            sequence_stream: None,
        }
    }

    /// A message whose payload is `value` encoded as JSON.
    pub fn from_json<T: Serialize + ?Sized>(
        source: impl Into<String>,
        id: impl Into<String>,
        value: &T,
    ) -> Result<Self, serde_json::Error> {
        Ok(Message::new(source, id, serde_json::to_vec(value)?))
    }

    /// Adds a header (replacing one of the same name).
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Sets the ordering key: in queued mode, messages with the same key are
    /// processed one at a time in receive order.
    pub fn with_ordering_key(mut self, key: impl Into<String>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }

    /// Sets the message's sequence number in its source: the sender
    /// numbers its messages 1, 2, 3, … (a source counting from 0, such as
    /// a partition offset, adds 1; one starting elsewhere, see
    /// [`Postroom::reset_sequence`](crate::Postroom::reset_sequence)), each
    /// number used once. Per consumer and source the engine then keeps a
    /// watermark (every sequence up to it settled) that outlives
    /// retention: a redelivery whose row retention deleted is still
    /// answered as a duplicate ([`Outcome::DuplicateBySequence`]). The
    /// numbers may arrive in any order; a gap only holds the watermark
    /// back. From 1 to [`MAX_SEQUENCE`]. docs/DESIGN.md ("Sequence
    /// watermarks") has the whole contract.
    pub fn with_sequence(mut self, seq: u64) -> Self {
        self.sequence = Some(seq);
        self.sequence_stream = None;
        self
    }

    /// [`with_sequence`](Message::with_sequence) for a counter that numbers
    /// several sources at once (one sender's topics, a postroom outbox):
    /// the watermark is kept per consumer and `stream` instead of per
    /// source. Deduplication still keys on `(source, id)`.
    pub fn with_sequence_in(mut self, stream: impl Into<String>, seq: u64) -> Self {
        self.sequence = Some(seq);
        self.sequence_stream = Some(stream.into());
        self
    }

    /// The sequence number, if the sender gave one.
    pub fn sequence(&self) -> Option<u64> {
        self.sequence
    }

    /// The stream the sequence number counts in: the one given to
    /// [`with_sequence_in`](Message::with_sequence_in), else the source.
    /// `None` without a sequence.
    pub fn sequence_stream(&self) -> Option<&str> {
        self.sequence?;
        Some(self.sequence_stream.as_deref().unwrap_or(&self.source))
    }

    /// The stream this message came from.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The message id, unique within `source`.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The payload bytes.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// The headers.
    pub fn headers(&self) -> &Headers {
        &self.headers
    }

    /// One header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }

    /// The ordering key, if any.
    pub fn ordering_key(&self) -> Option<&str> {
        self.ordering_key.as_deref()
    }

    /// Decodes the payload as JSON. In a handler, `?` turns a decoding error
    /// into [`Failure::Reject`]: a payload that does not decode never will.
    pub fn json<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_slice(&self.payload)
    }
}

/// A message a handler publishes through the outbox
/// ([`Tx::publish`](crate::Tx::publish)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outgoing {
    pub(crate) topic: String,
    #[serde(default)]
    pub(crate) key: Option<String>,
    #[serde(default)]
    pub(crate) id: Option<String>,
    pub(crate) payload: Vec<u8>,
    #[serde(default)]
    pub(crate) headers: Headers,
}

impl Outgoing {
    /// An outgoing message with raw payload bytes.
    pub fn new(topic: impl Into<String>, payload: impl Into<Vec<u8>>) -> Self {
        Outgoing {
            topic: topic.into(),
            key: None,
            id: None,
            payload: payload.into(),
            headers: Headers::new(),
        }
    }

    /// An outgoing message whose payload is `value` encoded as JSON.
    pub fn json<T: Serialize + ?Sized>(
        topic: impl Into<String>,
        value: &T,
    ) -> Result<Self, serde_json::Error> {
        Ok(Outgoing::new(topic, serde_json::to_vec(value)?))
    }

    /// Sets the key: rows with the same key are handed to the sink in commit
    /// order.
    pub fn with_key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Sets the message id. By default it is derived from the incoming
    /// message that caused it (the same on every attempt of a stored
    /// message, so a retry publishes the same id), or random outside a
    /// handler; both are unique by construction. A named id is checked
    /// against the other named ids: publishing one twice fails the second
    /// publish. It is not checked against the derived and random ids
    /// (`postroom check` reports a copy of one).
    pub fn with_id(mut self, id: impl Into<String>) -> Self {
        self.id = Some(id.into());
        self
    }

    /// Adds a header (replacing one of the same name).
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }
}

/// What became of a delivery. Acknowledge the message to the broker when
/// [`Outcome::should_ack`] says so, and not before `deliver` has returned.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Outcome {
    /// The handler ran and its effects were committed. Acknowledge.
    Processed {
        /// Attempts it took, this one included.
        attempts: u32,
    },
    /// The message had been processed before; the handler did not run.
    /// Acknowledge.
    Duplicate,
    /// The message's row is gone (retention), but its sequence number
    /// says it settled before (completed or dead): at or below its
    /// stream's watermark, or listed settled above it with the same key
    /// and payload. The handler did not run. Acknowledge. Only a message
    /// with a sequence ([`Message::with_sequence`]) gets this answer.
    DuplicateBySequence {
        /// The message's sequence number.
        sequence: u64,
    },
    /// A message with this id but a different payload was processed before.
    /// The stored message is untouched and this delivery was quarantined in
    /// `postroom_conflicts`; nothing is lost by acknowledging, but the
    /// producer reused an id, which deserves an alert.
    Conflict {
        /// Row id in `postroom_conflicts`.
        conflict_id: i64,
    },
    /// The message is parked as a dead letter, with its payload and last
    /// error: rejected by the handler, or out of attempts. Acknowledge;
    /// redrive it once the cause is fixed.
    Dead {
        /// Attempts made.
        attempts: u32,
        /// The last error.
        error: String,
    },
    /// The handler failed and the message will be retried. Do not
    /// acknowledge; redeliver after `retry_after`. A redelivery before then
    /// gets this answer again without running the handler.
    Failed {
        /// Attempts made so far.
        attempts: u32,
        /// The last error.
        error: String,
        /// How long until the next attempt is due.
        retry_after: Duration,
    },
    /// Another worker holds this message right now. Do not acknowledge.
    InFlight {
        /// How long until its lease runs out.
        retry_after: Duration,
    },
}

impl Outcome {
    /// True when the broker may be told the message is done with.
    pub fn should_ack(&self) -> bool {
        matches!(
            self,
            Outcome::Processed { .. }
                | Outcome::Duplicate
                | Outcome::DuplicateBySequence { .. }
                | Outcome::Conflict { .. }
                | Outcome::Dead { .. }
        )
    }

    /// When a message that must not be acknowledged should come back.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Outcome::Failed { retry_after, .. } | Outcome::InFlight { retry_after } => {
                Some(*retry_after)
            }
            _ => None,
        }
    }
}

/// What became of a message handed to
/// [`Postroom::receive`](crate::Postroom::receive): every receipt means the
/// message is safely stored (or was before), so the broker may be told.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "receipt", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Receipt {
    /// Stored as `pending`; queued processing will run it.
    Accepted,
    /// Seen before with the same payload; not stored again.
    Duplicate,
    /// Its row is gone (retention), but its sequence number says it
    /// settled before; not stored again (see
    /// [`Outcome::DuplicateBySequence`]).
    DuplicateBySequence {
        /// The message's sequence number.
        sequence: u64,
    },
    /// Seen before with a different payload; this one was quarantined in
    /// `postroom_conflicts` and the stored one left alone.
    Conflict {
        /// Row id in `postroom_conflicts`.
        conflict_id: i64,
    },
}

impl Receipt {
    /// Always true: a receipt is only given once the message is durable.
    /// (Present so receive and deliver read alike at the call site.)
    pub fn should_ack(&self) -> bool {
        true
    }
}

/// Why a handler did not complete a message.
///
/// `?` converts the common errors: a [`serde_json::Error`] (the payload does
/// not decode) becomes [`Failure::Reject`]; a [`rusqlite::Error`] becomes
/// [`Failure::Sqlite`], which is retried — except storage errors (disk full,
/// busy, I/O, corruption), which are not the message's fault: the delivery
/// then fails with an [`Error`](crate::Error), no attempt is counted and
/// nothing is acknowledged.
#[derive(Debug)]
#[non_exhaustive]
pub enum Failure {
    /// Transient: try again later. `after` overrides the backoff policy.
    Retry {
        /// Stored as the row's `last_error`.
        reason: String,
        /// When to try again; `None` uses exponential backoff.
        after: Option<Duration>,
    },
    /// Permanent (poison message, failed validation): dead-letter at once.
    Reject {
        /// Stored as the row's `last_error`.
        reason: String,
    },
    /// A SQLite error from the handler's own statements.
    Sqlite(rusqlite::Error),
}

impl Failure {
    /// A retryable failure with the default backoff.
    pub fn retry(reason: impl fmt::Display) -> Self {
        Failure::Retry {
            reason: reason.to_string(),
            after: None,
        }
    }

    /// A retryable failure, next attempt after `after`.
    pub fn retry_after(reason: impl fmt::Display, after: Duration) -> Self {
        Failure::Retry {
            reason: reason.to_string(),
            after: Some(after),
        }
    }

    /// A permanent failure: the message goes to the dead letters.
    pub fn reject(reason: impl fmt::Display) -> Self {
        Failure::Reject {
            reason: reason.to_string(),
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Retry { reason, .. } => f.write_str(reason),
            Failure::Reject { reason } => write!(f, "rejected: {reason}"),
            Failure::Sqlite(e) => write!(f, "sqlite: {e}"),
        }
    }
}

impl std::error::Error for Failure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Failure::Sqlite(e) => Some(e),
            _ => None,
        }
    }
}

impl From<rusqlite::Error> for Failure {
    fn from(e: rusqlite::Error) -> Self {
        Failure::Sqlite(e)
    }
}

impl From<serde_json::Error> for Failure {
    fn from(e: serde_json::Error) -> Self {
        Failure::reject(format_args!("invalid JSON: {e}"))
    }
}
