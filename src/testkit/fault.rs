//! The faults a [`Scenario`](super::Scenario) schedules, and what a failed
//! run found ([`Violation`]).
//!
//! Invariants: a [`Fault`] is plain data (step, kind, argument), so a
//! schedule prints, compares and replays exactly; [`FaultKind::ALL`] lists
//! every kind once, in the order reports print them.

use std::fmt;

/// A kind of fault the testkit injects. Every kind is on by default;
/// [`Scenario::without`](super::Scenario::without) switches one off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum FaultKind {
    /// An acknowledged message comes again later (at-least-once delivery).
    Redeliver,
    /// The handler committed but the answer never reached the broker: the
    /// message comes again at once (a duplicate before the ack).
    LostAck,
    /// The message arrives some places later than it was generated.
    Reorder,
    /// The message's id comes again with another payload (a producer bug).
    ReusedId,
    /// The handler (or an effect handler's external step) ran, then the
    /// process died before the commit; the engine reopens (its real
    /// recovery) and the message is redelivered.
    CrashBeforeCommit,
    /// The commit was durable, then the process died before the ack; the
    /// engine reopens and the message is redelivered.
    CrashAfterCommit,
    /// After the relay handed rows to the sink, the process dies: the sink
    /// is dropped without its destructor running (what `kill -9` does),
    /// and the engine reopens with a fresh sink.
    CrashInRelay,
    /// Your effect handler's external step outlives its lease: while the
    /// step runs, the lease expires and the engine's reaper makes the
    /// message due again; the step's result is discarded by the lease
    /// fence and the step runs again, with the same idempotency key (a
    /// slow payment API, a stalled worker). An effect that ignores
    /// `ctx.idempotency_key()` is applied twice. Applies when the setup
    /// has an [`App::effectful_consumer`](super::App::effectful_consumer).
    LeaseExpiry,
    /// After your handler (or your effect handler's `apply`) ran, SQL in
    /// its transaction rolls the whole transaction back (`INSERT OR
    /// ROLLBACK` meeting a conflict), without a restart: what your code
    /// keeps in memory survives, its writes do not. The message is
    /// redelivered.
    SqlRollback,
    /// The disk fills up during the message's delivery (a real page quota
    /// on the engine's connection, at the file's size): every write that
    /// needs a new page fails with `SQLITE_FULL`, yours included, and a
    /// page-sized write after your handler makes sure one does. The engine
    /// answers a retryable error and the message is redelivered once there
    /// is room again: it must not be lost (dead-lettered) nor doubled.
    DiskFull,
    /// The sink's next sends fail (answered `Retry` before reaching your sink).
    SinkFails,
    /// The sink's destination is down for its next sends (`Unavailable`).
    SinkUnavailable,
    /// The destination's acknowledgement times out for the next 1–3
    /// messages [`Downstream::accept`](super::Downstream::accept) is
    /// given: the first did not arrive, a second one arrived late. A sink
    /// must answer `Retry` (or `Unavailable`), never `Sent`. Applies when
    /// the setup uses [`App::downstream`](super::App::downstream).
    SinkTimeout,
    /// The clock jumps: forward up to two days, or back up to a minute.
    ClockJump,
    /// Once the message is acknowledged and a later one has an inbox row
    /// (retention never deletes the newest), the clock passes the
    /// retention period, a retention pass deletes the completed inbox rows,
    /// and the message comes again: the engine no longer knows it and
    /// processes it again (a documented limit of the dedupe horizon, unless
    /// the message carries a sequence number). Counted as fired only when
    /// the pass removed the message's row; on the last message it cannot.
    /// The verdict expects those effects again and the report counts them
    /// as a known limit.
    RetentionPass,
}

impl FaultKind {
    /// Every kind, in report order.
    pub const ALL: [FaultKind; 15] = [
        FaultKind::Redeliver,
        FaultKind::LostAck,
        FaultKind::Reorder,
        FaultKind::ReusedId,
        FaultKind::CrashBeforeCommit,
        FaultKind::CrashAfterCommit,
        FaultKind::CrashInRelay,
        FaultKind::LeaseExpiry,
        FaultKind::SqlRollback,
        FaultKind::DiskFull,
        FaultKind::SinkFails,
        FaultKind::SinkUnavailable,
        FaultKind::SinkTimeout,
        FaultKind::ClockJump,
        FaultKind::RetentionPass,
    ];

    /// Its name in reports: `crash-before-commit`, ….
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Redeliver => "redeliver",
            FaultKind::LostAck => "lost-ack",
            FaultKind::Reorder => "reorder",
            FaultKind::ReusedId => "reused-id",
            FaultKind::CrashBeforeCommit => "crash-before-commit",
            FaultKind::CrashAfterCommit => "crash-after-commit",
            FaultKind::CrashInRelay => "crash-in-relay",
            FaultKind::LeaseExpiry => "lease-expiry",
            FaultKind::SqlRollback => "sql-rollback",
            FaultKind::DiskFull => "disk-full",
            FaultKind::SinkFails => "sink-fails",
            FaultKind::SinkUnavailable => "sink-unavailable",
            FaultKind::SinkTimeout => "sink-timeout",
            FaultKind::ClockJump => "clock-jump",
            FaultKind::RetentionPass => "retention-pass",
        }
    }

    /// Whether it needs a sink to mean anything.
    pub(crate) fn needs_sink(self) -> bool {
        matches!(
            self,
            FaultKind::CrashInRelay
                | FaultKind::SinkFails
                | FaultKind::SinkUnavailable
                | FaultKind::SinkTimeout
        )
    }

    /// Whether it needs an effectful consumer.
    pub(crate) fn needs_effectful(self) -> bool {
        self == FaultKind::LeaseExpiry
    }

    /// Whether it needs the [`Downstream`](super::Downstream) stand-in.
    pub(crate) fn needs_downstream(self) -> bool {
        self == FaultKind::SinkTimeout
    }

    /// Whether it is a crash of the process.
    pub fn is_crash(self) -> bool {
        matches!(
            self,
            FaultKind::CrashBeforeCommit | FaultKind::CrashAfterCommit | FaultKind::CrashInRelay
        )
    }
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One scheduled fault: at the first delivery of the `step`-th generated
/// message, `kind`, with `arg` (places for a reorder, milliseconds for a
/// clock jump, sends for a sink fault; 1 for a crash that is a real kill
/// of a child process; 0 otherwise).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// The index of the generated message it is attached to.
    pub step: usize,
    /// What happens.
    pub kind: FaultKind,
    /// Its size, per kind.
    pub arg: i64,
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "message #{}: {}", self.step, self.kind)?;
        match self.kind {
            FaultKind::Reorder => write!(f, " by {} places", self.arg),
            FaultKind::ClockJump => write!(f, " by {:+} ms", self.arg),
            FaultKind::SinkFails | FaultKind::SinkUnavailable | FaultKind::SinkTimeout => {
                write!(f, " for {} sends", self.arg)
            }
            FaultKind::CrashBeforeCommit | FaultKind::CrashAfterCommit
                if self.arg == super::process::REAL_KILL =>
            {
                write!(f, " (SIGKILL of a child process)")
            }
            _ => Ok(()),
        }
    }
}

/// What a failed run found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Violation {
    /// A message's effects (your `effects` closure) were not applied once
    /// per consumer that completed it.
    EffectsNotOnce {
        /// The message's id.
        message_id: String,
        /// Consumers that completed it (the effects expected).
        expected: u64,
        /// What `effects` counted.
        counted: u64,
    },
    /// The final state (your `outcome` closure) differs from the state a
    /// fault-free, in-order run of the same messages leaves.
    OutcomeDiffers {
        /// The fault-free run's outcome.
        expected: String,
        /// This run's.
        got: String,
    },
    /// A message a fault-free run completes ended as a dead letter under
    /// the faults: a transient error (a full disk, a rollback) was treated
    /// as permanent, so the message is lost until someone redrives it.
    LostToFault {
        /// The message's id.
        message_id: String,
        /// The consumer that dead-lettered it.
        consumer: String,
    },
    /// The times your `detect_wall_clock` closure rendered differ between
    /// two fault-free runs whose engine clocks are 1,000 days apart: your
    /// code reads the wall clock, or the closure renders absolute times
    /// (see [`Scenario::detect_wall_clock`](super::Scenario::detect_wall_clock)).
    ReadsWallClock {
        /// The rendering at the usual clock.
        expected: String,
        /// The rendering with the clock shifted.
        got: String,
    },
    /// One of your invariants failed.
    Invariant {
        /// After which step (`"the end"` for the final check).
        after: String,
        /// Your invariant's message.
        message: String,
    },
    /// A message was never recorded for a consumer, or never settled
    /// (completed or dead) although it was redelivered until acknowledged.
    NotSettled {
        /// The message's id.
        message_id: String,
        /// The consumer.
        consumer: String,
        /// Its status, if it has a row.
        status: Option<String>,
    },
    /// An outbox row never reached the sink.
    NeverHandedToSink {
        /// The outbox message id.
        message_id: String,
    },
    /// The sink answered `Sent` for a message the downstream stand-in
    /// never received: a downstream message lost (a sink that answers
    /// `Sent` before its destination acknowledged, and then crashes).
    LostDownstream {
        /// The outbox message id.
        message_id: String,
    },
    /// Messages of one key reached the sink or the downstream out of
    /// commit order.
    OutOfOrder {
        /// Where: `"sink"` or `"downstream"`.
        at: &'static str,
        /// The key.
        key: String,
    },
    /// A fault kind that is switched on never fired in any seed, so the
    /// run could not tell whether your code survives it.
    NeverFired {
        /// The kinds.
        kinds: Vec<FaultKind>,
    },
    /// The engine refused or failed (an error to fix before anything else).
    Engine {
        /// What failed.
        message: String,
    },
}

impl Violation {
    /// A short name: `effects-not-once`, `outcome-differs`, ….
    pub fn name(&self) -> &'static str {
        match self {
            Violation::EffectsNotOnce { .. } => "effects-not-once",
            Violation::OutcomeDiffers { .. } => "outcome-differs",
            Violation::LostToFault { .. } => "lost-to-fault",
            Violation::ReadsWallClock { .. } => "reads-wall-clock",
            Violation::Invariant { .. } => "invariant",
            Violation::NotSettled { .. } => "not-settled",
            Violation::NeverHandedToSink { .. } => "never-handed-to-sink",
            Violation::LostDownstream { .. } => "lost-downstream",
            Violation::OutOfOrder { .. } => "out-of-order",
            Violation::NeverFired { .. } => "never-fired",
            Violation::Engine { .. } => "engine",
        }
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Violation::EffectsNotOnce {
                message_id,
                expected,
                counted,
            } => write!(
                f,
                "message {message_id:?}: effects applied {counted} times, expected {expected} \
                 (once per consumer that completed it)"
            ),
            Violation::OutcomeDiffers { expected, got } => write!(
                f,
                "the final state differs from a fault-free in-order run:\n    expected: {expected}\n    got:      {got}"
            ),
            Violation::LostToFault {
                message_id,
                consumer,
            } => write!(
                f,
                "message {message_id:?} is a dead letter of consumer {consumer:?}, but a \
                 fault-free run completes it: a transient error (full disk, rollback) was \
                 treated as permanent (a Failure::reject for an SQL error?)"
            ),
            Violation::ReadsWallClock { expected, got } => write!(
                f,
                "the final state depends on the wall clock: with the engine's clock 1,000 days \
                 later it differs (read time with tx.now_ms(), not SystemTime::now(); render \
                 times relative to check.now_ms()):\n    expected: {expected}\n    got:      {got}"
            ),
            Violation::Invariant { after, message } => {
                write!(f, "invariant failed after {after}: {message}")
            }
            Violation::NotSettled {
                message_id,
                consumer,
                status,
            } => match status {
                Some(s) => write!(
                    f,
                    "message {message_id:?} for consumer {consumer:?} never settled (status {s})"
                ),
                None => write!(
                    f,
                    "message {message_id:?} for consumer {consumer:?} was acknowledged but is not in the inbox"
                ),
            },
            Violation::NeverHandedToSink { message_id } => {
                write!(f, "outbox message {message_id:?} never reached the sink")
            }
            Violation::LostDownstream { message_id } => write!(
                f,
                "outbox message {message_id:?} was answered Sent but never reached the downstream: \
                 the sink said Sent before its destination acknowledged"
            ),
            Violation::OutOfOrder { at, key } => {
                write!(f, "messages of key {key:?} reached the {at} out of commit order")
            }
            Violation::NeverFired { kinds } => {
                let names: Vec<&str> = kinds.iter().map(|k| k.name()).collect();
                write!(
                    f,
                    "fault kinds never fired: {} (more seeds or messages, or switch them off \
                     with .without(..))",
                    names.join(", ")
                )
            }
            Violation::Engine { message } => write!(f, "engine error: {message}"),
        }
    }
}
