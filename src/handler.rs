//! Handlers and the transaction they write through.

use std::ops::Deref;

use rusqlite::Connection;

use crate::config::Config;
use crate::message::{Failure, Message, Outgoing};
use crate::outbox;

/// Processes one consumer's messages.
///
/// `handle` runs inside the engine's write transaction (in its own
/// savepoint): everything it writes through `tx`, domain rows and published
/// messages alike, commits together with the inbox record or not at all. It
/// runs on the writer thread, one message at a time, so keep it quick; do
/// slow external calls elsewhere. Returning an error (or panicking) rolls its
/// writes back. A handler must not begin, commit or roll back transactions
/// itself, and must not call the engine it runs in.
pub trait Handler: Send + Sync + 'static {
    /// Applies `msg`.
    fn handle(&self, tx: &mut Tx<'_>, msg: &Message) -> Result<(), Failure>;
}

/// A [`Handler`] made from a closure; see [`handler_fn`].
pub struct HandlerFn<F>(F);

/// Makes a [`Handler`] from a closure.
///
/// ```
/// use postroom::{handler_fn, Failure};
/// let h = handler_fn(|tx, msg| {
///     tx.execute("INSERT INTO seen (id) VALUES (?1)", [msg.id()])?;
///     Ok::<(), Failure>(())
/// });
/// # let _ = h;
/// ```
pub fn handler_fn<F>(f: F) -> HandlerFn<F>
where
    F: Fn(&mut Tx<'_>, &Message) -> Result<(), Failure> + Send + Sync + 'static,
{
    HandlerFn(f)
}

impl<F> Handler for HandlerFn<F>
where
    F: Fn(&mut Tx<'_>, &Message) -> Result<(), Failure> + Send + Sync + 'static,
{
    fn handle(&self, tx: &mut Tx<'_>, msg: &Message) -> Result<(), Failure> {
        (self.0)(tx, msg)
    }
}

/// The inbox message that caused a transaction.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cause<'a> {
    pub consumer: &'a str,
    pub msg: &'a Message,
    pub attempt: u32,
}

/// The write transaction a handler runs in. Derefs to
/// [`rusqlite::Connection`] for domain SQL; [`Tx::publish`] adds outbox rows.
/// There is no commit: the engine commits when the handler returns `Ok`.
pub struct Tx<'c> {
    conn: &'c Connection,
    config: &'c Config,
    now_ms: i64,
    cause: Option<Cause<'c>>,
    published: u32,
}

impl<'c> Tx<'c> {
    pub(crate) fn new(
        conn: &'c Connection,
        config: &'c Config,
        now_ms: i64,
        cause: Option<Cause<'c>>,
    ) -> Self {
        Tx {
            conn,
            config,
            now_ms,
            cause,
            published: 0,
        }
    }

    /// Queues `out` in the outbox, in this transaction. Returns its message
    /// id: stable, and derived from the incoming message, so a downstream
    /// inbox can deduplicate it. An outgoing message over the limits is a
    /// [`Failure::Reject`].
    pub fn publish(&mut self, out: Outgoing) -> Result<String, Failure> {
        self.config
            .check_outgoing(&out)
            .map_err(|e| Failure::reject(e.to_string()))?;
        let id = outbox::insert(self.conn, &out, self.cause, self.published, self.now_ms)?;
        self.published += 1;
        Ok(id)
    }

    /// Which attempt this is, from 1; 0 outside a message handler.
    pub fn attempt(&self) -> u32 {
        self.cause.map_or(0, |c| c.attempt)
    }

    /// The consumer this message is being handled for, if any.
    pub fn consumer(&self) -> Option<&str> {
        self.cause.map(|c| c.consumer)
    }

    /// A key naming this message uniquely and stably across attempts: 32
    /// hex digits derived from `(consumer, source, id)`, short enough for
    /// any external service's idempotency-key field. Pass it along with
    /// external calls so a retried attempt is recognised there too. `None`
    /// outside a message handler.
    pub fn idempotency_key(&self) -> Option<String> {
        self.cause.map(|c| {
            crate::outbox::digest_hex(
                b"postroom-idempotency\0",
                &[c.consumer, &c.msg.source, &c.msg.id],
                &[],
            )
        })
    }

    /// The time the engine uses for this transaction, in unix milliseconds.
    pub fn now_ms(&self) -> i64 {
        self.now_ms
    }
}

impl Deref for Tx<'_> {
    type Target = Connection;
    fn deref(&self) -> &Connection {
        self.conn
    }
}
