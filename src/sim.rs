//! A thread-free, deterministic harness around the engine's state machine,
//! and a reference model to check it against (feature `_sim`).
//!
//! INTERNAL, DO NOT USE: the project's own model test (tests/model.rs) and
//! fuzz target (fuzz/) drive it; it is hidden from the docs and has no
//! stability promise (errors are plain `String`s naming the step). It
//! cannot move out of the crate: it drives crate-private state machines
//! (delivery, claims, relay marking, recovery) without the threads.
//! Applications test their handlers with [`crate::testkit`].
//!
//! [`Machine`] drives the same functions the writer, the workers, the relay
//! and recovery run — inline delivery, receive, claim and lease-fenced
//! completion, relay marking, retention, crash recovery — on a real SQLite
//! file, with a manual clock, each step in its own transaction. A simulated
//! crash drops the connection without committing (what a dead process
//! leaves) and keeps the in-flight marker, then re-opens through the real
//! recovery code.
//!
//! [`run_seed`] and [`run_bytes`] generate a sequence of operations (from a
//! seed, or from fuzzer input), apply each to the machine and to the model,
//! and compare outcomes and the whole inbox after every step. The seeded
//! form runs as an ordinary test; `fuzz/` feeds `run_bytes` to libFuzzer.
//! `apply` dispatches each operation to one function that computes the
//! model's expectation and compares the machine's answer; seeded choices
//! come from the testkit's [`Rng`], the project's one generator.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rusqlite::Connection;

use crate::config::{Config, RetryPolicy};
use crate::delivery::{self, exec, Env};
use crate::guard::UserCodeGuard;
use crate::handler::{Handler, Tx};
use crate::message::{Failure, Message, Outcome, Outgoing, Receipt};
use crate::recovery::recover_after_crash;
use crate::runtime::relay;
use crate::runtime::workers;
use crate::sink::{self, SendResult};
use crate::store::inbox::Status;
use crate::store::inflight::{ClaimMarks, Inflight, InflightLog, StartedClaim};
use crate::store::outbox;
use crate::store::queue;
use crate::store::retired;
use crate::store::schema;
use crate::testkit::Rng;

/// What the simulated handler does with a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// Succeeds.
    Ok,
    /// Fails, retry after 100 ms.
    Retry,
    /// Rejects: dead at once.
    Reject,
    /// Panics.
    Panic,
    /// The process dies inside the handler.
    Crash,
    /// The handler's SQL makes SQLite roll the whole transaction back (an
    /// `INSERT OR ROLLBACK` that fails). Generated for inline deliveries and
    /// batches, not for claimed rows.
    RollBack,
}

const RETRY_AFTER_MS: i64 = 100;
const LEASE_MS: i64 = 1_000;
const MAX_ATTEMPTS: u32 = 4;
const CONSUMERS: [&str; 2] = ["c0", "c1"];

/// One step of a sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Inline delivery of message `id` (payload variant `variant`).
    Deliver {
        /// Consumer index.
        consumer: u8,
        /// Message id.
        id: u8,
        /// Payload variant: another variant under the same id conflicts.
        variant: u8,
        /// What the handler does.
        plan: Plan,
    },
    /// Queued receipt of a batch.
    Receive {
        /// Consumer index.
        consumer: u8,
        /// (id, variant) pairs.
        msgs: Vec<(u8, u8)>,
    },
    /// Processes up to `limit` due rows in one transaction (the engine's
    /// path for transactional consumers), with `plans` in turn.
    Batch {
        /// Most rows processed.
        limit: u8,
        /// Plan of the n-th row (cycled).
        plans: Vec<Plan>,
    },
    /// Claims up to `limit` due rows and runs them with `plans` in turn
    /// (the engine's path for effectful consumers' transactional steps).
    Work {
        /// Most rows claimed.
        limit: u8,
        /// Plan of the n-th claimed row (cycled).
        plans: Vec<Plan>,
    },
    /// Moves the clock.
    Advance {
        /// Milliseconds.
        ms: u32,
    },
    /// Sets the clock back (an NTP correction): rows due at once stay due,
    /// a retry waits for its time.
    StepBack {
        /// Milliseconds.
        ms: u32,
    },
    /// Expires leases past their time.
    Reap,
    /// One relay pass; messages whose seq is a multiple of `fail_every`
    /// fail this time.
    Relay {
        /// 0: none fail.
        fail_every: u8,
    },
    /// Retention with this horizon.
    Cleanup {
        /// Milliseconds.
        retention_ms: u32,
        /// Whether the pass gets as far as deleting the key entries of
        /// the rows it deleted (and of any an earlier pass left); false is
        /// a pass cut short after its rows.
        keys: bool,
    },
    /// A drain's read of the retired keys (`retired::read`), whose
    /// deletions land only at the next [`Op::ApplyRetired`], other
    /// operations in between: the race its "still retired" guard is for.
    ReadRetired,
    /// Deletes (and clears the notes of) what the last
    /// [`Op::ReadRetired`] read; nothing if no read is pending.
    ApplyRetired,
    /// The process dies between operations, then re-opens.
    CrashReopen,
    /// The operator starts a consumer's sequence stream `sim` afresh at 1
    /// (`Postroom::reset_sequence`): a new epoch, whose numbers the
    /// retained rows of the old one no longer hold.
    ResetSequence {
        /// Consumer index.
        consumer: u8,
    },
}

struct SimHandler {
    plan: Arc<Mutex<Plan>>,
    /// Plans for the coming handler runs, one each, taken before `plan`.
    plans: Arc<Mutex<std::collections::VecDeque<Plan>>>,
    crashing: Arc<AtomicBool>,
}

impl Handler for SimHandler {
    fn handle(&self, tx: &mut Tx<'_>, msg: &Message) -> Result<(), Failure> {
        if let Some(next) = self
            .plans
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop_front()
        {
            *self.plan.lock().unwrap_or_else(|p| p.into_inner()) = next;
        }
        tx.execute(
            "INSERT INTO sim_effects (consumer, message_id) VALUES (?1, ?2)",
            [tx.consumer().unwrap_or(""), msg.id()],
        )?;
        tx.publish(Outgoing::new("sim", msg.payload().to_vec()).with_key(msg.id()))?;
        match *self.plan.lock().unwrap_or_else(|p| p.into_inner()) {
            Plan::Ok => Ok(()),
            Plan::Retry => Err(Failure::retry_after(
                "sim retry",
                Duration::from_millis(RETRY_AFTER_MS as u64),
            )),
            Plan::Reject => Err(Failure::reject("sim reject")),
            Plan::Panic => panic!("sim panic"),
            Plan::RollBack => {
                tx.execute("INSERT OR ROLLBACK INTO sim_strict VALUES (NULL)", [])?;
                Ok(())
            }
            Plan::Crash => {
                self.crashing.store(true, Ordering::SeqCst);
                Err(Failure::retry("sim crash"))
            }
        }
    }
}

/// The in-flight marker of a simulated process: kept across a simulated
/// crash (as the engine file is), not cleared by a handler that "died".
struct SimLog<'a> {
    marker: &'a mut Option<Inflight>,
    crashing: &'a AtomicBool,
}

impl InflightLog for SimLog<'_> {
    fn begin(
        &mut self,
        consumer: &str,
        msg: &Message,
        hash: &[u8; 32],
        prior_attempts: u32,
        at_ms: i64,
    ) -> std::io::Result<()> {
        // The process is dead: nothing after its last handler runs.
        if self.crashing.load(Ordering::SeqCst) {
            return Ok(());
        }
        *self.marker = Some(Inflight {
            consumer: consumer.to_owned(),
            msg: msg.clone(),
            hash: *hash,
            prior_attempts,
            at_ms,
        });
        Ok(())
    }
    fn end(&mut self) -> std::io::Result<()> {
        if !self.crashing.load(Ordering::SeqCst) {
            *self.marker = None;
        }
        Ok(())
    }
}

/// The claim marks of a simulated process: the claim whose user code runs,
/// kept across a simulated crash like the engine file's slots.
struct SimClaims<'a> {
    started: &'a mut Option<StartedClaim>,
    crashing: &'a AtomicBool,
}

impl ClaimMarks for SimClaims<'_> {
    fn started(&mut self, row_id: i64, token: i64) -> std::io::Result<()> {
        *self.started = Some(StartedClaim { row_id, token });
        Ok(())
    }
    fn finished(&mut self) -> std::io::Result<()> {
        if !self.crashing.load(Ordering::SeqCst) {
            *self.started = None;
        }
        Ok(())
    }
}

/// The engine's state machine on a real file, without threads.
pub struct Machine {
    path: PathBuf,
    conn: Option<(Connection, UserCodeGuard)>,
    config: Config,
    handler: SimHandler,
    plan: Arc<Mutex<Plan>>,
    crashing: Arc<AtomicBool>,
    marker: Option<Inflight>,
    started_claim: Option<StartedClaim>,
    /// What [`Op::ReadRetired`] read, until [`Op::ApplyRetired`]; kept
    /// across a crash, as another process's stale read would be.
    read_retired: Option<retired::Retired>,
    now_ms: i64,
    next_token: i64,
}

type SimResult<T> = std::result::Result<T, String>;

/// The machine's clock at the start of every run: 2040-01-01T00:00:00Z,
/// past the end of a 32-bit `time_t` (2038-01-19), so every model run —
/// on armv7 under `.ci/cross.sh` as elsewhere — checks retention, leases,
/// backoff and watermarks on timestamps a 32-bit seconds count cannot hold.
pub(crate) const START_MS: i64 = 2_208_988_800_000;

/// (consumer, message id).
type Key = (String, String);

/// (status, attempts, next_attempt_at) of an inbox row.
type RowState = (Status, u32, Option<i64>);

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

fn payload(id: u8, variant: u8) -> Vec<u8> {
    format!("message {id} variant {variant}").into_bytes()
}

/// The sequence of message `id`, for the ids that carry one: ids 3 to 5
/// are numbered 1 to 3 in stream `sim` (their source), so watermarks move,
/// wait on gaps and answer after retention; ids 0 to 2 carry none.
fn sequence_of(id: u8) -> Option<u64> {
    (3..=5).contains(&id).then(|| u64::from(id) - 2)
}

fn sim_message(id: u8, variant: u8) -> Message {
    let msg = Message::new("sim", id.to_string(), payload(id, variant));
    match sequence_of(id) {
        Some(seq) => msg.with_sequence(seq),
        None => msg,
    }
}

fn hash_of(bytes: &[u8]) -> [u8; 32] {
    *blake3::hash(bytes).as_bytes()
}

impl Machine {
    /// Creates (or re-opens) the database at `path`.
    pub fn open(path: &Path) -> SimResult<Machine> {
        let config = Config {
            // Power loss is not simulated; fsyncs would only slow the run.
            durability: crate::Durability::Normal,
            max_attempts: MAX_ATTEMPTS,
            retry: RetryPolicy {
                initial: Duration::from_millis(200),
                max: Duration::from_millis(1_000),
            },
            ..Config::default()
        };
        let plan = Arc::new(Mutex::new(Plan::Ok));
        let crashing = Arc::new(AtomicBool::new(false));
        let mut machine = Machine {
            path: path.to_path_buf(),
            conn: None,
            config,
            handler: SimHandler {
                plan: Arc::clone(&plan),
                plans: Arc::default(),
                crashing: Arc::clone(&crashing),
            },
            plan,
            crashing,
            marker: None,
            started_claim: None,
            read_retired: None,
            now_ms: START_MS,
            next_token: 1,
        };
        schema::create_private(path).map_err(err)?;
        machine.reopen()?;
        Ok(machine)
    }

    /// Opens the connection and runs crash recovery, as the engine does.
    fn reopen(&mut self) -> SimResult<()> {
        let mut conn = schema::open_writer(&self.path, &self.config).map_err(err)?;
        schema::migrate(&mut conn).map_err(err)?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS sim_effects (consumer TEXT NOT NULL, message_id TEXT NOT NULL);
             CREATE TABLE IF NOT EXISTS sim_strict (x INTEGER NOT NULL);",
        )
        .map_err(err)?;
        let started: Vec<StartedClaim> = self.started_claim.into_iter().collect();
        recover_after_crash(
            &conn,
            &self.config,
            self.now_ms,
            self.marker.as_ref(),
            &started,
        )
        .map_err(err)?;
        self.marker = None;
        self.started_claim = None;
        let guard = UserCodeGuard::install(&mut conn).map_err(err)?;
        self.conn = Some((conn, guard));
        Ok(())
    }

    /// Drops the connection without committing: what a dead process leaves.
    fn crash(&mut self) -> SimResult<()> {
        self.conn = None;
        self.crashing.store(false, Ordering::SeqCst);
        self.reopen()
    }

    fn conn(&self) -> &Connection {
        &self.conn.as_ref().expect("open").0
    }

    /// Runs `step` in a transaction; commits on `Ok`, rolls back on `Err`.
    /// If the handler "died" in it, crashes instead and returns `None`.
    fn in_tx<T>(
        &mut self,
        step: impl FnOnce(&mut Machine) -> crate::Result<T>,
    ) -> SimResult<Option<T>> {
        exec(self.conn(), "BEGIN IMMEDIATE").map_err(err)?;
        let result = step(self);
        if self.crashing.load(Ordering::SeqCst) {
            self.crash()?;
            return Ok(None);
        }
        match result {
            Ok(value) => {
                exec(self.conn(), "COMMIT").map_err(err)?;
                Ok(Some(value))
            }
            Err(e) => {
                let _ = self.conn().execute_batch("ROLLBACK");
                Err(err(e))
            }
        }
    }

    /// Inline delivery. `None`: the process died in the handler.
    pub fn deliver(
        &mut self,
        consumer: &str,
        id: u8,
        variant: u8,
        plan: Plan,
    ) -> SimResult<Option<Outcome>> {
        *self.plan.lock().unwrap_or_else(|p| p.into_inner()) = plan;
        let msg = sim_message(id, variant);
        let hash = hash_of(&msg.payload);
        // As the writer does: a handler that rolled the transaction back
        // has its delivery run again, recording that attempt as failed.
        let mut rolled_back = false;
        loop {
            let step_rolled_back = rolled_back;
            let result = self.in_tx(|m| {
                let (conn, guard) = m.conn.as_ref().expect("open");
                let mut log = SimLog {
                    marker: &mut m.marker,
                    crashing: &m.crashing,
                };
                let mut env = Env {
                    conn,
                    config: &m.config,
                    now_ms: m.now_ms,
                    log: &mut log,
                    guard,
                };
                let step = if step_rolled_back {
                    delivery::Step::RolledBack
                } else {
                    delivery::Step::Run(&m.handler)
                };
                let outcome = delivery::deliver(&mut env, consumer, step, &msg, &hash);
                if matches!(outcome, Err(crate::Error::RolledBack { .. })) && conn.is_autocommit() {
                    rolled_back = true;
                }
                outcome
            });
            if rolled_back && !step_rolled_back {
                continue;
            }
            return result;
        }
    }

    /// Queued receipt of a batch, in one transaction.
    pub fn receive(&mut self, consumer: &str, msgs: &[(u8, u8)]) -> SimResult<Vec<Receipt>> {
        let consumer = consumer.to_owned();
        let msgs: Vec<Message> = msgs.iter().map(|&(id, v)| sim_message(id, v)).collect();
        self.in_tx(move |m| {
            msgs.iter()
                .map(|msg| {
                    queue::receive(m.conn(), &consumer, msg, &hash_of(&msg.payload), m.now_ms)
                        .map_err(|e| crate::Error::sqlite("receive", e))
                })
                .collect()
        })
        .map(Option::unwrap_or_default)
    }

    /// Claims up to `limit` due rows (consumer c0 first, then c1), then
    /// completes each in its own transaction with the next plan. Stops at a
    /// crash. Returns (consumer, id, outcome) per row completed.
    pub fn work(
        &mut self,
        limit: usize,
        plans: &[Plan],
    ) -> SimResult<Vec<(String, String, Outcome)>> {
        let token = self.next_token;
        self.next_token += 1;
        let claims = self
            .in_tx(move |m| {
                let mut claims = Vec::new();
                for consumer in CONSUMERS {
                    let want = limit - claims.len();
                    if want == 0 {
                        break;
                    }
                    claims.extend(
                        queue::claim(
                            m.conn(),
                            consumer,
                            want,
                            m.now_ms,
                            m.now_ms + LEASE_MS,
                            token,
                            MAX_ATTEMPTS,
                        )
                        .map_err(|e| crate::Error::sqlite("claim", e))?,
                    );
                }
                Ok(claims)
            })?
            .unwrap_or_default();
        let mut done = Vec::new();
        for (i, claim) in claims.into_iter().enumerate() {
            let plan = plans
                .get(i % plans.len().max(1))
                .copied()
                .unwrap_or(Plan::Ok);
            *self.plan.lock().unwrap_or_else(|p| p.into_inner()) = plan;
            let outcome = self.in_tx(|m| {
                let Machine {
                    conn,
                    config,
                    handler,
                    started_claim,
                    crashing,
                    now_ms,
                    ..
                } = m;
                let (conn, guard) = conn.as_ref().expect("open");
                let mut marks = SimClaims {
                    started: started_claim,
                    crashing,
                };
                workers::complete_claim(conn, config, guard, *now_ms, &claim, &mut marks, |tx| {
                    handler.handle(tx, &claim.msg)
                })
            })?;
            match outcome {
                None => break, // crashed: the rest stay claimed until recovery
                Some(None) => return Err(format!("lease lost for row {}", claim.row_id)),
                Some(Some(outcome)) => done.push((claim.consumer, claim.msg.id, outcome)),
            }
        }
        Ok(done)
    }

    /// Processes up to `limit` due rows (consumer c0 first, then c1) in one
    /// transaction, as the engine's dispatcher does for transactional
    /// consumers, the n-th handler run with the n-th plan (cycled). Returns
    /// (consumer, id, outcome) per row settled: none after a crash (nothing
    /// of the batch committed); after a handler rolled the transaction
    /// back, only that row's, its attempt counted in a transaction of its
    /// own.
    pub fn process(
        &mut self,
        limit: usize,
        plans: &[Plan],
    ) -> SimResult<Vec<(String, String, Outcome)>> {
        // Enough for every run (a run rolled back is run again).
        *self.handler.plans.lock().unwrap_or_else(|p| p.into_inner()) = (0..limit * (limit + 2))
            .map(|i| {
                plans
                    .get(i % plans.len().max(1))
                    .copied()
                    .unwrap_or(Plan::Ok)
            })
            .collect();
        // As the writer does: a batch a handler rolled back runs again,
        // counting that row's attempt first.
        let mut poisoned = Vec::new();
        let result = loop {
            let before = poisoned.len();
            let result = self.in_tx(|m| {
                let Machine {
                    conn,
                    config,
                    handler,
                    marker,
                    crashing,
                    now_ms,
                    ..
                } = m;
                let (conn, guard) = conn.as_ref().expect("open");
                let mut log = SimLog { marker, crashing };
                let mut env = Env {
                    conn,
                    config,
                    now_ms: *now_ms,
                    log: &mut log,
                    guard,
                };
                let consumers: Vec<(&str, &dyn Handler)> = CONSUMERS
                    .iter()
                    .map(|&c| (c, handler as &dyn Handler))
                    .collect();
                delivery::process_due(&mut env, &consumers, limit, &mut poisoned, &mut Vec::new())
            });
            // Crashed, committed, or failed for another reason.
            if poisoned.len() == before || result.is_ok() {
                break result;
            }
        };
        self.handler
            .plans
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        Ok(result?
            .unwrap_or_default()
            .into_iter()
            .map(|p| (p.consumer, p.message_id, p.outcome))
            .collect())
    }

    /// Moves the clock.
    pub fn advance(&mut self, ms: u32) {
        self.now_ms += i64::from(ms);
    }

    /// Sets the clock back.
    pub fn step_back(&mut self, ms: u32) {
        self.now_ms -= i64::from(ms);
    }

    /// Expires leases whose time has passed (the engine's reaper, for rows
    /// this process does not hold).
    pub fn reap(&mut self) -> SimResult<u64> {
        self.in_tx(|m| {
            let mut n = 0;
            for row in queue::leased(m.conn()).map_err(|e| crate::Error::sqlite("leased", e))? {
                if row.lease_until.is_none_or(|u| u < m.now_ms)
                    && queue::expire(
                        m.conn(),
                        row.row_id,
                        row.token,
                        "lease expired",
                        MAX_ATTEMPTS,
                        m.now_ms,
                    )
                    .map_err(|e| crate::Error::sqlite("expire", e))?
                {
                    n += 1;
                }
            }
            Ok(n)
        })
        .map(Option::unwrap_or_default)
    }

    /// One relay pass: fetch due rows, "send" them (failing those whose
    /// seq is a multiple of `fail_every`), record the results.
    pub fn relay(&mut self, fail_every: u8) -> SimResult<usize> {
        let batch: Vec<_> = outbox::fetch_due(self.conn(), self.now_ms, 50)
            .map_err(err)?
            .into_iter()
            .map(|(msg, _)| msg)
            .collect();
        let results = sink::per_message(&batch, |msg| {
            if fail_every > 0 && msg.seq % i64::from(fail_every) == 0 {
                SendResult::Retry {
                    reason: "sim sink down".into(),
                    after: Some(Duration::from_millis(50)),
                }
            } else {
                SendResult::Sent
            }
        });
        let n = batch.len();
        self.in_tx(move |m| {
            relay::record_results(m.conn(), &m.config, m.now_ms, &batch, &results).map(drop)
        })?;
        Ok(n)
    }

    /// Retention of completed inbox rows older than `retention_ms`, then,
    /// with `keys`, of the key entries deleted rows left (`retired.rs`).
    /// Returns rows deleted.
    pub fn cleanup(&mut self, retention_ms: u32, keys: bool) -> SimResult<usize> {
        let cutoff = self.now_ms - i64::from(retention_ms);
        let rows = self
            .in_tx(move |m| {
                queue::delete_expired(m.conn(), queue::DELETE_COMPLETED, cutoff, usize::MAX)
                    .map_err(|e| crate::Error::sqlite("cleanup", e))
            })?
            .unwrap_or_default();
        if keys {
            let m = RefCell::new(self);
            retired::drain(
                || retired::read(m.borrow().conn()).map_err(err),
                |batch| m.borrow_mut().write_retired(batch),
            )?;
        }
        Ok(rows)
    }

    /// The first half of a drain: reads the retired keys, for
    /// [`Machine::apply_retired`] to delete later.
    pub fn read_retired(&mut self) -> SimResult<()> {
        self.read_retired = retired::read(self.conn()).map_err(err)?;
        Ok(())
    }

    /// The second half: deletes the key entries the last read found (those
    /// still retired) and clears its notes. Returns entries deleted.
    pub fn apply_retired(&mut self) -> SimResult<u64> {
        let mut read = self.read_retired.take();
        retired::drain(|| Ok(read.take()), |batch| self.write_retired(batch))
    }

    /// One batch of a drain, in its own transaction.
    fn write_retired(&mut self, batch: retired::Batch) -> SimResult<usize> {
        self.in_tx(move |m| {
            retired::apply(m.conn(), &batch).map_err(|e| crate::Error::sqlite("retired keys", e))
        })
        .map(Option::unwrap_or_default)
    }

    /// Starts `consumer`'s stream `sim` afresh at 1.
    pub fn reset_sequence(&mut self, consumer: &str) -> SimResult<()> {
        let consumer = consumer.to_owned();
        self.in_tx(move |m| {
            crate::store::watermark::reset(m.conn(), &consumer, "sim", 1)
                .map_err(|e| crate::Error::sqlite("reset sequence", e))
        })
        .map(drop)
    }

    /// The process dies between operations and re-opens.
    pub fn crash_reopen(&mut self) -> SimResult<()> {
        self.crash()
    }

    /// The clock.
    pub fn now_ms(&self) -> i64 {
        self.now_ms
    }

    /// Every inbox row: (consumer, id) -> (status, attempts, next_attempt_at).
    fn inbox(&self) -> SimResult<BTreeMap<Key, RowState>> {
        let mut stmt = self
            .conn()
            .prepare("SELECT consumer, message_id, status, attempts, next_attempt_at FROM postroom_inbox")
            .map_err(err)?;
        let rows = stmt
            .query_map([], |r| {
                Ok(((r.get(0)?, r.get(1)?), (r.get(2)?, r.get(3)?, r.get(4)?)))
            })
            .map_err(err)?;
        rows.collect::<rusqlite::Result<_>>().map_err(err)
    }

    /// `consumer`'s stream `sim`: settled_below (1 when unknown) and the
    /// sequences listed settled above the watermark.
    fn watermark(&self, consumer: &str) -> SimResult<(u64, Vec<u64>)> {
        let below: i64 = self
            .conn()
            .query_row(
                "SELECT coalesce((SELECT settled_below FROM postroom_watermarks
                                  WHERE consumer = ?1 AND stream = 'sim'), 1)",
                [consumer],
                |r| r.get(0),
            )
            .map_err(err)?;
        let mut stmt = self
            .conn()
            .prepare(
                "SELECT seq FROM postroom_watermark_settled
                 WHERE consumer = ?1 AND stream = 'sim' ORDER BY seq",
            )
            .map_err(err)?;
        let listed = stmt
            .query_map([consumer], |r| r.get::<_, i64>(0))
            .map_err(err)?
            .map(|r| r.map(|s| s as u64))
            .collect::<rusqlite::Result<_>>()
            .map_err(err)?;
        Ok((below as u64, listed))
    }

    /// How many times each (consumer, id) had its effect committed, and how
    /// many outbox rows each caused.
    fn effects(&self, sql: &str) -> SimResult<BTreeMap<(String, String), u32>> {
        let mut stmt = self.conn().prepare(sql).map_err(err)?;
        let rows = stmt
            .query_map([], |r| Ok(((r.get(0)?, r.get(1)?), r.get(2)?)))
            .map_err(err)?;
        rows.collect::<rusqlite::Result<_>>().map_err(err)
    }
}

/// The reference model's view of one message.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    variant: u8,
    status: Status,
    attempts: u32,
    next_at: Option<i64>,
    processed_at: Option<i64>,
    /// Receive order (the row id's order).
    order: u64,
    /// Received (workers retry it) rather than delivered inline.
    queued: bool,
    /// Its row holds its sequence (ids 3 to 5), until a reset of its
    /// stream takes the numbers off the old epoch's rows.
    numbered: bool,
}

#[derive(Debug, Default, Clone)]
struct Model {
    entries: BTreeMap<(String, String), Entry>,
    /// Completed messages whose rows retention deleted and whose key
    /// entries a pass cut short left behind, with their payload variant.
    retired: BTreeMap<(String, String), u8>,
    /// The notes of `postroom_retired_keys`, in `seq` order: one per
    /// completed row retention deleted, until a drain clears it. A note
    /// outlives its key's retirement when the key is delivered anew.
    notes: Vec<(u64, (String, String))>,
    next_note: u64,
    /// What the pending [`Op::ReadRetired`] read: the noted keys, and the
    /// last note's `seq` (what its clear goes up to).
    read_retired: Option<(BTreeSet<(String, String)>, u64)>,
    applied: BTreeMap<(String, String), u32>,
    created: u64,
    /// Per consumer, every sequence that ever settled (completed or
    /// dead), with the payload variant it settled with: what the
    /// watermark and its listed sequences must stand for.
    settled: BTreeMap<String, BTreeMap<u64, u8>>,
}

/// What a run did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RunStats {
    /// Operations applied.
    pub ops: usize,
    /// Handler runs whose effects committed.
    pub processed: u64,
    /// Simulated process deaths (in handlers and between operations).
    pub crashes: u64,
    /// Deliveries or receipts quarantined as conflicts.
    pub conflicts: u64,
    /// Messages dead-lettered.
    pub dead: u64,
    /// Batches a handler rolled back whole (its attempt counted alone).
    pub rolled_back: u64,
    /// Keys a split drain read that had an inbox row again (delivered
    /// anew) when its deletions landed: their entries stayed.
    pub live_at_apply: u64,
    /// Deliveries or receipts answered by a sequence watermark.
    pub by_sequence: u64,
    /// Sequence streams reset.
    pub resets: u64,
}

impl Model {
    fn key(consumer: &str, id: u8) -> (String, String) {
        (consumer.to_owned(), id.to_string())
    }

    fn create(&mut self, key: &(String, String), variant: u8, queued: bool) -> &mut Entry {
        self.created += 1;
        let order = self.created;
        self.entries.insert(
            key.clone(),
            Entry {
                variant,
                status: Status::Pending,
                attempts: 0,
                next_at: None,
                processed_at: None,
                order,
                queued,
                numbered: key.1.parse().ok().and_then(sequence_of).is_some(),
            },
        );
        self.entries.get_mut(key).expect("just inserted")
    }

    /// Applies one attempt's plan to an entry whose attempt count already
    /// includes it. Returns the expected outcome (`None` for a crash, whose
    /// effect on the row is applied at recovery).
    fn attempt(&mut self, key: &(String, String), plan: Plan, now: i64) -> Option<Outcome> {
        let e = self.entries.get_mut(key).expect("entry");
        let attempts = e.attempts;
        let last = attempts >= MAX_ATTEMPTS;
        match plan {
            Plan::Ok => {
                e.status = Status::Completed;
                e.next_at = None;
                e.processed_at = Some(now);
                *self.applied.entry(key.clone()).or_default() += 1;
                Some(Outcome::Processed { attempts })
            }
            Plan::Reject => {
                e.status = Status::Dead;
                e.next_at = None;
                Some(Outcome::Dead {
                    attempts,
                    error: "sim reject".into(),
                })
            }
            Plan::Retry | Plan::Panic | Plan::RollBack if last => {
                e.status = Status::Dead;
                e.next_at = None;
                let error = match plan {
                    Plan::Retry => "sim retry",
                    Plan::Panic => "handler panicked: sim panic",
                    _ => delivery::HANDLER_ROLLED_BACK,
                };
                Some(Outcome::Dead {
                    attempts,
                    error: error.into(),
                })
            }
            Plan::Retry => {
                e.status = Status::Failed;
                e.next_at = Some(now + RETRY_AFTER_MS);
                Some(Outcome::Failed {
                    attempts,
                    error: "sim retry".into(),
                    retry_after: Duration::from_millis(RETRY_AFTER_MS as u64),
                })
            }
            Plan::Panic | Plan::RollBack => {
                // The delay is jittered: the check reads it back.
                e.status = Status::Failed;
                e.next_at = None;
                let error = if plan == Plan::Panic {
                    "handler panicked: sim panic"
                } else {
                    delivery::HANDLER_ROLLED_BACK
                };
                Some(Outcome::Failed {
                    attempts,
                    error: error.into(),
                    retry_after: Duration::ZERO,
                })
            }
            Plan::Crash => None,
        }
    }

    /// What is due, c0 before c1, in receive order: at most `limit` rows.
    fn due(&self, now: i64, limit: u8) -> Vec<(String, String)> {
        let mut due: Vec<(&(String, String), u64)> = self
            .entries
            .iter()
            .filter(|(_, e)| {
                e.queued
                    && matches!(e.status, Status::Pending | Status::Failed)
                    && e.next_at.is_none_or(|at| at <= now)
            })
            .map(|(k, e)| (k, e.order))
            .collect();
        due.sort_by(|a, b| (&a.0 .0, a.1).cmp(&(&b.0 .0, b.1)));
        due.into_iter()
            .take(usize::from(limit))
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Notes every sequenced entry that is settled now (settled is final:
    /// nothing in the simulation takes a message out of completed or dead,
    /// and retention deletes a row only in a later step).
    fn note_settled(&mut self) {
        for ((consumer, id), e) in &self.entries {
            let seq = id.parse().ok().and_then(sequence_of).filter(|_| e.numbered);
            if let (Some(seq), Status::Completed | Status::Dead) = (seq, e.status) {
                self.settled
                    .entry(consumer.clone())
                    .or_default()
                    .entry(seq)
                    .or_insert(e.variant);
            }
        }
    }

    /// The watermark of `consumer`'s stream, and the settled sequences
    /// listed above it.
    fn watermark(&self, consumer: &str) -> (u64, Vec<u64>) {
        let Some(settled) = self.settled.get(consumer) else {
            return (0, Vec::new());
        };
        let mut w = 0;
        while settled.contains_key(&(w + 1)) {
            w += 1;
        }
        (w, settled.keys().copied().filter(|&s| s > w).collect())
    }

    /// What the sequence of a message without an inbox row says (its key
    /// entry, if retired with another payload, already dropped): `None`,
    /// it is new; else the answer.
    fn by_sequence(&self, consumer: &str, id: u8, variant: u8) -> Option<SeqAnswer> {
        let seq = sequence_of(id)?;
        let (w, _) = self.watermark(consumer);
        if seq <= w {
            return Some(SeqAnswer::Duplicate(seq));
        }
        match self.settled.get(consumer)?.get(&seq) {
            Some(&v) if v == variant => Some(SeqAnswer::Duplicate(seq)),
            Some(_) => Some(SeqAnswer::Conflict),
            None => None,
        }
    }

    /// A claimed or in-flight attempt whose process died: counted, due at
    /// once, or dead if it was the last.
    fn died(&mut self, key: &(String, String)) {
        let e = self.entries.get_mut(key).expect("entry");
        if e.attempts >= MAX_ATTEMPTS {
            e.status = Status::Dead;
            e.next_at = None;
        } else {
            e.status = Status::Failed;
            e.next_at = None;
        }
    }
}

/// The model's answer for a sequenced message without a row.
enum SeqAnswer {
    Duplicate(u64),
    Conflict,
}

/// Compares a real outcome with the model's, allowing the jittered backoff
/// of a panic within its bounds. Fills in the model's `next_at` from it.
fn same_outcome(real: &Outcome, expected: &Outcome, model_entry: &mut Entry, now: i64) -> bool {
    match (real, expected) {
        (
            Outcome::Failed {
                attempts: a,
                error: e,
                retry_after: r,
            },
            Outcome::Failed {
                attempts: b,
                error: f,
                retry_after: s,
            },
        ) if s.is_zero() && e == f && a == b => {
            // Jittered: between half and all of 200 ms doubled per attempt,
            // capped at 1 s.
            let full = (200u64 << (a - 1).min(10)).min(1_000);
            let ms = r.as_millis() as u64;
            model_entry.next_at = Some(now + ms as i64);
            (full / 2..=full).contains(&ms)
        }
        (
            Outcome::Dead {
                attempts: a,
                error: e,
            },
            Outcome::Dead {
                attempts: b,
                error: f,
            },
        ) => a == b && (e == f || e.starts_with("attempts exhausted")),
        _ => real == expected,
    }
}

/// Runs `ops` against a fresh database in `dir`, checking every step.
/// `Err` names the step and what differed.
pub fn run(dir: &Path, ops: &[Op]) -> SimResult<RunStats> {
    let mut machine = Machine::open(&dir.join("sim.db"))?;
    let mut model = Model::default();
    let mut stats = RunStats::default();
    for (step, op) in ops.iter().enumerate() {
        apply(&mut machine, &mut model, &mut stats, op)
            .and_then(|()| {
                model.note_settled();
                check(&machine, &model)
            })
            .map_err(|e| format!("step {step} {op:?}: {e}"))?;
        stats.ops += 1;
    }
    let integrity: String = machine
        .conn()
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .map_err(err)?;
    if integrity != "ok" {
        return Err(format!("integrity_check: {integrity}"));
    }
    Ok(stats)
}

/// One operation, on the machine and on the model, compared.
fn apply(m: &mut Machine, model: &mut Model, stats: &mut RunStats, op: &Op) -> SimResult<()> {
    match op {
        Op::Deliver {
            consumer,
            id,
            variant,
            plan,
        } => deliver(m, model, stats, consumer, id, variant, plan)?,
        Op::Receive { consumer, msgs } => receive(m, model, stats, consumer, msgs)?,
        Op::Batch { limit, plans } => batch(m, model, stats, limit, plans)?,
        Op::Work { limit, plans } => work(m, model, stats, limit, plans)?,
        Op::Advance { ms } => m.advance(*ms),
        Op::StepBack { ms } => m.step_back(*ms),
        Op::Reap => {
            let n = m.reap()?;
            if n != 0 {
                return Err(format!("reaped {n} leases; none should be outstanding"));
            }
        }
        Op::Relay { fail_every } => {
            m.relay(*fail_every)?;
        }
        Op::Cleanup { retention_ms, keys } => cleanup(m, model, retention_ms, keys)?,
        Op::ReadRetired => read_retired(m, model)?,
        Op::ApplyRetired => apply_retired(m, model, stats)?,
        Op::CrashReopen => {
            stats.crashes += 1;
            m.crash_reopen()?;
        }
        Op::ResetSequence { consumer } => reset_sequence(m, model, stats, consumer)?,
    }
    Ok(())
}

/// Inline delivery: the model's expected outcome, then the machine's, compared.
fn deliver(
    m: &mut Machine,
    model: &mut Model,
    stats: &mut RunStats,
    consumer: &u8,
    id: &u8,
    variant: &u8,
    plan: &Plan,
) -> SimResult<()> {
    let now = m.now_ms();
    let consumer = CONSUMERS[usize::from(*consumer) % 2];
    let key = Model::key(consumer, *id);
    let expected: Option<Outcome> = match model.entries.get(&key).cloned() {
        None if model.retired.get(&key) == Some(variant) => Some(Outcome::Duplicate),
        Some(e) if e.variant != *variant => Some(Outcome::Conflict { conflict_id: 0 }),
        Some(e) => match e.status {
            Status::Completed => Some(Outcome::Duplicate),
            Status::Dead => Some(Outcome::Dead {
                attempts: e.attempts,
                error: String::new(),
            }),
            Status::Processing => return Err("model: processing between steps".into()),
            Status::Pending | Status::Failed => {
                if e.next_at.is_some_and(|at| at > now) {
                    Some(Outcome::Failed {
                        attempts: e.attempts,
                        error: String::new(),
                        retry_after: Duration::from_millis((e.next_at.unwrap_or(now) - now) as u64),
                    })
                } else {
                    model.entries.get_mut(&key).expect("entry").attempts += 1;
                    model.attempt(&key, *plan, now)
                }
            }
        },
        None => {
            // A retired key with another payload: forgotten, new,
            // unless its sequence says otherwise.
            model.retired.remove(&key);
            match model.by_sequence(consumer, *id, *variant) {
                Some(SeqAnswer::Duplicate(sequence)) => {
                    Some(Outcome::DuplicateBySequence { sequence })
                }
                Some(SeqAnswer::Conflict) => Some(Outcome::Conflict { conflict_id: 0 }),
                None => {
                    model.create(&key, *variant, false).attempts = 1;
                    model.attempt(&key, *plan, now)
                }
            }
        }
    };
    let real = m.deliver(consumer, *id, *variant, *plan)?;
    match (real, expected) {
        (None, None) => {
            stats.crashes += 1;
            model.died(&key);
        }
        (Some(Outcome::Conflict { .. }), Some(Outcome::Conflict { .. })) => stats.conflicts += 1,
        // A retired key's duplicate: no row, nothing more to compare.
        (Some(Outcome::Duplicate), Some(Outcome::Duplicate))
            if !model.entries.contains_key(&key) => {}
        (
            Some(Outcome::DuplicateBySequence { sequence: a }),
            Some(Outcome::DuplicateBySequence { sequence: b }),
        ) if a == b => stats.by_sequence += 1,
        (Some(real), Some(expected)) => {
            let entry = model.entries.get_mut(&key).expect("entry");
            let ok = match (&real, &expected) {
                // Answers given without running: compare the parts
                // that do not depend on stored text.
                (Outcome::Dead { attempts: a, .. }, Outcome::Dead { attempts: b, error })
                    if error.is_empty() =>
                {
                    a == b
                }
                (
                    Outcome::Failed {
                        attempts: a,
                        retry_after: r,
                        ..
                    },
                    Outcome::Failed {
                        attempts: b,
                        retry_after: s,
                        error,
                    },
                ) if error.is_empty() => a == b && r == s,
                _ => same_outcome(&real, &expected, entry, now),
            };
            if !ok {
                return Err(format!("outcome {real:?}, model expected {expected:?}"));
            }
            match real {
                Outcome::Processed { .. } => stats.processed += 1,
                Outcome::Dead { .. } => stats.dead += 1,
                _ => {}
            }
        }
        (real, expected) => return Err(format!("outcome {real:?}, model expected {expected:?}")),
    }
    Ok(())
}

/// A queued receipt of a batch: each receipt against the model's.
fn receive(
    m: &mut Machine,
    model: &mut Model,
    stats: &mut RunStats,
    consumer: &u8,
    msgs: &[(u8, u8)],
) -> SimResult<()> {
    let consumer = CONSUMERS[usize::from(*consumer) % 2];
    let mut expected = Vec::new();
    for &(id, variant) in msgs {
        let key = Model::key(consumer, id);
        expected.push(match model.entries.get(&key) {
            None if model.retired.get(&key) == Some(&variant) => Receipt::Duplicate,
            None => {
                model.retired.remove(&key);
                match model.by_sequence(consumer, id, variant) {
                    Some(SeqAnswer::Duplicate(sequence)) => {
                        Receipt::DuplicateBySequence { sequence }
                    }
                    Some(SeqAnswer::Conflict) => Receipt::Conflict { conflict_id: 0 },
                    None => {
                        model.create(&key, variant, true);
                        Receipt::Accepted
                    }
                }
            }
            Some(e) if e.variant == variant => {
                // An acked receipt hands an unfinished inline
                // message over to the workers.
                let e = model.entries.get_mut(&key).expect("entry");
                if matches!(e.status, Status::Pending | Status::Failed) {
                    e.queued = true;
                }
                Receipt::Duplicate
            }
            Some(_) => Receipt::Conflict { conflict_id: 0 },
        });
    }
    let real = m.receive(consumer, msgs)?;
    let strip = |r: &Receipt| match r {
        Receipt::Conflict { .. } => Receipt::Conflict { conflict_id: 0 },
        other => *other,
    };
    let real: Vec<Receipt> = real.iter().map(strip).collect();
    if real != expected {
        return Err(format!("receipts {real:?}, model expected {expected:?}"));
    }
    stats.conflicts += real
        .iter()
        .filter(|r| matches!(r, Receipt::Conflict { .. }))
        .count() as u64;
    stats.by_sequence += real
        .iter()
        .filter(|r| matches!(r, Receipt::DuplicateBySequence { .. }))
        .count() as u64;
    Ok(())
}

/// A batch of transactional queued processing, replayed in the model run by run (a handler's rollback restarts the batch).
fn batch(
    m: &mut Machine,
    model: &mut Model,
    stats: &mut RunStats,
    limit: &u8,
    plans: &[Plan],
) -> SimResult<()> {
    let now = m.now_ms();
    let real = m.process(usize::from(*limit), plans)?;
    // Each run the engine makes of the batch starts from the same
    // state: nothing of a run a handler rolled back (or died in)
    // committed. A run first counts the attempts of the rows whose
    // handlers rolled earlier runs back, then processes what is due.
    let start = model.clone();
    let mut poisons: Vec<(String, String)> = Vec::new();
    let mut next_plan = 0;
    let expected = loop {
        *model = start.clone();
        let mut expected = Vec::new();
        for key in &poisons {
            model.entries.get_mut(key).expect("entry").attempts += 1;
            let outcome = model.attempt(key, Plan::RollBack, now).expect("no crash");
            // Backed off (jittered: the check reads the time back),
            // so not due again in this run.
            let entry = model.entries.get_mut(key).expect("entry");
            if entry.status == Status::Failed {
                entry.next_at = Some(now + 1);
            }
            expected.push((key.clone(), outcome));
        }
        let room = usize::from(*limit) - poisons.len();
        let due = model.due(now, u8::try_from(room).unwrap_or(u8::MAX));
        let mut rolled_back = None;
        let mut crashed = false;
        for key in due {
            let plan = plans
                .get(next_plan % plans.len().max(1))
                .copied()
                .unwrap_or(Plan::Ok);
            next_plan += 1;
            model.entries.get_mut(&key).expect("entry").attempts += 1;
            match plan {
                // Nothing of this run committed; the crashed
                // attempt is counted at recovery.
                Plan::Crash => {
                    *model = start.clone();
                    model.entries.get_mut(&key).expect("entry").attempts += 1;
                    model.died(&key);
                    stats.crashes += 1;
                    crashed = true;
                    break;
                }
                Plan::RollBack => {
                    rolled_back = Some(key);
                    break;
                }
                _ => {
                    let outcome = model.attempt(&key, plan, now).expect("no crash");
                    expected.push((key, outcome));
                }
            }
        }
        if crashed {
            break Vec::new();
        }
        match rolled_back {
            Some(key) => {
                stats.rolled_back += 1;
                poisons.push(key);
            }
            None => break expected,
        }
    };
    if real.len() != expected.len() {
        return Err(format!(
            "batch settled {} rows, model expected {}: {real:?} vs {expected:?}",
            real.len(),
            expected.len()
        ));
    }
    for ((c, id, outcome), (key, want)) in real.iter().zip(&expected) {
        if (c, id) != (&key.0, &key.1) {
            return Err(format!(
                "processed {c}/{id}, model expected {}/{}",
                key.0, key.1
            ));
        }
        let entry = model.entries.get_mut(key).expect("entry");
        if !same_outcome(outcome, want, entry, now) {
            return Err(format!("{c}/{id}: {outcome:?}, model expected {want:?}"));
        }
        match outcome {
            Outcome::Processed { .. } => stats.processed += 1,
            Outcome::Dead { .. } => stats.dead += 1,
            _ => {}
        }
    }
    Ok(())
}

/// Claimed effectful rows, each against the model.
fn work(
    m: &mut Machine,
    model: &mut Model,
    stats: &mut RunStats,
    limit: &u8,
    plans: &[Plan],
) -> SimResult<()> {
    let now = m.now_ms();
    let due = model.due(now, *limit);
    let real = m.work(usize::from(*limit), plans)?;
    let mut crashed = false;
    let mut completed = 0;
    for (i, key) in due.iter().enumerate() {
        if crashed {
            // Claimed in the same batch, never started: handed
            // back at recovery, its claim's attempt uncounted.
            continue;
        }
        model.entries.get_mut(key).expect("entry").attempts += 1;
        let plan = plans
            .get(i % plans.len().max(1))
            .copied()
            .unwrap_or(Plan::Ok);
        let Some(expected) = model.attempt(key, plan, now) else {
            crashed = true;
            stats.crashes += 1;
            model.died(key);
            continue;
        };
        let Some((c, id, outcome)) = real.get(i) else {
            return Err(format!("worked {} rows, model expected more", real.len()));
        };
        if (c, id) != (&key.0, &key.1) {
            return Err(format!(
                "claimed {c}/{id}, model expected {}/{}",
                key.0, key.1
            ));
        }
        let entry = model.entries.get_mut(key).expect("entry");
        if !same_outcome(outcome, &expected, entry, now) {
            return Err(format!(
                "{c}/{id}: {outcome:?}, model expected {expected:?}"
            ));
        }
        match outcome {
            Outcome::Processed { .. } => stats.processed += 1,
            Outcome::Dead { .. } => stats.dead += 1,
            _ => {}
        }
        completed += 1;
    }
    if real.len() != completed {
        return Err(format!(
            "worked {} rows, model expected {completed}",
            real.len()
        ));
    }
    Ok(())
}

/// A retention pass: the rows the model retires, counted against the deletions.
fn cleanup(m: &mut Machine, model: &mut Model, retention_ms: &u32, keys: &bool) -> SimResult<()> {
    let now = m.now_ms();
    let cutoff = now - i64::from(*retention_ms);
    let before = model.entries.len();
    let (retired, notes) = (&mut model.retired, &mut model.notes);
    let next_note = &mut model.next_note;
    // Retention keeps the newest row, whatever its age.
    let newest = model.entries.values().map(|e| e.order).max();
    model.entries.retain(|key, e| {
        let expired = e.status == Status::Completed
            && e.processed_at.is_some_and(|at| at < cutoff)
            && Some(e.order) != newest;
        if expired {
            retired.insert(key.clone(), e.variant);
            *next_note += 1;
            notes.push((*next_note, key.clone()));
        }
        !expired
    });
    if *keys {
        retired.clear();
        notes.clear();
    }
    let n = m.cleanup(*retention_ms, *keys)?;
    if n != before - model.entries.len() {
        return Err(format!(
            "cleanup deleted {n}, model expected {}",
            before - model.entries.len()
        ));
    }
    Ok(())
}

/// The first half of a split drain: the model notes what it read.
fn read_retired(m: &mut Machine, model: &mut Model) -> SimResult<()> {
    m.read_retired()?;
    model.read_retired = model.notes.last().map(|&(last, _)| {
        let keys = model.notes.iter().map(|(_, key)| key.clone()).collect();
        (keys, last)
    });
    Ok(())
}

/// The second half of a split drain: the deletions against the model.
fn apply_retired(m: &mut Machine, model: &mut Model, stats: &mut RunStats) -> SimResult<()> {
    let real = m.apply_retired()?;
    let mut expected = 0;
    if let Some((keys, last)) = model.read_retired.take() {
        for key in keys {
            if model.retired.remove(&key).is_some() {
                expected += 1;
            } else if model.entries.contains_key(&key) {
                stats.live_at_apply += 1;
            }
        }
        model.notes.retain(|&(seq, _)| seq > last);
    }
    if real != expected {
        return Err(format!(
            "a split drain deleted {real} key entries, model expected {expected}"
        ));
    }
    Ok(())
}

/// A consumer's sequence reset (a new epoch).
fn reset_sequence(
    m: &mut Machine,
    model: &mut Model,
    stats: &mut RunStats,
    consumer: &u8,
) -> SimResult<()> {
    let consumer = CONSUMERS[usize::from(*consumer) % 2];
    m.reset_sequence(consumer)?;
    model.settled.remove(consumer);
    for ((c, _), e) in model.entries.iter_mut() {
        if c == consumer {
            e.numbered = false;
        }
    }
    stats.resets += 1;
    Ok(())
}

/// The whole inbox, every effect count and every outbox count against the
/// model.
fn check(m: &Machine, model: &Model) -> SimResult<()> {
    let mut broken = Vec::new();
    crate::store::inbox::key_mismatches(m.conn(), |table, id, what| {
        broken.push(format!("{table} {id}: {what}"))
    })
    .map_err(|e| format!("check inbox keys: {e}"))?;
    if !broken.is_empty() {
        return Err(format!("key table: {}", broken.join("; ")));
    }
    let retired = m.effects(
        "SELECT consumer, message_id, 1 FROM postroom_inbox_keys k
         WHERE NOT EXISTS (SELECT 1 FROM postroom_inbox i
                           WHERE i.id = k.inbox_id AND i.consumer = k.consumer
                             AND i.source = k.source AND i.message_id = k.message_id)",
    )?;
    if !retired.keys().eq(model.retired.keys()) {
        return Err(format!(
            "retired key entries {:?}, model {:?}",
            retired.keys().collect::<Vec<_>>(),
            model.retired
        ));
    }
    let inbox = m.inbox()?;
    if inbox.len() != model.entries.len() {
        return Err(format!(
            "{} inbox rows, model has {}",
            inbox.len(),
            model.entries.len()
        ));
    }
    for (key, e) in &model.entries {
        let Some(&(status, attempts, next_at)) = inbox.get(key) else {
            return Err(format!("{key:?} missing from the inbox"));
        };
        if (status, attempts) != (e.status, e.attempts) {
            return Err(format!(
                "{key:?}: inbox has {status}/{attempts}, model {}/{}",
                e.status, e.attempts
            ));
        }
        // Due at once is NULL, not a time (schema.sql); a retry's time is
        // exact (a panic's jittered one was read back from its outcome).
        if matches!(e.status, Status::Pending | Status::Failed) && next_at != e.next_at {
            return Err(format!(
                "{key:?}: next_attempt_at {next_at:?}, model {:?}",
                e.next_at
            ));
        }
    }
    for consumer in CONSUMERS {
        let (below, listed) = m.watermark(consumer)?;
        let (w, model_listed) = model.watermark(consumer);
        if (below.saturating_sub(1), &listed) != (w, &model_listed) {
            return Err(format!(
                "{consumer}: watermark {} listing {listed:?}, model {w} listing {model_listed:?}",
                below.saturating_sub(1)
            ));
        }
    }
    let applied =
        m.effects("SELECT consumer, message_id, count(*) FROM sim_effects GROUP BY 1, 2")?;
    let published = m.effects(
        "SELECT cause_consumer, cause_message_id, count(*) FROM postroom_outbox GROUP BY 1, 2",
    )?;
    let expected: BTreeMap<_, _> = model
        .applied
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(k, n)| (k.clone(), *n))
        .collect();
    if applied != expected {
        return Err(format!("effects {applied:?}, model {expected:?}"));
    }
    if published != expected {
        return Err(format!("outbox rows {published:?}, model {expected:?}"));
    }
    Ok(())
}

/// A source of choices: a seeded generator, or fuzzer bytes (zeros once
/// they run out).
trait Choices {
    fn next(&mut self) -> u64;
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// The seeded source is the testkit's generator (SplitMix64): one
/// implementation, the same numbers on every platform.
impl Choices for Rng {
    fn next(&mut self) -> u64 {
        self.next_u64()
    }
}

struct Bytes<'a>(&'a [u8]);

impl Choices for Bytes<'_> {
    fn next(&mut self) -> u64 {
        let (&b, rest) = self.0.split_first().unwrap_or((&0, &[]));
        self.0 = rest;
        u64::from(b)
    }
}

fn plan(c: &mut dyn Choices) -> Plan {
    match c.below(20) {
        0..=11 => Plan::Ok,
        12..=14 => Plan::Retry,
        15 => Plan::Reject,
        16..=17 => Plan::Panic,
        _ => Plan::Crash,
    }
}

fn op(c: &mut dyn Choices) -> Op {
    // Few ids, so duplicates and conflicts are common.
    let id = |c: &mut dyn Choices| c.below(6) as u8;
    let variant = |c: &mut dyn Choices| u8::from(c.below(12) == 0);
    match c.below(100) {
        0..=34 => Op::Deliver {
            consumer: c.below(2) as u8,
            id: id(c),
            variant: variant(c),
            plan: if c.below(24) == 0 {
                Plan::RollBack
            } else {
                plan(c)
            },
        },
        35..=49 => Op::Receive {
            consumer: c.below(2) as u8,
            msgs: (0..1 + c.below(3)).map(|_| (id(c), variant(c))).collect(),
        },
        50..=56 => Op::Work {
            limit: 1 + c.below(4) as u8,
            plans: (0..1 + c.below(3)).map(|_| plan(c)).collect(),
        },
        57..=64 => Op::Batch {
            limit: 1 + c.below(4) as u8,
            plans: (0..1 + c.below(3))
                .map(|_| {
                    if c.below(16) == 0 {
                        Plan::RollBack
                    } else {
                        plan(c)
                    }
                })
                .collect(),
        },
        65..=73 => Op::Advance {
            ms: [10, 60, 150, 400, 1_500][c.below(5) as usize],
        },
        74..=75 => Op::StepBack {
            ms: [100, 2_000][c.below(2) as usize],
        },
        76..=77 => Op::ReadRetired,
        78..=79 => Op::ApplyRetired,
        80..=83 => Op::Reap,
        84..=91 => Op::Relay {
            fail_every: c.below(4) as u8,
        },
        92..=95 => Op::Cleanup {
            retention_ms: [0, 500, 5_000][c.below(3) as usize],
            keys: c.below(3) != 0,
        },
        96 => Op::ResetSequence {
            consumer: c.below(2) as u8,
        },
        _ => Op::CrashReopen,
    }
}

/// Generates `len` operations from `seed`.
pub fn ops_from_seed(seed: u64, len: usize) -> Vec<Op> {
    let mut c = Rng::new(seed);
    (0..len).map(|_| op(&mut c)).collect()
}

/// Generates operations from fuzzer input (about three bytes each).
pub fn ops_from_bytes(data: &[u8]) -> Vec<Op> {
    let mut c = Bytes(data);
    let n = data.len() / 3;
    (0..n.min(400)).map(|_| op(&mut c)).collect()
}

/// Runs the sequence generated from `seed` in `dir`.
pub fn run_seed(dir: &Path, seed: u64, len: usize) -> SimResult<RunStats> {
    run(dir, &ops_from_seed(seed, len))
}

/// Runs the sequence generated from fuzzer input in `dir`.
pub fn run_bytes(dir: &Path, data: &[u8]) -> SimResult<RunStats> {
    run(dir, &ops_from_bytes(data))
}
