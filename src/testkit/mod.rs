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

mod app;
mod armed;
mod fault;
mod process;
mod report;
mod run;
mod stand_in;

use std::cell::{Ref, RefCell};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use rusqlite::{Connection, OpenFlags, OptionalExtension};

use app::World;
pub use app::{App, Check};
use armed::{Armed, Crashable, CrashableEffect, FaultySink, Mode, SinkLog};
pub use fault::{Fault, FaultKind, Violation};
pub use report::{Failed, Report};
use run::{engine, env_u64, scratch_dir, Applies, Done, Reference, Run, SHIFT_MS};
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
/// The lease of an effectful consumer's claim (on the monotonic clock).
/// Longer than any wait of a run, so that no effect step outlives it on a
/// busy machine (only a `lease-expiry` fault expires one); a claim whose
/// worker gave up (its `apply` met a full disk) is expired at once by the
/// settling, never waited out.
const LEASE: Duration = Duration::from_secs(2 * WAIT.as_secs());
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
            return Err(self.unseeded(Violation::Engine {
                message: "real kills: make this the first scenario its #[test] runs \
                          (the child process takes the first one)"
                    .into(),
            }));
        }
        let replay_seed = env_u64(SEED_VAR);
        let mut report = Report {
            switched_off: self.off.iter().copied().collect(),
            ..Report::default()
        };
        let applies = self.probe()?;
        let kinds = self.kinds(applies);
        self.run_seeds(&mut report, &kinds, replay_seed, kill_seed)?;
        self.run_kill_seeds(&mut report, replay_seed, kill_seed)?;
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
            return Err(self.unseeded(Violation::NeverFired { kinds: never }));
        }
        report.elapsed = started.elapsed();
        Ok(report)
    }

    /// A failure of the whole run rather than of one seed.
    fn unseeded(&self, violation: Violation) -> Box<Failed> {
        Box::new(Failed {
            seed: None,
            violation,
            schedule: Vec::new(),
            shrunk: Vec::new(),
            replay: self.command(),
            ids: Vec::new(),
        })
    }

    /// The in-process seeds to run: the one replayed, none while a real
    /// kill is replayed, else `seeds` (or `POSTROOM_TESTKIT_SEEDS`) from the
    /// first seed.
    fn seed_list(&self, replay_seed: Option<u64>, kill_seed: Option<u64>) -> Vec<u64> {
        match (replay_seed, kill_seed) {
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
        }
    }

    /// Runs the in-process seeds, adding to `report`; the first failure,
    /// shrunk, as an error.
    fn run_seeds(
        &self,
        report: &mut Report,
        kinds: &[FaultKind],
        replay_seed: Option<u64>,
        kill_seed: Option<u64>,
    ) -> Result<(), Box<Failed>> {
        let keep: Option<Vec<usize>> = std::env::var(FAULTS_VAR)
            .ok()
            .map(|s| s.split(',').filter_map(|i| i.trim().parse().ok()).collect());
        for seed in self.seed_list(replay_seed, kill_seed) {
            report.seeds += 1;
            let msgs = self.generate(seed);
            report.messages += msgs.len() as u64;
            let full = self.schedule(seed, msgs.len(), kinds);
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
        Ok(())
    }

    /// Runs the real-process seeds (each SIGKILLs a child), adding to
    /// `report`; the first failure as an error.
    fn run_kill_seeds(
        &self,
        report: &mut Report,
        replay_seed: Option<u64>,
        kill_seed: Option<u64>,
    ) -> Result<(), Box<Failed>> {
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
        Ok(())
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
