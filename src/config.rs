//! The builder, its documented defaults, and input limits.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::clock::{Clock, SystemClock};
use crate::engine::Postroom;
use crate::error::{Error, Result};
use crate::handler::{EffectHandler, ErasedEffect, Handler};
use crate::message::{Headers, Message, Outgoing};
use crate::relay::Sink;

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
}

impl Default for Config {
    fn default() -> Self {
        Config {
            durability: Durability::Full,
            busy_timeout: Duration::from_secs(5),
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
            poll_interval: Duration::from_millis(250),
            reaper_interval: Duration::from_secs(5),
            retention: Duration::from_secs(7 * 24 * 3600),
            dead_retention: None,
            conflict_retention: None,
            checkpoint_wal_bytes: 4 * 1024 * 1024,
            relay_batch: 100,
            relay_poll: Duration::from_secs(1),
        }
    }
}

/// Most worker threads: one claim slot each in the engine file, beside
/// the writer's.
const MAX_WORKERS: usize = 63;
const _: () = assert!(MAX_WORKERS < crate::inflight::SLOTS);
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
    fn validate(&self) -> Result<()> {
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
    /// the poll interval, so a failure that lasts does not spin.
    pub(crate) fn storage_retry_delay(&self) -> Duration {
        self.retry.initial.max(self.poll_interval)
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

/// Builds a [`Postroom`] engine. Every setting has a default, listed on its
/// method; `Postroom::builder().consumer(..).open(path)` is a complete setup.
///
/// The builder is taken and returned by value, like r2d2's.
pub struct Builder {
    pub(crate) config: Config,
    pub(crate) consumers: Vec<(String, ConsumerKind)>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) sink: Option<Box<dyn Sink>>,
    pub(crate) handle_signals: bool,
}

/// The two kinds of handler a consumer can have.
#[derive(Clone)]
pub(crate) enum ConsumerKind {
    /// Everything in the transaction: inline or queued.
    Transactional(Arc<dyn Handler>),
    /// An external step, then a transactional one: queued only.
    Effectful(Arc<dyn ErasedEffect>),
}

impl Default for Builder {
    fn default() -> Self {
        Builder {
            config: Config::default(),
            consumers: Vec::new(),
            clock: Arc::new(SystemClock),
            sink: None,
            handle_signals: false,
        }
    }
}

impl std::fmt::Debug for Builder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Builder")
            .field("config", &self.config)
            .field(
                "consumers",
                &self.consumers.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl Builder {
    /// Registers a consumer: a name (1..=128 bytes) and the handler that
    /// processes its messages. Consumers keep separate dedupe namespaces:
    /// the same message may be delivered once to each.
    pub fn consumer(mut self, name: impl Into<String>, handler: impl Handler) -> Self {
        self.consumers
            .push((name.into(), ConsumerKind::Transactional(Arc::new(handler))));
        self
    }

    /// Registers a consumer whose handler has a step outside the
    /// transaction (see [`EffectHandler`]). Such a consumer takes messages
    /// through [`Postroom::receive`] only; `deliver` refuses it.
    pub fn effectful_consumer(
        mut self,
        name: impl Into<String>,
        handler: impl EffectHandler,
    ) -> Self {
        self.consumers
            .push((name.into(), ConsumerKind::Effectful(Arc::new(handler))));
        self
    }

    /// Where the relay sends outbox messages. Without a sink no relay runs
    /// and outbox rows wait (another process may relay them). Default: none.
    pub fn sink(mut self, sink: impl Sink) -> Self {
        self.sink = Some(Box::new(sink));
        self
    }

    /// Most outbox messages handed to the sink at once (they are held in
    /// memory together): 1 to 65,536. Default: 100.
    pub fn relay_batch(mut self, messages: usize) -> Self {
        self.config.relay_batch = messages;
        self
    }

    /// How often the relay looks for due rows when nothing woke it (retries
    /// coming due, rows committed by another process); commits of this
    /// engine wake it at once. 1 ms to 365 days. Default: 1 s.
    pub fn relay_poll(mut self, interval: Duration) -> Self {
        self.config.relay_poll = interval;
        self
    }

    /// Turn SIGINT and SIGTERM into a graceful shutdown of this engine
    /// (deadline: `drop_deadline`), after which the process terminates as
    /// the signal would have had it. Default: false.
    pub fn handle_signals(mut self, handle: bool) -> Self {
        self.handle_signals = handle;
        self
    }

    /// Worker threads running effectful consumers' external steps; 0
    /// processes no received (queued) message at all, of any consumer, so
    /// they wait. Transactional consumers' queued messages are processed in
    /// batches inside the writer's transaction (see
    /// [`process_batch`](Builder::process_batch)), not on these threads.
    /// 0 to 63. Default: 2.
    pub fn workers(mut self, workers: usize) -> Self {
        self.config.workers = workers;
        self
    }

    /// Most received messages of transactional consumers processed in one
    /// write transaction: each handler in its own savepoint, one commit for
    /// the batch, shared with whatever callers write at the same time. A
    /// larger batch drains a backlog with fewer commits; a smaller one
    /// holds concurrent `deliver`/`receive` callers up for less time.
    /// 1 to 100,000. Default: 64.
    pub fn process_batch(mut self, messages: usize) -> Self {
        self.config.process_batch = messages;
        self
    }

    /// How often idle workers look for due messages (backoffs expiring,
    /// rows written by another process); a `receive` wakes them at once.
    /// 1 ms to 365 days. Default: 250 ms.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.config.poll_interval = interval;
        self
    }

    /// How often the reaper recovers expired leases and applies retention.
    /// 1 ms to 365 days. Default: 5 s.
    pub fn reaper_interval(mut self, interval: Duration) -> Self {
        self.config.reaper_interval = interval;
        self
    }

    /// How long completed inbox rows are kept: the dedupe horizon. A
    /// message redelivered after the reaper pass that deleted its row is
    /// processed again. (During that pass, until its key entry follows the
    /// row, or until the next pass if that one was cut short, a redelivery
    /// with the same payload is still a duplicate.) Sent outbox rows are
    /// kept as long. The newest row of each table is kept whatever its age,
    /// so no row id or `seq` is ever given out twice. Any duration;
    /// `Duration::MAX` keeps them for ever. Default: 7 days.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.config.retention = retention;
        self
    }

    /// Delete dead letters this long after they died. Default: `None`,
    /// dead letters are kept until redriven or discarded (or deleted by
    /// hand: [`admin::cleanup`](crate::admin::cleanup),
    /// `postroom cleanup --dead-retention-secs`). Any duration.
    pub fn dead_retention(mut self, retention: Option<Duration>) -> Self {
        self.config.dead_retention = retention;
        self
    }

    /// Delete quarantined deliveries (`postroom_conflicts`) this long after
    /// they were last seen. Default: `None`, they are kept until an
    /// operator discards them (`postroom conflicts discard`,
    /// [`admin::conflicts_discard`](crate::admin::conflicts_discard)) or
    /// deletes them by age (`postroom cleanup --conflict-retention-secs`). Each
    /// keeps its whole payload: set this where a sender reusing ids could
    /// fill the disk. A conflict's id is never given out again. Any
    /// duration.
    pub fn conflict_retention(mut self, retention: Option<Duration>) -> Self {
        self.config.conflict_retention = retention;
        self
    }

    /// Once the `-wal` file is larger than this and the engine is idle, the
    /// checkpointer thread truncates it (the checkpoints it makes every
    /// 1000 WAL frames let SQLite reuse the file's space, but never shrink
    /// it); `open` truncates a WAL left larger than this. Any size.
    /// Default: 4 MiB.
    ///
    /// On a small filesystem (under about 264 MiB with 4 KiB pages, sized
    /// at `open`) the engine bounds the WAL to an eighth of it: the
    /// writer copies the WAL back after each commit from that size on,
    /// the checkpointer is woken every sixty-fourth of the filesystem
    /// instead of every 1000 frames, and this threshold is lowered to a
    /// sixteenth of the filesystem when that is smaller (a 4 MiB
    /// filesystem: copy-back every 15 frames, at most about 512 KiB of
    /// WAL, truncated above 256 KiB when idle). Larger filesystems keep
    /// the thresholds above.
    ///
    /// Whenever a write finds the disk full ([`Error::StorageFull`]), the
    /// engine copies the WAL back and truncates it, so that its space and
    /// any freed later take commits again; if the copy-back itself finds
    /// no room (the database file has to grow), the first commit that
    /// succeeds once space has been freed does it. No restart is needed.
    pub fn checkpoint_wal_bytes(mut self, bytes: u64) -> Self {
        self.config.checkpoint_wal_bytes = bytes;
        self
    }

    /// Commit durability. Default: [`Durability::Full`].
    pub fn durability(mut self, durability: Durability) -> Self {
        self.config.durability = durability;
        self
    }

    /// How long a write waits for another connection's lock before failing
    /// with [`Error::Busy`]. Set before any other pragma. 0 to
    /// 2,147,483,647 ms (SQLite's limit, about 24.8 days). Default: 5 s.
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.config.busy_timeout = timeout;
        self
    }

    /// Most jobs committed in one transaction (group commit); also the
    /// capacity of the queue callers wait in while another batch runs.
    /// 1 to 65,536. Default: 256.
    pub fn max_batch(mut self, jobs: usize) -> Self {
        self.config.max_batch = jobs;
        self
    }

    /// Attempts before a failing message is dead-lettered, counting attempts
    /// that crashed the process. At least 1. Default: 5.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.config.max_attempts = attempts;
        self
    }

    /// Backoff between attempts: `initial` doubling each attempt up to
    /// `max`, each delay jittered down by up to half. Each at most 365 days,
    /// `initial` at most `max`. Default: 1 s to 5 min.
    pub fn backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.config.retry = RetryPolicy { initial, max };
        self
    }

    /// How long an effectful consumer's claimed message stays leased to one
    /// worker; past it the reaper counts the attempt as failed and the
    /// message is retried (transactional consumers' queued messages take no
    /// lease: they are processed inside the writer's transaction)
    /// (measured on a monotonic clock within the process). 1 ms to 365 days.
    /// Default: 30 s.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.config.lease = lease;
        self
    }

    /// Largest payload accepted, in bytes (at most 256 MiB). Default: 1 MiB.
    pub fn max_payload(mut self, bytes: usize) -> Self {
        self.config.max_payload = bytes;
        self
    }

    /// Keep payloads of completed inbox rows (for audit or replay) instead of
    /// clearing them on completion. Failed and dead rows always keep theirs.
    /// Default: false.
    pub fn keep_payloads(mut self, keep: bool) -> Self {
        self.config.keep_payloads = keep;
        self
    }

    /// Run `PRAGMA quick_check` when opening, refusing a damaged database
    /// with [`Error::Corrupt`]. It reads the whole file: about a second per
    /// few hundred MB. Default: true.
    pub fn quick_check_on_open(mut self, check: bool) -> Self {
        self.config.quick_check_on_open = check;
        self
    }

    /// How long dropping the engine without calling
    /// [`Postroom::shutdown`] waits for its threads. At most 365 days.
    /// Default: 10 s.
    pub fn drop_deadline(mut self, deadline: Duration) -> Self {
        self.config.drop_deadline = deadline;
        self
    }

    /// Read-only connections kept for `stats()` and other readers.
    /// 1 to 256. Default: 4.
    pub fn read_pool_size(mut self, connections: u32) -> Self {
        self.config.read_pool_size = connections;
        self
    }

    /// The clock for stored timestamps and backoff. Default: the system
    /// clock. Tests use [`ManualClock`](crate::ManualClock).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Opens (creating if needed, with mode 0600) the database at `path`,
    /// applies or checks the schema, recovers what a crashed process left
    /// behind, and starts the writer thread.
    ///
    /// A setting outside the range its method documents is refused here
    /// with [`Error::InvalidInput`] naming it, before any file is touched.
    pub fn open(self, path: impl AsRef<Path>) -> Result<Postroom> {
        self.config.validate()?;
        let mut seen = HashMap::new();
        for (name, _) in &self.consumers {
            check_name("consumer", name)?;
            if seen.insert(name.as_str(), ()).is_some() {
                return Err(Error::invalid(
                    "consumer",
                    format!("{name:?} is registered twice"),
                ));
            }
        }
        Postroom::open_with(self, path.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
