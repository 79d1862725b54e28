//! The builder: what an application registers (consumers, a sink, a
//! clock) and its settings, each with its documented default. Opening is
//! the engine's (`Builder::open`, in engine/open.rs).

use std::sync::Arc;
use std::time::Duration;

use crate::clock::{Clock, SystemClock};
use crate::config::{Config, Durability, RetryPolicy};
use crate::handler::{EffectHandler, ErasedEffect, Handler};
use crate::sink::Sink;

/// Builds a [`Postroom`](crate::Postroom) engine. Every setting has a default, listed on its
/// method; `Postroom::builder().consumer(..).open(path)` is a complete setup.
///
/// The builder is taken and returned by value, like r2d2's.
///
/// ```
/// use std::time::Duration;
/// use postroom::{handler_fn, Durability, NdjsonSink, Postroom};
///
/// # fn main() -> postroom::Result<()> {
/// # let dir = tempfile::tempdir().unwrap();
/// let room = Postroom::builder()
///     .consumer("audit", handler_fn(|tx, msg| {
///         tx.execute_batch("CREATE TABLE IF NOT EXISTS audit (id TEXT)")?;
///         tx.execute("INSERT INTO audit (id) VALUES (?1)", [msg.id()])?;
///         Ok(())
///     }))
///     .durability(Durability::Normal)      // survives a crash; a power cut may lose ~1 s
///     .max_attempts(3)
///     .backoff(Duration::from_millis(100), Duration::from_secs(30))
///     .retention(Duration::from_secs(24 * 3600))
///     .sink(NdjsonSink::new(std::io::sink())) // the relay's destination
///     .open(dir.path().join("app.db"))?;
/// # room.shutdown(Duration::from_secs(5))?;
/// # Ok(()) }
/// ```
///
/// A setting out of its range is refused at `open`, naming it:
///
/// ```
/// # let dir = tempfile::tempdir().unwrap();
/// let refused = postroom::Postroom::builder().max_attempts(0).open(dir.path().join("app.db"));
/// assert!(matches!(refused, Err(postroom::Error::InvalidInput { .. })));
/// assert!(!dir.path().join("app.db").exists()); // nothing created
/// ```
pub struct Builder {
    pub(crate) config: Config,
    pub(crate) consumers: Vec<(String, ConsumerKind)>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) sink: Option<Box<dyn Sink>>,
    pub(crate) handle_signals: bool,
    pub(crate) backlog_limits: Vec<(String, u64)>,
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
            backlog_limits: Vec::new(),
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
    /// through [`Postroom::receive`](crate::Postroom::receive) only; `deliver` refuses it.
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

    /// The longest the relay sleeps with nothing to do. It does not poll:
    /// commits of this engine wake it at once, a retry when it comes due
    /// (read from the outbox), and rows committed by another process within
    /// about 1.25 s (the checkpointer thread checks the file that often
    /// while idle). This only bounds the sleep, as a safety net.
    /// 1 ms to 365 days. Default: 5 min (was 1 s, a polling rate).
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

    /// Brakes for `consumer`'s queued intake: once `rows` of its received
    /// messages wait for processing or are being processed (pending,
    /// failed and due for a retry, processing), [`receive`](crate::Postroom::receive)
    /// and [`receive_batch`](crate::Postroom::receive_batch) store nothing
    /// and answer the retryable [`Error::Backlogged`](crate::Error::Backlogged)
    /// until the workers have drained some. A puller then pauses (say
    /// 100 ms to a second) and pulls the same changes again; the built-in
    /// intakes stop reading from their broker, acknowledging nothing
    /// meanwhile. A bound, not an exact cap: a call is taken while the
    /// backlog is under it, so the backlog can pass it by that call's
    /// messages (and those of calls running at the same time). `deliver`
    /// is not braked: it processes as it stores.
    ///
    /// The backlog is counted through the indexes that list those rows, at
    /// most `rows` of them, and only near the bound (between counts, each
    /// call's stored messages are added). 1 to 2^63 - 1; a consumer
    /// registered on this builder. Default: none (no bound).
    pub fn backlog_limit(mut self, consumer: impl Into<String>, rows: u64) -> Self {
        self.backlog_limits.push((consumer.into(), rows));
        self
    }

    /// Strict order for `consumer`'s ordering keys: a dead letter holds its
    /// key. By default a message that dies releases its key (the key's
    /// later messages run, and a redriven one runs after them); with this,
    /// no later message of its key runs (queued or retried) until an
    /// operator redrives it (it runs first, then the rest in receive
    /// order) or discards it (the rest run). For data where each message
    /// builds on the one before (edits of one document). `deliver` of a
    /// message whose key is held, or has an earlier message still
    /// unfinished, runs nothing and stores nothing: it answers the
    /// retryable [`Error::KeyHeld`](crate::Error::KeyHeld) (the broker
    /// redelivers later). Messages without a key are not affected.
    /// `postroom status` shows each strict consumer's held keys and the age
    /// of the oldest dead letter holding one. A consumer registered on
    /// this builder; refused at `open` together with
    /// [`dead_retention`](Builder::dead_retention), whose deletion of a
    /// dead letter would release its key. Default: off for every consumer.
    pub fn strict_order(mut self, consumer: impl Into<String>) -> Self {
        self.config.strict_order.insert(consumer.into());
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

    /// A transactional handler runs inside the writer's transaction, so
    /// while it runs every write of the engine waits (`deliver`,
    /// `receive`, `transaction`, for every consumer). One that has held
    /// the writer longer than this is logged (a warning naming its consumer
    /// and message id), counted (`postroom_slow_handlers_total`) and shown
    /// by `postroom status` and `top` while it runs; a queued processing
    /// batch takes no further rows once its handlers have held the writer
    /// this long. Slow work (a network call, a long computation) belongs in
    /// an effectful consumer, whose external step runs outside the
    /// transaction. 10 ms to 1 hour. Default: 1 s.
    pub fn slow_handler(mut self, threshold: Duration) -> Self {
        self.config.slow_handler = threshold;
        self
    }

    /// The longest queued processing sleeps with nothing to do. It does
    /// not poll: a `receive` wakes it at once, a retry when it comes due
    /// (read from the inbox), a worker when it finishes, and rows made due
    /// by another process (the CLI's `retry`, `redeliver`) within about
    /// 1.25 s (the checkpointer thread checks the file that often while
    /// idle). This only bounds the sleep, as a safety net. 1 ms to 365
    /// days. Default: 5 min (was 250 ms, a polling rate).
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.config.poll_interval = interval;
        self
    }

    /// The least time between two passes of the reaper, which recovers
    /// expired leases and applies retention. It does not poll: a pass runs
    /// when a lease expires or a row passes retention (read from the data),
    /// but no sooner than this after the last one, so an idle engine's
    /// reaper does not wake at all. 1 ms to 365 days. Default: 5 s.
    pub fn reaper_interval(mut self, interval: Duration) -> Self {
        self.config.reaper_interval = interval;
        self
    }

    /// How long completed inbox rows are kept: the dedupe horizon. A
    /// message redelivered after the reaper pass that deleted its row is
    /// processed again. (During that pass, until its key entry follows the
    /// row, or until the next pass if that one was cut short, a redelivery
    /// with the same payload is still a duplicate.) Rows are deleted in the
    /// order they were stored: a completed row still within its retention
    /// keeps the rows stored after it until it ages, so a row may be kept
    /// longer by as long as an earlier one took to complete. Sent outbox
    /// rows are kept as long. The newest row of each table is kept whatever its age,
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
    /// Whenever a write finds the disk full ([`Error::StorageFull`](crate::Error::StorageFull)), the
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
    /// with [`Error::Busy`](crate::Error::Busy). Set before any other pragma. 0 to
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
    /// with [`Error::Corrupt`](crate::Error::Corrupt). It reads the whole file: about a second per
    /// few hundred MB. Default: true.
    pub fn quick_check_on_open(mut self, check: bool) -> Self {
        self.config.quick_check_on_open = check;
        self
    }

    /// How long dropping the engine without calling
    /// [`Postroom::shutdown`](crate::Postroom::shutdown) waits for its threads. At most 365 days.
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
}
