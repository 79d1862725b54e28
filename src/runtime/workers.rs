//! Queued processing, driven by the dispatcher thread.
//!
//! Transactional consumers' rows are processed in batches inside the
//! writer's transaction (`delivery::process_due`): up to `process_batch`
//! due rows, each handler in its own savepoint, one commit for all, sent as
//! a rider so that it shares the commit of whatever callers write next. No
//! lease, no claim commit: nothing else writes while the batch runs.
//!
//! Effectful consumers' rows need a committed claim (attempt counted, lease
//! recorded) before their external step runs, on a worker thread, outside
//! any transaction. The dispatcher claims no more of them than there are
//! idle workers, so nothing claimed sits waiting while its lease runs out.
//!
//! With nothing to do the dispatcher sleeps until its consumers' next row
//! comes due (`store::due::inbox`, read by the same writer job that found
//! nothing), at most `poll_interval`: a `receive`, a worker finishing, or
//! the checkpointer's watch (another process's commit, a clock step) wakes
//! it sooner. It never polls, so an idle engine's dispatcher is asleep.

use crate::escape::Esc;
use std::collections::HashMap;
use std::panic::{self, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};

use crate::builder::ConsumerKind;
use crate::clock::{self, Clock};
use crate::config::Config;
use crate::delivery::{self, attempt_of, finish, panic_message, run_user_step, Attempt, Env};
use crate::error::{Error, Result};
use crate::failpoint;
use crate::guard::UserCodeGuard;
use crate::handler::{idempotency_key, EffectContext, Handler, Tx};
use crate::message::{Failure, Outcome};
use crate::runtime::writer::{WriterCtx, WriterHandle};
use crate::store::due::{self, NextDue};
use crate::store::inflight::{ClaimMarks, ClaimSlot, NoInflightLog};
use crate::store::queue::{self, Claimed};

/// A registered consumer.
pub(crate) struct Consumer {
    pub name: String,
    pub kind: ConsumerKind,
}

/// Leases this process holds, with deadlines on the monotonic clock: a
/// wall-clock jump can neither expire a live lease early nor keep a dead one.
#[derive(Debug, Default)]
pub(crate) struct Leases(Mutex<HashMap<i64, Lease>>);

/// One lease this process holds.
#[derive(Debug, Clone, Copy)]
struct Lease {
    token: i64,
    deadline: Instant,
    /// Its worker is done with it and could not record the result (the
    /// row is the reaper's once the lease runs out).
    given_up: bool,
}

/// What the process knows of a row's lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LeaseState {
    /// Not held by this process (left behind, or inserted by hand): judge
    /// by the stored `lease_until`.
    Unknown,
    Live,
    Expired,
}

impl Leases {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<i64, Lease>> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn insert(&self, row_id: i64, token: i64, deadline: Instant) {
        self.lock().insert(
            row_id,
            Lease {
                token,
                deadline,
                given_up: false,
            },
        );
    }

    pub fn remove(&self, row_id: i64, token: Option<i64>) {
        let mut map = self.lock();
        if map.get(&row_id).map(|l| Some(l.token)) == Some(token) {
            map.remove(&row_id);
        }
    }

    /// The worker holding `row_id` with `token` is done with it without
    /// having settled it.
    fn give_up(&self, row_id: i64, token: i64) {
        if let Some(lease) = self.lock().get_mut(&row_id) {
            if lease.token == token {
                lease.given_up = true;
            }
        }
    }

    /// The deadline of the lease this process holds on `row_id` with
    /// `token`, if it holds it.
    pub fn deadline(&self, row_id: i64, token: Option<i64>) -> Option<Instant> {
        match self.lock().get(&row_id) {
            Some(l) if Some(l.token) == token => Some(l.deadline),
            _ => None,
        }
    }

    /// Test support (feature `testkit`): every lease this process holds
    /// is due by `now`, as if its step had outlived it; the next reaper
    /// pass expires them. The testkit's `lease-expiry` fault, without
    /// waiting out a real lease.
    #[cfg(feature = "testkit")]
    pub fn expire_all(&self, now: Instant) {
        for lease in self.lock().values_mut() {
            lease.deadline = lease.deadline.min(now);
        }
    }

    /// Test support (feature `testkit`): the leases whose worker gave up
    /// are due by `now`, and whether there was one. No step runs under
    /// them, so nothing but the wait is skipped: the testkit settles a
    /// claim whose `apply` met a full disk without waiting out its lease.
    #[cfg(feature = "testkit")]
    pub fn expire_given_up(&self, now: Instant) -> bool {
        let mut any = false;
        for lease in self.lock().values_mut().filter(|l| l.given_up) {
            lease.deadline = lease.deadline.min(now);
            any = true;
        }
        any
    }

    pub fn state(&self, row_id: i64, token: Option<i64>, now: Instant) -> LeaseState {
        match self.lock().get(&row_id) {
            Some(l) if Some(l.token) == token => {
                if now >= l.deadline {
                    LeaseState::Expired
                } else {
                    LeaseState::Live
                }
            }
            _ => LeaseState::Unknown,
        }
    }
}

/// What the dispatcher, the workers and the reaper share.
pub(crate) struct Shared {
    pub path: PathBuf,
    pub writer: WriterHandle,
    pub config: Config,
    pub clock: Arc<dyn Clock>,
    pub consumers: HashMap<String, Arc<Consumer>>,
    pub leases: Arc<Leases>,
    pub stopping: AtomicBool,
    pub wake_tx: Sender<()>,
    pub wake_rx: Receiver<()>,
    /// Wakes the reaper to look at its timers again (new leases, rows
    /// changed by another process, the clock stepped).
    pub reaper_wake_tx: Sender<()>,
    pub reaper_wake_rx: Receiver<()>,
    /// True while the reaper's timer fires no later than any lease claimed
    /// from now on would expire (see `reaper::reap`); the dispatcher wakes
    /// it after a claim when false.
    pub reaper_armed: AtomicBool,
    pub in_flight: AtomicUsize,
    /// The next claim's lease token. Starts at a random base
    /// (`schema::lease_token_base`), not 1, so that tokens are unique
    /// across processes: were two engines ever on one file, equal tokens
    /// would let each one's claim pass the other's fence.
    pub next_token: AtomicI64,
}

impl Shared {
    /// Wakes the dispatcher (new rows, a worker became free, shutdown).
    pub fn wake(&self) {
        let _ = self.wake_tx.try_send(());
    }

    /// Wakes the reaper (see [`Shared::reaper_armed`]).
    pub fn wake_reaper(&self) {
        let _ = self.reaper_wake_tx.try_send(());
    }
}

/// How soon the dispatcher or the relay looks again when its read of the
/// next due time failed (`NextDue::partial`).
pub(crate) const PARTIAL_RECHECK: std::time::Duration = std::time::Duration::from_secs(1);

/// Notices an engine clock that does not follow time passing (a stopped
/// `ManualClock` in tests): a due time just ahead of such a clock is never
/// reached, so a sleep until it would end at once, again and again (a
/// clock stopped 5 ms short of a retry woke the dispatcher ~400 times a
/// second, each a writer job). While the clock lags, a sleep is at least
/// [`Stalled::FLOOR`] (the polling rate before issue 33), or the cap if
/// shorter. A real clock follows within a millisecond: never floored.
pub(crate) struct Stalled {
    base: (i64, std::time::Instant),
    stalled: bool,
}

impl Stalled {
    pub const FLOOR: std::time::Duration = std::time::Duration::from_millis(250);
    /// How much time passing one judgement needs (the clock's milliseconds
    /// are whole).
    const SPAN: std::time::Duration = std::time::Duration::from_millis(50);

    pub fn new(now_ms: i64) -> Self {
        Stalled {
            base: (now_ms, std::time::Instant::now()),
            stalled: false,
        }
    }

    /// `wait`, floored while the clock, read as `now_ms`, lags.
    pub fn wait(
        &mut self,
        now_ms: i64,
        wait: std::time::Duration,
        cap: std::time::Duration,
    ) -> std::time::Duration {
        let real = self.base.1.elapsed();
        if real >= Self::SPAN {
            self.stalled = now_ms.saturating_sub(self.base.0) < clock::millis(real) / 2;
            self.base = (now_ms, std::time::Instant::now());
        }
        if self.stalled {
            wait.max(Self::FLOOR.min(cap))
        } else {
            wait
        }
    }
}

/// How long queued processing, caught up, waits for more messages before
/// its next batch: a few milliseconds of latency for far fewer pages per
/// message while callers keep receiving.
const LINGER: std::time::Duration = std::time::Duration::from_millis(10);

/// The dispatcher thread's body.
pub(crate) fn dispatch(shared: Arc<Shared>, work: Sender<Claimed>) {
    let (mut transactional, mut names) = by_kind(&shared);
    // Rows whose step failed the last batch; held back by the next one.
    let held: Arc<Mutex<Vec<Claimed>>> = Arc::default();
    let mut stalled = Stalled::new(shared.clock.now_ms());
    while !shared.stopping.load(Ordering::Acquire) {
        // When the next row comes due, as read by this round's jobs: what
        // the dispatcher sleeps until when it found nothing to do.
        let mut round = Round::default();
        if !transactional.is_empty() {
            // Rotate so that one busy consumer does not starve the others.
            transactional.rotate_left(1);
            match process_round(&shared, &transactional, &held) {
                Turn::Went(r) => round = r,
                Turn::Again => continue,
                Turn::Stop => return,
            }
        }
        let free = shared
            .config
            .workers
            .saturating_sub(shared.in_flight.load(Ordering::Acquire));
        if free > 0 && !names.is_empty() {
            // Rotate so that one busy consumer does not starve the others.
            names.rotate_left(1);
            match claim_round(&shared, &names, free, &work) {
                Turn::Went(r) => {
                    round.next = round.next.min(r.next);
                    round.claimed_any |= r.claimed_any;
                }
                Turn::Again => continue,
                Turn::Stop => return,
            }
        }
        if !round.claimed_any {
            // Asleep until the next row comes due, a commit of this engine
            // or a worker wakes it, or the checkpointer saw another
            // process change the file (see `checkpoint::Watch`);
            // `poll_interval` bounds the sleep.
            let now_ms = shared.clock.now_ms();
            let wait = round
                .next
                .wait(now_ms, shared.config.poll_interval, PARTIAL_RECHECK);
            let wait = stalled.wait(now_ms, wait, shared.config.poll_interval);
            let _ = shared.wake_rx.recv_timeout(wait);
        }
    }
}

/// What one of the dispatcher's steps found: whether it claimed (or
/// processed) anything, so more may be due at once, and when the next row
/// comes due.
#[derive(Default)]
struct Round {
    claimed_any: bool,
    next: NextDue,
}

/// How the dispatcher goes on after a step.
enum Turn {
    /// To the next step of this round.
    Went(Round),
    /// To the next round at once (a failure already waited, or a row is
    /// held back).
    Again,
    /// The engine is closing.
    Stop,
}

/// Transactional consumers with their handlers, by name.
type Transactional = Vec<(String, Arc<dyn Handler>)>;

/// The engine's consumers in name order: transactional ones with their
/// handlers, and the names of the effectful ones.
fn by_kind(shared: &Shared) -> (Transactional, Vec<String>) {
    let mut consumers: Vec<&Arc<Consumer>> = shared.consumers.values().collect();
    consumers.sort_by(|a, b| a.name.cmp(&b.name));
    let mut transactional: Transactional = Vec::new();
    let mut names: Vec<String> = Vec::new();
    for consumer in consumers {
        match &consumer.kind {
            ConsumerKind::Transactional(h) => {
                transactional.push((consumer.name.clone(), Arc::clone(h)))
            }
            ConsumerKind::Effectful(_) => names.push(consumer.name.clone()),
        }
    }
    (transactional, names)
}

/// One batch of the transactional consumers' due rows, processed in one
/// transaction.
fn process_round(
    shared: &Arc<Shared>,
    transactional: &[(String, Arc<dyn Handler>)],
    held: &Arc<Mutex<Vec<Claimed>>>,
) -> Turn {
    let holding = lock(held).len();
    match process_batch(shared, transactional.to_vec(), Arc::clone(held)) {
        // A full batch: more may be due at once.
        Ok((n, due)) => {
            lock(held).clear();
            let mut claimed_any = n >= shared.config.process_batch;
            if n > 0 && !claimed_any {
                // Caught up while messages keep arriving: let a batch's
                // worth gather rather than add one message's pages to
                // every commit of the callers receiving them.
                std::thread::sleep(LINGER);
                while shared.wake_rx.try_recv().is_ok() {}
                claimed_any = true;
            }
            Turn::Went(Round {
                claimed_any,
                next: due,
            })
        }
        Err(Error::Closed) => Turn::Stop,
        // A row to hold back: the next batch goes on without it.
        Err(e) if lock(held).len() > holding => {
            log::warn!(
                "postroom dispatcher: processing a batch failed: {}",
                Esc(&e)
            );
            Turn::Again
        }
        Err(e) => {
            // The storage failed, not a message: nothing was counted. Wait
            // before the next try, so a failure that lasts does not spin.
            log::warn!(
                "postroom dispatcher: processing a batch failed: {}",
                Esc(&e)
            );
            let _ = shared
                .wake_rx
                .recv_timeout(shared.config.storage_retry_delay());
            Turn::Again
        }
    }
}

/// Claims up to `free` due rows of the effectful consumers `names` (in
/// that order) under one lease token, and hands them to the workers.
fn claim_round(
    shared: &Arc<Shared>,
    names: &[String],
    free: usize,
    work: &Sender<Claimed>,
) -> Turn {
    let lease = shared.config.lease;
    let lease_ms = clock::millis(lease);
    let order = names.to_vec();
    let token = shared.next_token.fetch_add(1, Ordering::Relaxed);
    let started = Instant::now();
    let result = shared.writer.submit_uncounted(move |w| {
        let now = w.clock.now_ms();
        let until = now.saturating_add(lease_ms);
        let max_attempts = w.config.max_attempts;
        let mut claimed = Vec::new();
        for name in &order {
            let want = free - claimed.len();
            if want == 0 {
                break;
            }
            let due = queue::Due {
                consumer: name,
                order: w.config.key_order(name),
                limit: want,
                now_ms: now,
                max_attempts,
            };
            claimed.extend(
                queue::claim(w.conn, due, until, token)
                    .map_err(|e| Error::sqlite("claim due messages", e))?,
            );
        }
        // Nothing to claim: when to look again. (Only then does the
        // dispatcher sleep; with every worker busy, the next one to finish
        // wakes it.)
        let mut next = NextDue::default();
        if claimed.is_empty() {
            for name in &order {
                next = next.min(next_due(w.conn, name, now));
            }
        }
        Ok((claimed, next))
    });
    // A failure here leaves the rows claimed but unstarted: their leases
    // expire and the reaper makes them due again.
    let result = result.and_then(|claims| failpoint::hit("dispatch.after_claim").map(|()| claims));
    match result {
        Ok((claims, next)) => {
            // A lease the reaper's timer may not cover yet.
            if !claims.is_empty() && !shared.reaper_armed.swap(true, Ordering::SeqCst) {
                shared.wake_reaper();
            }
            let claimed_any = !claims.is_empty();
            for claim in claims {
                shared.leases.insert(claim.row_id, token, started + lease);
                shared.in_flight.fetch_add(1, Ordering::AcqRel);
                if work.send(claim).is_err() {
                    return Turn::Stop;
                }
            }
            Turn::Went(Round { claimed_any, next })
        }
        Err(Error::Closed) => Turn::Stop,
        Err(e) => {
            // As for a failed batch: wait before the next try, so a failure
            // that lasts does not spin, nor sleeps `poll_interval` (no due
            // time was read).
            log::warn!("postroom dispatcher: claiming failed: {}", Esc(&e));
            // Claims may have committed before the failure: their leases
            // are the reaper's to time.
            shared.wake_reaper();
            let _ = shared
                .wake_rx
                .recv_timeout(shared.config.storage_retry_delay());
            Turn::Again
        }
    }
}

/// Processes one batch of transactional consumers' due rows (see the
/// module docs). Returns how many rows it settled and, when none, when
/// their next row comes due. A row whose handler
/// rolled the whole transaction back is counted as a failed attempt when
/// the writer runs the batch again.
fn process_batch(
    shared: &Shared,
    consumers: Vec<(String, Arc<dyn Handler>)>,
    held: Arc<Mutex<Vec<Claimed>>>,
) -> Result<(usize, NextDue)> {
    let limit = shared.config.process_batch;
    let mut poisoned: Vec<Claimed> = Vec::new();
    let (done, next) = shared.writer.submit_rider(move |w| {
        let list: Vec<(&str, &dyn Handler)> =
            consumers.iter().map(|(n, h)| (n.as_str(), &**h)).collect();
        let mut env = w.env();
        let mut held = lock(&held);
        let done = delivery::process_due(&mut env, &list, limit, &mut poisoned, &mut held)?;
        failpoint::hit("process.after_batch")?;
        // Nothing due: when to look again (only then does the dispatcher
        // sleep; a partial batch lingers and looks again at once).
        let mut next = NextDue::default();
        if done.is_empty() {
            let now = w.clock.now_ms();
            for (name, _) in &list {
                next = next.min(next_due(w.conn, name, now));
            }
        }
        Ok((done, next))
    })?;
    for p in &done {
        crate::telemetry::outcome(&p.consumer, &p.outcome);
        log::debug!(
            consumer = p.consumer.as_str(), message_id = p.message_id.as_str();
            "postroom: {}/{} (row {}): {}",
            Esc(&p.consumer),
            Esc(&p.message_id),
            p.row_id,
            Esc(format_args!("{:?}", p.outcome))
        );
    }
    Ok((done.len(), next))
}

/// When `consumer`'s next row comes due; a failed read is logged and
/// taken as partial (looked at again within [`PARTIAL_RECHECK`]) rather
/// than failing the job it rides in.
fn next_due(conn: &rusqlite::Connection, consumer: &str, now_ms: i64) -> NextDue {
    due::inbox(conn, consumer, now_ms).unwrap_or_else(|e| {
        log::warn!(
            "postroom dispatcher: reading when {:?} next has a row due: {}",
            Esc(consumer),
            Esc(&e)
        );
        NextDue {
            at: None,
            partial: true,
        }
    })
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A worker thread's body: processes claimed rows until the dispatcher is
/// gone. Once stopping, rows not yet started are handed back unattempted.
pub(crate) fn work(shared: Arc<Shared>, claims: Receiver<Claimed>, mut slot: ClaimSlot) {
    while let Ok(claim) = claims.recv() {
        let (row_id, token) = (claim.row_id, claim.token);
        let settled = if shared.stopping.load(Ordering::Acquire) {
            match release(&shared, row_id, token) {
                Ok(()) => true,
                Err(e) => {
                    log::warn!(
                        "postroom worker: releasing row {row_id}: {}; recovered at next open",
                        Esc(&e)
                    );
                    false
                }
            }
        } else {
            run(&shared, claim, &mut slot)
        };
        // A row not settled keeps its lease on the monotonic clock, for
        // the reaper.
        if settled {
            shared.leases.remove(row_id, Some(token));
        } else {
            shared.leases.give_up(row_id, token);
        }
        shared.in_flight.fetch_sub(1, Ordering::AcqRel);
        shared.wake();
    }
}

/// Runs a claim; true when the row is no longer the claim's (finished,
/// handed back, or taken over).
fn run(shared: &Shared, claim: Claimed, slot: &mut ClaimSlot) -> bool {
    let row_id = claim.row_id;
    let Some(consumer) = shared.consumers.get(&claim.consumer) else {
        log::error!(
            "postroom worker: row {row_id}: no consumer {:?}; retried once its lease expires",
            Esc(&claim.consumer)
        );
        return false;
    };
    let message_id = claim.msg.id.clone();
    match process(shared, consumer, claim, slot) {
        Ok(Some(outcome)) => {
            crate::telemetry::outcome(&consumer.name, &outcome);
            log::debug!(
                consumer = consumer.name.as_str(), message_id = message_id.as_str();
                "postroom worker: row {row_id}: {}",
                Esc(format_args!("{outcome:?}"))
            );
            true
        }
        Ok(None) => {
            log::warn!(
                "postroom worker: row {row_id}: lease lost (expired and claimed again); \
                 this attempt's result was discarded"
            );
            true
        }
        Err(Error::Closed) => {
            log::warn!("postroom worker: row {row_id}: engine closed; recovered at next open");
            false
        }
        // The external call has happened: the attempt stays counted, and
        // the lease expires.
        Err(e) => {
            log::error!(
                "postroom worker: row {row_id}: {}; retried once its lease expires",
                Esc(&e)
            );
            false
        }
    }
}

/// Hands a claim back uncounted, due as it was (its step never started).
fn release(shared: &Shared, row_id: i64, token: i64) -> Result<()> {
    shared.writer.submit_uncounted(move |w| {
        queue::release(w.conn, row_id, token)
            .map(drop)
            .map_err(|e| Error::sqlite("release claim", e))
    })
}

/// Runs one claimed row. `Ok(None)`: the lease was lost, nothing recorded.
fn process(
    shared: &Shared,
    consumer: &Consumer,
    claim: Claimed,
    slot: &mut ClaimSlot,
) -> Result<Option<Outcome>> {
    match &consumer.kind {
        // The dispatcher claims effectful consumers' rows only.
        ConsumerKind::Transactional(_) => Err(Error::Aborted {
            reason: "a transactional consumer's row was claimed; it is processed in batches".into(),
        }),
        ConsumerKind::Effectful(handler) => {
            let ctx = EffectContext {
                consumer: &claim.consumer,
                attempt: claim.attempt,
                idempotency_key: idempotency_key(&claim.consumer, &claim.msg),
            };
            slot.started(claim.row_id, claim.token)
                .map_err(|e| Error::io("mark claim started", e))?;
            let output = panic::catch_unwind(AssertUnwindSafe(|| handler.effect(&ctx, &claim.msg)))
                .unwrap_or_else(|panic| {
                    Err(Failure::retry(format_args!(
                        "effect panicked: {}",
                        panic_message(panic.as_ref())
                    )))
                });
            slot.finished()
                .map_err(|e| Error::io("mark claim finished", e))?;
            let handler = Arc::clone(handler);
            shared.writer.submit_uncounted(move |w| match output {
                Ok(output) => complete(w, &claim, |tx| handler.apply(tx, &claim.msg, output)),
                Err(failure) => record_failure(w, &claim, failure),
            })
        }
    }
}

/// The transactional step of a claimed row.
fn complete(
    w: &mut WriterCtx<'_>,
    claim: &Claimed,
    body: impl FnOnce(&mut Tx<'_>) -> Result<(), Failure>,
) -> Result<Option<Outcome>> {
    let now = w.clock.now_ms();
    complete_claim(w.conn, w.config, w.guard, now, claim, w.engine_file, body)
}

/// Records a failed external step.
fn record_failure(
    w: &mut WriterCtx<'_>,
    claim: &Claimed,
    failure: Failure,
) -> Result<Option<Outcome>> {
    let now = w.clock.now_ms();
    fenced(w.conn, w.config, w.guard, now, claim, |env, at| {
        finish(env, at, Some(failure))
    })
}

/// Runs the transactional step of `claim` and records its result, if the
/// claim's lease token still holds the row. Must run inside a transaction.
/// `marks` records that this claim's user code runs (see
/// [`crate::store::inflight`]), so a crash inside it is counted and a crash while
/// it only waited is not.
pub(crate) fn complete_claim(
    conn: &rusqlite::Connection,
    config: &Config,
    guard: &UserCodeGuard,
    now_ms: i64,
    claim: &Claimed,
    marks: &mut dyn ClaimMarks,
    body: impl FnOnce(&mut Tx<'_>) -> Result<(), Failure>,
) -> Result<Option<Outcome>> {
    fenced(conn, config, guard, now_ms, claim, |env, at| {
        marks
            .started(claim.row_id, claim.token)
            .map_err(|e| Error::io("mark claim started", e))?;
        let failure = run_user_step(env, at, body);
        let cleared = marks.finished();
        let failure = failure?;
        cleared.map_err(|e| Error::io("mark claim finished", e))?;
        finish(env, at, failure)
    })
}

/// Runs `step` only while `claim`'s lease token still holds the row, so a
/// worker whose lease was reaped and re-claimed cannot complete it twice.
/// `Ok(None)`: the lease was lost and nothing was written.
fn fenced(
    conn: &rusqlite::Connection,
    config: &Config,
    guard: &UserCodeGuard,
    now_ms: i64,
    claim: &Claimed,
    step: impl FnOnce(&mut Env<'_>, Attempt<'_>) -> Result<Outcome>,
) -> Result<Option<Outcome>> {
    if !queue::lease_held(conn, claim.row_id, claim.token)
        .map_err(|e| Error::sqlite("check lease", e))?
    {
        return Ok(None);
    }
    // The claim already counted this attempt: no in-flight marker needed.
    let mut log = NoInflightLog;
    let mut env = Env {
        conn,
        config,
        now_ms,
        log: &mut log,
        guard,
    };
    step(&mut env, attempt_of(claim)).map(Some)
}
