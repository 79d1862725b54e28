//! What the relay hands committed outbox rows to: the [`Sink`] trait, what
//! a sink answers per message, and the generic sinks (a closure, a channel,
//! NDJSON lines). Sinks that need an engine live in `sinks.rs`.

use std::collections::HashSet;
use std::io::Write;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use crate::store::outbox::OutboxMessage;

/// What became of one message handed to a [`Sink`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SendResult {
    /// Handed over; the row is marked sent.
    Sent,
    /// Not handed over this time; try again after `after` (or the backoff).
    Retry {
        /// Stored as the row's `last_error`.
        reason: String,
        /// When to try again; `None` uses exponential backoff.
        after: Option<Duration>,
    },
    /// Will never go through: the row is dead at once.
    Dead {
        /// Stored as the row's `last_error`.
        reason: String,
    },
    /// The destination could not be reached (a broker that is down, a
    /// connection lost before the message was acknowledged): nothing is
    /// known against the message itself. The row stays pending and is
    /// handed over again after `after`, and no attempt is counted, so an
    /// outage however long never dead-letters a row. A sink must return it
    /// only for failures that are not the message's fault, or a message the
    /// destination refuses would be retried for ever.
    Unavailable {
        /// Stored as the row's `last_error`.
        reason: String,
        /// When to try again.
        after: Duration,
    },
}

impl SendResult {
    /// A retryable failure with the default backoff.
    pub fn retry(reason: impl std::fmt::Display) -> Self {
        SendResult::Retry {
            reason: reason.to_string(),
            after: None,
        }
    }

    /// The destination is unreachable: try again after `after`, counting
    /// no attempt (see [`SendResult::Unavailable`]).
    pub fn unavailable(reason: impl std::fmt::Display, after: Duration) -> Self {
        SendResult::Unavailable {
            reason: reason.to_string(),
            after,
        }
    }

    /// A permanent failure.
    pub fn dead(reason: impl std::fmt::Display) -> Self {
        SendResult::Dead {
            reason: reason.to_string(),
        }
    }
}

/// Where the relay sends outbox messages. Owned by the relay thread.
///
/// `send` gets a batch in commit order and returns one result per message,
/// in the same order. Messages of one key appear in commit order; after
/// failing one, do not deliver later messages of the same key in that
/// batch (return `Retry` for them): the relay hands them over again once
/// the failed one went through. A missing result counts as `Retry`.
///
/// Return [`SendResult::Sent`] only once the destination has the message
/// (the broker acknowledged it), not when a client library merely queued
/// it: a row marked sent is never handed over again.
///
/// ```
/// use std::collections::HashSet;
/// use postroom::{OutboxMessage, SendResult, Sink};
///
/// /// Writes each message to a store, all of a batch acknowledged at once.
/// struct Store {
///     saved: Vec<String>,
/// }
///
/// impl Sink for Store {
///     fn send(&mut self, batch: &[OutboxMessage]) -> Vec<SendResult> {
///         let mut failed_keys: HashSet<&str> = HashSet::new();
///         let mut results = Vec::with_capacity(batch.len());
///         for m in batch {
///             let key = m.key.as_deref();
///             // After a failure, later messages of its key wait their turn.
///             let result = if key.is_some_and(|k| failed_keys.contains(k)) {
///                 SendResult::retry("behind an earlier failure of its key")
///             } else if m.payload.is_empty() {
///                 SendResult::dead("empty payload") // will never go through
///             } else {
///                 self.saved.push(m.id.clone()); // the store has it: acknowledged
///                 SendResult::Sent
///             };
///             if result != SendResult::Sent {
///                 failed_keys.extend(key);
///             }
///             results.push(result);
///         }
///         results
///     }
/// }
///
/// # fn main() -> postroom::Result<()> {
/// # let dir = tempfile::tempdir().unwrap();
/// let room = postroom::Postroom::builder()
///     .sink(Store { saved: Vec::new() })
///     .open(dir.path().join("app.db"))?;
/// room.transaction(|tx| Ok(tx.publish(postroom::Outgoing::new("events", "hi"))?))?;
/// let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
/// while room.stats()?.outbox.sent < 1 && std::time::Instant::now() < deadline {
///     std::thread::sleep(std::time::Duration::from_millis(10));
/// }
/// assert_eq!(room.stats()?.outbox.sent, 1);
/// # Ok(()) }
/// ```
pub trait Sink: Send + 'static {
    /// Hands `batch` over.
    fn send(&mut self, batch: &[OutboxMessage]) -> Vec<SendResult>;
}

/// Calls `each` per message in order, skipping (as `Retry`) later messages
/// of a key once one of that key was not sent.
pub(crate) fn per_message(
    batch: &[OutboxMessage],
    mut each: impl FnMut(&OutboxMessage) -> SendResult,
) -> Vec<SendResult> {
    let mut failed_keys: HashSet<&str> = HashSet::new();
    batch
        .iter()
        .map(|msg| {
            if let Some(key) = msg.key.as_deref() {
                if failed_keys.contains(key) {
                    return held_back();
                }
            }
            let result = each(msg);
            if result != SendResult::Sent {
                if let Some(key) = msg.key.as_deref() {
                    failed_keys.insert(key);
                }
            }
            result
        })
        .collect()
}

fn held_back() -> SendResult {
    SendResult::retry("held back behind an earlier message of its key")
}

/// A [`Sink`] made from a closure called once per message; see [`sink_fn`].
pub struct FnSink<F>(F);

/// Makes a [`Sink`] from a closure called once per message, in order. After
/// a message of some key is not `Sent`, the closure is not called for later
/// messages of that key in the batch.
pub fn sink_fn<F>(f: F) -> FnSink<F>
where
    F: FnMut(&OutboxMessage) -> SendResult + Send + 'static,
{
    FnSink(f)
}

impl<F> Sink for FnSink<F>
where
    F: FnMut(&OutboxMessage) -> SendResult + Send + 'static,
{
    fn send(&mut self, batch: &[OutboxMessage]) -> Vec<SendResult> {
        per_message(batch, &mut self.0)
    }
}

/// A [`Sink`] that sends each message into a crossbeam channel. A full
/// channel makes the relay wait up to `timeout` per batch (default 1 s),
/// then retry what did not fit; a disconnected one is retried too.
#[derive(Debug, Clone)]
pub struct ChannelSink {
    tx: Sender<OutboxMessage>,
    timeout: Duration,
}

impl ChannelSink {
    /// Sends into `tx`.
    pub fn new(tx: Sender<OutboxMessage>) -> Self {
        ChannelSink {
            tx,
            timeout: Duration::from_secs(1),
        }
    }

    /// How long one batch may wait for room in a full channel.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

impl Sink for ChannelSink {
    fn send(&mut self, batch: &[OutboxMessage]) -> Vec<SendResult> {
        // One deadline for the whole batch: a full channel holds the relay
        // (and a shutdown's flush) for `timeout`, not `timeout` per message.
        let deadline = Instant::now() + self.timeout;
        per_message(batch, |msg| {
            match self.tx.send_deadline(msg.clone(), deadline) {
                Ok(()) => SendResult::Sent,
                Err(e) => SendResult::retry(format_args!("channel: {e}")),
            }
        })
    }
}

/// A [`Sink`] writing one JSON object per line to any [`Write`] (stdout, a
/// file, a pipe), flushed after each batch: `{"id", "seq", "origin",
/// "topic", "key", "headers", "payload"}` (`seq` numbers the messages of
/// `origin`, the upstream database: a reader that delivers them into a
/// postroom can keep a watermark with
/// `Message::with_sequence_in(outbox_stream(origin), seq)`), where
/// `payload` is the JSON value itself when the payload is JSON, else a
/// string when it is UTF-8, else absent and `payload_hex` given instead.
#[derive(Debug)]
pub struct NdjsonSink<W> {
    out: W,
}

impl<W: Write + Send + 'static> NdjsonSink<W> {
    /// Writes to `out`.
    pub fn new(out: W) -> Self {
        NdjsonSink { out }
    }
}

/// One outbox message as an NDJSON line.
pub(crate) fn ndjson_line(msg: &OutboxMessage) -> serde_json::Value {
    let mut line = serde_json::json!({
        "id": msg.id,
        "seq": msg.seq,
        "origin": msg.origin,
        "topic": msg.topic,
        "key": msg.key,
        "headers": msg.headers,
    });
    if let Ok(value) = serde_json::from_slice::<serde_json::Value>(&msg.payload) {
        line["payload"] = value;
    } else if let Ok(text) = std::str::from_utf8(&msg.payload) {
        line["payload"] = text.into();
    } else {
        let hex: String = msg.payload.iter().map(|b| format!("{b:02x}")).collect();
        line["payload_hex"] = hex.into();
    }
    line
}

impl<W: Write + Send + 'static> Sink for NdjsonSink<W> {
    fn send(&mut self, batch: &[OutboxMessage]) -> Vec<SendResult> {
        let mut buf = Vec::new();
        for msg in batch {
            // A `Value` always serializes.
            let _ = serde_json::to_writer(&mut buf, &ndjson_line(msg));
            buf.push(b'\n');
        }
        // All or nothing: a partly written batch is re-sent whole (at least
        // once), never split around a failure.
        match self.out.write_all(&buf).and_then(|()| self.out.flush()) {
            Ok(()) => vec![SendResult::Sent; batch.len()],
            Err(e) => vec![SendResult::retry(format_args!("write: {e}")); batch.len()],
        }
    }
}
