//! # postroom
//!
//! Exactly-once effects on top of at-least-once delivery, in one SQLite file:
//! the transactional inbox and outbox patterns as one embedded engine.
//!
//! Each incoming message is recorded in an inbox table **in the same SQLite
//! transaction** as your handler's domain writes and the messages it
//! publishes (the outbox). A redelivered message is recognised and not
//! applied again; a message whose handler fails is retried with backoff and
//! dead-lettered when it keeps failing; a message whose id was reused with a
//! different payload is quarantined, never merged.
//!
//! ```
//! use postroom::{handler_fn, Message, Outcome, Outgoing, Postroom};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Serialize, Deserialize)]
//! struct OrderPaid { order_id: i64 }
//!
//! # fn main() -> postroom::Result<()> {
//! let dir = tempfile::tempdir().unwrap();
//! let room = Postroom::builder()
//!     .consumer("order-service", handler_fn(|tx, msg| {
//!         let paid: OrderPaid = msg.json()?;           // bad JSON: dead-lettered
//!         tx.execute("UPDATE orders SET paid = 1 WHERE id = ?1", [paid.order_id])?;
//!         tx.publish(Outgoing::json("shipping.requested", &paid)?
//!             .with_key(paid.order_id.to_string()))?;
//!         Ok(())
//!     }))
//!     .open(dir.path().join("app.db"))?;
//!
//! // The application's own tables live in the same file.
//! room.transaction(|tx| {
//!     tx.execute_batch("CREATE TABLE orders (id INTEGER PRIMARY KEY, paid INTEGER);
//!                       INSERT INTO orders VALUES (7, 0);")?;
//!     Ok(())
//! })?;
//!
//! let msg = Message::from_json("orders", "evt-123", &OrderPaid { order_id: 7 }).unwrap();
//! let outcome = room.deliver("order-service", msg.clone())?;
//! assert_eq!(outcome, Outcome::Processed { attempts: 1 });
//! assert!(outcome.should_ack());                 // now ack to the broker
//!
//! // The broker redelivers: recognised, the handler does not run again.
//! assert_eq!(room.deliver("order-service", msg)?, Outcome::Duplicate);
//!
//! let stats = room.stats()?;
//! assert_eq!(stats.inbox["order-service"].completed, 1);
//! assert_eq!(stats.outbox.pending, 1);           // waiting for the relay
//! room.shutdown(std::time::Duration::from_secs(5))?;
//! # Ok(()) }
//! ```
//!
//! ## Guarantees
//!
//! * **Exactly-once effects**: for a key `(consumer, source, message_id)`
//!   the handler's writes commit at most once, and at least once if the
//!   message keeps being redelivered until [`Outcome::should_ack`].
//! * **Ack after commit**: `deliver` returns only after the decision is
//!   durable (per [`Durability`]).
//! * **Nothing lost**: a message is processed, parked as dead with its
//!   payload and last error, or (same id, different payload) quarantined.
//! * **Crash anywhere**: `kill -9` at any instant, re-open, redeliver: no
//!   committed work lost, nothing half-applied. A handler that kills the
//!   process is counted as an attempt, so a crash-looping message is
//!   dead-lettered after `max_attempts` restarts (see [`Builder::max_attempts`]).
//!
//! ## Async runtimes
//!
//! The engine is thread-based and its calls block: [`Postroom::deliver`],
//! [`Postroom::receive`] and [`Postroom::transaction`] return once their
//! commit is durable (an fsync at [`Durability::Full`]), typically well
//! under a millisecond to a few milliseconds, longer while another process
//! holds the lock. Do not call them on an async executor's threads: share
//! the engine as an `Arc<Postroom>` and call through
//! `tokio::task::spawn_blocking` (or your runtime's equivalent), as
//! `examples/tokio.rs` does. Handlers and sinks run on the engine's own
//! threads and must not block on the runtime either; a sink that needs an
//! async client can hand messages over a channel and wait for the reply
//! (`Handle::block_on` from a non-runtime thread).
//!
//! ## Metrics
//!
//! Counters, gauges and histograms go through the [`metrics`](https://docs.rs/metrics)
//! facade, so any exporter the application installs receives them; with
//! none installed they cost next to nothing. Each is reported after the
//! commit it describes.
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | `postroom_delivered_total` | counter | `consumer` | messages processed: handler's writes committed (inline or queued) |
//! | `postroom_duplicates_total` | counter | `consumer` | redeliveries recognised (a `Duplicate` answer or receipt) |
//! | `postroom_conflicts_total` | counter | `consumer` | ids reused with another payload, quarantined |
//! | `postroom_failed_total` | counter | `consumer` | attempts that failed and will be retried |
//! | `postroom_dead_total` | counter | `consumer` | `Dead` answers and results (a redelivery of a dead message is answered `Dead` again) |
//! | `postroom_deliver_seconds` | histogram | `consumer` | `deliver` latency, call to durable answer |
//! | `postroom_group_size` | histogram | | jobs committed together in one group commit |
//! | `postroom_outbox_sent_total` | counter | | outbox messages marked sent by the relay |
//! | `postroom_relay_lag_seconds` | histogram | | from an outbox message's commit to its being marked sent |
//! | `postroom_outbox_dead_total` | counter | | outbox messages dead (refused, or out of attempts) |
//! | `postroom_slow_handlers_total` | counter | `consumer` | handlers that held the writer past `slow_handler` |
//! | `postroom_checkpoint_blocked_total` | counter | | the writer's WAL copy-backs that a reader (another connection's read transaction) kept from completing |
//! | `postroom_wal_over_cap_total` | counter | | commits that left the WAL past its cap (a reader holds an old snapshot) |
//! | `postroom_waiting_for_redelivery` | gauge | `consumer` | failed rows no worker retries, waiting for their sender's redelivery (live, and set by [`Postroom::stats`]) |
//! | `postroom_oldest_waiting_for_redelivery_seconds` | gauge | `consumer` | age of the oldest of those since its last attempt; 0 when none (live, and set by [`Postroom::stats`]) |
//! | `postroom_backlog` | gauge | `consumer` | live: received (queued) messages not settled: pending, waiting for a retry, being processed (counted up to 100,000 per index) |
//! | `postroom_oldest_backlog_seconds` | gauge | `consumer` | live: age of the oldest of those since received; 0 when none |
//! | `postroom_waiting_for_retry` | gauge | `consumer` | live: of the backlog, messages that failed and wait out their backoff (among the first 1,000 in receive order, and of the ordering keys' first 1,000) |
//! | `postroom_dead_letters` | gauge | `consumer` | live: dead letters (among the oldest 10,000 of all consumers) |
//! | `postroom_oldest_dead_letter_seconds` | gauge | `consumer` | live: age of the oldest dead letter since it died; 0 when none |
//! | `postroom_watermark_gaps` | gauge | `consumer` | live: sequences up to each stream's highest that have not settled (never arrived, or not yet processed), summed over the consumer's streams ([`Stats::sequences`] lists them) |
//! | `postroom_wal_bytes` | gauge | | live: size of the `-wal` file |
//!
//! The live gauges are kept by the engine itself, for its registered
//! consumers: read again through indexes (bounded reads, a count at its
//! bound reads "at least") at most once every 1.25 s and only after the
//! database changed (a commit of this engine or of another process), so
//! an idle engine reads nothing for them; the ages are set again at that
//! pace from what the last read found, so they keep growing while nothing
//! changes. Two engines in one process with a consumer of the same name
//! set the same gauges (the last set wins), as they do
//! `postroom_wal_bytes`.
//!
//! ## Logs
//!
//! Through the [`log`](https://docs.rs/log) crate; records about one
//! message (a dead letter, a queued result) carry `consumer` and
//! `message_id` as key-values for structured loggers.
//!
//! ## Serde
//!
//! The value types ([`Message`], [`OutboxMessage`], [`Outcome`],
//! [`Receipt`], [`Stats`], [`DeadLetter`], …) implement `Serialize` and
//! `Deserialize`: outcomes as `{"outcome": "failed", "attempts": 2, …}`.
//!
//! ## SQLite
//!
//! The default `bundled` feature compiles SQLite in. Without it the
//! system's library is linked (or SQLCipher, through rusqlite's features),
//! and [`Builder::open`] refuses one older than [`MIN_SQLITE_VERSION`] with
//! [`Error::SqliteTooOld`]. Use [`rusqlite`] as re-exported here rather
//! than a rusqlite of your own: a program can link only one
//! `libsqlite3-sys`, so an application with its own rusqlite dependency
//! must be on the version postroom uses.
//!
//! ## After the dedupe window
//!
//! An id is remembered until retention deletes its row (7 days by
//! default). A sender that numbers its messages
//! ([`Message::with_sequence`]) is remembered for good: per consumer and
//! source the engine keeps a watermark below which every message has
//! settled, and a redelivery weeks later is answered
//! [`Outcome::DuplicateBySequence`]. Out-of-order and missing numbers are
//! never dropped; [`Stats::sequences`] shows what is missing.
//! [`InboxSink`] numbers what it forwards, so postroom-to-postroom chains
//! get this without code.
//!
//! ## Testing your handlers
//!
//! With the `testkit` feature, `testkit::Scenario` runs
//! your own handlers, effect handlers and sinks through this engine under
//! seeded crashes (in process, or a child process killed with SIGKILL),
//! redeliveries, reorders, reused ids, rollbacks, a full disk, sink
//! failures and timeouts, clock jumps and retention passes, and checks
//! that each message's effects happened exactly once; a failure prints the
//! seed, a shrunk fault schedule and the command that replays it. See
//! docs/TESTING-YOUR-HANDLERS.md.
//!
//! ## Limits
//!
//! Message ids: 1 to 512 bytes. Consumer, source, topic, key and
//! ordering-key names: 1 to 128 bytes, no control characters. Payloads: up
//! to `max_payload` (1 MiB by default); empty payloads are allowed. Headers:
//! at most 64, names 1 to 128 bytes, 16 KiB in all. Sequences: 1 to
//! [`MAX_SEQUENCE`], sequence stream names as source names. Anything outside these is
//! refused with [`Error::InvalidInput`] before anything is stored.
//!
//! ## Files
//!
//! Beside `app.db` SQLite keeps `app.db-wal` and `app.db-shm`; postroom adds
//! `app.db-postroom`, which holds the engine's lock (one engine per database
//! at a time) and the marker of the handler currently running. All are
//! created with mode 0600.
// One module may use `unsafe`: `guard::raw`, two SQLite C calls rusqlite
// does not wrap, with why they are sound. Denied everywhere else.
#![deny(unsafe_code)]
#![warn(missing_docs)]

// Layers, lowest first; each module uses only its own layer and those
// below (checked by .ci/layers.py; docs/DESIGN.md says what lives where).
// base: values, errors, settings.
mod clock;
mod config;
mod error;
mod escape;
#[doc(hidden)]
pub mod failpoint;
mod guard;
mod message;
mod platform;
mod telemetry;
// store: SQL as plain functions over a connection, `now` passed in.
mod store;
// What user code implements and calls.
mod builder;
mod handler;
mod sink;
// The state machines over the store, and recovery at open.
mod brakes;
mod delivery;
mod recovery;
// The threads.
mod runtime;
// The engine: opening, the public calls, shutdown.
mod engine;
// On top: operator functions, the thread-free harness, engine-to-engine sinks.
pub mod admin;
pub mod hop;
#[cfg(feature = "mqtt")]
pub mod mqtt;
#[cfg(feature = "nats")]
pub mod nats;
// The project's own model harness: internal (feature `_sim`), hidden.
#[cfg(feature = "_sim")]
#[doc(hidden)]
pub mod sim;
mod sinks;
#[cfg(feature = "testkit")]
pub mod testkit;

/// The rusqlite this crate is built on: [`Tx`] hands out its statements,
/// rows and errors, so handlers can use its traits (`OptionalExtension`,
/// …) without pinning the version themselves. Use this path rather than a rusqlite dependency
/// of your own: only one `libsqlite3-sys` can be linked into a program, so
/// a second rusqlite version cannot be added beside this one.
///
/// ```
/// use postroom::rusqlite::OptionalExtension;
/// use postroom::{handler_fn, Failure};
///
/// let handler = handler_fn(|tx, msg| {
///     let seen: Option<i64> = tx
///         .query_row("SELECT 1 FROM seen WHERE id = ?1", [msg.id()], |r| r.get(0))
///         .optional()?;
///     if seen.is_none() {
///         tx.execute("INSERT INTO seen (id) VALUES (?1)", [msg.id()])?;
///     }
///     Ok::<(), Failure>(())
/// });
/// # let _ = handler;
/// ```
pub use rusqlite;

pub use builder::Builder;
pub use clock::{Clock, ManualClock, SystemClock};
pub use config::{
    Durability, MAX_HEADERS, MAX_HEADERS_BYTES, MAX_HEADER_NAME_BYTES, MAX_ID_BYTES,
    MAX_NAME_BYTES, MAX_PAYLOAD_LIMIT,
};
pub use engine::{Postroom, ShutdownReport};
pub use error::{Error, Result};
pub use handler::{handler_fn, EffectContext, EffectHandler, Handler, HandlerFn, Tx};
pub use message::{Failure, Headers, Message, Outcome, Outgoing, Receipt, MAX_SEQUENCE};
pub use runtime::reaper::CleanupReport;
pub use sink::{sink_fn, ChannelSink, FnSink, NdjsonSink, SendResult, Sink};
pub use sinks::InboxSink;
pub use store::inbox::Status;
pub use store::outbox::{outbox_stream, OutboxMessage, CAUSATION_HEADER, CORRELATION_HEADER};
pub use store::queue::DeadLetter;
pub use store::schema::{MIN_SQLITE_VERSION, SCHEMA_SQL, SCHEMA_VERSION};
pub use store::stats::{OutboxCounts, Stats, StatusCounts};
pub use store::watermark::{StreamWatermark, MAX_LISTED_SEQUENCES, MAX_SETTLED_RUNS, RESUME_WALK};
