//! Generating operations: from a seed (the testkit's [`Rng`]) or from
//! fuzzer bytes (zeros once they run out), through one source of choices
//! ([`Choices`]), and the entry points that run them.
//!
//! Invariant: the same seed or bytes give the same operations on every
//! platform.

use super::*;

/// A source of choices: a seeded generator, or fuzzer bytes (zeros once
/// they run out).
pub(super) trait Choices {
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

pub(super) struct Bytes<'a>(&'a [u8]);

impl Choices for Bytes<'_> {
    fn next(&mut self) -> u64 {
        let (&b, rest) = self.0.split_first().unwrap_or((&0, &[]));
        self.0 = rest;
        u64::from(b)
    }
}

pub(super) fn plan(c: &mut dyn Choices) -> Plan {
    match c.below(20) {
        0..=11 => Plan::Ok,
        12..=14 => Plan::Retry,
        15 => Plan::Reject,
        16..=17 => Plan::Panic,
        _ => Plan::Crash,
    }
}

pub(super) fn op(c: &mut dyn Choices) -> Op {
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
