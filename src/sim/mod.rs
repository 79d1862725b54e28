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
//!
//! The files: `machine.rs` (the engine without threads), `model.rs` (the
//! reference model), `ops.rs` (one function per operation, and the
//! comparison after each step), `generate.rs` (operations from a seed or
//! from fuzzer bytes).

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
use crate::store::sweep;
use crate::testkit::Rng;

mod generate;
mod machine;
mod model;
mod ops;

pub use generate::{ops_from_bytes, ops_from_seed, run_bytes, run_seed};
pub use machine::Machine;
pub use model::RunStats;
use model::{same_outcome, Model, SeqAnswer};
use ops::{
    apply_retired, batch, check, cleanup, deliver, read_retired, receive, reset_sequence, work,
};

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
