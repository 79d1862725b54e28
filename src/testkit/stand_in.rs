//! What stands in for the world around the engine in a scenario: the
//! seeded [`Rng`] your message generator draws from, an external
//! [`Service`] that counts calls per idempotency key, and a [`Downstream`]
//! that records what a sink's destination acknowledged.
//!
//! Invariants: [`Rng`] is SplitMix64, so a seed gives the same numbers on
//! every platform and release; a [`Service`] and a [`Downstream`] outlive
//! the simulated crashes of one seed (they are other systems) and are
//! fresh for every seed; clones share state.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::OutboxMessage;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A small deterministic random number generator (SplitMix64): the same
/// seed gives the same numbers everywhere.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }

    /// A number in `lo..=hi`.
    pub fn range(&mut self, lo: i64, hi: i64) -> i64 {
        let span = hi.saturating_sub(lo).saturating_add(1).max(1) as u64;
        lo.saturating_add(self.below(span) as i64)
    }

    /// True `percent` times in a hundred.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    /// One element of `items` (`None` when empty).
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        items.get(self.below(items.len() as u64) as usize)
    }
}

#[derive(Debug, Default)]
struct ServiceState {
    calls: u64,
    deduplicated: u64,
    by_key: HashMap<String, u64>,
    applied: HashMap<String, u64>,
}

/// A stand-in for an external service an [`EffectHandler`](crate::EffectHandler)
/// calls (a payment API): it applies an effect per call, and, like real
/// idempotent APIs, a call that repeats an idempotency key is answered
/// with the first call's receipt and not applied again. A call without a
/// key is applied every time. Get one with
/// [`App::service`](super::App::service); read it back in `effects` with
/// [`Check::service`](super::Check::service).
#[derive(Debug, Clone)]
pub struct Service {
    name: Arc<str>,
    state: Arc<Mutex<ServiceState>>,
}

impl Service {
    pub(crate) fn new(name: &str) -> Service {
        Service {
            name: name.into(),
            state: Arc::default(),
        }
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Calls the service: applies `effect` (a label such as
    /// `"charge order 7"`) unless `idempotency_key` was seen before.
    /// Returns the receipt number (the first call's for a repeated key).
    pub fn call(&self, idempotency_key: Option<&str>, effect: &str) -> u64 {
        let mut s = lock(&self.state);
        s.calls += 1;
        if let Some(key) = idempotency_key {
            if let Some(&receipt) = s.by_key.get(key) {
                s.deduplicated += 1;
                return receipt;
            }
        }
        let receipt = s.calls;
        if let Some(key) = idempotency_key {
            s.by_key.insert(key.to_owned(), receipt);
        }
        *s.applied.entry(effect.to_owned()).or_insert(0) += 1;
        receipt
    }

    /// How many times `effect` was applied.
    pub fn applied(&self, effect: &str) -> u64 {
        lock(&self.state).applied.get(effect).copied().unwrap_or(0)
    }

    /// Calls made, repeats included.
    pub fn calls(&self) -> u64 {
        lock(&self.state).calls
    }

    /// Calls recognised by their idempotency key and not applied again.
    pub fn deduplicated(&self) -> u64 {
        lock(&self.state).deduplicated
    }
}

/// One message the downstream acknowledged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    /// The outbox message id.
    pub id: String,
    /// Its key.
    pub key: Option<String>,
    /// Its topic.
    pub topic: String,
}

/// The destination did not acknowledge in time: the message may have
/// arrived or not. Answer `Retry` (or `Unavailable`) for it, never `Sent`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeout;

impl std::fmt::Display for Timeout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(
            "the destination did not acknowledge in time (the message may or may not have arrived)",
        )
    }
}

impl std::error::Error for Timeout {}

#[derive(Debug, Default)]
struct DownState {
    received: Vec<Received>,
    /// Acknowledgements still to time out, of the fault in progress.
    timeouts: i64,
    /// Timed-out acknowledgements of the fault in progress.
    answered: u64,
    /// Timeout faults that met an `accept`.
    fired: u64,
}

/// A stand-in for the destination your [`Sink`](crate::Sink) hands
/// messages to (a broker): call [`accept`](Downstream::accept) where your
/// sink waits for its destination's acknowledgement, and answer `Sent` only
/// when it is `Ok`. The verdict then demands that every message your sink
/// answered `Sent` for was accepted here, in per-key order. Get one with
/// [`App::downstream`](super::App::downstream).
#[derive(Debug, Clone, Default)]
pub struct Downstream {
    state: Arc<Mutex<DownState>>,
}

impl Downstream {
    /// Hands `msg` to the destination and waits for its acknowledgement:
    /// `Ok` once it has it durably (it survives the crash of your
    /// process). During a [`sink-timeout`](super::FaultKind::SinkTimeout)
    /// fault the acknowledgement times out: `Err(Timeout)`, the message
    /// lost in transit (the first of the fault) or arrived late (the next).
    #[must_use = "answer Sent only when the destination acknowledged"]
    pub fn accept(&self, msg: &OutboxMessage) -> Result<(), Timeout> {
        let mut s = lock(&self.state);
        let arrived = Received {
            id: msg.id.clone(),
            key: msg.key.clone(),
            topic: msg.topic.clone(),
        };
        if s.timeouts > 0 {
            s.timeouts -= 1;
            let n = s.answered;
            s.answered += 1;
            if n == 0 {
                s.fired += 1;
            } else {
                s.received.push(arrived);
            }
            return Err(Timeout);
        }
        s.received.push(arrived);
        Ok(())
    }

    /// Everything accepted, in order, repeats (and late arrivals) included.
    pub fn received(&self) -> Vec<Received> {
        lock(&self.state).received.clone()
    }

    /// Starts a timeout fault: the next `acks` acknowledgements time out.
    pub(crate) fn time_out(&self, acks: i64) {
        let mut s = lock(&self.state);
        s.timeouts = acks;
        s.answered = 0;
    }

    /// Timeout faults that met an `accept` since the last call.
    pub(crate) fn take_fired(&self) -> u64 {
        std::mem::take(&mut lock(&self.state).fired)
    }
}
