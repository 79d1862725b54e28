//! A fault testkit for applications (feature `testkit`): your own
//! handlers, effect handlers and sinks, run through the real engine under
//! seeded, replayable faults, with a verdict on exactly-once effects.
//!
//! ```no_run
//! use postroom::testkit::{FaultKind, Scenario};
//! use postroom::{handler_fn, Message};
//!
//! #[test]
//! fn orders_survive_the_fire() {
//!     Scenario::new(|app| {
//!         app.consumer("billing", handler_fn(|tx, msg| {
//!             tx.execute("INSERT INTO paid (id) VALUES (?1)", [msg.id()])?;
//!             Ok(())
//!         }));
//!     })
//!     .schema(|tx| Ok(tx.execute_batch("CREATE TABLE paid (id TEXT)")?))
//!     .messages(|rng| {
//!         (0..8).map(|i| Message::new("orders", format!("o-{i}"), "{}")).collect()
//!     })
//!     .effects(|check, msg| {
//!         check.count("SELECT count(*) FROM paid WHERE id = ?1", [msg.id()])
//!     })
//!     .without(FaultKind::SinkFails) // say so for each kind you switch off
//!     .seeds(200)
//!     .run();
//! }
//! ```
//!
//! Per seed, in a fresh temporary directory: your `setup` registers the
//! consumers and the sink on an [`App`] (called again at every reopen, as a
//! restarted process would), the engine opens on a real SQLite file with a
//! [`ManualClock`], your `schema` runs, your generator
//! makes the messages from a seeded [`Rng`], and a broker stand-in delivers
//! each message to every consumer (`deliver` for inline consumers,
//! `receive` for queued and effectful ones), redelivering until
//! acknowledged, while the seed's schedule of [`Fault`]s fires. Then the
//! verdict ([`Violation`]): effects exactly once per completed message, no
//! acknowledged message missing, every outbox row handed to the sink in
//! per-key order (and, when your sink uses the [`Downstream`] stand-in,
//! none answered `Sent` but lost), your invariants after every step, and,
//! with [`Scenario::outcome`], the same final state as a fault-free
//! in-order run. A failure panics with the seed, the schedule, a shrunk
//! schedule and the command that replays it. See
//! docs/TESTING-YOUR-HANDLERS.md.
//!
//! Invariants of this module: it uses only the crate's public API (it
//! could be a separate crate) and two test hooks of the engine, the page
//! quota (public, hidden) and the lease expiry (crate-private, this
//! feature only); a seed fixes the messages and the fault
//! schedule (the messages come from a generator seeded apart from the
//! schedule, so a shrunk schedule replays the same messages); the relay
//! and the workers run on the engine's own threads as in production, so
//! which rows a sink fault meets may vary between replays of one seed,
//! while every verdict is about what must hold whatever the interleaving;
//! a simulated crash drops the engine with the sink's destructor not run
//! and everything in memory of the handlers lost, but lets the engine's
//! threads stop (the in-process crash cannot stop a thread mid-write; for
//! that, [`Scenario::real_kills`] SIGKILLs a child process, see `process`);
//! a rollback fault (`sql-rollback`, `disk-full`) keeps the process and
//! its memory, and rolls back only the transaction; a lease-expiry fault
//! holds the worker after the effect step until the lease has expired (a
//! handshake, bounded, not a short lease that a slow machine might
//! outlive by chance); a disk-full quota is
//! lifted before the delivery's wait, so nothing else waits on a full disk;
//! every wait is bounded (60 s). The testkit writes only its own
//! `_testkit_*` tables in your database.

mod fault;
mod process;
mod stand_in;

use std::cell::{Ref, RefCell};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use rusqlite::{Connection, OpenFlags, OptionalExtension};

pub use fault::{Fault, FaultKind, Violation};
pub use stand_in::{Downstream, Received, Rng, Service, Timeout};

use crate::{
    Builder, Durability, EffectContext, EffectHandler, Failure, Handler, ManualClock, Message,
    OutboxMessage, Postroom, SendResult, Sink, Tx,
};

/// What the wrapper's failure says, so a log line is recognisable.
const CRASH: &str = "postroom testkit: simulated crash before commit";
/// The longest wait for queued work or the relay; far beyond what a busy
/// machine needs, short enough to fail instead of hanging.
const WAIT: Duration = Duration::from_secs(60);
/// How far the manual clock moves per poll while waiting, so retry delays
/// and `Unavailable` pauses (in manual time) run out.
const TICK: Duration = Duration::from_millis(200);
/// Environment variables of a replay.
const SEED_VAR: &str = "POSTROOM_TESTKIT_SEED";
const FAULTS_VAR: &str = "POSTROOM_TESTKIT_FAULTS";
const SEEDS_VAR: &str = "POSTROOM_TESTKIT_SEEDS";
/// The engine's retention in a scenario; a retention-pass fault moves the
/// clock past it.
const RETENTION: Duration = Duration::from_secs(30 * 86_400);
/// The testkit's own tables in your database (not `postroom_*`: those are
/// the engine's, and user code may not write them). The ballast fills the
/// disk; the rollback table's one row makes `INSERT OR ROLLBACK` conflict.
const TESTKIT_SCHEMA: &str = "CREATE TABLE IF NOT EXISTS _testkit_ballast (b BLOB);
     CREATE TABLE IF NOT EXISTS _testkit_rollback (id INTEGER PRIMARY KEY);
     INSERT OR IGNORE INTO _testkit_rollback (id) VALUES (1);";
/// The lease of an effectful consumer's claim (on the monotonic clock):
/// a claim whose `apply` met a full disk stays claimed until it expires.
/// Short, so that the settling does not wait long; an effect step that
/// outlives it on a very busy machine is run again with the same
/// idempotency key, which a correct effect handler survives.
const LEASE: Duration = Duration::from_secs(2);
/// A page quota beyond any test's needs: the quota lifted.
const NO_QUOTA: u32 = 1_073_741_823;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

type Setup = dyn Fn(&mut App<'_>) + Send + Sync;
type Schema = dyn Fn(&mut Tx<'_>) -> Result<(), Failure> + Send + Sync;
type Generator = dyn Fn(&mut Rng) -> Vec<Message>;
type Effects = dyn Fn(&Check<'_>, &Message) -> u64;
type Invariant = dyn Fn(&Check<'_>) -> Result<(), String>;
type OutcomeFn = dyn Fn(&Check<'_>) -> String;
type Configure = dyn Fn(Builder) -> Builder;
type Register = Box<dyn FnOnce(Builder, &Arc<Armed>) -> Builder>;

/// What lives on across the crashes of one seed: the other systems.
#[derive(Default)]
struct World {
    services: Mutex<BTreeMap<String, Service>>,
    downstream: Downstream,
    downstream_used: AtomicBool,
}

impl World {
    fn service(&self, name: &str) -> Service {
        lock(&self.services)
            .entry(name.to_owned())
            .or_insert_with(|| Service::new(name))
            .clone()
    }
}

/// What your setup registers, once per process life of a seed: at the
/// first open and again at every reopen after a simulated crash, so
/// in-memory state of handlers and sinks is lost as in a real restart.
pub struct App<'a> {
    dir: &'a Path,
    world: &'a World,
    consumers: Vec<(String, bool, Register)>,
    /// The names of the effectful consumers.
    effectful: BTreeSet<String>,
    sink: Option<Box<dyn Sink>>,
}

impl App<'_> {
    /// An inline consumer: the broker stand-in calls
    /// [`Postroom::deliver`] and acknowledges on
    /// [`Outcome::should_ack`](crate::Outcome::should_ack).
    pub fn consumer(&mut self, name: &str, handler: impl Handler) -> &mut Self {
        let owned = name.to_owned();
        self.consumers.push((
            owned.clone(),
            false,
            Box::new(move |b: Builder, armed: &Arc<Armed>| {
                b.consumer(
                    owned,
                    Crashable {
                        inner: handler,
                        armed: armed.clone(),
                    },
                )
            }),
        ));
        self
    }

    /// A queued consumer: [`Postroom::receive`], processed by a worker.
    pub fn queued_consumer(&mut self, name: &str, handler: impl Handler) -> &mut Self {
        self.consumer(name, handler);
        if let Some(last) = self.consumers.last_mut() {
            last.1 = true;
        }
        self
    }

    /// An effectful consumer ([`EffectHandler`]), queued. A
    /// crash-before-commit fault lands after its external step, which then
    /// runs again on the redelivery (with the same idempotency key).
    pub fn effectful_consumer(&mut self, name: &str, handler: impl EffectHandler) -> &mut Self {
        let owned = name.to_owned();
        self.effectful.insert(owned.clone());
        self.consumers.push((
            owned.clone(),
            true,
            Box::new(move |b: Builder, armed: &Arc<Armed>| {
                b.effectful_consumer(
                    owned,
                    CrashableEffect {
                        inner: handler,
                        armed: armed.clone(),
                    },
                )
            }),
        ));
        self
    }

    /// Your sink, built for this process life (hand it
    /// [`App::downstream`] where it has its destination's ack).
    pub fn sink(&mut self, sink: impl Sink) -> &mut Self {
        self.sink = Some(Box::new(sink));
        self
    }

    /// The stand-in external service `name`: the same one across the
    /// crashes of a seed, a fresh one for each seed.
    pub fn service(&self, name: &str) -> Service {
        self.world.service(name)
    }

    /// The stand-in destination of your sink. Once asked for, the verdict
    /// demands that everything your sink answered `Sent` for reached it.
    pub fn downstream(&self) -> Downstream {
        self.world.downstream_used.store(true, Ordering::Relaxed);
        self.world.downstream.clone()
    }

    /// This seed's temporary directory (the database is `app.db` in it):
    /// the place for files your handlers write outside the database.
    pub fn dir(&self) -> &Path {
        self.dir
    }
}

/// What your `effects`, `invariant` and `outcome` closures read: a
/// read-only connection to the seed's database, the stand-ins, the
/// directory.
pub struct Check<'a> {
    conn: &'a Connection,
    world: &'a World,
    dir: &'a Path,
    now_ms: i64,
}

impl Check<'_> {
    /// A read-only connection to the database.
    pub fn conn(&self) -> &Connection {
        self.conn
    }

    /// `SELECT count(*) …`-style shorthand: the first column of the first
    /// row as a count (0 for no row or NULL). Panics on an SQL error, with
    /// the statement: this is test code.
    pub fn count<P: rusqlite::Params>(&self, sql: &str, params: P) -> u64 {
        // Cached: an invariant runs the same statements after every step.
        match self
            .conn
            .prepare_cached(sql)
            .and_then(|mut stmt| stmt.query_row(params, |r| r.get::<_, Option<i64>>(0)))
            .optional()
        {
            Ok(n) => n.flatten().unwrap_or(0).max(0) as u64,
            Err(e) => panic!("postroom testkit: {sql:?} failed: {e}"),
        }
    }

    /// The stand-in service `name` (as the handlers saw it).
    pub fn service(&self, name: &str) -> Service {
        self.world.service(name)
    }

    /// The stand-in downstream.
    pub fn downstream(&self) -> Downstream {
        self.world.downstream.clone()
    }

    /// The seed's directory.
    pub fn dir(&self) -> &Path {
        self.dir
    }

    /// The engine's clock now, in unix milliseconds (the scenario's
    /// manual clock, not the wall clock): render stored times relative to
    /// it.
    pub fn now_ms(&self) -> i64 {
        self.now_ms
    }
}

/// What a fault in your handler's transaction does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// The process dies before the commit.
    Crash,
    /// SQL rolls the whole transaction back.
    Rollback,
    /// The disk is full (the quota is set by the run; the wrapper adds a
    /// page-sized write so that the transaction surely meets it).
    DiskFull,
    /// In a child process of the real-process mode: tell the parent, and
    /// wait for its SIGKILL, inside the uncommitted transaction.
    Kill,
    /// After an effect handler's external step, hold the worker until the
    /// run has expired its lease (see [`Hold`]).
    Lease,
}

/// The handshake of a lease-expiry fault between the effect wrapper (on a
/// worker thread) and the run: the wrapper holds after the external step
/// until the run has expired the lease, so the expiry lands under the step
/// on every machine, fast or slow, without waiting out a real lease.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Hold {
    /// No step held.
    #[default]
    Idle,
    /// A step is held, its lease still live.
    Holding,
    /// The run has expired the lease (or gave up): the step goes on.
    Released,
}

/// Which message a fault in the handler's transaction waits for, and
/// whether it fired. Shared by the handler wrappers of every process life
/// of a seed.
#[derive(Default)]
struct Armed {
    target: Mutex<Option<(String, String, Mode)>>,
    fired: Mutex<Option<Mode>>,
    /// The file a child process creates when it is ready to be killed.
    ready: Mutex<Option<PathBuf>>,
    /// A lease-expiry fault's handshake, and its signal.
    hold: Mutex<Hold>,
    held: Condvar,
}

impl Armed {
    fn arm(&self, msg: &Message, mode: Mode) {
        *lock(&self.target) = Some((msg.source().to_owned(), msg.id().to_owned(), mode));
        *lock(&self.fired) = None;
    }

    /// The armed mode, once, for the armed message, if it is one of `modes`.
    fn take(&self, msg: &Message, modes: &[Mode]) -> Option<Mode> {
        let mut target = lock(&self.target);
        let mode = match target.as_ref() {
            Some((s, id, mode)) if s == msg.source() && id == msg.id() && modes.contains(mode) => {
                *mode
            }
            _ => return None,
        };
        *target = None;
        Some(mode)
    }

    /// Whether the armed message was taken by a handler (fired or not).
    fn taken(&self) -> bool {
        lock(&self.target).is_none()
    }

    fn fire(&self, mode: Mode) {
        *lock(&self.fired) = Some(mode);
    }

    /// On the worker, after the external step: holds until the run has
    /// expired the lease (at most [`WAIT`]).
    fn hold_for_expiry(&self) {
        let mut hold = lock(&self.hold);
        *hold = Hold::Holding;
        self.held.notify_all();
        let deadline = Instant::now() + WAIT;
        while *hold == Hold::Holding {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            hold = self
                .held
                .wait_timeout(hold, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        *hold = Hold::Idle;
    }

    /// On the run: waits (at most `wait`) for a step held by
    /// [`hold_for_expiry`](Self::hold_for_expiry); whether one is.
    fn await_hold(&self, wait: Duration) -> bool {
        let mut hold = lock(&self.hold);
        let deadline = Instant::now() + wait;
        while *hold != Hold::Holding {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            hold = self
                .held
                .wait_timeout(hold, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        true
    }

    /// On the run: lets a held step go on.
    fn release_hold(&self) {
        let mut hold = lock(&self.hold);
        if *hold == Hold::Holding {
            *hold = Hold::Released;
        }
        self.held.notify_all();
    }

    /// Disarms; what fired.
    fn disarm(&self) -> Option<Mode> {
        *lock(&self.target) = None;
        lock(&self.fired).take()
    }

    /// Runs `inner` (your handler's transactional part) under the fault
    /// `mode`: the crash after it, the rollback after it, the full disk
    /// during it and, if your code wrote nothing that needed a page, in a
    /// page-sized write after it.
    fn around(
        &self,
        tx: &mut Tx<'_>,
        mode: Mode,
        inner: impl FnOnce(&mut Tx<'_>) -> Result<(), Failure>,
    ) -> Result<(), Failure> {
        let result = inner(tx);
        if mode == Mode::Kill {
            self.die();
        }
        if result.is_err() && mode != Mode::Crash {
            // Your code met the fault (or failed by itself): either way it
            // answered first.
            self.fire(mode);
            return result;
        }
        match mode {
            Mode::Crash | Mode::Kill => {
                self.fire(mode);
                Err(Failure::retry(CRASH))
            }
            Mode::Rollback => {
                self.fire(mode);
                tx.execute(
                    "INSERT OR ROLLBACK INTO _testkit_rollback (id) VALUES (1)",
                    [],
                )?;
                Err(Failure::retry(
                    "postroom testkit: the rollback did not happen",
                ))
            }
            Mode::DiskFull => {
                let page: i64 = tx.query_row("PRAGMA page_size", [], |r| r.get(0))?;
                match tx.execute(
                    "INSERT INTO _testkit_ballast (b) VALUES (zeroblob(?1))",
                    [page * 4],
                ) {
                    Err(e) => {
                        self.fire(mode);
                        Err(e.into())
                    }
                    // Room after all (freed pages): the fault did not fire.
                    Ok(_) => result,
                }
            }
            // Held in the effect step, never around a transaction.
            Mode::Lease => result,
        }
    }
}

/// Your handler, and around it (when armed for this message) the fault:
/// a crash or a rollback after it (its writes are rolled back as a dead
/// process's would be, whatever it did outside the transaction stays
/// done), or a full disk.
struct Crashable<H> {
    inner: H,
    armed: Arc<Armed>,
}

impl<H: Handler> Handler for Crashable<H> {
    fn handle(&self, tx: &mut Tx<'_>, msg: &Message) -> Result<(), Failure> {
        match self.armed.take(
            msg,
            &[Mode::Crash, Mode::Rollback, Mode::DiskFull, Mode::Kill],
        ) {
            None => self.inner.handle(tx, msg),
            Some(mode) => self.armed.around(tx, mode, |tx| self.inner.handle(tx, msg)),
        }
    }
}

/// Your effect handler: the crash after its external step, the rollback
/// and the full disk around its `apply`.
struct CrashableEffect<H> {
    inner: H,
    armed: Arc<Armed>,
}

impl<H: EffectHandler> EffectHandler for CrashableEffect<H> {
    type Output = H::Output;

    fn effect(&self, ctx: &EffectContext<'_>, msg: &Message) -> Result<H::Output, Failure> {
        let lease = self.armed.take(msg, &[Mode::Lease]).is_some();
        let out = self.inner.effect(ctx, msg);
        if lease {
            // Whatever the step answered, its lease expires under it.
            self.armed.hold_for_expiry();
        }
        let out = out?;
        if let Some(Mode::Kill) = self.armed.take(msg, &[Mode::Kill]) {
            self.armed.die();
        }
        if self.armed.take(msg, &[Mode::Crash]).is_some() {
            self.armed.fire(Mode::Crash);
            return Err(Failure::retry(CRASH));
        }
        Ok(out)
    }

    fn apply(&self, tx: &mut Tx<'_>, msg: &Message, output: H::Output) -> Result<(), Failure> {
        match self.armed.take(msg, &[Mode::Rollback, Mode::DiskFull]) {
            None => self.inner.apply(tx, msg, output),
            Some(mode) => self
                .armed
                .around(tx, mode, |tx| self.inner.apply(tx, msg, output)),
        }
    }
}

/// What the sink wrapper saw, across the process lives of a seed.
#[derive(Default)]
struct SinkLog {
    /// A sink fault in progress: its kind and the sends it still answers.
    failing: Option<(FaultKind, i64)>,
    /// Whether `failing` has answered (and been counted) yet.
    answering: bool,
    fired: BTreeMap<FaultKind, u64>,
    /// Every message handed to your sink, in order: (seq, id, key).
    handed: Vec<(i64, String, Option<String>)>,
    /// Ids your sink answered `Sent`.
    sent: BTreeSet<String>,
}

/// Your sink behind the sink faults; after a crash it answers
/// `Unavailable` (the process is gone) and is forgotten, not dropped.
struct FaultySink {
    inner: Option<Box<dyn Sink>>,
    dead: Arc<AtomicBool>,
    log: Arc<Mutex<SinkLog>>,
}

impl Sink for FaultySink {
    fn send(&mut self, batch: &[OutboxMessage]) -> Vec<SendResult> {
        let down = |why: &str| {
            batch
                .iter()
                .map(|_| SendResult::unavailable(why, Duration::from_millis(1)))
                .collect()
        };
        if self.dead.load(Ordering::SeqCst) {
            return down("postroom testkit: the process crashed");
        }
        {
            let mut log = lock(&self.log);
            if let Some((kind, left)) = log.failing.take() {
                if left > 0 {
                    if !log.answering {
                        // Counted once per fault, at its first answer.
                        log.answering = true;
                        *log.fired.entry(kind).or_insert(0) += 1;
                    }
                    log.failing = Some((kind, left - 1));
                    return batch
                        .iter()
                        .map(|_| match kind {
                            FaultKind::SinkUnavailable => SendResult::unavailable(
                                "postroom testkit: destination down",
                                Duration::from_millis(100),
                            ),
                            _ => SendResult::retry("postroom testkit: send failed"),
                        })
                        .collect();
                }
            }
        }
        let Some(inner) = self.inner.as_mut() else {
            return down("postroom testkit: no sink");
        };
        let results = inner.send(batch);
        let mut log = lock(&self.log);
        for (i, m) in batch.iter().enumerate() {
            log.handed.push((m.seq, m.id.clone(), m.key.clone()));
            if results.get(i) == Some(&SendResult::Sent) {
                log.sent.insert(m.id.clone());
            }
        }
        results
    }
}

impl Drop for FaultySink {
    fn drop(&mut self) {
        if self.dead.load(Ordering::SeqCst) {
            // A killed process runs no destructors: a sink that flushes
            // its buffer on drop must not be saved by it here.
            if let Some(inner) = self.inner.take() {
                std::mem::forget(inner);
            }
        }
    }
}

/// A scenario: your consumers and sink, your schema, your messages, what
/// must hold; run over many seeds. See the [module docs](self).
pub struct Scenario {
    setup: Arc<Setup>,
    schema: Option<Arc<Schema>>,
    messages: Option<Box<Generator>>,
    effects: Option<Box<Effects>>,
    invariants: Vec<Box<Invariant>>,
    outcome: Option<Box<OutcomeFn>>,
    configure: Option<Box<Configure>>,
    seeds: u64,
    first_seed: u64,
    fault_rate: u64,
    off: BTreeSet<FaultKind>,
    /// Seeds run in the real-process mode.
    real_kills: u64,
    /// Renders times for the comparison under a shifted clock.
    wall_clock: Option<Box<OutcomeFn>>,
    /// The replay command, if not the default.
    name: Option<String>,
}

/// What a passing run did.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Seeds run.
    pub seeds: u64,
    /// Messages generated, over all seeds.
    pub messages: u64,
    /// Deliveries made (per consumer, redeliveries included).
    pub deliveries: u64,
    /// Faults that fired, per kind.
    pub fired: BTreeMap<FaultKind, u64>,
    /// Kinds switched off with [`Scenario::without`].
    pub switched_off: Vec<FaultKind>,
    /// Kinds that cannot apply (sink faults without a sink, the
    /// destination's timeout without [`App::downstream`]).
    pub not_applicable: Vec<FaultKind>,
    /// Deliveries processed again because a retention pass had removed
    /// the message's inbox row (a known limit, see
    /// [`FaultKind::RetentionPass`]); their effects were expected again.
    pub reprocessed_after_retention: u64,
    /// Seeds run in the real-process mode (a child killed with SIGKILL).
    pub real_kills: u64,
    /// Wall time.
    pub elapsed: Duration,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "postroom testkit: {} seeds, {} messages, {} deliveries in {:.1} s; faults fired:",
            self.seeds,
            self.messages,
            self.deliveries,
            self.elapsed.as_secs_f64()
        )?;
        for (kind, n) in &self.fired {
            writeln!(f, "  {:<20} {n}", kind.name())?;
        }
        if self.real_kills > 0 {
            writeln!(
                f,
                "  {:<20} {} (child processes, crash counts above include them)",
                "real kills", self.real_kills
            )?;
        }
        for kind in &self.switched_off {
            if *kind == FaultKind::RetentionPass {
                writeln!(
                    f,
                    "  {:<20} off (known limit, untested: a duplicate arriving after \
                     retention removed its row is processed again; .with(FaultKind::RetentionPass))",
                    kind.name()
                )?;
            } else {
                writeln!(f, "  {:<20} off", kind.name())?;
            }
        }
        for kind in &self.not_applicable {
            let why = if kind.needs_downstream() {
                "no app.downstream()"
            } else if kind.needs_effectful() {
                "no app.effectful_consumer(..)"
            } else {
                "no sink"
            };
            writeln!(f, "  {:<20} not applicable ({why})", kind.name())?;
        }
        if self.reprocessed_after_retention > 0 {
            writeln!(
                f,
                "  known limit: {} deliveries came after a retention pass had removed their \
                 message and were processed again (retention is the dedupe horizon; \
                 Message::with_sequence closes it)",
                self.reprocessed_after_retention
            )?;
        }
        Ok(())
    }
}

/// A failed run: what was found, where, and how to see it again.
#[derive(Debug, Clone)]
pub struct Failed {
    /// The seed that failed (`None` for a run-wide finding such as
    /// [`Violation::NeverFired`]).
    pub seed: Option<u64>,
    /// What was found.
    pub violation: Violation,
    /// The seed's fault schedule.
    pub schedule: Vec<Fault>,
    /// A smaller schedule that still fails the same way: faults dropped
    /// one at a time while it did.
    pub shrunk: Vec<Fault>,
    /// The command that replays the shrunk schedule.
    pub replay: String,
    /// The generated messages' ids, to name a fault's message.
    ids: Vec<String>,
}

impl Failed {
    /// Whether the shrunk schedule holds a fault of `kind`.
    pub fn blames(&self, kind: FaultKind) -> bool {
        self.shrunk.iter().any(|f| f.kind == kind)
    }
}

impl fmt::Display for Failed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "postroom testkit: {}", self.violation)?;
        if let Some(seed) = self.seed {
            writeln!(f, "  seed: {seed}")?;
            writeln!(f, "  fault schedule ({} faults):", self.schedule.len())?;
            let id = |fault: &Fault| {
                self.ids
                    .get(fault.step)
                    .map_or(String::new(), |id| format!(" ({id:?})"))
            };
            for (i, fault) in self.schedule.iter().enumerate() {
                writeln!(f, "    [{i}] {fault}{}", id(fault))?;
            }
            writeln!(f, "  shrunk to ({} faults):", self.shrunk.len())?;
            for fault in &self.shrunk {
                writeln!(f, "    {fault}{}", id(fault))?;
            }
            if !self.shrunk.is_empty()
                && self
                    .shrunk
                    .iter()
                    .all(|f| f.kind == FaultKind::RetentionPass)
            {
                writeln!(
                    f,
                    "  note: the engine's known limit: a duplicate arriving after retention \
                     removed its row is processed again. Make the handler idempotent in its \
                     own data, give messages sequence numbers, or keep retention longer than \
                     any redelivery (and drop .with(FaultKind::RetentionPass))"
                )?;
            }
        }
        write!(f, "  replay: {}", self.replay)
    }
}

impl std::error::Error for Failed {}

impl Scenario {
    /// A scenario whose consumers and sink `setup` registers on an [`App`].
    pub fn new(setup: impl Fn(&mut App<'_>) + Send + Sync + 'static) -> Scenario {
        Scenario {
            setup: Arc::new(setup),
            schema: None,
            messages: None,
            effects: None,
            invariants: Vec::new(),
            outcome: None,
            configure: None,
            seeds: 100,
            first_seed: 0,
            fault_rate: 30,
            // The known limit is opt-in: see `with`.
            off: BTreeSet::from([FaultKind::RetentionPass]),
            real_kills: 0,
            wall_clock: None,
            name: None,
        }
    }

    /// Creates your tables (run once per seed, before any message).
    pub fn schema(
        mut self,
        schema: impl Fn(&mut Tx<'_>) -> Result<(), Failure> + Send + Sync + 'static,
    ) -> Self {
        self.schema = Some(Arc::new(schema));
        self
    }

    /// Your messages for one seed, from its [`Rng`]. Each goes to every
    /// consumer.
    pub fn messages(mut self, generate: impl Fn(&mut Rng) -> Vec<Message> + 'static) -> Self {
        self.messages = Some(Box::new(generate));
        self
    }

    /// How many times `msg`'s effects are applied; checked at the end to be
    /// once per consumer that completed it (0 for a dead message).
    pub fn effects(mut self, effects: impl Fn(&Check<'_>, &Message) -> u64 + 'static) -> Self {
        self.effects = Some(Box::new(effects));
        self
    }

    /// Must hold after every step and at the end.
    pub fn invariant(
        mut self,
        invariant: impl Fn(&Check<'_>) -> Result<(), String> + 'static,
    ) -> Self {
        self.invariants.push(Box::new(invariant));
        self
    }

    /// The final state, as text (leave out timestamps): must equal that of a
    /// fault-free run delivering the same messages once each, in generated
    /// order. Catches handlers whose result depends on arrival order. Costs
    /// a second run per seed.
    pub fn outcome(mut self, outcome: impl Fn(&Check<'_>) -> String + 'static) -> Self {
        self.outcome = Some(Box::new(outcome));
        self
    }

    /// Further engine settings (`max_attempts`, …), applied after the
    /// testkit's own.
    pub fn configure(mut self, configure: impl Fn(Builder) -> Builder + 'static) -> Self {
        self.configure = Some(Box::new(configure));
        self
    }

    /// How many seeds (default 100; `POSTROOM_TESTKIT_SEEDS` overrides,
    /// but not 0: `seeds(0)` with [`real_kills`](Self::real_kills) runs
    /// only the kills).
    pub fn seeds(mut self, seeds: u64) -> Self {
        self.seeds = seeds;
        self
    }

    /// The first seed (default 0): seeds run from it upwards.
    pub fn first_seed(mut self, seed: u64) -> Self {
        self.first_seed = seed;
        self
    }

    /// The share of messages, in percent, that get a fault (default 30).
    pub fn fault_rate(mut self, percent: u64) -> Self {
        self.fault_rate = percent.min(100);
        self
    }

    /// Switches a fault kind off. Every kind but
    /// [`RetentionPass`](FaultKind::RetentionPass) is on by default, and a
    /// run in which an enabled kind never fired fails: it could not tell.
    pub fn without(mut self, kind: FaultKind) -> Self {
        self.off.insert(kind);
        self
    }

    /// Switches a fault kind on: [`FaultKind::RetentionPass`], off by
    /// default because what it shows is a limit of the engine (a duplicate
    /// arriving after its row was cleaned is processed again), not a bug
    /// of your code. Switch it on to see whether your handler's own data
    /// (a unique key, a version check) absorbs such a duplicate.
    pub fn with(mut self, kind: FaultKind) -> Self {
        self.off.remove(&kind);
        self
    }

    /// The command a failure tells you to run, after the replay's
    /// environment variables (default: `cargo test TEST -- --exact`, TEST
    /// being the test thread's name, which is the test's path). Name your
    /// features here if the test needs them.
    pub fn replay_command(mut self, command: impl Into<String>) -> Self {
        self.name = Some(command.into());
        self
    }

    /// Runs every seed; panics with the failure (seed, schedule, shrunk
    /// schedule, replay command) if one fails.
    pub fn run(&self) -> Report {
        match self.try_run() {
            Ok(report) => {
                eprintln!("{report}");
                report
            }
            Err(failed) => panic!("{failed}"),
        }
    }

    /// Runs each seed fault-free twice, the second time with the engine's
    /// clock 1,000 days, 13 hours and 7 seconds later, and demands that
    /// `times` renders the same text for both: render the times your
    /// handlers stored relative to [`Check::now_ms`] (an age). A handler
    /// that reads the wall clock (`SystemTime::now()`) instead of the
    /// engine's (`tx.now_ms()`) fails with [`Violation::ReadsWallClock`].
    /// Costs one or two more runs per seed.
    pub fn detect_wall_clock(mut self, times: impl Fn(&Check<'_>) -> String + 'static) -> Self {
        self.wall_clock = Some(Box::new(times));
        self
    }

    /// After the in-process seeds, `seeds` more in the real-process mode:
    /// the test binary runs again as a child process (this test only, by
    /// its name), delivers the seed's messages and is killed with SIGKILL
    /// before or after the commit of one of them (fault `arg` 1); this
    /// process then opens the same file with the engine's real recovery,
    /// delivers the rest and judges. About 100 ms to a few seconds per
    /// seed. Only in a `#[test]`, and only for the first scenario its test
    /// runs. The stand-ins ([`Service`], [`Downstream`]) live in memory and
    /// die with the child: judge with files and database rows.
    pub fn real_kills(mut self, seeds: u64) -> Self {
        self.real_kills = seeds;
        self
    }

    /// Runs every seed; the first failure, shrunk, as an error.
    pub fn try_run(&self) -> Result<Report, Box<Failed>> {
        let ordinal = process::ordinal();
        if let Ok(spec) = std::env::var(process::CHILD_VAR) {
            if ordinal == 0 {
                self.run_child(&spec);
            }
        }
        let started = Instant::now();
        let kill_seed = env_u64(process::KILL_VAR);
        if self.real_kills > 0 && ordinal != 0 {
            return Err(Box::new(Failed {
                seed: None,
                violation: Violation::Engine {
                    message: "real kills: make this the first scenario its #[test] runs \
                              (the child process takes the first one)"
                        .into(),
                },
                schedule: Vec::new(),
                shrunk: Vec::new(),
                replay: self.command(),
                ids: Vec::new(),
            }));
        }
        let replay_seed = env_u64(SEED_VAR);
        let keep: Option<Vec<usize>> = std::env::var(FAULTS_VAR)
            .ok()
            .map(|s| s.split(',').filter_map(|i| i.trim().parse().ok()).collect());
        let seeds: Vec<u64> = match (replay_seed, kill_seed) {
            (_, Some(_)) => Vec::new(),
            (Some(seed), None) => vec![seed],
            (None, None) => {
                // `seeds(0)` (only real kills) stays 0.
                let n = match self.seeds {
                    0 => 0,
                    n => env_u64(SEEDS_VAR).unwrap_or(n),
                };
                (0..n).map(|i| self.first_seed.wrapping_add(i)).collect()
            }
        };
        let mut report = Report {
            switched_off: self.off.iter().copied().collect(),
            ..Report::default()
        };
        let applies = self.probe()?;
        let kinds = self.kinds(applies);
        for seed in seeds {
            report.seeds += 1;
            let msgs = self.generate(seed);
            report.messages += msgs.len() as u64;
            let full = self.schedule(seed, msgs.len(), &kinds);
            let schedule: Vec<Fault> = match (&keep, replay_seed) {
                (Some(keep), Some(_)) => {
                    keep.iter().filter_map(|&i| full.get(i)).copied().collect()
                }
                _ => full.clone(),
            };
            let mut reference = Reference::default();
            match self.judge(seed, &msgs, &schedule, &mut reference) {
                Ok(done) => {
                    report.deliveries += done.deliveries;
                    report.reprocessed_after_retention += done.reprocessed;
                    for (k, n) in done.fired {
                        *report.fired.entry(k).or_insert(0) += n;
                    }
                }
                Err(v) => {
                    let mut failed = self.failed(seed, &msgs, v, schedule, &mut reference);
                    // A failure names its faults by their places in the
                    // full schedule.
                    failed.replay = self.replay_line(seed, &full, &failed.shrunk);
                    return Err(failed);
                }
            }
        }
        let kill_seeds: Vec<u64> = match (replay_seed, kill_seed) {
            (_, Some(seed)) => vec![seed],
            (Some(_), None) => Vec::new(),
            (None, None) => (0..self.real_kills)
                .map(|i| self.first_seed.wrapping_add(i))
                .collect(),
        };
        for seed in kill_seeds {
            let msgs = self.generate(seed);
            if msgs.is_empty() {
                continue;
            }
            report.messages += msgs.len() as u64;
            match self.run_killed(seed, &msgs) {
                Ok(done) => {
                    report.real_kills += 1;
                    report.deliveries += done.deliveries;
                    for (k, n) in done.fired {
                        *report.fired.entry(k).or_insert(0) += n;
                    }
                }
                Err(violation) => {
                    let kill = process::kill_point(seed, msgs.len());
                    return Err(Box::new(Failed {
                        seed: Some(seed),
                        violation,
                        schedule: vec![kill],
                        shrunk: vec![kill],
                        replay: format!("{}={seed} {}", process::KILL_VAR, self.command()),
                        ids: msgs.iter().map(|m| m.id().to_owned()).collect(),
                    }));
                }
            }
        }
        report.not_applicable = FaultKind::ALL
            .into_iter()
            .filter(|k| !self.off.contains(k) && !applies.admits(*k))
            .collect();
        let never: Vec<FaultKind> = kinds
            .into_iter()
            .filter(|k| report.fired.get(k).copied().unwrap_or(0) == 0)
            .collect();
        // Without in-process seeds (only real kills) no kind could fire.
        if !never.is_empty() && replay_seed.is_none() && kill_seed.is_none() && report.seeds > 0 {
            return Err(Box::new(Failed {
                seed: None,
                violation: Violation::NeverFired { kinds: never },
                schedule: Vec::new(),
                shrunk: Vec::new(),
                replay: self.command(),
                ids: Vec::new(),
            }));
        }
        report.elapsed = started.elapsed();
        Ok(report)
    }

    /// Runs one seed's `schedule` and judges it, the verdicts that compare
    /// with a fault-free run included (`reference`, run once when first
    /// needed).
    fn judge(
        &self,
        seed: u64,
        msgs: &[Message],
        schedule: &[Fault],
        reference: &mut Reference,
    ) -> Result<Done, Violation> {
        if self.outcome.is_some() {
            reference.get(|| self.run_seed(seed, msgs, &[]))?;
        }
        if self.wall_clock.is_some() {
            let base = reference.get(|| self.run_seed(seed, msgs, &[]))?;
            let shifted = reference.shifted(|| self.run_shifted(seed, msgs))?;
            if let (Some(expected), Some(got)) = (base.times, shifted.times) {
                if expected != got {
                    return Err(Violation::ReadsWallClock { expected, got });
                }
            }
        }
        let done = self.run_seed(seed, msgs, schedule)?;
        if !done.dead.is_empty() {
            let fault_free = reference.get(|| self.run_seed(seed, msgs, &[]))?;
            if let Some((consumer, id)) = done.dead.difference(&fault_free.dead).next() {
                return Err(Violation::LostToFault {
                    message_id: id.clone(),
                    consumer: consumer.clone(),
                });
            }
        }
        if let Some(Ok(fault_free)) = &reference.0 {
            if let (Some(expected), Some(got)) = (&fault_free.outcome, &done.outcome) {
                if expected != got {
                    return Err(Violation::OutcomeDiffers {
                        expected: expected.clone(),
                        got: got.clone(),
                    });
                }
            }
        }
        Ok(done)
    }

    /// Runs one seed and schedule decoded from fuzzer bytes (the first 8
    /// are the seed, then 3 per fault: message, kind, size); panics with
    /// the failure, as a fuzz target should. The never-fired rule does
    /// not apply to one input. For a cargo-fuzz target:
    /// `fuzz_target!(|data: &[u8]| my_scenario().run_bytes(data));`
    pub fn run_bytes(&self, data: &[u8]) {
        if let Err(failed) = self.try_run_bytes(data) {
            panic!("{failed}");
        }
    }

    /// [`run_bytes`](Self::run_bytes), returning the failure.
    pub fn try_run_bytes(&self, data: &[u8]) -> Result<(), Box<Failed>> {
        let (head, rest) = data.split_at(data.len().min(8));
        let mut seed_bytes = [0u8; 8];
        seed_bytes[..head.len()].copy_from_slice(head);
        let seed = u64::from_le_bytes(seed_bytes);
        let kinds = self.kinds(self.probe()?);
        let msgs = self.generate(seed);
        if msgs.is_empty() || kinds.is_empty() {
            return Ok(());
        }
        let schedule: Vec<Fault> = rest
            .chunks_exact(3)
            .map(|c| {
                let kind = kinds[usize::from(c[1]) % kinds.len()];
                let size = i64::from(c[2]);
                Fault {
                    step: usize::from(c[0]) % msgs.len(),
                    kind,
                    arg: match kind {
                        FaultKind::Reorder => 1 + size % 4,
                        // The seeded schedule's range: back 1 s to a
                        // minute, forward 1 s to two days.
                        FaultKind::ClockJump if size < 128 => -(1_000 + size * 59_000 / 127),
                        FaultKind::ClockJump => {
                            1_000 + (size - 128) * (2 * 86_400_000 - 1_000) / 127
                        }
                        FaultKind::SinkFails
                        | FaultKind::SinkUnavailable
                        | FaultKind::SinkTimeout => 1 + size % 3,
                        _ => 0,
                    },
                }
            })
            .collect();
        let mut reference = Reference::default();
        self.judge(seed, &msgs, &schedule, &mut reference)
            .map(drop)
            .map_err(|v| {
                let mut failed = self.failed(seed, &msgs, v, schedule, &mut reference);
                // The schedule came from the bytes, not from the seed.
                failed.replay = "run the fuzz target on the failing input: \
                                 cargo fuzz run TARGET path/to/crash-file"
                    .into();
                failed
            })
    }

    fn generate(&self, seed: u64) -> Vec<Message> {
        // Seeded apart from the schedule: dropping faults keeps the messages.
        let mut rng = Rng::new(seed ^ 0x6D65_7373_6167_6573);
        self.messages
            .as_ref()
            .map_or_else(Vec::new, |g| g(&mut rng))
    }

    /// Whether the setup registers a sink and asks for the downstream
    /// (asked of a throwaway App).
    fn probe(&self) -> Result<Applies, Box<Failed>> {
        let world = World::default();
        let dir = std::env::temp_dir();
        let mut app = App {
            dir: &dir,
            world: &world,
            consumers: Vec::new(),
            effectful: BTreeSet::new(),
            sink: None,
        };
        (self.setup)(&mut app);
        if app.consumers.is_empty() {
            let v = Violation::Engine {
                message: "the setup registers no consumer (app.consumer(..))".into(),
            };
            return Err(Box::new(Failed {
                seed: None,
                violation: v,
                schedule: Vec::new(),
                shrunk: Vec::new(),
                replay: self.command(),
                ids: Vec::new(),
            }));
        }
        let applies = Applies {
            sink: app.sink.is_some(),
            effectful: !app.effectful.is_empty(),
            downstream: world.downstream_used.load(Ordering::Relaxed),
        };
        // Nothing was opened: forget the sink rather than run a destructor
        // that might flush to a downstream of this throwaway world.
        if let Some(sink) = app.sink.take() {
            std::mem::forget(sink);
        }
        Ok(applies)
    }

    fn kinds(&self, applies: Applies) -> Vec<FaultKind> {
        FaultKind::ALL
            .into_iter()
            .filter(|k| !self.off.contains(k) && applies.admits(*k))
            .collect()
    }

    fn schedule(&self, seed: u64, messages: usize, kinds: &[FaultKind]) -> Vec<Fault> {
        let mut rng = Rng::new(seed);
        let mut out = Vec::new();
        for step in 0..messages {
            if !rng.chance(self.fault_rate) {
                continue;
            }
            let Some(&kind) = rng.pick(kinds) else {
                continue;
            };
            let arg = match kind {
                FaultKind::Reorder => rng.range(1, 4),
                FaultKind::ClockJump => {
                    if rng.chance(50) {
                        rng.range(1_000, 2 * 86_400_000)
                    } else {
                        -rng.range(1_000, 60_000)
                    }
                }
                FaultKind::SinkFails | FaultKind::SinkUnavailable | FaultKind::SinkTimeout => {
                    rng.range(1, 3)
                }
                _ => 0,
            };
            out.push(Fault { step, kind, arg });
        }
        out
    }

    fn run_seed(&self, seed: u64, msgs: &[Message], schedule: &[Fault]) -> Result<Done, Violation> {
        let dir = scratch_dir().map_err(|e| Violation::Engine {
            message: format!("cannot make a temporary directory: {e}"),
        })?;
        let result = Run::new(self, dir.path(), seed).execute(msgs, schedule);
        drop(dir);
        result
    }

    /// A fault-free run with the engine's clock `SHIFT_MS` later.
    fn run_shifted(&self, seed: u64, msgs: &[Message]) -> Result<Done, Violation> {
        let dir = scratch_dir().map_err(|e| Violation::Engine {
            message: format!("cannot make a temporary directory: {e}"),
        })?;
        let mut run = Run::new(self, dir.path(), seed);
        run.clock.advance(Duration::from_millis(SHIFT_MS as u64));
        let result = run.execute(msgs, &[]);
        drop(dir);
        result
    }

    fn failed(
        &self,
        seed: u64,
        msgs: &[Message],
        violation: Violation,
        schedule: Vec<Fault>,
        reference: &mut Reference,
    ) -> Box<Failed> {
        let shrunk = self.shrink(seed, msgs, &violation, &schedule, reference);
        let replay = self.replay_line(seed, &schedule, &shrunk);
        Box::new(Failed {
            seed: Some(seed),
            violation,
            schedule,
            shrunk,
            replay,
            ids: msgs.iter().map(|m| m.id().to_owned()).collect(),
        })
    }

    /// The command that replays `shrunk`, by its places in `full`, the
    /// seed's whole schedule.
    fn replay_line(&self, seed: u64, full: &[Fault], shrunk: &[Fault]) -> String {
        let keep: Vec<String> = shrunk
            .iter()
            .filter_map(|f| full.iter().position(|g| g == f))
            .map(|i| i.to_string())
            .collect();
        format!(
            "{SEED_VAR}={seed} {FAULTS_VAR}={} {}",
            if keep.is_empty() {
                "none".to_owned()
            } else {
                keep.join(",")
            },
            self.command()
        )
    }

    /// Drops faults one at a time, last first, keeping each removal after
    /// which the seed still fails the same way.
    fn shrink(
        &self,
        seed: u64,
        msgs: &[Message],
        violation: &Violation,
        schedule: &[Fault],
        reference: &mut Reference,
    ) -> Vec<Fault> {
        let mut current = schedule.to_vec();
        let mut i = current.len();
        while i > 0 {
            i -= 1;
            let mut candidate = current.clone();
            candidate.remove(i);
            let same = match self.judge(seed, msgs, &candidate, reference) {
                Err(v) => v.name() == violation.name(),
                Ok(_) => false,
            };
            if same {
                current = candidate;
            }
        }
        current
    }

    fn command(&self) -> String {
        self.name.clone().unwrap_or_else(|| {
            let test = std::thread::current()
                .name()
                .filter(|n| *n != "main")
                .unwrap_or("YOUR_TEST")
                .to_owned();
            format!("cargo test {test} -- --exact")
        })
    }
}

/// A fresh directory per seed: under `POSTROOM_TESTKIT_DIR` if set, else
/// in `/dev/shm` where there is one (a memory filesystem: the in-process
/// crashes need no fsync, and the runs are twice as fast), else in the
/// system's temporary directory.
fn scratch_dir() -> std::io::Result<tempfile::TempDir> {
    let base = std::env::var_os("POSTROOM_TESTKIT_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            let shm = Path::new("/dev/shm");
            shm.is_dir().then(|| shm.to_owned())
        });
    match base {
        Some(base) => tempfile::Builder::new()
            .prefix("postroom-testkit-")
            .tempdir_in(base)
            .or_else(|_| tempfile::tempdir()),
        None => tempfile::tempdir(),
    }
}

fn is_full(e: &crate::Error) -> bool {
    matches!(e, crate::Error::StorageFull { .. })
}

/// Fills the disk: the free pages taken by ballast, then a page quota at
/// the file's size (the engine's test hook; user code cannot set it), so
/// that any write needing a new page fails with `SQLITE_FULL`.
fn fill_disk(room: &Postroom) -> Result<(), Violation> {
    let pages = retry(|| {
        room.transaction(|tx| {
            let free: i64 = tx.query_row("PRAGMA freelist_count", [], |r| r.get(0))?;
            if free > 0 {
                let page: i64 = tx.query_row("PRAGMA page_size", [], |r| r.get(0))?;
                tx.execute(
                    "INSERT INTO _testkit_ballast (b) VALUES (zeroblob(?1))",
                    [free * page],
                )?;
            }
            Ok(tx.query_row("PRAGMA page_count", [], |r| r.get::<_, i64>(0))?)
        })
    })
    .map_err(engine("filling the disk"))?;
    let quota = u32::try_from(pages).unwrap_or(NO_QUOTA);
    retry(|| room.set_max_page_count_for_tests(quota))
        .map(drop)
        .map_err(engine("setting the page quota"))
}

/// Makes room again.
fn lift_quota(room: &Postroom) -> Result<(), Violation> {
    retry(|| room.set_max_page_count_for_tests(NO_QUOTA))
        .map(drop)
        .map_err(engine("lifting the page quota"))
}

/// Calls `f` until it answers anything but a retryable error (a full
/// disk, a busy database), at most 100 times, 10 ms apart.
fn retry<T>(mut f: impl FnMut() -> crate::Result<T>) -> crate::Result<T> {
    let mut tries = 0;
    loop {
        match f() {
            Err(e) if e.is_retryable() && tries < 100 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
            other => return other,
        }
    }
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok()?.trim().parse().ok()
}

/// What one seed's run leaves for the report.
#[derive(Clone)]
struct Done {
    fired: BTreeMap<FaultKind, u64>,
    deliveries: u64,
    outcome: Option<String>,
    /// What `detect_wall_clock`'s closure rendered.
    times: Option<String>,
    /// (consumer, message id) of the dead letters.
    dead: BTreeSet<(String, String)>,
    /// Messages processed again after retention removed their rows.
    reprocessed: u64,
}

/// A seed's fault-free, in-order run, made once, when a verdict first
/// needs it.
#[derive(Default)]
struct Reference(
    Option<Result<Done, Violation>>,
    /// The same under a clock shifted by [`SHIFT_MS`] (wall-clock check).
    Option<Result<Done, Violation>>,
);

impl Reference {
    fn get(&mut self, run: impl FnOnce() -> Result<Done, Violation>) -> Result<Done, Violation> {
        self.0.get_or_insert_with(run).clone()
    }

    fn shifted(
        &mut self,
        run: impl FnOnce() -> Result<Done, Violation>,
    ) -> Result<Done, Violation> {
        self.1.get_or_insert_with(run).clone()
    }
}

/// How far the wall-clock check shifts the engine's clock: 1,000 days, 13
/// hours and 7 seconds, so that no rendering in whole days, hours or
/// minutes hides it.
const SHIFT_MS: i64 = ((1_000 * 24 + 13) * 3_600 + 7) * 1_000;

/// Which fault kinds the setup admits.
#[derive(Debug, Clone, Copy)]
struct Applies {
    sink: bool,
    effectful: bool,
    downstream: bool,
}

impl Applies {
    fn admits(self, kind: FaultKind) -> bool {
        (self.sink || !kind.needs_sink())
            && (self.downstream || !kind.needs_downstream())
            && (self.effectful || !kind.needs_effectful())
    }
}

/// One delivery the broker stand-in has queued.
#[derive(Debug, Clone, Copy)]
struct Item {
    msg: usize,
    /// The id-reuse variant: same id, another payload.
    reused: bool,
    /// The message's first delivery, where its faults are attached.
    first: bool,
}

/// One seed's run.
struct Run<'s> {
    sc: &'s Scenario,
    db: PathBuf,
    dir: PathBuf,
    world: World,
    armed: Arc<Armed>,
    log: Arc<Mutex<SinkLog>>,
    /// The current process life's sink: set to crash it.
    sink_dead: Option<Arc<AtomicBool>>,
    clock: ManualClock,
    fired: BTreeMap<FaultKind, u64>,
    /// (name, queued), in registration order.
    consumers: Vec<(String, bool)>,
    has_sink: bool,
    /// The effectful consumers' names.
    effectful: BTreeSet<String>,
    deliveries: u64,
    /// A lease-expiry fault for the delivery in hand: expire the lease
    /// under the effect step it holds.
    lease: bool,
    /// A disk-full fault for the delivery in hand: set the quota first;
    /// cleared once it met a storage error.
    disk_full: bool,
    /// A delivery met the full disk (a storage error).
    full_met: bool,
    /// (message index, consumer) pairs the engine has answered for.
    answered: BTreeSet<(usize, String)>,
    /// Per (source, id): deliveries processed again after a retention
    /// pass removed the message's row.
    reprocessed: BTreeMap<(String, String), u64>,
    /// After a real kill: the outbox rows the dead child had sent (they
    /// count as handed to the sink; its downstream died with it).
    killed: Option<BTreeSet<String>>,
    /// The read-only connection of the checks, kept (see `reader`).
    conn: RefCell<Option<Connection>>,
}

fn engine(what: &str) -> impl Fn(crate::Error) -> Violation + '_ {
    move |e| Violation::Engine {
        message: format!("{what}: {e}"),
    }
}

impl<'s> Run<'s> {
    fn new(sc: &'s Scenario, dir: &Path, seed: u64) -> Run<'s> {
        Run {
            sc,
            db: dir.join("app.db"),
            dir: dir.to_owned(),
            world: World::default(),
            armed: Arc::default(),
            log: Arc::default(),
            sink_dead: None,
            clock: ManualClock::new(1_700_000_000_000 + (seed % 1000) as i64 * 1000),
            fired: BTreeMap::new(),
            consumers: Vec::new(),
            has_sink: false,
            effectful: BTreeSet::new(),
            deliveries: 0,
            lease: false,
            disk_full: false,
            full_met: false,
            answered: BTreeSet::new(),
            reprocessed: BTreeMap::new(),
            killed: None,
            conn: RefCell::new(None),
        }
    }

    fn fire(&mut self, kind: FaultKind) {
        *self.fired.entry(kind).or_insert(0) += 1;
    }

    fn open(&mut self) -> Result<Postroom, Violation> {
        let mut app = App {
            dir: &self.dir,
            world: &self.world,
            consumers: Vec::new(),
            effectful: BTreeSet::new(),
            sink: None,
        };
        (self.sc.setup)(&mut app);
        let App {
            consumers,
            sink,
            effectful,
            ..
        } = app;
        self.effectful = effectful;
        let queued = consumers.iter().any(|c| c.1);
        let mut b = Postroom::builder()
            .handle_signals(false)
            .durability(Durability::Normal)
            .clock(self.clock.clone())
            .backoff(Duration::ZERO, Duration::ZERO)
            .max_attempts(25)
            .workers(usize::from(queued))
            .poll_interval(Duration::from_millis(2))
            .relay_poll(Duration::from_millis(2))
            .lease(LEASE)
            .retention(RETENTION)
            .dead_retention(None)
            .quick_check_on_open(false)
            .drop_deadline(Duration::from_secs(10));
        self.consumers = consumers.iter().map(|c| (c.0.clone(), c.1)).collect();
        for (_, _, register) in consumers {
            b = register(b, &self.armed);
        }
        if let Some(sink) = sink {
            let dead = Arc::new(AtomicBool::new(false));
            self.sink_dead = Some(dead.clone());
            self.has_sink = true;
            b = b.sink(FaultySink {
                inner: Some(sink),
                dead,
                log: self.log.clone(),
            });
        }
        if let Some(configure) = &self.sc.configure {
            b = configure(b);
        }
        b.open(&self.db).map_err(engine("open"))
    }

    /// The process dies: the sink is forgotten, the engine dropped (its
    /// threads stop; what they had committed stays, nothing else), and a
    /// new process life opens with the real recovery.
    fn crash(&mut self, room: Postroom) -> Result<Postroom, Violation> {
        if let Some(dead) = self.sink_dead.take() {
            dead.store(true, Ordering::SeqCst);
        }
        drop(room);
        self.open()
    }

    /// The testkit's tables and yours, in one transaction.
    fn schema(&self, room: &Postroom) -> Result<(), Violation> {
        let schema = self.sc.schema.clone();
        room.transaction(move |tx| {
            tx.execute_batch(TESTKIT_SCHEMA)?;
            match &schema {
                Some(schema) => schema(tx),
                None => Ok(()),
            }
        })
        .map_err(engine("schema"))
    }

    fn execute(&mut self, msgs: &[Message], schedule: &[Fault]) -> Result<Done, Violation> {
        let mut room = self.open()?;
        self.schema(&room)?;
        let mut order: Vec<usize> = (0..msgs.len()).collect();
        for f in schedule.iter().filter(|f| f.kind == FaultKind::Reorder) {
            if let Some(pos) = order.iter().position(|&m| m == f.step) {
                let m = order.remove(pos);
                let to = (pos + f.arg.max(0) as usize).min(order.len());
                order.insert(to, m);
                if to != pos {
                    self.fire(FaultKind::Reorder);
                }
            }
        }
        let mut queue: VecDeque<Item> = order
            .into_iter()
            .map(|msg| Item {
                msg,
                reused: false,
                first: true,
            })
            .collect();
        let budget = msgs.len() * 60 + 100;
        let mut steps = 0;
        while let Some(item) = queue.pop_front() {
            steps += 1;
            let msg = if item.reused {
                reused(&msgs[item.msg])
            } else {
                msgs[item.msg].clone()
            };
            if steps > budget {
                return Err(Violation::NotSettled {
                    message_id: msg.id().to_owned(),
                    consumer: "(every consumer)".into(),
                    status: Some("still not acknowledged after many redeliveries".into()),
                });
            }
            let faults: Vec<Fault> = if item.first {
                schedule
                    .iter()
                    .filter(|f| f.step == item.msg)
                    .copied()
                    .collect()
            } else {
                Vec::new()
            };
            for f in &faults {
                match f.kind {
                    FaultKind::ClockJump => {
                        let now = crate::Clock::now_ms(&self.clock);
                        self.clock.set(now.saturating_add(f.arg));
                        self.fire(FaultKind::ClockJump);
                    }
                    FaultKind::SinkFails | FaultKind::SinkUnavailable => {
                        let mut log = lock(&self.log);
                        log.failing = Some((f.kind, f.arg));
                        log.answering = false;
                    }
                    FaultKind::SinkTimeout => self.world.downstream.time_out(f.arg),
                    FaultKind::CrashBeforeCommit => self.armed.arm(&msg, Mode::Crash),
                    FaultKind::SqlRollback => self.armed.arm(&msg, Mode::Rollback),
                    FaultKind::LeaseExpiry => {
                        self.armed.arm(&msg, Mode::Lease);
                        self.lease = true;
                    }
                    FaultKind::DiskFull => {
                        self.armed.arm(&msg, Mode::DiskFull);
                        self.disk_full = true;
                    }
                    _ => {}
                }
            }
            let again = Item {
                first: false,
                ..item
            };
            let acked = self.deliver(&room, item.msg, &msg)?;
            let fired = self.armed.disarm();
            self.disk_full = false;
            self.lease = false;
            let full_met = std::mem::take(&mut self.full_met);
            match fired {
                Some(Mode::Rollback) => self.fire(FaultKind::SqlRollback),
                Some(Mode::DiskFull) => self.fire(FaultKind::DiskFull),
                // The engine's own write met the full disk before a handler.
                _ if full_met => self.fire(FaultKind::DiskFull),
                _ => {}
            }
            if fired == Some(Mode::Crash) {
                self.fire(FaultKind::CrashBeforeCommit);
                room = self.crash(room)?;
                queue.push_front(again);
            } else if !acked {
                queue.push_back(again);
            } else {
                for f in &faults {
                    match f.kind {
                        FaultKind::CrashAfterCommit => {
                            room = self.crash(room)?;
                            queue.push_front(again);
                        }
                        FaultKind::LostAck => queue.push_front(again),
                        FaultKind::Redeliver => queue.push_back(again),
                        FaultKind::ReusedId => queue.push_front(Item {
                            reused: true,
                            ..again
                        }),
                        FaultKind::CrashInRelay => {
                            self.drain()?;
                            room = self.crash(room)?;
                        }
                        FaultKind::RetentionPass => {
                            self.settle(&room)?;
                            self.clock
                                .advance(RETENTION.saturating_add(Duration::from_secs(60)));
                            retry(|| room.cleanup()).map_err(engine("cleanup"))?;
                            queue.push_back(again);
                        }
                        _ => continue,
                    }
                    self.fire(f.kind);
                }
            }
            let after = format!("message #{} ({:?})", item.msg, msg.id());
            self.check_invariants(&after)?;
        }
        self.settle(&room)?;
        self.drain()?;
        let fired_sink = std::mem::take(&mut lock(&self.log).fired);
        for (k, n) in fired_sink {
            *self.fired.entry(k).or_insert(0) += n;
        }
        let timeouts = self.world.downstream.take_fired();
        if timeouts > 0 {
            *self.fired.entry(FaultKind::SinkTimeout).or_insert(0) += timeouts;
        }
        room.shutdown(Duration::from_secs(30))
            .map_err(engine("shutdown"))?;
        drop(room);
        self.verdict(msgs)
    }

    /// Hands `msg` (the `index`-th generated) to every consumer; whether
    /// every one acknowledged. A retryable error is no acknowledgement:
    /// the broker redelivers. Under a disk-full fault the quota holds
    /// until a consumer met it (or the last one answered).
    fn deliver(&mut self, room: &Postroom, index: usize, msg: &Message) -> Result<bool, Violation> {
        let mut acked = true;
        let consumers = self.consumers.clone();
        let last = consumers.len().saturating_sub(1);
        if self.disk_full {
            fill_disk(room)?;
        }
        for (i, (name, queued)) in consumers.into_iter().enumerate() {
            self.deliveries += 1;
            let gone = self.gone(index, &name, msg)?;
            let fresh = if queued {
                let answer = room.receive(&name, msg.clone());
                if self.disk_full {
                    // Until the worker met the fault (or the receive did).
                    let deadline = Instant::now() + WAIT;
                    while matches!(answer, Ok(crate::Receipt::Accepted))
                        && !self.armed.taken()
                        && Instant::now() < deadline
                    {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
                if self.lease
                    && self.effectful.contains(&name)
                    && matches!(answer, Ok(crate::Receipt::Accepted))
                {
                    self.lease = false;
                    self.expire_lease(room)?;
                }
                match answer {
                    Ok(receipt) => Some(matches!(receipt, crate::Receipt::Accepted)),
                    Err(e) if e.is_retryable() => {
                        self.full_met |= self.disk_full && is_full(&e);
                        acked = false;
                        None
                    }
                    Err(e) => return Err(engine("receive")(e)),
                }
            } else {
                match room.deliver(&name, msg.clone()) {
                    Ok(outcome) => {
                        if let crate::Outcome::Failed { retry_after, .. } = &outcome {
                            // The broker redelivers when the engine asked:
                            // time passes (a clock jumped back made it long).
                            self.clock.advance(*retry_after);
                        }
                        acked &= outcome.should_ack();
                        Some(!matches!(
                            outcome,
                            crate::Outcome::Duplicate
                                | crate::Outcome::DuplicateBySequence { .. }
                                | crate::Outcome::Conflict { .. }
                        ))
                    }
                    Err(e) if e.is_retryable() => {
                        self.full_met |= self.disk_full && is_full(&e);
                        acked = false;
                        None
                    }
                    Err(e) => return Err(engine("deliver")(e)),
                }
            };
            if self.disk_full && (fresh.is_none() || self.armed.taken() || i == last) {
                lift_quota(room)?;
                self.disk_full = false;
            }
            if let Some(fresh) = fresh {
                if gone && fresh {
                    *self
                        .reprocessed
                        .entry((msg.source().to_owned(), msg.id().to_owned()))
                        .or_insert(0) += 1;
                }
                self.answered.insert((index, name.clone()));
            }
            if queued {
                self.settle(room)?;
            }
        }
        Ok(acked)
    }

    /// A lease-expiry fault: once the worker holds after the effect step
    /// (at most [`WAIT`]), the leases expire and a reaper pass makes the
    /// row due again; then the step goes on, into the lease fence.
    fn expire_lease(&mut self, room: &Postroom) -> Result<(), Violation> {
        if !self.armed.await_hold(WAIT) {
            // The step never ran (the message was not claimed in time):
            // nothing fired; a step arriving late must not hold.
            self.armed.disarm();
            self.armed.release_hold();
            return Ok(());
        }
        let expired = retry(|| room.expire_leases_for_tests());
        self.armed.release_hold();
        if expired.map_err(engine("expiring the lease"))? > 0 {
            self.fire(FaultKind::LeaseExpiry);
        }
        Ok(())
    }

    /// Whether the engine answered for this message and consumer before
    /// and has no row for it now: a retention pass removed it.
    fn gone(&self, index: usize, consumer: &str, msg: &Message) -> Result<bool, Violation> {
        if !self.answered.contains(&(index, consumer.to_owned())) {
            return Ok(false);
        }
        let conn = self.reader()?;
        let n: i64 = conn
            .query_row(
                "SELECT count(*) FROM postroom_inbox
                 WHERE consumer = ?1 AND source = ?2 AND message_id = ?3",
                [consumer, msg.source(), msg.id()],
                |r| r.get(0),
            )
            .map_err(|e| Violation::Engine {
                message: format!("reading the inbox: {e}"),
            })?;
        Ok(n == 0)
    }

    /// Waits until no queued message is pending, processing or waiting for
    /// a retry, moving the clock so retries come due.
    fn settle(&self, room: &Postroom) -> Result<(), Violation> {
        if !self.consumers.iter().any(|c| c.1) {
            return Ok(());
        }
        let deadline = Instant::now() + WAIT;
        let mut reaped = Instant::now();
        loop {
            let mut busy = 0;
            for (name, _) in self.consumers.iter().filter(|c| c.1) {
                busy += self.count(
                    "SELECT count(*) FROM postroom_inbox WHERE consumer = ?1
                     AND status IN ('pending', 'processing', 'failed')",
                    [name],
                )?;
            }
            if busy == 0 {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(Violation::Engine {
                    message: format!("{busy} queued messages did not settle in {WAIT:?}"),
                });
            }
            if reaped.elapsed() > LEASE {
                // A claim left by a failed `apply` is due again once the
                // reaper saw its lease expire; do not wait for its pass.
                match room.cleanup() {
                    Ok(_) => {}
                    Err(e) if e.is_retryable() => {}
                    Err(e) => return Err(engine("cleanup")(e)),
                }
                reaped = Instant::now();
            }
            self.clock.advance(TICK);
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// A count through the run's reader: the waits poll it, and
    /// `Postroom::stats` would open a pool connection (another parse of the
    /// whole schema per process life) and count every status.
    fn count<P: rusqlite::Params>(&self, sql: &str, params: P) -> Result<u64, Violation> {
        let conn = self.reader()?;
        conn.prepare_cached(sql)
            .and_then(|mut stmt| stmt.query_row(params, |r| r.get::<_, i64>(0)))
            .map(|n| n.max(0) as u64)
            .map_err(|e| Violation::Engine {
                message: format!("counting ({sql}): {e}"),
            })
    }

    /// Waits until the relay has no pending outbox row.
    fn drain(&self) -> Result<(), Violation> {
        if !self.has_sink {
            return Ok(());
        }
        let deadline = Instant::now() + WAIT;
        loop {
            let pending = self.count(
                "SELECT count(*) FROM postroom_outbox WHERE status = 'pending'",
                [],
            )?;
            if pending == 0 {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(Violation::Engine {
                    message: format!("{pending} outbox rows still pending after {WAIT:?}"),
                });
            }
            self.clock.advance(TICK);
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The run's read-only connection, opened at first use and kept: a
    /// connection parses the whole schema (the engine's triggers
    /// included) at its first statement, which per check was a fifth of
    /// a seed's CPU. It holds no transaction between statements, so it
    /// neither pins the WAL nor sees a stale snapshot.
    fn reader(&self) -> Result<Ref<'_, Connection>, Violation> {
        if self.conn.borrow().is_none() {
            let conn = Connection::open_with_flags(
                &self.db,
                OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
            )
            .map_err(|e| Violation::Engine {
                message: format!("open a reader: {e}"),
            })?;
            *self.conn.borrow_mut() = Some(conn);
        }
        Ref::filter_map(self.conn.borrow(), Option::as_ref).map_err(|_| Violation::Engine {
            message: "open a reader: no connection".into(),
        })
    }

    fn check_invariants(&self, after: &str) -> Result<(), Violation> {
        if self.sc.invariants.is_empty() {
            return Ok(());
        }
        let conn = self.reader()?;
        let check = Check {
            conn: &conn,
            world: &self.world,
            dir: &self.dir,
            now_ms: crate::Clock::now_ms(&self.clock),
        };
        for invariant in &self.sc.invariants {
            invariant(&check).map_err(|message| Violation::Invariant {
                after: after.to_owned(),
                message,
            })?;
        }
        Ok(())
    }

    fn verdict(&self, msgs: &[Message]) -> Result<Done, Violation> {
        let conn = self.reader()?;
        let check = Check {
            conn: &conn,
            world: &self.world,
            dir: &self.dir,
            now_ms: crate::Clock::now_ms(&self.clock),
        };
        let sql_err = |e: rusqlite::Error| Violation::Engine {
            message: format!("reading the inbox: {e}"),
        };
        let mut seen: BTreeSet<(&str, &str)> = BTreeSet::new();
        let mut dead = BTreeSet::new();
        for (index, msg) in msgs.iter().enumerate() {
            // A generated repeat of an id is the same message again (or a
            // conflict): judged once, by its first payload.
            if !seen.insert((msg.source(), msg.id())) {
                continue;
            }
            let mut expected = 0;
            // Processed again after retention removed its row: those
            // effects may come again (the known limit), not must.
            let again = self
                .reprocessed
                .get(&(msg.source().to_owned(), msg.id().to_owned()))
                .copied()
                .unwrap_or(0);
            for (consumer, _) in &self.consumers {
                let status: Option<String> = conn
                    .query_row(
                        "SELECT status FROM postroom_inbox
                         WHERE consumer = ?1 AND source = ?2 AND message_id = ?3",
                        [consumer.as_str(), msg.source(), msg.id()],
                        |r| r.get(0),
                    )
                    .optional()
                    .map_err(sql_err)?;
                // No row, but answered before: a retention pass removed
                // it, and retention only removes completed rows.
                let cleaned =
                    status.is_none() && self.answered.contains(&(index, consumer.clone()));
                match status.as_deref() {
                    Some("completed") => expected += 1,
                    None if cleaned => expected += 1,
                    Some("dead") => {
                        dead.insert((consumer.clone(), msg.id().to_owned()));
                    }
                    _ => {
                        return Err(Violation::NotSettled {
                            message_id: msg.id().to_owned(),
                            consumer: consumer.clone(),
                            status,
                        })
                    }
                }
            }
            if let Some(effects) = &self.sc.effects {
                let counted = effects(&check, msg);
                if counted < expected || counted > expected + again {
                    return Err(Violation::EffectsNotOnce {
                        message_id: msg.id().to_owned(),
                        expected,
                        counted,
                    });
                }
            }
        }
        self.check_invariants("the end")?;
        if self.has_sink {
            self.check_relay(&conn)?;
        }
        Ok(Done {
            fired: self.fired.clone(),
            deliveries: self.deliveries,
            outcome: self.sc.outcome.as_ref().map(|o| o(&check)),
            times: self.sc.wall_clock.as_ref().map(|t| t(&check)),
            dead,
            reprocessed: self.reprocessed.values().sum(),
        })
    }

    fn check_relay(&self, conn: &Connection) -> Result<(), Violation> {
        let log = lock(&self.log);
        let mut handed: BTreeSet<&str> = log.handed.iter().map(|h| h.1.as_str()).collect();
        if let Some(sent) = &self.killed {
            handed.extend(sent.iter().map(String::as_str));
        }
        let mut stmt = conn
            .prepare("SELECT message_id FROM postroom_outbox ORDER BY seq")
            .map_err(|e| Violation::Engine {
                message: format!("reading the outbox: {e}"),
            })?;
        let ids: Vec<String> = stmt
            .query_map([], |r| r.get(0))
            .and_then(|rows| rows.collect())
            .map_err(|e| Violation::Engine {
                message: format!("reading the outbox: {e}"),
            })?;
        for id in &ids {
            if !handed.contains(id.as_str()) {
                return Err(Violation::NeverHandedToSink {
                    message_id: id.clone(),
                });
            }
        }
        // Per key, the first handing of each row in commit (seq) order.
        let mut last: HashMap<&str, i64> = HashMap::new();
        let mut first_seen: BTreeSet<i64> = BTreeSet::new();
        for (seq, _, key) in &log.handed {
            if !first_seen.insert(*seq) {
                continue;
            }
            if let Some(key) = key {
                if last.get(key.as_str()).is_some_and(|&prev| prev > *seq) {
                    return Err(Violation::OutOfOrder {
                        at: "sink",
                        key: key.clone(),
                    });
                }
                last.insert(key, *seq);
            }
        }
        if self.world.downstream_used.load(Ordering::Relaxed) && self.killed.is_none() {
            let received = self.world.downstream.received();
            let got: BTreeSet<&str> = received.iter().map(|r| r.id.as_str()).collect();
            for id in &log.sent {
                if !got.contains(id.as_str()) {
                    return Err(Violation::LostDownstream {
                        message_id: id.clone(),
                    });
                }
            }
            let seq_of: HashMap<&str, i64> =
                log.handed.iter().map(|h| (h.1.as_str(), h.0)).collect();
            let mut last: HashMap<&str, i64> = HashMap::new();
            let mut first: BTreeSet<&str> = BTreeSet::new();
            for r in &received {
                if !first.insert(r.id.as_str()) {
                    continue;
                }
                let (Some(key), Some(&seq)) = (r.key.as_deref(), seq_of.get(r.id.as_str())) else {
                    continue;
                };
                if last.get(key).is_some_and(|&prev| prev > seq) {
                    return Err(Violation::OutOfOrder {
                        at: "downstream",
                        key: key.to_owned(),
                    });
                }
                last.insert(key, seq);
            }
        }
        Ok(())
    }
}

/// The id-reuse variant of `msg`: same source and id, the payload with a
/// space appended (still the same JSON, another digest).
fn reused(msg: &Message) -> Message {
    let mut payload = msg.payload().to_vec();
    payload.push(b' ');
    let mut out = Message::new(msg.source(), msg.id(), payload);
    for (name, value) in msg.headers() {
        out = out.with_header(name.clone(), value.clone());
    }
    out
}
