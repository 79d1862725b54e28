//! The reference model ([`Model`]): what the inbox, the retired keys, the
//! watermarks and the effects should be after each operation, computed
//! without SQL, and [`RunStats`], what a run did.
//!
//! Invariant: the model never reads the machine; every expectation comes
//! from the operations alone, so a disagreement is a finding.

use super::*;

/// The reference model's view of one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Entry {
    pub(super) variant: u8,
    pub(super) status: Status,
    pub(super) attempts: u32,
    pub(super) next_at: Option<i64>,
    pub(super) processed_at: Option<i64>,
    /// Receive order (the row id's order).
    pub(super) order: u64,
    /// Received (workers retry it) rather than delivered inline.
    pub(super) queued: bool,
    /// Its row holds its sequence (ids 3 to 5), until a reset of its
    /// stream takes the numbers off the old epoch's rows.
    pub(super) numbered: bool,
}

#[derive(Debug, Default, Clone)]
pub(super) struct Model {
    pub(super) entries: BTreeMap<(String, String), Entry>,
    /// Completed messages whose rows retention deleted and whose key
    /// entries a pass cut short left behind, with their payload variant.
    pub(super) retired: BTreeMap<(String, String), u8>,
    /// The notes of `postroom_retired_keys`, in `seq` order: one per
    /// completed row retention deleted, until a drain clears it. A note
    /// outlives its key's retirement when the key is delivered anew.
    pub(super) notes: Vec<(u64, (String, String))>,
    pub(super) next_note: u64,
    /// What the pending [`Op::ReadRetired`] read: the noted keys, and the
    /// last note's `seq` (what its clear goes up to).
    pub(super) read_retired: Option<(BTreeSet<(String, String)>, u64)>,
    pub(super) applied: BTreeMap<(String, String), u32>,
    pub(super) created: u64,
    /// Where the last retention pass stopped (an entry's `order`), and
    /// when the last pass from the first entry ran: a pass whose cutoff
    /// is no later than that starts at the frontier (`store::sweep`).
    pub(super) frontier: Option<u64>,
    pub(super) swept_at: Option<i64>,
    /// Per consumer, every sequence that ever settled (completed or
    /// dead), with the payload variant it settled with: what the
    /// watermark and its listed sequences must stand for.
    pub(super) settled: BTreeMap<String, BTreeMap<u64, u8>>,
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
    pub(super) fn key(consumer: &str, id: u8) -> (String, String) {
        (consumer.to_owned(), id.to_string())
    }

    pub(super) fn create(
        &mut self,
        key: &(String, String),
        variant: u8,
        queued: bool,
    ) -> &mut Entry {
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
    pub(super) fn attempt(
        &mut self,
        key: &(String, String),
        plan: Plan,
        now: i64,
    ) -> Option<Outcome> {
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
    pub(super) fn due(&self, now: i64, limit: u8) -> Vec<(String, String)> {
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
    pub(super) fn note_settled(&mut self) {
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
    pub(super) fn watermark(&self, consumer: &str) -> (u64, Vec<u64>) {
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
    pub(super) fn by_sequence(&self, consumer: &str, id: u8, variant: u8) -> Option<SeqAnswer> {
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
    pub(super) fn died(&mut self, key: &(String, String)) {
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
pub(super) enum SeqAnswer {
    Duplicate(u64),
    Conflict,
}

/// Compares a real outcome with the model's, allowing the jittered backoff
/// of a panic within its bounds. Fills in the model's `next_at` from it.
pub(super) fn same_outcome(
    real: &Outcome,
    expected: &Outcome,
    model_entry: &mut Entry,
    now: i64,
) -> bool {
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
