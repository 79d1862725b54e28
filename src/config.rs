//! The engine's settings (their defaults are documented on the
//! [`Builder`](crate::Builder)'s methods), durability, and input limits.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::message::{Headers, Message, Outgoing};

/// How long completed and sent rows are kept by default: the dedupe
/// horizon.
pub(crate) const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
/// How long a connection waits for another's lock by default.
pub(crate) const DEFAULT_BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// Longest message id, in bytes.
pub const MAX_ID_BYTES: usize = 512;
/// Longest consumer, source, topic, key or ordering-key name, in bytes.
pub const MAX_NAME_BYTES: usize = 128;
/// Most headers on one message.
pub const MAX_HEADERS: usize = 64;
/// Longest header name, in bytes.
pub const MAX_HEADER_NAME_BYTES: usize = 128;
/// Largest total size of one message's headers (names plus values), in bytes.
pub const MAX_HEADERS_BYTES: usize = 16 * 1024;
/// Largest `max_payload` the builder accepts.
pub const MAX_PAYLOAD_LIMIT: usize = 256 * 1024 * 1024;

/// How hard a commit tries to reach stable storage before `deliver` returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Durability {
    /// `synchronous=FULL`: every commit is fsynced before the caller hears
    /// of it. Survives power loss. The default.
    #[default]
    Full,
    /// `synchronous=NORMAL`: commits survive a process crash but the last
    /// ones may be lost on power loss: the WAL is fsynced by checkpoints
    /// (under load, every few milliseconds) and otherwise by the
    /// checkpointer at most about a second after a commit, so a power cut
    /// loses about the last second of acknowledged commits. Several times
    /// faster for one caller at a time. The relay fsyncs the WAL before
    /// each batch it hands to the sink, so the sink never gets a row that a
    /// power cut could still take back.
    Normal,
}

impl Durability {
    pub(crate) fn pragma(self) -> &'static str {
        match self {
            Durability::Full => "FULL",
            Durability::Normal => "NORMAL",
        }
    }
}

/// Exponential backoff with jitter: attempt `n` waits between half and all
/// of `min(initial * 2^(n-1), max)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RetryPolicy {
    pub initial: Duration,
    pub max: Duration,
}

impl RetryPolicy {
    /// The delay after the `attempt`-th failure (1-based). `jitter` is any
    /// well-mixed number; the engine derives it from the message key so that
    /// retries of different messages spread out but a test can predict them.
    pub fn delay(&self, attempt: u32, jitter: u64) -> Duration {
        let shift = attempt.saturating_sub(1).min(32);
        let full = self
            .initial
            .checked_mul(1u32 << shift.min(31))
            .unwrap_or(self.max)
            .min(self.max);
        let full_ms = u64::try_from(full.as_millis()).unwrap_or(u64::MAX);
        let half = full_ms / 2;
        Duration::from_millis(half + jitter % (full_ms - half + 1))
    }
}

/// Settings the engine runs with. Built by [`Builder`].
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub durability: Durability,
    pub busy_timeout: Duration,
    pub max_batch: usize,
    pub max_attempts: u32,
    pub retry: RetryPolicy,
    pub lease: Duration,
    pub max_payload: usize,
    pub keep_payloads: bool,
    pub quick_check_on_open: bool,
    pub drop_deadline: Duration,
    pub read_pool_size: u32,
    pub workers: usize,
    pub process_batch: usize,
    pub poll_interval: Duration,
    pub reaper_interval: Duration,
    pub retention: Duration,
    pub dead_retention: Option<Duration>,
    pub conflict_retention: Option<Duration>,
    pub checkpoint_wal_bytes: u64,
    pub relay_batch: usize,
    pub relay_poll: Duration,
    /// A handler holding the writer longer than this is reported (see
    /// [`Builder::slow_handler`](crate::Builder::slow_handler)).
    pub slow_handler: Duration,
    /// Consumers whose dead letters hold their ordering key
    /// ([`Builder::strict_order`](crate::Builder::strict_order)).
    pub strict_order: BTreeSet<String>,
}

/// What a dead letter does to the rest of its ordering key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum KeyOrder {
    /// The key's later rows run past it (the default): order holds among
    /// the rows that settle by running.
    #[default]
    DeadReleases,
    /// No later row of the key runs while it is dead: until an operator
    /// redrives it (it runs first) or discards it.
    DeadHolds,
}

impl Config {
    /// `consumer`'s [`KeyOrder`].
    pub(crate) fn key_order(&self, consumer: &str) -> KeyOrder {
        if self.strict_order.contains(consumer) {
            KeyOrder::DeadHolds
        } else {
            KeyOrder::DeadReleases
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            durability: Durability::Full,
            busy_timeout: DEFAULT_BUSY_TIMEOUT,
            max_batch: 256,
            max_attempts: 5,
            retry: RetryPolicy {
                initial: Duration::from_secs(1),
                max: Duration::from_secs(300),
            },
            lease: Duration::from_secs(30),
            max_payload: 1024 * 1024,
            keep_payloads: false,
            quick_check_on_open: true,
            drop_deadline: Duration::from_secs(10),
            read_pool_size: 4,
            workers: 2,
            process_batch: 64,
            poll_interval: Duration::from_secs(300),
            reaper_interval: Duration::from_secs(5),
            retention: DEFAULT_RETENTION,
            dead_retention: None,
            conflict_retention: None,
            checkpoint_wal_bytes: 4 * 1024 * 1024,
            relay_batch: 100,
            relay_poll: Duration::from_secs(300),
            slow_handler: Duration::from_secs(1),
            strict_order: BTreeSet::new(),
        }
    }
}

/// Most worker threads: one claim slot each in the engine file, beside
/// the writer's.
pub(crate) const MAX_WORKERS: usize = 63;
/// Most jobs per batch: also the capacity of the callers' queue, allocated
/// up front.
const MAX_BATCH: usize = 65_536;
/// Most read connections (each one an open file and its cache).
const MAX_READ_POOL: u32 = 256;
/// Most outbox rows read and handed to the sink at once (held in memory).
const MAX_RELAY_BATCH: usize = 65_536;
/// Most received messages processed in one transaction (held in memory).
const MAX_PROCESS_BATCH: usize = 100_000;
/// Longest lease, interval, backoff or shutdown deadline: each is added to
/// an `Instant`, which cannot hold every `Duration`.
const MAX_INTERVAL: Duration = Duration::from_secs(365 * 24 * 3600);
/// Longest busy timeout: SQLite takes it in milliseconds, as a C `int`.
const MAX_BUSY_TIMEOUT: Duration = Duration::from_millis(i32::MAX as u64);

/// `Ok` when `value` is within `min..=max`; else `InvalidInput` naming the
/// setting and its range.
fn in_range<T: PartialOrd + std::fmt::Debug>(
    field: &'static str,
    value: T,
    min: T,
    max: T,
) -> Result<()> {
    if value < min {
        Err(Error::invalid(
            field,
            format!("{value:?} is too small: must be at least {min:?} (and at most {max:?})"),
        ))
    } else if value > max {
        Err(Error::invalid(
            field,
            format!("{value:?} is too large: must be at most {max:?} (and at least {min:?})"),
        ))
    } else {
        Ok(())
    }
}

impl Config {
    /// Checks every setting against the range its builder method documents.
    /// Settings not named here take any value: retention (`Duration::MAX`
    /// keeps rows for ever; every use saturates), `max_attempts` from 1,
    /// `checkpoint_wal_bytes`.
    pub(crate) fn validate(&self) -> Result<()> {
        let ms = Duration::from_millis(1);
        in_range("max_batch", self.max_batch, 1, MAX_BATCH)?;
        if self.max_attempts == 0 {
            return Err(Error::invalid("max_attempts", "must be at least 1"));
        }
        in_range("backoff", self.retry.initial, Duration::ZERO, MAX_INTERVAL)?;
        in_range("backoff", self.retry.max, Duration::ZERO, MAX_INTERVAL)?;
        if self.retry.initial > self.retry.max {
            return Err(Error::invalid(
                "backoff",
                "the initial delay must not exceed the maximum",
            ));
        }
        if self.max_payload > MAX_PAYLOAD_LIMIT {
            return Err(Error::invalid(
                "max_payload",
                format!("must be at most {MAX_PAYLOAD_LIMIT} bytes"),
            ));
        }
        in_range("poll_interval", self.poll_interval, ms, MAX_INTERVAL)?;
        in_range("reaper_interval", self.reaper_interval, ms, MAX_INTERVAL)?;
        in_range("workers", self.workers, 0, MAX_WORKERS)?;
        in_range("relay_batch", self.relay_batch, 1, MAX_RELAY_BATCH)?;
        in_range("relay_poll", self.relay_poll, ms, MAX_INTERVAL)?;
        in_range("lease", self.lease, ms, MAX_INTERVAL)?;
        in_range("process_batch", self.process_batch, 1, MAX_PROCESS_BATCH)?;
        in_range("read_pool_size", self.read_pool_size, 1, MAX_READ_POOL)?;
        in_range(
            "slow_handler",
            self.slow_handler,
            Duration::from_millis(10),
            Duration::from_secs(3600),
        )?;
        in_range(
            "busy_timeout",
            self.busy_timeout,
            Duration::ZERO,
            MAX_BUSY_TIMEOUT,
        )?;
        in_range(
            "drop_deadline",
            self.drop_deadline,
            Duration::ZERO,
            MAX_INTERVAL,
        )?;
        Ok(())
    }

    /// How long a queued row, or queued processing, waits after the storage
    /// failed it (not the message): the first retry delay, and at least
    /// the poll interval or 1 s (the shorter: the poll interval is a
    /// sleep's upper bound, 5 min by default), so a failure that lasts does
    /// not spin.
    pub(crate) fn storage_retry_delay(&self) -> Duration {
        self.retry
            .initial
            .max(self.poll_interval.min(Duration::from_secs(1)))
    }

    /// Checks an incoming message against the limits.
    pub(crate) fn check_message(&self, msg: &Message) -> Result<()> {
        check_name("source", &msg.source)?;
        check_id("message id", &msg.id)?;
        self.check_payload("payload", &msg.payload)?;
        check_headers(&msg.headers)?;
        if let Some(key) = &msg.ordering_key {
            check_name("ordering key", key)?;
        }
        if let Some(stream) = &msg.sequence_stream {
            check_name("sequence stream", stream)?;
        }
        if let Some(seq) = msg.sequence {
            check_sequence(seq)?;
        }
        Ok(())
    }

    /// Checks an outgoing message against the limits.
    pub(crate) fn check_outgoing(&self, out: &Outgoing) -> Result<()> {
        check_name("topic", &out.topic)?;
        if let Some(key) = &out.key {
            check_name("outgoing key", key)?;
        }
        if let Some(id) = &out.id {
            check_id("outgoing message id", id)?;
        }
        self.check_payload("outgoing payload", &out.payload)?;
        check_headers(&out.headers)
    }

    fn check_payload(&self, field: &'static str, payload: &[u8]) -> Result<()> {
        if payload.len() > self.max_payload {
            return Err(Error::invalid(
                field,
                format!(
                    "{} bytes exceeds max_payload ({} bytes)",
                    payload.len(),
                    self.max_payload
                ),
            ));
        }
        Ok(())
    }
}

#[cfg_attr(not(feature = "mqtt"), allow(dead_code))] // used by the MQTT intake
/// The largest payload a dead letter of a refused message keeps whole
/// ([`storable`]): the largest an MQTT packet can carry (so every MQTT
/// message is kept whole), well below SQLite's default length limit
/// (SQLITE_MAX_LENGTH, 1,000,000,000 bytes for a whole row). A larger one
/// (from another intake) keeps its first this many bytes, with its length
/// and digest in the reason.
pub(crate) const MAX_REFUSED_PAYLOAD: usize = 256 * 1024 * 1024;

#[cfg_attr(not(feature = "mqtt"), allow(dead_code))] // used by the MQTT intake
/// What of a refused name or id a dead letter's reason shows.
const SHOWN_CHARS: usize = 64;

#[cfg_attr(not(feature = "mqtt"), allow(dead_code))] // used by the MQTT intake
/// `text` for a reason: escaped, its first [`SHOWN_CHARS`] characters and
/// its length when longer.
fn shown(text: &str) -> String {
    let mut out: String = text.chars().take(SHOWN_CHARS).collect();
    out = format!("{:?}", out);
    if text.chars().count() > SHOWN_CHARS {
        out.push_str(&format!("… ({} bytes)", text.len()));
    }
    out
}

#[cfg_attr(not(feature = "mqtt"), allow(dead_code))] // used by the MQTT intake
/// A message the engine refused ([`Config::check_message`]) made storable
/// as a dead letter, and `reason` with what was changed to make it so:
/// a source or id outside the limits gives way to source `refused` and id
/// `refused-` + blake3 of both (a resend of the message finds the same
/// key), shown in the reason; an ordering key outside them, or a sequence
/// number or stream outside them (or of a replaced key), is dropped; a
/// payload over [`MAX_REFUSED_PAYLOAD`] is cut there. Headers are kept as
/// they came (the inbox stores them as JSON, whatever their number).
pub(crate) fn storable(msg: Message, reason: &str) -> (Message, String) {
    storable_within(msg, reason, MAX_REFUSED_PAYLOAD)
}

#[cfg_attr(not(feature = "mqtt"), allow(dead_code))] // used by the MQTT intake
/// [`storable`], keeping at most `max_payload` bytes of the payload.
fn storable_within(mut msg: Message, reason: &str, max_payload: usize) -> (Message, String) {
    let mut reason = reason.to_owned();
    if check_name("source", &msg.source).is_err() || check_id("message id", &msg.id).is_err() {
        let digest = blake3::Hasher::new()
            .update(b"postroom-refused\0")
            .update(&(msg.source.len() as u64).to_le_bytes())
            .update(msg.source.as_bytes())
            .update(msg.id.as_bytes())
            .finalize();
        reason.push_str(&format!(
            "; sent as source {}, id {}",
            shown(&msg.source),
            shown(&msg.id)
        ));
        msg.source = "refused".to_owned();
        msg.id = format!("refused-{}", &digest.to_hex()[..32]);
        msg.sequence = None;
        msg.sequence_stream = None;
    }
    if let Some(key) = msg.ordering_key.take() {
        match check_name("ordering key", &key) {
            Ok(()) => msg.ordering_key = Some(key),
            Err(_) => reason.push_str(&format!("; ordering key {} dropped", shown(&key))),
        }
    }
    if let Some(seq) = msg.sequence {
        let stream_ok = msg
            .sequence_stream()
            .is_some_and(|s| check_name("sequence stream", s).is_ok());
        if check_sequence(seq).is_err() || !stream_ok {
            reason.push_str(&format!("; sequence {seq} dropped"));
            msg.sequence = None;
            msg.sequence_stream = None;
        }
    }
    if msg.payload.len() > max_payload {
        reason.push_str(&format!(
            "; payload cut to its first {max_payload} of {} bytes, blake3 of the whole: {}",
            msg.payload.len(),
            blake3::hash(&msg.payload).to_hex()
        ));
        msg.payload.truncate(max_payload);
    }
    (msg, reason)
}

/// A sequence number: from 1 (0 is the watermark of a stream nothing of
/// which has settled) to [`MAX_SEQUENCE`](crate::MAX_SEQUENCE).
pub(crate) fn check_sequence(seq: u64) -> Result<()> {
    if seq == 0 || seq > crate::message::MAX_SEQUENCE {
        return Err(Error::invalid(
            "sequence",
            format!(
                "{seq} is outside 1..={}: sequences start at 1 (add 1 to one counting from 0)",
                crate::message::MAX_SEQUENCE
            ),
        ));
    }
    Ok(())
}

/// Consumer, source, topic and key names: 1..=128 bytes, no control
/// characters (they end up in logs and the CLI's output).
pub(crate) fn check_name(field: &'static str, name: &str) -> Result<()> {
    if name.is_empty() {
        return Err(Error::invalid(field, "must not be empty"));
    }
    if name.len() > MAX_NAME_BYTES {
        return Err(Error::invalid(
            field,
            format!("{} bytes exceeds the limit of {MAX_NAME_BYTES}", name.len()),
        ));
    }
    if name.chars().any(char::is_control) {
        return Err(Error::invalid(field, "must not contain control characters"));
    }
    Ok(())
}

/// Message ids: 1..=512 bytes, no NUL (any other byte sequence of valid
/// UTF-8 is fine: ids are bound as parameters, never formatted into SQL).
fn check_id(field: &'static str, id: &str) -> Result<()> {
    if id.is_empty() {
        return Err(Error::invalid(field, "must not be empty"));
    }
    if id.len() > MAX_ID_BYTES {
        return Err(Error::invalid(
            field,
            format!("{} bytes exceeds the limit of {MAX_ID_BYTES}", id.len()),
        ));
    }
    if id.contains('\0') {
        return Err(Error::invalid(field, "must not contain NUL"));
    }
    Ok(())
}

fn check_headers(headers: &Headers) -> Result<()> {
    if headers.len() > MAX_HEADERS {
        return Err(Error::invalid(
            "headers",
            format!(
                "{} headers exceeds the limit of {MAX_HEADERS}",
                headers.len()
            ),
        ));
    }
    let mut total = 0;
    for (name, value) in headers {
        if name.is_empty() || name.len() > MAX_HEADER_NAME_BYTES {
            return Err(Error::invalid(
                "headers",
                format!("header names must be 1..={MAX_HEADER_NAME_BYTES} bytes"),
            ));
        }
        total += name.len() + value.len();
    }
    if total > MAX_HEADERS_BYTES {
        return Err(Error::invalid(
            "headers",
            format!("{total} bytes exceeds the limit of {MAX_HEADERS_BYTES}"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A refused message made storable: a valid key and sequence kept, an
    /// invalid key replaced by one derived from it (the same for a resend),
    /// what changed said in the reason, a payload past the limit cut with
    /// its length and digest recorded.
    #[test]
    fn a_refused_message_is_made_storable_and_the_reason_says_how() {
        let config = Config::default();
        let fine = Message::new("dev", "m-1", vec![7u8; 10]).with_sequence_in("outbox:o", 4);
        let (kept, why) = storable_within(fine.clone(), "too large", 100);
        assert_eq!((kept, why.as_str()), (fine, "too large"));

        let bad = Message::new("de\u{7}v", "i".repeat(600), "p")
            .with_ordering_key("k\n")
            .with_sequence(3);
        let (a, why) = storable_within(bad.clone(), "refused", 100);
        assert!(config.check_message(&a).is_ok(), "{a:?}");
        assert_eq!(a.source, "refused");
        assert!(a.id.starts_with("refused-"), "{}", a.id);
        assert_eq!((a.ordering_key.as_deref(), a.sequence), (None, None));
        assert!(why.contains("sent as source \"de\\u{7}v\""), "{why}");
        assert!(why.contains("… (600 bytes)"), "{why}");
        assert!(why.contains("ordering key"), "{why}");
        let (b, _) = storable_within(bad, "refused", 100);
        assert_eq!(a.id, b.id, "a resend finds the same key");

        let big = Message::new("dev", "m-2", vec![1u8; 300]);
        let (cut, why) = storable_within(big, "too large", 100);
        assert_eq!(cut.payload.len(), 100);
        assert!(why.contains("first 100 of 300 bytes"), "{why}");
        assert!(
            why.contains(&blake3::hash(&[1u8; 300]).to_hex().to_string()),
            "{why}"
        );
    }

    #[test]
    fn backoff_doubles_and_caps_with_jitter_in_upper_half() {
        let p = RetryPolicy {
            initial: Duration::from_millis(1000),
            max: Duration::from_millis(5000),
        };
        for jitter in [0u64, 1, 499, 500, 12345, u64::MAX] {
            let d1 = p.delay(1, jitter).as_millis();
            assert!((500..=1000).contains(&d1), "{d1}");
            let d3 = p.delay(3, jitter).as_millis();
            assert!((2000..=4000).contains(&d3), "{d3}");
            let d40 = p.delay(40, jitter).as_millis();
            assert!((2500..=5000).contains(&d40), "{d40}");
        }
        assert_eq!(p.delay(1, 0).as_millis(), 500);
        assert_eq!(p.delay(1, 500).as_millis(), 1000);
    }

    #[test]
    fn names_ids_and_headers_are_checked() {
        let cfg = Config::default();
        assert!(cfg.check_message(&Message::new("s", "id", "x")).is_ok());
        assert!(cfg.check_message(&Message::new("s", "id", "")).is_ok());
        assert!(cfg.check_message(&Message::new("", "id", "x")).is_err());
        assert!(cfg.check_message(&Message::new("s", "", "x")).is_err());
        assert!(cfg.check_message(&Message::new("s", "a\0b", "x")).is_err());
        assert!(cfg
            .check_message(&Message::new("s", "i".repeat(MAX_ID_BYTES), "x"))
            .is_ok());
        assert!(cfg
            .check_message(&Message::new("s", "i".repeat(MAX_ID_BYTES + 1), "x"))
            .is_err());
        assert!(cfg
            .check_message(&Message::new("s".repeat(MAX_NAME_BYTES + 1), "i", "x"))
            .is_err());
        assert!(cfg.check_message(&Message::new("s\n", "i", "x")).is_err());
        assert!(cfg
            .check_message(&Message::new("s", "i", vec![0; cfg.max_payload + 1]))
            .is_err());
        assert!(cfg
            .check_message(&Message::new("s", "i", "x").with_header("", "v"))
            .is_err());
        assert!(cfg
            .check_message(
                &Message::new("s", "i", "x").with_header("h", "v".repeat(MAX_HEADERS_BYTES))
            )
            .is_err());
    }
}
