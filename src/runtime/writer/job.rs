//! The writer's jobs: what a caller hands the writer ([`Job`]), how its
//! answer comes back ([`Answer`]), and the closures made into jobs
//! ([`job`], [`rerunnable_job`]).
//!
//! Invariants: a job answers exactly once (its `finish`, or its drop);
//! an answer's claim moves from queued to started or abandoned once, so
//! a caller that gave up waiting was told so only if nothing of the job
//! ran; a run-once job never runs twice, a rerunnable one runs again only
//! in a fresh transaction.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender};

use super::WriterCtx;
use crate::error::{Error, Result};

/// A job, and how its answer arrives.
pub(crate) type Answered<T> = (Box<dyn Job>, Answer<T>);

/// Where a job's answer arrives, and the job's claim: a caller that gives
/// up waiting (see [`WriterHandle::enqueue_job`]) may do so only while the
/// job has not started, so that an error it answers means nothing of the
/// job was stored.
pub(crate) struct Answer<T> {
    pub(super) rx: Receiver<Result<T>>,
    pub(super) claim: Arc<AtomicU8>,
}

/// [`Answer::claim`]: queued, not started yet.
pub(super) const QUEUED: u8 = 0;
/// Started (by a batch): its caller waits for the answer.
pub(super) const STARTED: u8 = 1;
/// Its caller gave up before it started: it never runs.
pub(super) const ABANDONED: u8 = 2;

/// A unit of work for the writer.
pub(crate) trait Job: Send {
    /// Runs inside the batch's transaction (and its own savepoint, unless
    /// alone in it). An `Err` (a copy of the job's own error) means its
    /// writes must be rolled back.
    fn run(&mut self, ctx: &mut WriterCtx<'_>) -> Result<()>;
    /// Answers the caller, once the batch has committed (`Ok`) or failed.
    fn finish(self: Box<Self>, batch: std::result::Result<(), &Error>);
    /// The transaction this job ran in (or was about to) was rolled back
    /// by some job's user code: true if the job can run again in a fresh
    /// one, else it answers with `reason` (or the error it met itself).
    fn rerun(&mut self, reason: &Error) -> bool;
    /// The storage rolled back the transaction while this job ran (a full
    /// disk met by its own writes): it answers with `own` and never runs
    /// again, whatever kind of job it is (run again, it would meet the
    /// same full disk).
    fn give_up(&mut self, own: Error);
    /// True for a job that can run again (see [`rerunnable_job`]).
    fn rerunnable(&self) -> bool;
}

/// A job's closure: run once (`None` once it ran), or as often as its
/// transaction is rolled back under it.
enum Work<F, G> {
    Once(Option<F>),
    Again(G),
}

/// `Again`'s type for a job that runs once.
type NeverAgain<T> = fn(&mut WriterCtx<'_>) -> Result<T>;

struct FnJob<T, F, G = NeverAgain<T>> {
    work: Work<F, G>,
    result: Option<Result<T>>,
    reply: Sender<Result<T>>,
    /// See [`Answer::claim`].
    claim: Arc<AtomicU8>,
}

impl<T, F, G> Job for FnJob<T, F, G>
where
    T: Send,
    F: FnOnce(&mut WriterCtx<'_>) -> Result<T> + Send,
    G: FnMut(&mut WriterCtx<'_>) -> Result<T> + Send,
{
    fn run(&mut self, ctx: &mut WriterCtx<'_>) -> Result<()> {
        let abandoned =
            self.claim
                .compare_exchange(QUEUED, STARTED, Ordering::AcqRel, Ordering::Acquire)
                == Err(ABANDONED);
        let result = match &mut self.work {
            // Its caller gave up before it started: nobody hears of it, and
            // nothing of it may be stored.
            _ if abandoned => Err(Error::Aborted {
                reason: "its caller stopped waiting".into(),
            }),
            Work::Once(work) => match work.take() {
                Some(work) => work(ctx),
                None => Err(Error::Aborted {
                    reason: "job ran twice".into(),
                }),
            },
            Work::Again(work) => work(ctx),
        };
        let copy = match &result {
            Ok(_) => Ok(()),
            Err(e) => Err(e.duplicate()),
        };
        self.result = Some(result);
        copy
    }

    fn rerunnable(&self) -> bool {
        matches!(self.work, Work::Again(_))
    }

    fn rerun(&mut self, reason: &Error) -> bool {
        match &mut self.work {
            Work::Once(Some(_)) => true,
            Work::Once(None) => {
                if !matches!(self.result, Some(Err(_))) {
                    self.result = Some(Err(reason.duplicate()));
                }
                false
            }
            Work::Again(_) => {
                self.result = None;
                true
            }
        }
    }

    fn give_up(&mut self, own: Error) {
        self.result = Some(Err(own));
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
pub(crate) fn job<T, F>(work: F) -> Answered<T>
where
    T: Send + 'static,
    F: FnOnce(&mut WriterCtx<'_>) -> Result<T> + Send + 'static,
{
    let (reply, rx) = crossbeam_channel::bounded(1);
    let claim = Arc::new(AtomicU8::new(QUEUED));
    let job: FnJob<T, F> = FnJob {
        work: Work::Once(Some(work)),
        result: None,
        reply,
        claim: Arc::clone(&claim),
    };
    (Box::new(job), Answer { rx, claim })
}

/// Like [`job`], for work that can run again when its transaction is
/// rolled back under it (see the module docs).
pub(crate) fn rerunnable_job<T, G>(work: G) -> Answered<T>
where
    T: Send + 'static,
    G: FnMut(&mut WriterCtx<'_>) -> Result<T> + Send + 'static,
{
    let (reply, rx) = crossbeam_channel::bounded(1);
    let claim = Arc::new(AtomicU8::new(QUEUED));
    let job: FnJob<T, NeverAgain<T>, G> = FnJob {
        work: Work::Again(work),
        result: None,
        reply,
        claim: Arc::clone(&claim),
    };
    (Box::new(job), Answer { rx, claim })
}

/// Adds queued jobs to `batch`, up to `max_batch` in all.
pub(super) fn take_queued(
    queue: &Receiver<Box<dyn Job>>,
    batch: &mut Vec<Box<dyn Job>>,
    max_batch: usize,
) {
    while batch.len() < max_batch {
        match queue.try_recv() {
            Ok(job) => batch.push(job),
            Err(_) => break,
        }
    }
}
