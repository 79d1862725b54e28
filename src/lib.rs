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
//! ## Limits
//!
//! Message ids: 1 to 512 bytes. Consumer, source, topic, key and
//! ordering-key names: 1 to 128 bytes, no control characters. Payloads: up
//! to `max_payload` (1 MiB by default); empty payloads are allowed. Headers:
//! at most 64, names 1 to 128 bytes, 16 KiB in all. Anything outside these is
//! refused with [`Error::InvalidInput`] before anything is stored.
//!
//! ## Files
//!
//! Beside `app.db` SQLite keeps `app.db-wal` and `app.db-shm`; postroom adds
//! `app.db-postroom`, which holds the engine's lock (one engine per database
//! at a time) and the marker of the handler currently running. All are
//! created with mode 0600.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod admin;
mod checkpoint;
mod clock;
mod config;
mod delivery;
mod engine;
mod error;
#[doc(hidden)]
pub mod failpoint;
mod guard;
mod handler;
mod inbox;
mod inflight;
mod message;
#[cfg(feature = "mqtt")]
pub mod mqtt;
mod outbox;
mod queue;
mod reaper;
mod relay;
mod retired;
mod schema;
#[cfg(feature = "sim")]
pub mod sim;
mod stats;
mod workers;
mod writer;

/// The rusqlite this crate is built on: [`Tx`] derefs to its `Connection`,
/// so handlers can use its traits (`OptionalExtension`, …) without pinning
/// the version themselves.
pub use rusqlite;

pub use clock::{Clock, ManualClock, SystemClock};
pub use config::{
    Builder, Durability, MAX_HEADERS, MAX_HEADERS_BYTES, MAX_HEADER_NAME_BYTES, MAX_ID_BYTES,
    MAX_NAME_BYTES, MAX_PAYLOAD_LIMIT,
};
pub use engine::{Postroom, ShutdownReport};
pub use error::{Error, Result};
pub use handler::{handler_fn, EffectContext, EffectHandler, Handler, HandlerFn, Tx};
pub use inbox::Status;
pub use message::{Failure, Headers, Message, Outcome, Outgoing, Receipt};
pub use outbox::{OutboxMessage, CAUSATION_HEADER, CORRELATION_HEADER};
pub use queue::DeadLetter;
pub use reaper::CleanupReport;
pub use relay::{sink_fn, ChannelSink, FnSink, InboxSink, NdjsonSink, SendResult, Sink};
pub use schema::{SCHEMA_SQL, SCHEMA_VERSION};
pub use stats::{OutboxCounts, Stats, StatusCounts};
