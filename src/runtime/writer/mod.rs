//! The write connection, and how jobs reach it: group commit with the
//! caller as leader when nobody else is writing.
//!
//! The connection lives behind a mutex. A caller that finds it free (and no
//! writer thread waiting for it) *leads*: it takes the lock, adds whatever
//! other callers have queued (up to `max_batch`), runs the batch on its own
//! thread and answers everyone. A caller that finds it taken queues its job;
//! the writer thread picks queued jobs up, takes the lock once the leader is
//! done, and runs them as the next batch. A lone caller thus never waits
//! on a thread hand-off. Concurrent callers share one commit: either
//! leader first waits, at most as long as the last `COMMIT` took, for the
//! callers the last batch answered to hand in their next jobs ([`gather`]).
//!
//! Each batch runs in one `BEGIN IMMEDIATE … COMMIT`, each job in its own
//! savepoint (a lone job in the transaction itself), and callers hear back
//! only after `COMMIT` returned, so one fsync covers the whole group.
//! Invariants:
//! * only the holder of the lock touches the connection;
//! * a job's `Err` rolls back its own writes and nothing else (its
//!   savepoint; a lone job's whole transaction);
//! * if `COMMIT` fails, or the transaction disappears mid-batch after an
//!   I/O error (SQLite rolls back by itself after some), every job of the
//!   batch is answered with an error: nothing of it was acknowledged;
//! * if it disappears because a job's writes met a full disk, that job is
//!   answered `StorageFull` and the others run again in a fresh
//!   transaction (after the WAL is given back), as for a rollback by user
//!   code below: one message too big for the disk does not fail the small
//!   ones beside it. A real filesystem fills at `COMMIT` instead (pages
//!   reach the WAL then), where nobody knows whose writes did not fit: the
//!   jobs left then commit one by one, a run-once job that already ran
//!   answering `StorageFull` (nothing of it was stored). Once per batch:
//!   after a second full disk, every job left is answered `StorageFull`;
//! * if a job's user code rolls the whole transaction back (a trigger's
//!   `RAISE(ROLLBACK)`, `INSERT OR ROLLBACK`: the job's doing, not the
//!   storage's), the batch runs again in a fresh transaction: jobs that
//!   can run again do (a delivery whose handler did it records that as a
//!   failed attempt), the others are answered with an error — so one
//!   message's SQL never fails the messages that shared its commit;
//! * a job queued before the writer was told to stop is run; a job queued
//!   after it had closed the connection is answered `Closed`.
//!
//! A *rider* (queued processing) is work nobody waits on: it joins the next
//! callers' batch, sharing their commit, and runs in a batch of its own only
//! once callers have left the writer alone for [`BACKGROUND_GRACE`]. So
//! processing received messages costs the callers who receive them no
//! commit of its own.

use crate::escape::Esc;
use std::cell::{Cell, RefCell};
use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError};
use rusqlite::Connection;

use crate::clock::Clock;
use crate::config::Config;
use crate::delivery::exec;
use crate::error::{Error, Result};
use crate::failpoint;
use crate::guard::UserCodeGuard;
use crate::store::inflight::EngineFile;

mod job;
mod trigger;
pub(crate) use job::{job, rerunnable_job, Answered, Job};
use job::{take_queued, ABANDONED, QUEUED};
pub(crate) use trigger::CheckpointTrigger;

/// What a job can use while it runs.
pub(crate) struct WriterCtx<'a> {
    pub conn: &'a Connection,
    pub config: &'a Config,
    pub clock: &'a dyn Clock,
    pub engine_file: &'a mut EngineFile,
    pub guard: &'a UserCodeGuard,
}

impl WriterCtx<'_> {
    /// What a delivery runs against in this batch: its clock read now, the
    /// engine file as the in-flight marker.
    pub fn env(&mut self) -> crate::delivery::Env<'_> {
        crate::delivery::Env {
            conn: self.conn,
            config: self.config,
            now_ms: self.clock.now_ms(),
            log: &mut *self.engine_file,
            guard: self.guard,
        }
    }
}

/// How long the writer, with nothing else to do, waits for a caller's job
/// before it starts a background job.
const BACKGROUND_GRACE: Duration = Duration::from_millis(1);
/// The longest background work is put off when callers keep the writer busy.
const BACKGROUND_MAX_DEFER: Duration = Duration::from_millis(25);
/// The longest a batch's leader (the writer thread or a leading caller)
/// waits, before the batch, for callers it expects to hand in a job (see
/// [`gather`]).
const GATHER: Duration = Duration::from_micros(200);

/// [`Core::callers_last_batch`] while a callers' batch runs.
const BATCH_RUNNING: u64 = u64::MAX;

/// How long giving the WAL back after a full disk waits for readers to
/// leave the frames it would drop. The writer's lock is held meanwhile,
/// and the storage is full anyway; whatever is not given back now is at
/// the next failure, the next commit or the next idle tick.
const GIVE_BACK_WAIT: Duration = Duration::from_millis(50);

/// The longest the writer's own copy-back after a commit waits for
/// readers (see [`WriterState::copy_back_inline`]): the engine's own reads
/// are shorter; a reader that stays longer is another process's snapshot,
/// and waiting for it would hold every commit up.
const INLINE_CHECKPOINT_WAIT: Duration = Duration::from_millis(5);
/// The longest the last copy-back, at close, waits for readers.
const CLOSE_CHECKPOINT_WAIT: Duration = Duration::from_millis(100);
/// After a copy-back a reader kept from completing, the next try waits at
/// least this long, doubling up to [`BLOCKED_BACKOFF_MAX`]: a pinned WAL
/// is not copied back by trying after every commit.
const BLOCKED_BACKOFF_MIN: Duration = Duration::from_millis(10);
/// The longest a pinned WAL waits between copy-back tries: about how long
/// it stays large after the reader left.
const BLOCKED_BACKOFF_MAX: Duration = Duration::from_secs(1);
/// The WAL's cap, in multiples of the writer's own copy-back bound
/// ([`WalBounds::inline_pages`]; about 128 MiB on a large disk, half the
/// filesystem on a small one). Only a reader holding an old snapshot gets
/// it there; past it, commits go on (refusing them would turn a DB
/// browser left open into an outage) but a warning names the cause, once
/// per doubling, and `postroom_wal_over_cap_total` counts the commits.
/// The filesystem's size stays the hard limit: a full disk answers the
/// retryable `Error::StorageFull`.
pub(crate) const WAL_CAP_FACTOR: c_int = 4;

thread_local! {
    /// The writers (by address) whose lock this thread holds: a caller
    /// inside a handler must not wait for a batch that waits for it.
    static HELD: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
    /// Frames in the WAL after the last commit on this thread, noted by
    /// [`note_wal_pages`] (the hook runs inside `COMMIT`, on the
    /// committing thread) and taken right after `COMMIT` returns.
    static WAL_PAGES: Cell<c_int> = const { Cell::new(0) };
}

/// The write connection's WAL hook. It replaces SQLite's automatic
/// checkpoint, which copied the WAL back inside whichever commit crossed
/// 1000 frames — a caller's, which then waited for the copy and its fsync.
pub(crate) fn note_wal_pages(wal: &mut rusqlite::hooks::Wal, pages: c_int) -> rusqlite::Result<()> {
    // A handler may write to an attached database; its WAL is not ours.
    if wal.name() == c"main" {
        WAL_PAGES.set(pages);
    }
    Ok(())
}

/// True when this thread holds some writer's lock: it runs inside a batch,
/// in a handler (of this engine or another).
fn holds_a_writer() -> bool {
    HELD.with(|held| !held.borrow().is_empty())
}

/// What the writer thread and leading callers share.
pub(crate) struct Core {
    state: Mutex<Option<WriterState>>,
    /// How many threads (the writer thread with a queued job, the
    /// checkpointer) wait for the lock; callers queue rather than lead
    /// while any does, so they cannot starve.
    writer_waiting: AtomicUsize,
    /// When callers' last batch ended, in ns since `epoch`, or
    /// [`BATCH_RUNNING`]: background work waits until callers have been
    /// quiet for [`BACKGROUND_GRACE`].
    callers_last_batch: AtomicU64,
    epoch: Instant,
    /// The rider waiting for a batch to join (at most one).
    rider: Mutex<Option<Box<dyn Job>>>,
    /// Callers between handing their job in and hearing back (see
    /// [`WriterHandle::caller`]), and their peak since the last batch
    /// began: how many jobs the next batch can expect.
    callers: CallerCount,
}

/// Callers inside `submit` (between handing their job in and hearing
/// back), and the most there were at once since the last batch began.
#[derive(Debug, Default)]
struct CallerCount {
    inside: AtomicUsize,
    peak: AtomicUsize,
}

impl CallerCount {
    fn enter(&self) {
        let inside = self.inside.fetch_add(1, Ordering::AcqRel) + 1;
        self.peak.fetch_max(inside, Ordering::AcqRel);
    }

    fn leave(&self) {
        self.inside.fetch_sub(1, Ordering::AcqRel);
    }

    /// How many jobs a batch beginning now can expect: the callers inside
    /// now, or, if more, the most there were at once since the last batch
    /// began. Callers that the last batch answered have left `submit`, but
    /// a caller looping on `deliver` is back within microseconds; counting
    /// only those inside would make concurrent callers alternate in two
    /// half-batches. The peak starts again from the callers inside now, so
    /// a caller that stopped is expected by one batch at most.
    fn expected_jobs(&self) -> usize {
        let inside = self.inside.load(Ordering::Acquire);
        self.peak.swap(inside, Ordering::AcqRel).max(inside)
    }
}

impl Core {
    pub fn new(state: WriterState) -> Arc<Core> {
        Arc::new(Core {
            state: Mutex::new(Some(state)),
            writer_waiting: AtomicUsize::new(0),
            callers_last_batch: AtomicU64::new(0),
            epoch: Instant::now(),
            rider: Mutex::new(None),
            callers: CallerCount::default(),
        })
    }

    fn take_rider(&self) -> Option<Box<dyn Job>> {
        self.rider.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    fn id(&self) -> usize {
        self as *const Core as usize
    }

    /// True when this thread holds the lock (it runs inside a batch).
    pub fn held_here(&self) -> bool {
        let id = self.id();
        HELD.with(|held| held.borrow().contains(&id))
    }

    fn lock(&self) -> Held<'_> {
        Held::new(self, self.state.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// The lock, for the writer thread: callers queue instead of leading
    /// while it waits (the mutex is not fair; a caller looping on `deliver`
    /// would otherwise win it again and again).
    fn lock_as_writer(&self) -> Held<'_> {
        self.writer_waiting.fetch_add(1, Ordering::AcqRel);
        let held = self.lock();
        self.writer_waiting.fetch_sub(1, Ordering::AcqRel);
        held
    }

    fn try_lock(&self) -> Option<Held<'_>> {
        match self.state.try_lock() {
            Ok(guard) => Some(Held::new(self, guard)),
            Err(TryLockError::Poisoned(p)) => Some(Held::new(self, p.into_inner())),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    /// Runs callers' jobs (not background work), and the rider if one
    /// waits, as one batch, marking the time callers keep the writer busy.
    fn run_callers_batch(&self, state: &mut WriterState, batch: &mut Vec<Box<dyn Job>>) {
        batch.extend(self.take_rider());
        self.callers_last_batch
            .store(BATCH_RUNNING, Ordering::Relaxed);
        state.run_batch(batch);
        let ended = u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(BATCH_RUNNING - 1);
        self.callers_last_batch.store(ended, Ordering::Relaxed);
    }

    fn callers_quiet_for(&self) -> Duration {
        match self.callers_last_batch.load(Ordering::Relaxed) {
            BATCH_RUNNING => Duration::ZERO,
            ended => self
                .epoch
                .elapsed()
                .saturating_sub(Duration::from_nanos(ended)),
        }
    }
}

/// The lock on the writer's state, registered in [`HELD`] while held.
struct Held<'a> {
    core: &'a Core,
    guard: MutexGuard<'a, Option<WriterState>>,
}

impl<'a> Held<'a> {
    fn new(core: &'a Core, guard: MutexGuard<'a, Option<WriterState>>) -> Self {
        // A holder that panicked may have left its batch's transaction open:
        // nobody may read (or build on) what it did not commit.
        if let Some(state) = guard.as_ref() {
            state.roll_back();
        }
        HELD.with(|held| held.borrow_mut().push(core.id()));
        Held { core, guard }
    }
}

impl Held<'_> {
    /// The state; only the writer thread closes it, at its very end, and
    /// leaders are made only while it is open.
    fn state(&mut self) -> &mut WriterState {
        self.guard
            .as_mut()
            .expect("the writer is open while held this way")
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let id = self.core.id();
        HELD.with(|held| {
            let mut held = held.borrow_mut();
            if let Some(at) = held.iter().rposition(|&h| h == id) {
                held.remove(at);
            }
        });
    }
}

/// What other threads hold to send work to the writer.
#[derive(Clone)]
pub(crate) struct WriterHandle {
    core: Arc<Core>,
    commands: Sender<Box<dyn Job>>,
    /// The same queue, for leaders to take other callers' jobs from.
    queued: Receiver<Box<dyn Job>>,
    background: Sender<Box<dyn Job>>,
    /// Rings the writer thread when a rider is left in [`Core::rider`].
    rider_bell: Sender<()>,
    stop: Sender<()>,
    /// Disconnects when the writer thread ends (its sender is dropped).
    alive: Receiver<()>,
    /// The longest a caller holding a writer's lock waits for this one
    /// (see [`WriterHandle::enqueue_job`]).
    busy_timeout: Duration,
}

impl WriterHandle {
    /// Runs `work` in a batch and returns its answer, which comes after that
    /// batch has committed: as the batch's leader when the writer is free,
    /// else in the writer thread's next batch.
    pub fn submit<T, F>(&self, work: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut WriterCtx<'_>) -> Result<T> + Send + 'static,
    {
        self.submit_job(job(work))
    }

    /// [`submit`](Self::submit) for the engine's own threads (relay,
    /// dispatcher, workers, reaper): not counted among the callers a batch
    /// waits for. They come back on their own schedule (the next sink
    /// answer, the next external step), not microseconds after their
    /// answer, so a batch waiting for them would wait its whole window.
    pub fn submit_uncounted<T, F>(&self, work: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut WriterCtx<'_>) -> Result<T> + Send + 'static,
    {
        self.lead_or_enqueue(job(work))
    }

    /// [`submit`](Self::submit) for a job made by [`job`] or
    /// [`rerunnable_job`].
    pub fn submit_job<T>(&self, job: Answered<T>) -> Result<T> {
        let _caller = self.caller();
        self.lead_or_enqueue(job)
    }

    fn lead_or_enqueue<T>(&self, job: Answered<T>) -> Result<T> {
        match self.lead() {
            Some(leader) => leader.run_job(job),
            None => self.enqueue_job(job),
        }
    }

    /// Counts the calling thread among the callers whose jobs the next
    /// batch can wait for, until the guard is dropped.
    pub fn caller(&self) -> CallerGuard<'_> {
        self.core.callers.enter();
        CallerGuard(&self.core)
    }

    /// The lock, if this caller can lead the next batch now.
    pub fn lead(&self) -> Option<Leader<'_>> {
        if self.core.writer_waiting.load(Ordering::Acquire) != 0 {
            return None;
        }
        let held = self.core.try_lock()?;
        // Closed: the queue answers `Closed` once the writer thread is gone.
        held.guard.is_some().then_some(Leader {
            held,
            queued: &self.queued,
        })
    }

    /// Queues a job made by [`job`] or [`rerunnable_job`] and waits for its
    /// answer.
    ///
    /// A caller that holds a writer's lock (it runs in a handler of this or
    /// another engine) waits at most `busy_timeout` for the job to start,
    /// then answers [`Error::Busy`] and the job never runs. Only such a
    /// wait can close a cycle (two engines whose handlers deliver into each
    /// other, each holding its own writer and queued for the other's): a
    /// caller that holds no lock holds nobody up. Bounding exactly those
    /// waits breaks every cycle within the busy timeout, without failing
    /// plain callers that queue behind a long batch. Once the job started,
    /// its batch runs on a thread holding the lock, whose own waits are
    /// bounded the same way, so the answer is waited for.
    pub fn enqueue_job<T>(&self, (job, answer): Answered<T>) -> Result<T> {
        if !holds_a_writer() {
            crossbeam_channel::select! {
                send(self.commands, job) -> sent => sent.map_err(|_| Error::Closed)?,
                recv(self.alive) -> _ => return Err(Error::Closed),
            }
            return self.wait(answer.rx);
        }
        let deadline = Instant::now() + self.busy_timeout;
        let busy = Error::Busy {
            op: "wait, from inside a handler, for another engine's writer (a handler of it \
                 waits for this one's?)",
        };
        crossbeam_channel::select! {
            send(self.commands, job) -> sent => sent.map_err(|_| Error::Closed)?,
            recv(self.alive) -> _ => return Err(Error::Closed),
            default(self.busy_timeout) => return Err(busy),
        }
        crossbeam_channel::select! {
            recv(answer.rx) -> reply => return reply.map_err(|_| Error::Closed)?,
            recv(self.alive) -> _ => return answer.rx.try_recv().map_err(|_| Error::Closed)?,
            default(deadline.saturating_duration_since(Instant::now())) => {}
        }
        match answer
            .claim
            .compare_exchange(QUEUED, ABANDONED, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => Err(busy),
            // Started: its batch is running; the answer follows it.
            Err(_) => self.wait(answer.rx),
        }
    }

    /// Like `submit`, for work that should not hold callers up: it runs when
    /// callers have left the writer alone for a moment (or it has been put
    /// off too long), in a transaction of its own.
    pub fn submit_background<T, F>(&self, work: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut WriterCtx<'_>) -> Result<T> + Send + 'static,
    {
        let (job, answer) = job(work);
        self.background.send(job).map_err(|_| Error::Closed)?;
        self.wait(answer.rx)
    }

    /// Runs `work` as a rider (see the module docs): in the next callers'
    /// batch, or alone once callers leave the writer alone; again when its
    /// transaction is rolled back under it. One rider at a time: the caller
    /// waits for its answer before sending another.
    pub fn submit_rider<T, G>(&self, work: G) -> Result<T>
    where
        T: Send + 'static,
        G: FnMut(&mut WriterCtx<'_>) -> Result<T> + Send + 'static,
    {
        let (job, answer) = rerunnable_job(work);
        let displaced = self
            .core
            .rider
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .replace(job);
        debug_assert!(displaced.is_none(), "one rider at a time");
        // Full: the thread is already rung.
        let _ = self.rider_bell.try_send(());
        self.wait(answer.rx)
    }

    fn wait<T>(&self, answer: Receiver<Result<T>>) -> Result<T> {
        // A job queued after the writer closed is never run, and the queue
        // keeps it (and its reply sender) after the writer is gone; so wait
        // on the writer's life as well as on the answer.
        crossbeam_channel::select! {
            recv(answer) -> reply => reply.map_err(|_| Error::Closed)?,
            recv(self.alive) -> _ => answer.try_recv().map_err(|_| Error::Closed)?,
        }
    }

    /// Asks the writer thread to run what is queued, then close.
    pub fn stop(&self) {
        // The channel holds one stop; a second adds nothing.
        let _ = self.stop.try_send(());
    }

    /// True when this thread is running inside one of this writer's batches.
    pub fn held_here(&self) -> bool {
        self.core.held_here()
    }

    /// Runs `f` while no batch can commit, once callers have left the
    /// writer alone for [`BACKGROUND_GRACE`]: the checkpointer's last pass,
    /// which no commit may race. Waits [`BACKGROUND_MAX_DEFER`] at most for
    /// that quiet; then runs `f` anyway when `force`, else not at all.
    pub fn with_writes_paused<T>(&self, force: bool, f: impl FnOnce() -> T) -> Option<T> {
        let deadline = Instant::now() + BACKGROUND_MAX_DEFER;
        while self.core.callers_quiet_for() < BACKGROUND_GRACE {
            if Instant::now() >= deadline {
                if !force {
                    return None;
                }
                break;
            }
            std::thread::sleep(BACKGROUND_GRACE / 4);
        }
        let _held = self.core.lock_as_writer();
        Some(f())
    }
}

/// A caller counted by [`WriterHandle::caller`].
pub(crate) struct CallerGuard<'a>(&'a Core);

impl Drop for CallerGuard<'_> {
    fn drop(&mut self) {
        self.0.callers.leave();
    }
}

/// A caller holding the writer's lock, about to run a batch.
pub(crate) struct Leader<'a> {
    held: Held<'a>,
    queued: &'a Receiver<Box<dyn Job>>,
}

impl Leader<'_> {
    /// Runs a job made by [`job`] or [`rerunnable_job`], and what other
    /// callers queued, as one batch.
    pub fn run_job<T>(mut self, (own, answer): Answered<T>) -> Result<T> {
        let mut batch = vec![own];
        let core = self.held.core;
        let state = self.held.state();
        gather(core, self.queued, &mut batch, state);
        core.run_callers_batch(state, &mut batch);
        drop(self.held);
        answer.rx.try_recv().map_err(|_| Error::Closed)?
    }

    /// The write connection, outside any transaction: for reads that may
    /// answer a caller without a batch.
    pub fn conn(&mut self) -> &Connection {
        &self.held.state().conn
    }
}

/// Counters for [`Stats`](crate::Stats): how many transactions the writer
/// committed and how many jobs they carried, and who copied the WAL back.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub batches: AtomicU64,
    pub jobs: AtomicU64,
    /// WAL frames appended by commits (see [`CheckpointTrigger::appended`]).
    pub wal_frames: AtomicU64,
    /// Passes the checkpointer made with writes paused.
    pub checkpoints: AtomicU64,
    /// Checkpoints the writer made itself, the checkpointer being behind.
    pub inline_checkpoints: AtomicU64,
    /// Microseconds the checkpointer's paused passes held writes: in all,
    /// and the longest.
    pub paused_us: AtomicU64,
    pub paused_max_us: AtomicU64,
    /// The writer's copy-backs a reader kept from completing.
    pub checkpoints_blocked: AtomicU64,
    /// Handlers that held the writer past `slow_handler`.
    pub slow_handlers: AtomicU64,
}

/// The write connection and what running a batch on it needs.
pub(crate) struct WriterState {
    pub conn: Connection,
    pub config: Config,
    pub clock: std::sync::Arc<dyn Clock>,
    pub engine_file: EngineFile,
    pub guard: UserCodeGuard,
    pub counters: Arc<Counters>,
    /// Set (by an update hook) when a job inserted outbox rows; the relay is
    /// woken once their batch has committed.
    pub outbox_dirty: Arc<AtomicBool>,
    pub relay_wake: Option<Sender<()>>,
    pub checkpoint: CheckpointTrigger,
    /// How long the last `COMMIT` took: the most a batch waits for more
    /// callers' jobs (see [`gather`]).
    pub last_commit: Duration,
}

impl WriterState {
    fn run_batch(&mut self, batch: &mut Vec<Box<dyn Job>>) {
        let outcome =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.execute(batch)))
                .unwrap_or_else(|panic| {
                    Err(Error::Aborted {
                        reason: format!(
                            "batch panicked: {}",
                            crate::delivery::panic_message(panic.as_ref())
                        ),
                    })
                });
        if let Ok(true) = outcome {
            crate::telemetry::group_size(batch.len());
            self.counters.batches.fetch_add(1, Ordering::Relaxed);
            self.counters
                .jobs
                .fetch_add(batch.len() as u64, Ordering::Relaxed);
            if let Some(wake) = &self.relay_wake {
                wake_relay(wake, &self.outbox_dirty);
            }
        } else {
            self.outbox_dirty.store(false, Ordering::Release);
        }
        if let Err(e) = &outcome {
            log::error!(
                "postroom writer: batch of {} failed: {}",
                batch.len(),
                Esc(&e)
            );
            self.roll_back();
            self.checkpoint.note(&outcome);
        }
        if self.checkpoint.full_now() {
            self.give_wal_back();
        }
        for job in batch.drain(..) {
            job.finish(outcome.as_ref().map(|_| ()));
        }
    }

    fn roll_back(&self) {
        if !self.conn.is_autocommit() {
            if let Err(e) = self.conn.execute_batch("ROLLBACK") {
                log::error!("postroom writer: ROLLBACK failed: {e}");
            }
        }
    }

    /// Runs the batch in one transaction: `Ok(true)` once committed,
    /// `Ok(false)` when a lone job failed and its transaction was rolled
    /// back. `Err` means nothing of it may be reported as committed. When
    /// a job's user code rolls the transaction back, the jobs that can run
    /// again do, in a fresh transaction (at most once per job).
    fn execute(&mut self, batch: &mut [Box<dyn Job>]) -> Result<bool> {
        // Jobs that can run again go first: a rollback by any job then
        // undoes only jobs that can run again (and the culprit itself),
        // never a run-once job's work that already ran (an effectful
        // step's apply, a `transaction()` closure), unless another run-once
        // job after it is the culprit.
        batch.sort_by_key(|job| !job.rerunnable());
        let mut live = vec![true; batch.len()];
        // Each run that is rolled back ends one culprit's run of user code
        // (a delivery records the failure without running its handler
        // again; a rider counts the row before going on), so this bound is
        // only reached by jobs that roll back on every run.
        let bound = 2 * batch.len() + self.config.process_batch;
        let mut storage_rerun = false;
        for _ in 0..bound {
            let (culprit, error, reason) = match self.execute_live(batch, &live)? {
                Ran::Done(committed) => return Ok(committed),
                Ran::RolledBackBy(culprit, error) => {
                    let reason = Error::GroupRolledBack {
                        reason: error.to_string(),
                    };
                    (culprit, error, reason)
                }
                Ran::StorageFullIn(culprit, error) => {
                    // The culprit answers with its own error and is done;
                    // the others run again in a fresh transaction, with
                    // the WAL given back first to make room. One that
                    // cannot run again answers with the same retryable
                    // error: nothing of it was stored. Once only: if the
                    // disk is still full on the second run, every job left
                    // answers so (running each in turn into a full disk
                    // would hold the writer for a square of the batch).
                    if storage_rerun {
                        self.roll_back();
                        give_up_live(batch, &mut live, &error);
                        return Ok(false);
                    }
                    storage_rerun = true;
                    batch[culprit].give_up(error.duplicate());
                    live[culprit] = false;
                    if self.checkpoint.full_now() {
                        self.give_wal_back();
                    }
                    let reason = error.duplicate();
                    (culprit, error, reason)
                }
                Ran::CommitFull(error) => {
                    // Met at COMMIT (a real filesystem fills when the WAL
                    // is written, not while a statement runs): the jobs
                    // left commit one by one, so only the one whose writes
                    // do not fit fails. Once per batch, as above.
                    if storage_rerun {
                        self.roll_back();
                        give_up_live(batch, &mut live, &error);
                        return Ok(false);
                    }
                    self.roll_back();
                    if self.checkpoint.full_now() {
                        self.give_wal_back();
                    }
                    for (i, job) in batch.iter_mut().enumerate() {
                        if live[i] {
                            live[i] = job.rerun(&error);
                        }
                    }
                    return Ok(self.execute_each(batch, &mut live));
                }
                Ran::CommitRefused(error) => {
                    // One job's writes failed a constraint at COMMIT: the
                    // jobs that can run again commit one by one, so that
                    // only the culprit's own COMMIT fails, answered with
                    // that error. A run-once job that already ran cannot
                    // run again: it answers `GroupRolledBack` (retryable;
                    // nothing of it was stored).
                    log::warn!(
                        "postroom writer: a batch's COMMIT failed ({}); its jobs commit one \
                         by one",
                        Esc(&error)
                    );
                    self.roll_back();
                    let reason = Error::GroupRolledBack {
                        reason: error.to_string(),
                    };
                    for (i, job) in batch.iter_mut().enumerate() {
                        if live[i] {
                            live[i] = job.rerun(&reason);
                        }
                    }
                    return Ok(self.execute_each(batch, &mut live));
                }
            };
            let others = live
                .iter()
                .enumerate()
                .filter(|&(i, &l)| l && i != culprit)
                .count();
            if others > 0 {
                log::warn!(
                    "postroom writer: {}; the batch's other {others} job(s) run again",
                    Esc(&error)
                );
            }
            for (i, job) in batch.iter_mut().enumerate() {
                if live[i] {
                    let why = if i == culprit { &error } else { &reason };
                    live[i] = job.rerun(why);
                }
            }
        }
        Err(Error::Aborted {
            reason: "the transaction was rolled back on every run".into(),
        })
    }

    /// After a batch's `COMMIT` met a full disk: runs each `live` job in a
    /// transaction of its own, so that the job whose writes do not fit is
    /// answered `StorageFull` and the others are stored. Once a second job
    /// meets the full disk, every job left is answered so (each failure
    /// costs a WAL give-back; a disk with no room at all is not tried job
    /// by job). Any other error answers the jobs left with it. Returns
    /// whether any job committed; every job not committed holds its error.
    fn execute_each(&mut self, batch: &mut [Box<dyn Job>], live: &mut [bool]) -> bool {
        let mut committed = false;
        let mut full_once = false;
        for i in 0..batch.len() {
            // Twice at most: a run rolled back by the job's own user code
            // is recorded by the next (a delivery counts the attempt).
            for _ in 0..2 {
                if !live[i] {
                    break;
                }
                let only: Vec<bool> = (0..batch.len()).map(|j| j == i).collect();
                let error = match self.execute_live(batch, &only) {
                    Ok(Ran::Done(c)) => {
                        committed |= c;
                        live[i] = false;
                        continue;
                    }
                    Ok(Ran::RolledBackBy(_, e)) => {
                        live[i] = batch[i].rerun(&e);
                        continue;
                    }
                    Ok(Ran::StorageFullIn(_, e) | Ran::CommitFull(e) | Ran::CommitRefused(e)) => e,
                    Err(e) => e,
                };
                self.roll_back();
                let full = matches!(error, Error::StorageFull { .. });
                batch[i].give_up(error.duplicate());
                live[i] = false;
                if refused_at_commit(&error) {
                    // This job's own writes: the next job's are not.
                    continue;
                }
                if full && !full_once {
                    full_once = true;
                    self.checkpoint.note(&Err::<(), _>(error.duplicate()));
                    if self.checkpoint.full_now() {
                        self.give_wal_back();
                    }
                    continue;
                }
                give_up_live(batch, live, &error);
                return committed;
            }
            if std::mem::take(&mut live[i]) {
                batch[i].give_up(Error::Aborted {
                    reason: "the transaction was rolled back on every run".into(),
                });
            }
        }
        committed
    }

    /// Runs the `live` jobs of the batch in one transaction.
    fn execute_live(&mut self, batch: &mut [Box<dyn Job>], live: &[bool]) -> Result<Ran> {
        // A holder that panicked mid-batch left its transaction open; none
        // of it was answered as committed.
        self.roll_back();
        if !live.contains(&true) {
            // Every job was answered already: nothing to commit.
            return Ok(Ran::Done(false));
        }
        failpoint::hit("writer.before_begin")?;
        exec(&self.conn, "BEGIN IMMEDIATE")?;
        let mut ctx = WriterCtx {
            conn: &self.conn,
            config: &self.config,
            clock: &*self.clock,
            engine_file: &mut self.engine_file,
            guard: &self.guard,
        };
        // A lone job (a single caller's) needs no savepoint of its own: the
        // transaction is its, and rolling it back undoes exactly its writes.
        let alone = live.iter().filter(|&&l| l).count() == 1;
        for (i, job) in batch.iter_mut().enumerate() {
            if !live[i] {
                continue;
            }
            if !alone {
                exec(ctx.conn, "SAVEPOINT postroom_job")?;
            }
            let result = job.run(&mut ctx);
            self.checkpoint.note(&result);
            if ctx.conn.is_autocommit() {
                return match result {
                    // The job's user code did it: not the storage's fault.
                    Err(e @ Error::RolledBack { .. }) => Ok(Ran::RolledBackBy(i, e)),
                    // SQLite rolled back the whole transaction when this
                    // job's writes met a full disk: this job's failure,
                    // not its neighbours'.
                    Err(e @ Error::StorageFull { .. }) => Ok(Ran::StorageFullIn(i, e)),
                    // After an I/O error (or a rollback nobody owns) the
                    // whole batch failed, for the reason this job met:
                    // running the others again would meet the same disk.
                    other => Err(other.err().unwrap_or(Error::Aborted {
                        reason: "the transaction was rolled back mid-batch".into(),
                    })),
                };
            }
            if alone {
                if result.is_err() {
                    // Nothing to commit; the job answers with its own error.
                    exec(ctx.conn, "ROLLBACK")?;
                    return Ok(Ran::Done(false));
                }
            } else {
                if result.is_err() {
                    exec(ctx.conn, "ROLLBACK TO postroom_job")?;
                }
                exec(ctx.conn, "RELEASE postroom_job")?;
            }
        }
        failpoint::hit("writer.before_commit")?;
        let committing = Instant::now();
        match exec(&self.conn, "COMMIT") {
            Ok(()) => self.last_commit = committing.elapsed(),
            // A filesystem that fills is met here, when the pages are
            // written to the WAL, after every job ran: whose writes did
            // not fit is unknown (a lone job's are its own: its error).
            Err(e @ Error::StorageFull { .. }) if !alone => {
                self.checkpoint.note(&Err::<(), _>(e.duplicate()));
                return Ok(Ran::CommitFull(e));
            }
            // A constraint checked only at COMMIT: one job's writes broke
            // it, and which one is unknown (each handler's are checked when
            // it returns, so this is the net under that check).
            Err(e) if !alone && refused_at_commit(&e) => return Ok(Ran::CommitRefused(e)),
            Err(e) => return Err(e),
        }
        self.after_commit();
        // An error here reaches callers although the batch committed: they
        // retry and are told Duplicate, which is safe (never the reverse).
        failpoint::hit("writer.after_commit")?;
        Ok(Ran::Done(true))
    }

    /// Hands the WAL's copying back to the checkpointer, or does it here
    /// when the WAL has grown too far for that.
    fn after_commit(&mut self) {
        let pages = WAL_PAGES.take();
        self.counters
            .wal_frames
            .fetch_add(self.checkpoint.appended(pages), Ordering::Relaxed);
        if self.checkpoint.owed {
            // The storage was full and the WAL could not be given back; this
            // commit found space, so the copy-back may too.
            self.give_wal_back();
        } else if self.checkpoint.after_commit(pages) {
            self.copy_back_inline(pages);
        }
        self.checkpoint.warn_past_cap(pages);
    }

    /// The writer's own copy-back, after a commit: never a wait on readers.
    /// A reader of another process (a DB browser, a report query, a
    /// backup) may hold an old snapshot for minutes; a copy-back that
    /// waited `busy_timeout` for it after every commit made every commit
    /// wait that long (issue 32). So it waits [`INLINE_CHECKPOINT_WAIT`] at
    /// most (the engine's own reads are that short), and only a `RESTART`
    /// waits; when a reader kept one from completing, the next `RESTART` is
    /// put off ([`CheckpointTrigger::blocked`]) and passive copy-backs,
    /// which never wait, go on after each commit meanwhile: the WAL grows
    /// only while the reader pins it, and is copied back once it leaves.
    fn copy_back_inline(&mut self, pages: c_int) {
        // RESTART lets the next commit write from the WAL's start; only
        // when passive passes have not got through.
        let restart = self.checkpoint.may_restart(pages);
        let sql = if restart {
            "PRAGMA wal_checkpoint(RESTART)"
        } else {
            "PRAGMA wal_checkpoint(PASSIVE)"
        };
        let _ = self.conn.busy_timeout(INLINE_CHECKPOINT_WAIT);
        let result = self.conn.query_row(sql, [], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, i64>(2)?,
            ))
        });
        let _ = self.conn.busy_timeout(self.config.busy_timeout);
        match result {
            Ok((busy, log, done)) => {
                self.counters
                    .inline_checkpoints
                    .fetch_add(1, Ordering::Relaxed);
                if busy != 0 || done < log {
                    self.counters
                        .checkpoints_blocked
                        .fetch_add(1, Ordering::Relaxed);
                    crate::telemetry::checkpoint_blocked();
                    // Only a `RESTART` waits (on readers, up to
                    // INLINE_CHECKPOINT_WAIT), so only it is put off: a
                    // passive copy-back never waits (a reader limits what
                    // it copies; the checkpointer's pass, holding the
                    // checkpoint lock, makes it busy at once) and is tried
                    // after the next commit again. Putting passive tries
                    // off too, doubling, left a loaded machine's writer
                    // without copy-backs for a whole burst while one of
                    // the engine's own short reads or the checkpointer's
                    // starved pass was in the way (the WAL reached 34,021
                    // frames, bound 16,000, in
                    // `the_wal_stays_bounded_while_writes_never_stop`).
                    if restart {
                        self.checkpoint.blocked(Instant::now());
                    }
                } else {
                    self.checkpoint.completed();
                }
            }
            Err(e) => {
                log::warn!("postroom writer: checkpoint of a {pages}-frame WAL failed: {e}");
                self.checkpoint.blocked(Instant::now());
            }
        }
    }

    /// After the storage was found full: copies the WAL back and truncates
    /// it, so that the disk space it holds, and whatever is freed later,
    /// takes commits again instead of the WAL growing into it. Each batch
    /// that meets a full disk tries again; if the copy-back itself found no
    /// space (the database file must grow to take the WAL's pages), so does
    /// the next commit that succeeds. Readers that still need old frames
    /// are waited for [`GIVE_BACK_WAIT`] at most; if they stay, the
    /// ordinary copy-backs (and the idle truncation) take over.
    fn give_wal_back(&mut self) {
        let deadline = Instant::now() + GIVE_BACK_WAIT;
        let _ = self.conn.busy_timeout(GIVE_BACK_WAIT);
        let result = loop {
            let result = self
                .conn
                .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| {
                    r.get::<_, i64>(0)
                });
            // Busy at once: the checkpointer's pass holds the checkpoint
            // lock, which SQLite does not wait for (readers it does, up to
            // the busy timeout). Its passes are short.
            match result {
                Ok(busy) if busy != 0 && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(1));
                }
                result => break result,
            }
        };
        let _ = self.conn.busy_timeout(self.config.busy_timeout);
        self.checkpoint.owed = match result {
            Ok(0) => {
                log::info!("postroom writer: the storage was full; the WAL was given back");
                // The WAL restarts from its first frame.
                self.checkpoint.last_pages = 0;
                self.checkpoint.wake_at = self.checkpoint.bounds.wake_pages;
                false
            }
            Ok(_) => {
                log::warn!(
                    "postroom writer: the storage was full; readers kept the WAL from \
                     being given back"
                );
                false
            }
            Err(e) => {
                log::warn!(
                    "postroom writer: the storage was full; giving the WAL back failed: {e}"
                );
                // Retried after the next commit only when space was what
                // it lacked: other errors are met again by the next
                // failure, or the checkpointer's passes.
                e.sqlite_error_code() == Some(rusqlite::ErrorCode::DiskFull)
            }
        };
    }

    fn close(self) {
        // Best effort: leave a small -wal behind for the next open.
        // The application's tables keep what `optimize` learns; postroom's
        // own keep nothing (`forget_statistics` says why), so `optimize`
        // may find them unanalyzed at every shutdown. SQLite 3.46 on reads
        // at most 2,000 rows per index for it (when `analysis_limit` is
        // unset); set here to the same, so that an older linked SQLite
        // (3.45.3 is accepted) does not read a multi-million-row inbox
        // whole against the shutdown deadline.
        if let Err(e) = self
            .conn
            .execute_batch("PRAGMA analysis_limit = 2000; PRAGMA optimize")
            .and_then(|()| crate::store::schema::forget_statistics(&self.conn))
        {
            log::debug!("postroom writer: optimize at shutdown: {e}");
        }
        // Not waiting on readers: another process's open read transaction
        // would hold the close (and its share of the shutdown deadline)
        // for the whole busy timeout. The next open truncates instead.
        let _ = self.conn.busy_timeout(CLOSE_CHECKPOINT_WAIT);
        if let Err(e) = self
            .conn
            .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
        {
            log::debug!("postroom writer: checkpoint at shutdown: {e}");
        }
        // A statement a handler leaked would keep the connection from
        // closing (and its files open); no user code runs now.
        let leaked_running = self.guard.release_leaked(&self.conn);
        if leaked_running > 0 {
            log::debug!("postroom writer: {leaked_running} leaked statement(s) were running");
        }
        if let Err((_, e)) = self.conn.close() {
            log::warn!("postroom writer: closing the database: {e}");
        }
    }
}

/// True for a `COMMIT` that failed on a constraint (a deferred foreign
/// key): the doing of some job's writes, not of the storage.
fn refused_at_commit(error: &Error) -> bool {
    matches!(
        error,
        Error::Sqlite { source, .. }
            if source.sqlite_error_code() == Some(rusqlite::ErrorCode::ConstraintViolation)
    )
}

/// Answers every job still `live` with `error` (nothing of it was
/// stored): none runs again.
fn give_up_live(batch: &mut [Box<dyn Job>], live: &mut [bool], error: &Error) {
    for (job, live) in batch.iter_mut().zip(live.iter_mut()) {
        if std::mem::take(live) {
            job.give_up(error.duplicate());
        }
    }
}

/// How one run of a batch's transaction ended.
enum Ran {
    /// Committed (`true`), or a lone job failed and was rolled back.
    Done(bool),
    /// Job `n`'s user code rolled the transaction back, with this error.
    RolledBackBy(usize, Error),
    /// SQLite rolled the transaction back when job `n`'s writes met a full
    /// disk (or `max_page_count`).
    StorageFullIn(usize, Error),
    /// `COMMIT` of several jobs met a full disk: which job's writes did not
    /// fit is unknown.
    CommitFull(Error),
    /// `COMMIT` of several jobs failed a constraint: whose writes broke it
    /// is unknown.
    CommitRefused(Error),
}

enum Turn {
    Job(Box<dyn Job>),
    /// The rider's turn to run, with or without callers' jobs.
    Rider,
    Background(Box<dyn Job>),
    Stop,
}

/// The writer thread: runs what callers queued while the lock was taken,
/// and background work when callers leave it alone.
pub(crate) struct WriterThread {
    core: Arc<Core>,
    commands: Receiver<Box<dyn Job>>,
    /// Low-priority jobs (retention), each run in a transaction of its own.
    background: Receiver<Box<dyn Job>>,
    rider_rung: Receiver<()>,
    /// A rider was left in the slot (a leader may have taken it since).
    rider_waits: bool,
    stop: Receiver<()>,
    /// A background job taken off its queue, and since when it waits.
    deferred: Option<(Box<dyn Job>, Instant)>,
    max_batch: usize,
}

/// Creates the writer's queues: the handle callers use, and the thread's
/// end. `alive` must be dropped when the thread ends.
pub(crate) fn writer(state: WriterState, alive: Receiver<()>) -> (WriterHandle, WriterThread) {
    let max_batch = state.config.max_batch;
    let busy_timeout = state.config.busy_timeout;
    let core = Core::new(state);
    let (commands, queued) = crossbeam_channel::bounded(max_batch);
    let (background, background_rx) = crossbeam_channel::bounded(1);
    let (rider_bell, rider_rung) = crossbeam_channel::bounded(1);
    let (stop, stop_rx) = crossbeam_channel::bounded(1);
    let handle = WriterHandle {
        core: Arc::clone(&core),
        commands,
        queued: queued.clone(),
        background,
        rider_bell,
        stop,
        alive,
        busy_timeout,
    };
    let thread = WriterThread {
        core,
        commands: queued,
        background: background_rx,
        rider_rung,
        rider_waits: false,
        stop: stop_rx,
        deferred: None,
        max_batch,
    };
    (handle, thread)
}

impl WriterThread {
    /// The thread's body: runs batches until told to stop or every handle
    /// is gone, then closes the connection.
    pub fn run(mut self) {
        let mut batch: Vec<Box<dyn Job>> = Vec::with_capacity(self.max_batch);
        loop {
            match self.next() {
                Turn::Job(job) => {
                    batch.push(job);
                    let mut held = self.core.lock_as_writer();
                    gather(&self.core, &self.commands, &mut batch, held.state());
                    self.core.run_callers_batch(held.state(), &mut batch);
                }
                Turn::Rider => {
                    let mut held = self.core.lock_as_writer();
                    take_queued(&self.commands, &mut batch, self.max_batch);
                    if batch.is_empty() {
                        // Alone: a batch that callers did not ask for, so
                        // it does not hold background work back.
                        batch.extend(self.core.take_rider());
                        if !batch.is_empty() {
                            held.state().run_batch(&mut batch);
                        }
                    } else {
                        self.core.run_callers_batch(held.state(), &mut batch);
                    }
                }
                Turn::Background(job) => {
                    // Alone in its transaction: nobody waits for its commit.
                    batch.push(job);
                    self.core.lock_as_writer().state().run_batch(&mut batch);
                }
                Turn::Stop => break,
            }
        }
        // Run what was queued before the stop, then close under the lock so
        // no leader can start a batch on a closing connection. Jobs queued
        // after this are answered `Closed` when the thread ends.
        let mut held = self.core.lock();
        loop {
            take_queued(&self.commands, &mut batch, self.max_batch);
            batch.extend(self.core.take_rider());
            if batch.is_empty() {
                break;
            }
            held.state().run_batch(&mut batch);
        }
        // Its waiting caller hears `Closed` now, not after the close.
        self.deferred = None;
        if let Some(state) = held.guard.take() {
            state.close();
        }
    }

    /// The next thing to do. Callers' jobs come first; a background job
    /// (retention) runs only once callers left the writer alone for
    /// [`BACKGROUND_GRACE`] — a caller sending its next message a few
    /// microseconds after its answer must not find itself behind a delete
    /// batch — or once it has been put off for [`BACKGROUND_MAX_DEFER`], so
    /// that it still progresses under full load (one batch at a time).
    fn next(&mut self) -> Turn {
        loop {
            if self.deferred.is_none() {
                if let Ok(job) = self.background.try_recv() {
                    self.deferred = Some((job, Instant::now()));
                }
            }
            if let Some((job, _)) = self
                .deferred
                .take_if(|(_, since)| since.elapsed() >= BACKGROUND_MAX_DEFER)
            {
                return Turn::Background(job);
            }
            match self.commands.try_recv() {
                Ok(job) => return Turn::Job(job),
                // Every handle is gone.
                Err(TryRecvError::Disconnected) => return Turn::Stop,
                Err(TryRecvError::Empty) => {}
            }
            if !matches!(self.stop.try_recv(), Err(TryRecvError::Empty)) {
                return Turn::Stop;
            }
            if self.rider_rung.try_recv().is_ok() {
                self.rider_waits = true;
            }
            // Nobody queued; leaders leave a trace of their last batch.
            let quiet = self.core.callers_quiet_for() >= BACKGROUND_GRACE;
            if self.rider_waits && quiet {
                self.rider_waits = false;
                return Turn::Rider;
            }
            if quiet {
                if let Some((job, _)) = self.deferred.take() {
                    return Turn::Background(job);
                }
            }
            if self.deferred.is_some() || self.rider_waits {
                crossbeam_channel::select! {
                    recv(self.commands) -> job => return job.map_or(Turn::Stop, Turn::Job),
                    recv(self.stop) -> _ => return Turn::Stop,
                    default(BACKGROUND_GRACE) => {}
                }
            } else {
                crossbeam_channel::select! {
                    recv(self.commands) -> job => return job.map_or(Turn::Stop, Turn::Job),
                    recv(self.stop) -> _ => return Turn::Stop,
                    recv(self.rider_rung) -> rung => match rung {
                        Ok(()) => self.rider_waits = true,
                        Err(_) => return Turn::Stop,
                    },
                    recv(self.background) -> job => match job {
                        Ok(job) => self.deferred = Some((job, Instant::now())),
                        // Every handle is gone.
                        Err(_) => return Turn::Stop,
                    },
                }
            }
        }
    }
}

/// Adds what is queued to `batch`, then waits for the jobs of callers that
/// are between batches — answered by the last one, about to hand in the
/// next ([`CallerCount::expected_jobs`]) — so that concurrent callers share one
/// commit rather than alternating in two halves. It waits at most as long
/// as the last `COMMIT` took (and [`GATHER`]): a job that comes later
/// costs less in a commit of its own than the batch waiting for it. Runs
/// with the lock held, by the writer thread or a leading caller: callers
/// arriving meanwhile queue. A lone caller expects only its own job and
/// never waits.
fn gather(
    core: &Core,
    queued: &Receiver<Box<dyn Job>>,
    batch: &mut Vec<Box<dyn Job>>,
    state: &WriterState,
) {
    let max_batch = state.config.max_batch;
    take_queued(queued, batch, max_batch);
    let expected = core.callers.expected_jobs().min(max_batch);
    if batch.len() >= expected {
        // A lone caller, or everyone expected already queued: no clock read.
        return;
    }
    let until = Instant::now() + state.last_commit.min(GATHER);
    // A thread waiting for the lock (the writer thread holding a queued
    // job it took, the checkpointer) holds what this batch waits for, or
    // waits for this batch: stop waiting.
    while batch.len() < expected
        && Instant::now() < until
        && core.writer_waiting.load(Ordering::Acquire) == 0
    {
        std::thread::yield_now();
        take_queued(queued, batch, max_batch);
    }
}

/// Wakes the relay after a commit that added outbox rows.
fn wake_relay(tx: &crossbeam_channel::Sender<()>, dirty: &std::sync::atomic::AtomicBool) {
    if dirty.swap(false, std::sync::atomic::Ordering::AcqRel) {
        let _ = tx.try_send(());
    }
}

#[cfg(test)]
mod tests {
    use super::CallerCount;

    #[test]
    fn a_batch_expects_the_callers_that_were_inside_since_the_last_one_began() {
        let count = CallerCount::default();
        assert_eq!(count.expected_jobs(), 0);
        // Alone, looping: a lone caller's batch expects its own job only.
        count.enter();
        assert_eq!(count.expected_jobs(), 1);
        count.leave();
        count.enter();
        assert_eq!(count.expected_jobs(), 1);
        // Three more come in and two of them leave (answered) before the
        // next batch begins: it expects all four, the answered ones being
        // about to come back.
        for _ in 0..3 {
            count.enter();
        }
        count.leave();
        count.leave();
        assert_eq!(count.expected_jobs(), 4);
        // Those two stopped: the batch after expects only the two inside.
        assert_eq!(count.expected_jobs(), 2);
        // The last two leave for good: they are expected by one more
        // batch (they were inside since the last began), then never.
        count.leave();
        count.leave();
        assert_eq!(count.expected_jobs(), 2);
        assert_eq!(count.expected_jobs(), 0);
    }
}
