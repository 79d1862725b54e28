//! Handlers and the transaction they write through.

use rusqlite::Connection;

use crate::config::Config;
use crate::guard::{self, UserCodeGuard};
use crate::message::{Failure, Message, Outgoing};
use crate::store::outbox;
use crate::store::outbox::Cause;

/// Processes one consumer's messages.
///
/// `handle` runs inside the engine's write transaction (in its own
/// savepoint): everything it writes through `tx`, domain rows and published
/// messages alike, commits together with the inbox record or not at all. It
/// runs while the engine's write connection is held (on the calling thread
/// or the writer thread), one message at a time, so keep it quick; do slow
/// external calls elsewhere. Returning an error (or panicking) rolls its
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

/// A handler with a step that must run outside any transaction — an HTTP
/// call to a payment API, a file written elsewhere — for queued consumers
/// ([`Postroom::receive`](crate::Postroom::receive)).
///
/// For each attempt, after the claim on the message has committed (the
/// attempt is counted, the row is `processing` under a lease), a worker
/// thread calls [`effect`](EffectHandler::effect) with no transaction
/// open, then the writer runs [`apply`](EffectHandler::apply) in the
/// transaction that writes your domain rows and completes the message. If
/// the lease was lost meanwhile (it expired and the message was claimed
/// again), `apply` is not run: the other attempt owns the message.
///
/// The effect may run more than once for one message (a crash after the
/// call, an expired lease): pass [`EffectContext::idempotency_key`] to the
/// external service so it recognises the repeat. Use a plain [`Handler`]
/// when everything the message does is in this database.
///
/// ```
/// use std::time::{Duration, Instant};
/// use postroom::{EffectContext, EffectHandler, Failure, Message, Postroom, Tx};
///
/// /// Charges a card through an external API, then records the charge.
/// struct Charge;
///
/// impl EffectHandler for Charge {
///     type Output = String; // the payment provider's charge id
///
///     fn effect(&self, ctx: &EffectContext<'_>, msg: &Message) -> Result<String, Failure> {
///         // payments.charge(amount, idempotency_key = ctx.idempotency_key())?
///         Ok(format!("ch_{}", &ctx.idempotency_key()[..8]))
///     }
///
///     fn apply(&self, tx: &mut Tx<'_>, msg: &Message, charge: String) -> Result<(), Failure> {
///         tx.execute(
///             "INSERT INTO charges (order_id, charge) VALUES (?1, ?2)",
///             [msg.id(), charge.as_str()],
///         )?;
///         Ok(())
///     }
/// }
///
/// # fn main() -> postroom::Result<()> {
/// # let dir = tempfile::tempdir().unwrap();
/// let room = Postroom::builder()
///     .effectful_consumer("payments", Charge)
///     .open(dir.path().join("app.db"))?;
/// room.transaction(|tx| {
///     Ok(tx.execute_batch("CREATE TABLE charges (order_id TEXT, charge TEXT)")?)
/// })?;
/// room.receive("payments", Message::new("orders", "order-7", "{}"))?;
///
/// let deadline = Instant::now() + Duration::from_secs(10);
/// while room.stats()?.inbox["payments"].completed < 1 && Instant::now() < deadline {
///     std::thread::sleep(Duration::from_millis(10));
/// }
/// assert_eq!(room.stats()?.inbox["payments"].completed, 1);
/// # Ok(()) }
/// ```
pub trait EffectHandler: Send + Sync + 'static {
    /// What the external step hands to the transactional step.
    type Output: Send + 'static;

    /// The external step. An `Err` counts as a failed attempt, as in a
    /// [`Handler`].
    fn effect(&self, ctx: &EffectContext<'_>, msg: &Message) -> Result<Self::Output, Failure>;

    /// The transactional step: domain writes and publishes, committed
    /// together with the message's completion.
    fn apply(&self, tx: &mut Tx<'_>, msg: &Message, output: Self::Output) -> Result<(), Failure>;
}

/// What an [`EffectHandler`]'s external step knows about its attempt.
#[derive(Debug)]
pub struct EffectContext<'a> {
    pub(crate) consumer: &'a str,
    pub(crate) attempt: u32,
    pub(crate) idempotency_key: String,
}

impl EffectContext<'_> {
    /// The consumer the message was received for.
    pub fn consumer(&self) -> &str {
        self.consumer
    }

    /// Which attempt this is, from 1.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The message's idempotency key (as [`Tx::idempotency_key`]): the same
    /// on every attempt. Send it with the external call.
    pub fn idempotency_key(&self) -> &str {
        &self.idempotency_key
    }
}

pub(crate) type AnyOutput = Box<dyn std::any::Any + Send>;

/// An [`EffectHandler`] with its output type erased, so consumers of
/// different output types fit in one map.
pub(crate) trait ErasedEffect: Send + Sync {
    fn effect(&self, ctx: &EffectContext<'_>, msg: &Message) -> Result<AnyOutput, Failure>;
    fn apply(&self, tx: &mut Tx<'_>, msg: &Message, output: AnyOutput) -> Result<(), Failure>;
}

impl<H: EffectHandler> ErasedEffect for H {
    fn effect(&self, ctx: &EffectContext<'_>, msg: &Message) -> Result<AnyOutput, Failure> {
        EffectHandler::effect(self, ctx, msg).map(|out| Box::new(out) as AnyOutput)
    }
    fn apply(&self, tx: &mut Tx<'_>, msg: &Message, output: AnyOutput) -> Result<(), Failure> {
        match output.downcast::<H::Output>() {
            Ok(out) => EffectHandler::apply(self, tx, msg, *out),
            Err(_) => Err(Failure::retry(
                "internal error: effect output of the wrong type",
            )),
        }
    }
}

/// The idempotency key of a message: 32 hex digits of a length-prefixed
/// blake3 of `(consumer, source, id)`.
pub(crate) fn idempotency_key(consumer: &str, msg: &Message) -> String {
    crate::store::outbox::digest_hex(
        b"postroom-idempotency\0",
        &[consumer, &msg.source, &msg.id],
        &[],
    )
}

/// The write transaction a handler (or a
/// [`Postroom::transaction`](crate::Postroom::transaction) closure) runs in:
/// SQL for the application's tables, [`Tx::publish`] for outbox rows, and
/// savepoints of its own ([`Tx::savepoint`]). There is no commit: the engine
/// commits when the handler returns `Ok`.
///
/// A `Tx` is not the connection: it offers what a handler needs and nothing
/// that would change the connection for later messages, which share it
/// (`set_db_config`, `busy_timeout`, hooks, functions, `pragma_update`...
/// do not exist here). Its SQL passes an allowlist: reads and writes of the
/// application's tables, its own schema changes, reading pragmas, setting
/// `user_version` and `application_id`; anything else (transaction control,
/// `ATTACH`, writes to postroom's tables, pragmas that set connection state)
/// fails to prepare with `not authorized`. Read postroom's tables freely.
///
/// These do not compile: a handler cannot reach the connection.
///
/// ```compile_fail,E0599
/// let h = postroom::handler_fn(|tx, _msg| {
///     // Would switch dedupe off for every later message.
///     tx.set_db_config(rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_TRIGGER, false)?;
///     Ok(())
/// });
/// ```
///
/// ```compile_fail,E0599
/// let h = postroom::handler_fn(|tx, _msg| {
///     // Would make later deliveries fail `Busy` at once.
///     tx.busy_timeout(std::time::Duration::ZERO)?;
///     Ok(())
/// });
/// ```
///
/// ```compile_fail,E0614
/// let h = postroom::handler_fn(|tx, _msg| {
///     let conn: &rusqlite::Connection = &**tx;
///     Ok(())
/// });
/// ```
pub struct Tx<'c> {
    conn: &'c Connection,
    config: &'c Config,
    guard: &'c UserCodeGuard,
    now_ms: i64,
    cause: Option<Cause<'c>>,
    published: u32,
}

impl<'c> Tx<'c> {
    pub(crate) fn new(
        conn: &'c Connection,
        config: &'c Config,
        guard: &'c UserCodeGuard,
        now_ms: i64,
        cause: Option<Cause<'c>>,
    ) -> Self {
        Tx {
            conn,
            config,
            guard,
            now_ms,
            cause,
            published: 0,
        }
    }

    /// Queues `out` in the outbox, in this transaction. Returns its message
    /// id: stable, and derived from the incoming message, so a downstream
    /// inbox can deduplicate it. An outgoing message over the limits is a
    /// [`Failure::Reject`].
    pub fn publish(&mut self, mut out: Outgoing) -> Result<String, Failure> {
        // Checked as stored, causation headers included: a row over the
        // limits would be refused by a downstream postroom inbox.
        outbox::add_causation(&mut out.headers, self.cause);
        self.config
            .check_outgoing(&out)
            .map_err(|e| Failure::reject(e.to_string()))?;
        // The engine's own write to its table, which user SQL may not do.
        let id = self
            .guard
            .engine(|| outbox::insert(self.conn, &out, self.cause, self.published, self.now_ms))?;
        self.published += 1;
        Ok(id)
    }

    /// Runs one SQL statement, as [`Connection::execute`] does, through the
    /// connection's statement cache: a handler runs the same few statements
    /// for every message, and parsing one anew costs more than running it.
    ///
    /// ```
    /// # use postroom::{handler_fn, Postroom, Message};
    /// # fn main() -> postroom::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// let room = Postroom::builder()
    ///     .consumer("counter", handler_fn(|tx, _msg| {
    ///         tx.execute("UPDATE hits SET n = n + 1 WHERE id = ?1", [1])?;
    ///         Ok(())
    ///     }))
    ///     .open(dir.path().join("app.db"))?;
    /// room.transaction(|tx| {
    ///     tx.execute_batch("CREATE TABLE hits (id INTEGER PRIMARY KEY, n INTEGER);
    ///                       INSERT INTO hits VALUES (1, 0);")?;
    ///     Ok(())
    /// })?;
    /// room.deliver("counter", Message::new("s", "m1", "x"))?;
    /// # room.shutdown(std::time::Duration::from_secs(5))?;
    /// # Ok(()) }
    /// ```
    pub fn execute<P: rusqlite::Params>(&self, sql: &str, params: P) -> rusqlite::Result<usize> {
        self.seen(self.prepare_cached(sql).and_then(|mut s| s.execute(params)))
    }

    /// Runs SQL statements separated by `;`, with no parameters, as
    /// [`Connection::execute_batch`] does (not cached: for schema set-up
    /// and one-off work).
    pub fn execute_batch(&self, sql: &str) -> rusqlite::Result<()> {
        self.seen(self.conn.execute_batch(sql))
    }

    /// Runs a query expected to return at least one row and maps the first,
    /// as [`Connection::query_row`] does, through the statement cache.
    pub fn query_row<T, P, F>(&self, sql: &str, params: P, f: F) -> rusqlite::Result<T>
    where
        P: rusqlite::Params,
        F: FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
    {
        self.seen(
            self.prepare_cached(sql)
                .and_then(|mut s| s.query_row(params, f)),
        )
    }

    /// What a statement answered, as it is; with the testkit, a full-disk
    /// error is noted first (the testkit's `disk-full` fault reads it).
    #[inline]
    fn seen<T>(&self, answer: rusqlite::Result<T>) -> rusqlite::Result<T> {
        #[cfg(feature = "testkit")]
        if let Err(e) = &answer {
            self.guard.note_error(e);
        }
        answer
    }

    /// Test support (feature `testkit`): the full-disk errors this
    /// connection's `Tx` statements returned to user code so far.
    #[cfg(feature = "testkit")]
    pub(crate) fn full_disk_errors_for_tests(&self) -> u64 {
        self.guard.full_disk_errors()
    }

    /// Prepares a statement, as [`Connection::prepare`] does. A statement
    /// runs the SQL it was prepared with and nothing else; it lives no
    /// longer than this borrow of the transaction.
    pub fn prepare(&self, sql: &str) -> rusqlite::Result<rusqlite::Statement<'_>> {
        // Tagged as user code's, as cached ones are: a statement left
        // running after the handler returned is found by its tag.
        self.conn.prepare(&guard::user_sql(sql))
    }

    /// Prepares a statement through the connection's statement cache, as
    /// [`Connection::prepare_cached`] does. User code's entries are its own:
    /// it is never handed a statement the engine prepared.
    pub fn prepare_cached(&self, sql: &str) -> rusqlite::Result<rusqlite::CachedStatement<'_>> {
        self.conn.prepare_cached(&guard::user_sql(sql))
    }

    /// Test support (feature `testkit`): sets the write connection's page
    /// quota for the rest of this transaction (the testkit's full disk,
    /// lifted once the handler answered), as the engine's own change.
    #[cfg(feature = "testkit")]
    pub(crate) fn set_max_page_count_for_tests(&self, pages: u32) -> rusqlite::Result<()> {
        self.guard.set_max_page_count(self.conn, pages).map(drop)
    }

    /// The rowid of the last row inserted (by this transaction's SQL or, after
    /// [`Tx::publish`], the engine's), as [`Connection::last_insert_rowid`].
    pub fn last_insert_rowid(&self) -> i64 {
        self.conn.last_insert_rowid()
    }

    /// The rows changed by the last `INSERT`, `UPDATE` or `DELETE`, as
    /// [`Connection::changes`].
    pub fn changes(&self) -> u64 {
        self.conn.changes()
    }

    /// Runs `f` in a savepoint of its own: if `f` returns `Err`, what it
    /// wrote (rows and published messages) is rolled back and the rest of
    /// the transaction stands, so a handler can try a step and carry on
    /// without it. Savepoints nest.
    ///
    /// ```
    /// # use postroom::{handler_fn, Failure, Postroom, Message};
    /// # fn main() -> postroom::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// let room = Postroom::builder()
    ///     .consumer("c", handler_fn(|tx, msg| {
    ///         tx.execute("INSERT INTO seen (id) VALUES (?1)", [msg.id()])?;
    ///         // Best effort: a duplicate audit row is dropped, `seen` stays.
    ///         let _ = tx.savepoint(|tx| {
    ///             tx.execute("INSERT INTO audit (id) VALUES (?1)", [msg.id()])?;
    ///             Ok::<_, Failure>(())
    ///         });
    ///         Ok(())
    ///     }))
    ///     .open(dir.path().join("app.db"))?;
    /// room.transaction(|tx| {
    ///     Ok(tx.execute_batch("CREATE TABLE seen (id TEXT);
    ///                          CREATE TABLE audit (id TEXT UNIQUE);")?)
    /// })?;
    /// room.deliver("c", Message::new("s", "m1", "x"))?;
    /// # room.shutdown(std::time::Duration::from_secs(5))?;
    /// # Ok(()) }
    /// ```
    pub fn savepoint<T>(
        &mut self,
        f: impl FnOnce(&mut Tx<'c>) -> Result<T, Failure>,
    ) -> Result<T, Failure> {
        self.execute("SAVEPOINT tx_savepoint", [])?;
        let published = self.published;
        match f(self) {
            Ok(value) => {
                self.execute("RELEASE tx_savepoint", [])?;
                Ok(value)
            }
            Err(failure) => {
                self.execute("ROLLBACK TO tx_savepoint", [])?;
                self.execute("RELEASE tx_savepoint", [])?;
                // Rolled back: its publishes never happened, and the next
                // one takes their place (ids stay stable across attempts).
                self.published = published;
                Err(failure)
            }
        }
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
        self.cause.map(|c| idempotency_key(c.consumer, c.msg))
    }

    /// The time the engine uses for this transaction, in unix milliseconds.
    pub fn now_ms(&self) -> i64 {
        self.now_ms
    }
}
