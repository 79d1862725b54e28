//! The writer thread: owns the only write connection and commits jobs in
//! groups.
//!
//! It blocks for one job, then takes whatever else is already queued, up to
//! `max_batch`, and runs them all in one `BEGIN IMMEDIATE … COMMIT`, each in
//! its own savepoint. Callers hear back only after `COMMIT` returned, so one
//! fsync covers the whole group. Invariants:
//! * a job's `Err` rolls back its own savepoint and nothing else;
//! * if `COMMIT` fails, or the transaction disappears mid-batch (SQLite
//!   rolls back by itself after some I/O errors), every job of the batch is
//!   answered with an error: nothing of it was acknowledged.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use rusqlite::Connection;

use crate::clock::Clock;
use crate::config::Config;
use crate::delivery::exec;
use crate::error::{Error, Result};
use crate::failpoint;
use crate::guard::UserCodeGuard;
use crate::inflight::EngineFile;

/// What a job can use while it runs.
pub(crate) struct WriterCtx<'a> {
    pub conn: &'a Connection,
    pub config: &'a Config,
    pub clock: &'a dyn Clock,
    pub engine_file: &'a mut EngineFile,
    pub guard: &'a UserCodeGuard,
}

/// A unit of work for the writer thread.
pub(crate) trait Job: Send {
    /// Runs inside the batch's transaction and its own savepoint. An `Err`
    /// (a copy of the job's own error) means its writes must be rolled back.
    fn run(&mut self, ctx: &mut WriterCtx<'_>) -> Result<()>;
    /// Answers the caller, once the batch has committed (`Ok`) or failed.
    fn finish(self: Box<Self>, batch: std::result::Result<(), &Error>);
}

pub(crate) enum Command {
    Job(Box<dyn Job>),
    /// Finish the queued jobs before this one, then exit.
    Stop,
}

/// How long the writer, with nothing else to do, waits for a caller's job
/// before it starts a background job.
const BACKGROUND_GRACE: Duration = Duration::from_millis(1);
/// The longest background work is put off when callers keep the writer busy.
const BACKGROUND_MAX_DEFER: Duration = Duration::from_millis(25);

enum Next {
    Command(Command),
    Background(Box<dyn Job>),
    Disconnected,
}

/// What other threads hold to send work to the writer.
#[derive(Clone)]
pub(crate) struct WriterHandle {
    commands: Sender<Command>,
    background: Sender<Box<dyn Job>>,
    /// Disconnects when the writer thread ends (its sender is dropped).
    alive: Receiver<()>,
}

impl WriterHandle {
    pub fn new(
        commands: Sender<Command>,
        background: Sender<Box<dyn Job>>,
        alive: Receiver<()>,
    ) -> Self {
        WriterHandle {
            commands,
            background,
            alive,
        }
    }

    /// Runs `work` in the writer's next batch and waits for its answer,
    /// which comes after that batch has committed.
    pub fn submit<T, F>(&self, work: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut WriterCtx<'_>) -> Result<T> + Send + 'static,
    {
        let (job, answer) = job(work);
        self.commands
            .send(Command::Job(job))
            .map_err(|_| Error::Closed)?;
        self.wait(answer)
    }

    /// Like `submit`, for work that should not hold callers up: it runs when
    /// the writer has nothing else to do (or has put it off too long), in a
    /// transaction of its own.
    pub fn submit_background<T, F>(&self, work: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut WriterCtx<'_>) -> Result<T> + Send + 'static,
    {
        let (job, answer) = job(work);
        self.background.send(job).map_err(|_| Error::Closed)?;
        self.wait(answer)
    }

    fn wait<T>(&self, answer: Receiver<Result<T>>) -> Result<T> {
        // A job that lands behind `Stop` is never run, and a bounded
        // channel keeps it (and its reply sender) after the writer is gone;
        // so wait on the writer's life as well as on the answer.
        crossbeam_channel::select! {
            recv(answer) -> reply => reply.map_err(|_| Error::Closed)?,
            recv(self.alive) -> _ => answer.try_recv().map_err(|_| Error::Closed)?,
        }
    }

    /// Asks the writer to stop once the commands queued before this one are
    /// done, waiting at most `deadline` for room in the queue.
    pub fn stop(&self, deadline: std::time::Duration) {
        let _ = self.commands.send_timeout(Command::Stop, deadline);
    }

    /// Like `stop`, without waiting (for the writer thread itself).
    pub fn try_stop(&self) {
        let _ = self.commands.try_send(Command::Stop);
    }
}

struct FnJob<T, F> {
    work: Option<F>,
    result: Option<Result<T>>,
    reply: Sender<Result<T>>,
}

impl<T, F> Job for FnJob<T, F>
where
    T: Send,
    F: FnOnce(&mut WriterCtx<'_>) -> Result<T> + Send,
{
    fn run(&mut self, ctx: &mut WriterCtx<'_>) -> Result<()> {
        let result = match self.work.take() {
            Some(work) => work(ctx),
            None => Err(Error::Aborted {
                reason: "job ran twice".into(),
            }),
        };
        let copy = match &result {
            Ok(_) => Ok(()),
            Err(e) => Err(e.duplicate()),
        };
        self.result = Some(result);
        copy
    }

    fn finish(self: Box<Self>, batch: std::result::Result<(), &Error>) {
        let answer = match (self.result, batch) {
            (Some(Err(own)), _) => Err(own),
            (Some(Ok(value)), Ok(())) => Ok(value),
            (_, Err(batch)) => Err(batch.duplicate()),
            (None, Ok(())) => Err(Error::Aborted {
                reason: "job was not run".into(),
            }),
        };
        // The caller may have given up waiting; that is its business.
        let _ = self.reply.send(answer);
    }
}

/// Wraps a closure as a job, with the channel its answer arrives on.
pub(crate) fn job<T, F>(work: F) -> (Box<dyn Job>, Receiver<Result<T>>)
where
    T: Send + 'static,
    F: FnOnce(&mut WriterCtx<'_>) -> Result<T> + Send + 'static,
{
    let (reply, answer) = crossbeam_channel::bounded(1);
    let job = FnJob {
        work: Some(work),
        result: None,
        reply,
    };
    (Box::new(job), answer)
}

/// Counters the writer keeps for [`Stats`](crate::Stats): how many
/// transactions it committed and how many jobs they carried.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub batches: AtomicU64,
    pub jobs: AtomicU64,
}

/// Everything the writer thread owns.
pub(crate) struct Writer {
    pub conn: Connection,
    pub config: Config,
    pub clock: std::sync::Arc<dyn Clock>,
    pub engine_file: EngineFile,
    pub guard: UserCodeGuard,
    pub commands: Receiver<Command>,
    /// Low-priority jobs (retention), each run in a transaction of its own.
    pub background: Receiver<Box<dyn Job>>,
    pub counters: Arc<Counters>,
    /// Set (by an update hook) when a job inserted outbox rows; the relay is
    /// woken once their batch has committed.
    pub outbox_dirty: Arc<AtomicBool>,
    pub relay_wake: Option<Sender<()>>,
}

impl Writer {
    /// The thread's body: runs batches until told to stop or every sender
    /// is gone, then checkpoints and closes.
    pub fn run(mut self) {
        let mut batch: Vec<Box<dyn Job>> = Vec::with_capacity(self.config.max_batch);
        let mut deferring_since: Option<Instant> = None;
        'run: loop {
            let first = match self.next_command(&mut deferring_since) {
                Next::Command(command) => command,
                Next::Background(job) => {
                    // Alone in its transaction: nobody waits for its commit.
                    batch.push(job);
                    self.run_batch(&mut batch);
                    continue;
                }
                Next::Disconnected => break,
            };
            let mut next = Some(first);
            while let Some(command) = next.take() {
                match command {
                    Command::Stop => break 'run,
                    Command::Job(job) => {
                        batch.push(job);
                        while batch.len() < self.config.max_batch {
                            match self.commands.try_recv() {
                                Ok(Command::Job(job)) => batch.push(job),
                                Ok(other) => {
                                    next = Some(other);
                                    break;
                                }
                                Err(_) => break,
                            }
                        }
                        self.run_batch(&mut batch);
                    }
                }
            }
        }
        // Jobs that arrived behind Stop are dropped unrun: their callers
        // hear `Closed` (the reply channel disconnects).
        while self.commands.try_recv().is_ok() {}
        while self.background.try_recv().is_ok() {}
        self.close();
    }

    /// The next thing to do. Callers' jobs come first; a background job
    /// (retention) runs only once no caller's job arrived for
    /// [`BACKGROUND_GRACE`] — a caller sending its next message a few
    /// microseconds after its answer must not find itself behind a delete
    /// batch — or once background work has been put off for
    /// [`BACKGROUND_MAX_DEFER`], so that it still progresses under full
    /// load (one batch at a time).
    fn next_command(&self, deferring_since: &mut Option<Instant>) -> Next {
        if self.background.is_empty() {
            *deferring_since = None;
        } else if deferring_since.get_or_insert_with(Instant::now).elapsed() >= BACKGROUND_MAX_DEFER
        {
            if let Ok(job) = self.background.try_recv() {
                *deferring_since = None;
                return Next::Background(job);
            }
        }
        match self.commands.try_recv() {
            Ok(command) => return Next::Command(command),
            Err(TryRecvError::Disconnected) => return Next::Disconnected,
            Err(TryRecvError::Empty) => {}
        }
        match self.commands.recv_timeout(BACKGROUND_GRACE) {
            Ok(command) => return Next::Command(command),
            Err(RecvTimeoutError::Disconnected) => return Next::Disconnected,
            Err(RecvTimeoutError::Timeout) => {}
        }
        crossbeam_channel::select! {
            recv(self.commands) -> command => match command {
                Ok(command) => Next::Command(command),
                Err(_) => Next::Disconnected,
            },
            recv(self.background) -> job => match job {
                Ok(job) => {
                    *deferring_since = None;
                    Next::Background(job)
                }
                // Only the engine holds background senders; with them gone
                // the callers' channel decides when to stop.
                Err(_) => match self.commands.recv() {
                    Ok(command) => Next::Command(command),
                    Err(_) => Next::Disconnected,
                },
            },
        }
    }

    fn run_batch(&mut self, batch: &mut Vec<Box<dyn Job>>) {
        let outcome = self.execute(batch);
        if outcome.is_ok() {
            self.counters.batches.fetch_add(1, Ordering::Relaxed);
            self.counters
                .jobs
                .fetch_add(batch.len() as u64, Ordering::Relaxed);
            if let Some(wake) = &self.relay_wake {
                crate::relay::wake(wake, &self.outbox_dirty);
            }
        } else {
            self.outbox_dirty.store(false, Ordering::Release);
        }
        if let Err(e) = &outcome {
            log::error!("postroom writer: batch of {} failed: {e}", batch.len());
            if !self.conn.is_autocommit() {
                if let Err(e) = self.conn.execute_batch("ROLLBACK") {
                    log::error!("postroom writer: ROLLBACK failed: {e}");
                }
            }
        }
        for job in batch.drain(..) {
            job.finish(outcome.as_ref().map(|_| ()));
        }
    }

    /// Runs the batch in one transaction. `Err` means nothing of it may be
    /// reported as committed.
    fn execute(&mut self, batch: &mut [Box<dyn Job>]) -> Result<()> {
        failpoint::hit("writer.before_begin")?;
        exec(&self.conn, "BEGIN IMMEDIATE")?;
        let mut ctx = WriterCtx {
            conn: &self.conn,
            config: &self.config,
            clock: &*self.clock,
            engine_file: &mut self.engine_file,
            guard: &self.guard,
        };
        for job in batch.iter_mut() {
            exec(ctx.conn, "SAVEPOINT postroom_job")?;
            let result = job.run(&mut ctx);
            if ctx.conn.is_autocommit() {
                // SQLite rolled back the whole transaction (after a full
                // disk or an I/O error): the whole batch failed, for the
                // reason this job met.
                return Err(result.err().unwrap_or(Error::Aborted {
                    reason: "the transaction was rolled back mid-batch".into(),
                }));
            }
            if result.is_err() {
                exec(ctx.conn, "ROLLBACK TO postroom_job")?;
            }
            exec(ctx.conn, "RELEASE postroom_job")?;
        }
        failpoint::hit("writer.before_commit")?;
        exec(&self.conn, "COMMIT")?;
        // An error here reaches callers although the batch committed: they
        // retry and are told Duplicate, which is safe (never the reverse).
        failpoint::hit("writer.after_commit")
    }

    fn close(self) {
        // Best effort: leave a small -wal behind for the next open.
        if let Err(e) = self.conn.execute_batch("PRAGMA optimize") {
            log::debug!("postroom writer: optimize at shutdown: {e}");
        }
        if let Err(e) = self
            .conn
            .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
        {
            log::debug!("postroom writer: checkpoint at shutdown: {e}");
        }
        if let Err((_, e)) = self.conn.close() {
            log::warn!("postroom writer: closing the database: {e}");
        }
    }
}
