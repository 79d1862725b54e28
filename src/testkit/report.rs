//! What a scenario run returns: the [`Report`] of a passing run and the
//! [`Failed`] error of a failing one, with the seed, the schedule, the
//! shrunk schedule and the command that replays it.
//!
//! Invariant: a failure's message always carries what replays it.

use super::*;

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
    pub(super) ids: Vec<String>,
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
