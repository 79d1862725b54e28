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
//! could be a separate crate); a seed fixes the messages and the fault
//! schedule (the messages come from a generator seeded apart from the
//! schedule, so a shrunk schedule replays the same messages); the relay
//! and the workers run on the engine's own threads as in production, so
//! which rows a sink fault meets may vary between replays of one seed,
//! while every verdict is about what must hold whatever the interleaving;
//! a simulated crash drops the engine with the sink's destructor not run
//! and everything in memory of the handlers lost, but lets the engine's
//! threads stop (the in-process crash cannot stop a thread mid-write; the
//! crash tests of the engine itself use SIGKILL and failpoints).

mod fault;
mod stand_in;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use rusqlite::{Connection, OpenFlags, OptionalExtension};

pub use fault::{Fault, FaultKind, Violation};
pub use stand_in::{Downstream, Received, Rng, Service};

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
        match self
            .conn
            .query_row(sql, params, |r| r.get::<_, Option<i64>>(0))
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
}

/// Which message a crash-before-commit fault waits for, and whether it
/// fired. Shared by the handler wrappers of every process life of a seed.
#[derive(Default)]
struct Armed {
    crash: Mutex<Option<(String, String)>>,
    fired: AtomicBool,
}

impl Armed {
    fn arm(&self, msg: &Message) {
        *lock(&self.crash) = Some((msg.source().to_owned(), msg.id().to_owned()));
        self.fired.store(false, Ordering::SeqCst);
    }

    /// True once, for the armed message.
    fn take(&self, msg: &Message) -> bool {
        let mut armed = lock(&self.crash);
        let hit = armed
            .as_ref()
            .is_some_and(|(s, id)| s == msg.source() && id == msg.id());
        if hit {
            *armed = None;
            self.fired.store(true, Ordering::SeqCst);
        }
        hit
    }

    /// Disarms; whether it fired.
    fn disarm(&self) -> bool {
        *lock(&self.crash) = None;
        self.fired.swap(false, Ordering::SeqCst)
    }
}

/// Your handler, and after it (when armed for this message) the crash:
/// its writes are rolled back as a dead process's would be, and whatever
/// it did outside the transaction stays done.
struct Crashable<H> {
    inner: H,
    armed: Arc<Armed>,
}

impl<H: Handler> Handler for Crashable<H> {
    fn handle(&self, tx: &mut Tx<'_>, msg: &Message) -> Result<(), Failure> {
        self.inner.handle(tx, msg)?;
        if self.armed.take(msg) {
            return Err(Failure::retry(CRASH));
        }
        Ok(())
    }
}

struct CrashableEffect<H> {
    inner: H,
    armed: Arc<Armed>,
}

impl<H: EffectHandler> EffectHandler for CrashableEffect<H> {
    type Output = H::Output;

    fn effect(&self, ctx: &EffectContext<'_>, msg: &Message) -> Result<H::Output, Failure> {
        let out = self.inner.effect(ctx, msg)?;
        if self.armed.take(msg) {
            return Err(Failure::retry(CRASH));
        }
        Ok(out)
    }

    fn apply(&self, tx: &mut Tx<'_>, msg: &Message, output: H::Output) -> Result<(), Failure> {
        self.inner.apply(tx, msg, output)
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
    /// Kinds that cannot apply (sink faults without a sink).
    pub not_applicable: Vec<FaultKind>,
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
        for kind in &self.switched_off {
            writeln!(f, "  {:<20} off", kind.name())?;
        }
        for kind in &self.not_applicable {
            writeln!(f, "  {:<20} not applicable (no sink)", kind.name())?;
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
            off: BTreeSet::new(),
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

    /// How many seeds (default 100; `POSTROOM_TESTKIT_SEEDS` overrides).
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

    /// Switches a fault kind off. Every kind is on by default, and a run in
    /// which an enabled kind never fired fails: it could not tell.
    pub fn without(mut self, kind: FaultKind) -> Self {
        self.off.insert(kind);
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

    /// Runs every seed; the first failure, shrunk, as an error.
    pub fn try_run(&self) -> Result<Report, Box<Failed>> {
        let started = Instant::now();
        let replay_seed = env_u64(SEED_VAR);
        let keep: Option<Vec<usize>> = std::env::var(FAULTS_VAR)
            .ok()
            .map(|s| s.split(',').filter_map(|i| i.trim().parse().ok()).collect());
        let seeds: Vec<u64> = match replay_seed {
            Some(seed) => vec![seed],
            None => {
                let n = env_u64(SEEDS_VAR).unwrap_or(self.seeds);
                (0..n).map(|i| self.first_seed.wrapping_add(i)).collect()
            }
        };
        let mut report = Report {
            switched_off: self.off.iter().copied().collect(),
            ..Report::default()
        };
        let has_sink = self.probe()?;
        let kinds = self.kinds(has_sink);
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
            // A failure names its faults by their places in the full schedule.
            let renumber = |mut failed: Box<Failed>| {
                failed.replay = self.replay_line(seed, &full, &failed.shrunk);
                failed
            };
            let reference = match &self.outcome {
                Some(_) => match self.run_seed(seed, &msgs, &[]) {
                    Ok(done) => done.outcome,
                    Err(v) => return Err(renumber(self.failed(seed, &msgs, v, Vec::new(), None))),
                },
                None => None,
            };
            match self.run_seed(seed, &msgs, &schedule) {
                Ok(done) => {
                    if let (Some(expected), Some(got)) = (&reference, &done.outcome) {
                        if expected != got {
                            let v = Violation::OutcomeDiffers {
                                expected: expected.clone(),
                                got: got.clone(),
                            };
                            return Err(renumber(self.failed(seed, &msgs, v, schedule, reference)));
                        }
                    }
                    report.deliveries += done.deliveries;
                    for (k, n) in done.fired {
                        *report.fired.entry(k).or_insert(0) += n;
                    }
                }
                Err(v) => return Err(renumber(self.failed(seed, &msgs, v, schedule, reference))),
            }
        }
        report.not_applicable = FaultKind::ALL
            .into_iter()
            .filter(|k| k.needs_sink() && !has_sink && !self.off.contains(k))
            .collect();
        let never: Vec<FaultKind> = self
            .kinds(has_sink)
            .into_iter()
            .filter(|k| report.fired.get(k).copied().unwrap_or(0) == 0)
            .collect();
        if !never.is_empty() && replay_seed.is_none() {
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
                        FaultKind::ClockJump => (size - 128) * 60_000,
                        FaultKind::SinkFails | FaultKind::SinkUnavailable => 1 + size % 3,
                        _ => 0,
                    },
                }
            })
            .collect();
        let reference = match &self.outcome {
            Some(_) => match self.run_seed(seed, &msgs, &[]) {
                Ok(done) => done.outcome,
                Err(v) => return Err(self.failed(seed, &msgs, v, Vec::new(), None)),
            },
            None => None,
        };
        let verdict = match self.run_seed(seed, &msgs, &schedule) {
            Ok(done) => match (&reference, done.outcome) {
                (Some(expected), Some(got)) if *expected != got => {
                    let v = Violation::OutcomeDiffers {
                        expected: expected.clone(),
                        got,
                    };
                    Err(self.failed(seed, &msgs, v, schedule, reference))
                }
                _ => Ok(()),
            },
            Err(v) => Err(self.failed(seed, &msgs, v, schedule, reference)),
        };
        verdict.map_err(|mut failed| {
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

    /// Whether the setup registers a sink (asked of a throwaway App).
    fn probe(&self) -> Result<bool, Box<Failed>> {
        let world = World::default();
        let dir = std::env::temp_dir();
        let mut app = App {
            dir: &dir,
            world: &world,
            consumers: Vec::new(),
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
        let has_sink = app.sink.is_some();
        // Nothing was opened: forget the sink rather than run a destructor
        // that might flush to a downstream of this throwaway world.
        if let Some(sink) = app.sink.take() {
            std::mem::forget(sink);
        }
        Ok(has_sink)
    }

    fn kinds(&self, has_sink: bool) -> Vec<FaultKind> {
        FaultKind::ALL
            .into_iter()
            .filter(|k| !self.off.contains(k) && (has_sink || !k.needs_sink()))
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
                FaultKind::SinkFails | FaultKind::SinkUnavailable => rng.range(1, 3),
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
        let mut run = Run {
            sc: self,
            db: dir.path().join("app.db"),
            dir: dir.path().to_owned(),
            world: World::default(),
            armed: Arc::default(),
            log: Arc::default(),
            sink_dead: None,
            clock: ManualClock::new(1_700_000_000_000 + (seed % 1000) as i64 * 1000),
            fired: BTreeMap::new(),
            consumers: Vec::new(),
            has_sink: false,
            deliveries: 0,
        };
        let result = run.execute(msgs, schedule);
        drop(dir);
        result
    }

    fn failed(
        &self,
        seed: u64,
        msgs: &[Message],
        violation: Violation,
        schedule: Vec<Fault>,
        reference: Option<String>,
    ) -> Box<Failed> {
        let shrunk = self.shrink(seed, msgs, &violation, &schedule, reference.as_deref());
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
        reference: Option<&str>,
    ) -> Vec<Fault> {
        let mut current = schedule.to_vec();
        let mut i = current.len();
        while i > 0 {
            i -= 1;
            let mut candidate = current.clone();
            candidate.remove(i);
            let same = match self.run_seed(seed, msgs, &candidate) {
                Err(v) => v.name() == violation.name(),
                Ok(done) => match (&done.outcome, reference) {
                    (Some(got), Some(expected)) => {
                        got != expected && violation.name() == "outcome-differs"
                    }
                    _ => false,
                },
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

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok()?.trim().parse().ok()
}

/// What one seed's run leaves for the report.
struct Done {
    fired: BTreeMap<FaultKind, u64>,
    deliveries: u64,
    outcome: Option<String>,
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
    deliveries: u64,
}

fn engine(what: &str) -> impl Fn(crate::Error) -> Violation + '_ {
    move |e| Violation::Engine {
        message: format!("{what}: {e}"),
    }
}

impl Run<'_> {
    fn fire(&mut self, kind: FaultKind) {
        *self.fired.entry(kind).or_insert(0) += 1;
    }

    fn open(&mut self) -> Result<Postroom, Violation> {
        let mut app = App {
            dir: &self.dir,
            world: &self.world,
            consumers: Vec::new(),
            sink: None,
        };
        (self.sc.setup)(&mut app);
        let App {
            consumers, sink, ..
        } = app;
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
            .lease(Duration::from_secs(86_400))
            .retention(Duration::from_secs(100 * 365 * 86_400))
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

    fn execute(&mut self, msgs: &[Message], schedule: &[Fault]) -> Result<Done, Violation> {
        let mut room = self.open()?;
        if let Some(schema) = &self.sc.schema {
            let schema = schema.clone();
            room.transaction(move |tx| schema(tx))
                .map_err(engine("schema"))?;
        }
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
                    FaultKind::CrashBeforeCommit => self.armed.arm(&msg),
                    _ => {}
                }
            }
            let again = Item {
                first: false,
                ..item
            };
            let acked = self.deliver(&room, &msg)?;
            if self.armed.disarm() {
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
                            self.drain(&room)?;
                            room = self.crash(room)?;
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
        self.drain(&room)?;
        let fired_sink = std::mem::take(&mut lock(&self.log).fired);
        for (k, n) in fired_sink {
            *self.fired.entry(k).or_insert(0) += n;
        }
        room.shutdown(Duration::from_secs(30))
            .map_err(engine("shutdown"))?;
        drop(room);
        self.verdict(msgs)
    }

    /// Hands `msg` to every consumer; whether every one acknowledged.
    fn deliver(&mut self, room: &Postroom, msg: &Message) -> Result<bool, Violation> {
        let mut acked = true;
        for (name, queued) in self.consumers.clone() {
            self.deliveries += 1;
            if queued {
                room.receive(&name, msg.clone())
                    .map_err(engine("receive"))?;
                self.settle(room)?;
            } else {
                let outcome = room
                    .deliver(&name, msg.clone())
                    .map_err(engine("deliver"))?;
                acked &= outcome.should_ack();
            }
        }
        Ok(acked)
    }

    /// Waits until no queued message is pending, processing or waiting for
    /// a retry, moving the clock so retries come due.
    fn settle(&self, room: &Postroom) -> Result<(), Violation> {
        if !self.consumers.iter().any(|c| c.1) {
            return Ok(());
        }
        let deadline = Instant::now() + WAIT;
        loop {
            let stats = room.stats().map_err(engine("stats"))?;
            let busy: u64 = self
                .consumers
                .iter()
                .filter(|c| c.1)
                .filter_map(|c| stats.inbox.get(&c.0))
                .map(|s| s.pending + s.processing + s.failed)
                .sum();
            if busy == 0 {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(Violation::Engine {
                    message: format!("{busy} queued messages did not settle in {WAIT:?}"),
                });
            }
            self.clock.advance(TICK);
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Waits until the relay has no pending outbox row.
    fn drain(&self, room: &Postroom) -> Result<(), Violation> {
        if !self.has_sink {
            return Ok(());
        }
        let deadline = Instant::now() + WAIT;
        loop {
            let pending = room.stats().map_err(engine("stats"))?.outbox.pending;
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

    fn reader(&self) -> Result<Connection, Violation> {
        Connection::open_with_flags(
            &self.db,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(|e| Violation::Engine {
            message: format!("open a reader: {e}"),
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
        };
        let sql_err = |e: rusqlite::Error| Violation::Engine {
            message: format!("reading the inbox: {e}"),
        };
        let mut seen: BTreeSet<(&str, &str)> = BTreeSet::new();
        for msg in msgs {
            // A generated repeat of an id is the same message again (or a
            // conflict): judged once, by its first payload.
            if !seen.insert((msg.source(), msg.id())) {
                continue;
            }
            let mut expected = 0;
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
                match status.as_deref() {
                    Some("completed") => expected += 1,
                    Some("dead") => {}
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
                if counted != expected {
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
        })
    }

    fn check_relay(&self, conn: &Connection) -> Result<(), Violation> {
        let log = lock(&self.log);
        let handed: BTreeSet<&str> = log.handed.iter().map(|h| h.1.as_str()).collect();
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
        if self.world.downstream_used.load(Ordering::Relaxed) {
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
