//! The engine: opens the database, owns the threads (writer, dispatcher,
//! workers, reaper) and the read pool, and is what callers talk to.

use crate::clock;
use crate::escape::Esc;
use std::collections::HashMap;
use std::panic::{self, AssertUnwindSafe};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crossbeam_channel::{RecvTimeoutError, Sender};
use rusqlite::Connection;

use crate::brakes::Brake;
use crate::builder::{Builder, ConsumerKind};
use crate::delivery::{self, panic_message, Step};
use crate::error::{Error, Result};
use crate::failpoint;
use crate::handler::Tx;
use crate::message::{Failure, Message, Outcome, Receipt};
use crate::runtime::checkpoint;
use crate::runtime::reaper::{self, CleanupReport};
use crate::runtime::relay;
use crate::runtime::wal;
use crate::runtime::workers::{self, Consumer, Shared};
use crate::runtime::writer::{self, Counters, WriterCtx};
use crate::runtime::{read_connection, ReadManager, Readers};
use crate::sink::Sink;
use crate::store::admission::{self, Admission};
use crate::store::inflight::ClaimSlot;
use crate::store::outbox::{self, OutboxMessage};
use crate::store::queue::{self, DeadLetter};
use crate::store::stats::{self, Stats};
use crate::store::strict;
use crate::telemetry;

mod open;
use open::CheckpointInputs;

const WRITER_THREAD: &str = "postroom-writer";

/// How long past its due time an unfinished head of a key still holds the
/// intakes' later messages of the key ([`Postroom::intake_key_wait`]). A
/// broker brings a message asked back at its due time (the NAK delay, the
/// reconnect, which the intake times to it); one that has not come back
/// this long after was lost by the broker (a session it did not keep, a
/// stream limit), and holding on would stall the intake for nothing.
const HEAD_GRACE: Duration = Duration::from_secs(30);
/// The shortest and the longest an intake waits for a key's head at once.
const HEAD_WAIT_MIN: Duration = Duration::from_millis(200);
const HEAD_WAIT_MAX: Duration = Duration::from_secs(5);

/// A running thread, and the channel that says it has finished (sent from
/// a guard, so it also arrives when the thread panics).
struct Running {
    name: String,
    handle: JoinHandle<()>,
    done: crossbeam_channel::Receiver<()>,
}

struct DoneGuard(Sender<()>);

impl Drop for DoneGuard {
    fn drop(&mut self) {
        let _ = self.0.send(());
    }
}

/// The first engine thread that died, and why.
///
/// Invariant: once set, every call that hands the engine work is refused
/// with [`Error::Stopped`]: a dead dispatcher, worker, relay, reaper or
/// checkpointer means work accepted from then on may never be done (or
/// leases never expire, or the WAL never shrinks), so nothing more is
/// accepted and the caller is told why. Reads still work.
#[derive(Debug, Default)]
struct Casualty {
    /// Set after `first`, read first: the hot path's only cost.
    dead: AtomicBool,
    first: Mutex<Option<(String, String)>>,
}

impl Casualty {
    fn record(&self, thread: &str, reason: String) {
        let mut first = self.first.lock().unwrap_or_else(|p| p.into_inner());
        first.get_or_insert_with(|| (thread.to_owned(), reason));
        self.dead.store(true, Ordering::Release);
    }

    fn check(&self) -> Result<()> {
        if !self.dead.load(Ordering::Acquire) {
            return Ok(());
        }
        let first = self.first.lock().unwrap_or_else(|p| p.into_inner());
        let (thread, reason) = first.clone().unwrap_or_default();
        Err(Error::Stopped { thread, reason })
    }
}

/// Starts an engine thread. A panic escaping `body` is logged and recorded
/// in `casualty` before the thread ends (see [`Casualty`]); `join` still
/// reports it.
fn spawn(
    name: String,
    casualty: &Arc<Casualty>,
    body: impl FnOnce() + Send + 'static,
) -> Result<Running> {
    let (done_tx, done) = crossbeam_channel::bounded(1);
    let thread_name = name.clone();
    let casualty = Arc::clone(casualty);
    let handle = thread::Builder::new()
        .name(name.clone())
        .spawn(move || {
            let _done = DoneGuard(done_tx);
            if let Err(panic) = panic::catch_unwind(AssertUnwindSafe(body)) {
                let reason = panic_message(panic.as_ref());
                log::error!(
                    "postroom: thread {thread_name} panicked: {}; the engine refuses new \
                     work until it is shut down and opened again",
                    Esc(&reason)
                );
                casualty.record(&thread_name, reason);
                panic::resume_unwind(panic);
            }
        })
        .map_err(|e| Error::io("spawn thread", e))?;
    Ok(Running { name, handle, done })
}

/// The share of [`Postroom::shutdown`]'s deadline kept for the writer,
/// whatever the other threads take: it commits what they left queued and
/// closes the database.
const WRITER_SHARE: f64 = 0.2;
/// ... and at least this much (or half the deadline, if shorter): closing
/// syncs the file, which on a busy disk takes longer than a fifth of a
/// short deadline.
const WRITER_SHARE_FLOOR: Duration = Duration::from_secs(1);

/// `now + wait`; past what an `Instant` holds, a century from now, which
/// is as good as never.
fn deadline_after(wait: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(wait)
        .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 24 * 3600)))
        .unwrap_or(now)
}

impl Running {
    /// Joins the thread if it finishes before `deadline`.
    fn join(self, deadline: Instant, report: &mut ShutdownReport) {
        let left = deadline.saturating_duration_since(Instant::now());
        match self.done.recv_timeout(left) {
            Ok(()) | Err(RecvTimeoutError::Disconnected) => match self.handle.join() {
                Ok(()) => report.joined.push(self.name),
                Err(panic) => report
                    .panicked
                    .push((self.name, panic_message(panic.as_ref()))),
            },
            Err(RecvTimeoutError::Timeout) => {
                log::warn!("postroom: {} missed the shutdown deadline", self.name);
                report.missed_deadline.push(self.name);
            }
        }
    }
}

/// The engine's threads, in the order shutdown stops them.
#[derive(Default)]
struct Threads {
    dispatcher: Option<Running>,
    workers: Vec<Running>,
    reaper: Option<Running>,
    checkpointer: Option<Running>,
    /// Dropping it stops the reaper and the checkpointer.
    timers_stop: Option<Sender<()>>,
    relay: Option<Running>,
    relay_stop: Option<Sender<relay::StopAt>>,
    signals: Option<(Running, crate::platform::signals::Closer)>,
    writer: Option<Running>,
}

/// What [`Postroom::shutdown`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct ShutdownReport {
    /// Threads that finished and were joined.
    pub joined: Vec<String>,
    /// Threads still running at the deadline (left detached).
    pub missed_deadline: Vec<String>,
    /// Threads that had panicked, with the panic message.
    pub panicked: Vec<(String, String)>,
}

impl ShutdownReport {
    /// True when every thread stopped in time without panicking.
    pub fn is_clean(&self) -> bool {
        self.missed_deadline.is_empty() && self.panicked.is_empty()
    }
}

/// An open postroom database: the inbox, the outbox, and the threads that
/// serve them. Share it between threads by reference or in an `Arc`; every
/// method takes `&self`.
///
/// Dropping it shuts it down (waiting up to the builder's `drop_deadline`);
/// call [`Postroom::shutdown`] to choose the deadline and see the report.
pub struct Postroom {
    control: Arc<Control>,
    shared: Arc<Shared>,
    readers: Readers,
    /// Set once `shutdown` has closed the read connections.
    readers_closed: Arc<AtomicBool>,
    counters: Arc<Counters>,
    /// Consumers with a backlog bound (`Builder::backlog_limit`).
    brakes: HashMap<String, Brake>,
}

/// What shutting down needs, shared with the signal thread (which holds it
/// weakly, so it never keeps an engine alive).
struct Control {
    shared: Arc<Shared>,
    closed: AtomicBool,
    casualty: Arc<Casualty>,
    threads: Mutex<Threads>,
}

impl Control {
    /// An open engine's control, with its writer thread running.
    fn new(shared: &Arc<Shared>, casualty: Arc<Casualty>, writer: Running) -> Self {
        Control {
            shared: Arc::clone(shared),
            closed: AtomicBool::new(false),
            casualty,
            threads: Mutex::new(Threads {
                writer: Some(writer),
                ..Threads::default()
            }),
        }
    }
}

impl std::fmt::Debug for Postroom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Postroom")
            .field("path", &self.shared.path)
            .field("closed", &self.control.closed.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Postroom {
    /// A builder with the default settings.
    pub fn builder() -> Builder {
        Builder::default()
    }

    fn start_signal_thread(&self) -> Result<()> {
        use crate::platform::signals;
        let mut listener =
            signals::Listener::new().map_err(|e| Error::io("install signal handlers", e))?;
        let handle = listener.closer();
        let control = Arc::downgrade(&self.control);
        let running = spawn(
            "postroom-signals".into(),
            &self.control.casualty,
            move || {
                if let Some(request) = listener.wait() {
                    log::info!("postroom: {request}: shutting down");
                    if let Some(control) = control.upgrade() {
                        let deadline = control.shared.config.drop_deadline;
                        match control.shutdown(deadline) {
                            Ok(report) if !report.is_clean() => {
                                log::error!("postroom: shutdown on signal: {report:?}")
                            }
                            _ => {}
                        }
                    }
                    // Then do what the signal would have done.
                    signals::after_shutdown(request);
                }
            },
        )?;
        self.control.lock_threads().signals = Some((running, handle));
        Ok(())
    }

    fn start_background(
        &self,
        shared: &Arc<Shared>,
        sink: Option<Box<dyn Sink>>,
        relay_woken: crossbeam_channel::Receiver<()>,
        checkpoint_inputs: CheckpointInputs,
        wal_bounds: wal::WalBounds,
        worker_slots: Vec<ClaimSlot>,
    ) -> Result<()> {
        let casualty = &self.control.casualty;
        let mut threads = self.control.lock_threads();
        if let Some(sink) = sink {
            let (stop_tx, stop_rx) = crossbeam_channel::bounded(1);
            threads.relay_stop = Some(stop_tx);
            let s = Arc::clone(shared);
            threads.relay = Some(spawn("postroom-relay".into(), casualty, move || {
                relay::relay(s, sink, relay_woken, stop_rx)
            })?);
        }
        let (stop_tx, stop_rx) = crossbeam_channel::bounded::<()>(0);
        threads.timers_stop = Some(stop_tx);
        let s = Arc::clone(shared);
        let stop = stop_rx.clone();
        let readers = self.readers.clone();
        threads.reaper = Some(spawn("postroom-reaper".into(), casualty, move || {
            reaper::reap(s, readers, stop)
        })?);
        let checkpointer = checkpoint::Checkpointer {
            db: shared.path.clone(),
            config: shared.config.clone(),
            bounds: wal_bounds,
            counters: Arc::clone(&self.counters),
            writer: shared.writer.clone(),
            wake: checkpoint_inputs.woken,
            stop: stop_rx,
            guard: checkpoint_inputs.guard,
            slow_record: checkpoint_inputs.slow_record,
            watch: checkpoint_inputs.watch,
        };
        threads.checkpointer = Some(spawn(
            "postroom-checkpointer".into(),
            casualty,
            move || checkpointer.run(),
        )?);
        let workers = shared.config.workers;
        if workers == 0 || shared.consumers.is_empty() {
            return Ok(());
        }
        let (work_tx, work_rx) = crossbeam_channel::bounded(workers);
        for (n, slot) in worker_slots.into_iter().enumerate() {
            let (s, rx) = (Arc::clone(shared), work_rx.clone());
            threads.workers.push(spawn(
                format!("postroom-worker-{n}"),
                casualty,
                move || workers::work(s, rx, slot),
            )?);
        }
        let s = Arc::clone(shared);
        threads.dispatcher = Some(spawn("postroom-dispatcher".into(), casualty, move || {
            workers::dispatch(s, work_tx)
        })?);
        Ok(())
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.shared.path
    }

    /// Checks a message against this engine's limits, as `receive` would.
    pub(crate) fn check_message(&self, msg: &Message) -> Result<()> {
        self.shared.config.check_message(msg)
    }

    /// For the intakes: how long `msg` must wait before it is delivered
    /// inline to `consumer`, because an earlier message of its ordering key
    /// is unfinished in the inbox (failed and waiting for its redelivery,
    /// or pending): `None` when nothing of the key is ahead of it (the head
    /// is `msg` itself, or `msg` is a redelivery of an earlier settled
    /// row). The inbox is what survives an intake's (or
    /// the process's) restart, so per-key order does too; an intake's own
    /// memory of what it asked back does not.
    ///
    /// A head overdue by [`HEAD_GRACE`] (its redelivery never came: the
    /// broker dropped it, or it went elsewhere) holds nothing any more:
    /// the key goes on, as it did before, rather than wedge.
    pub(crate) fn intake_key_wait(
        &self,
        consumer: &str,
        msg: &Message,
    ) -> Result<Option<Duration>> {
        let Some(key) = msg.ordering_key.as_deref() else {
            return Ok(None);
        };
        let conn = self.reader()?;
        let Some(head) = strict::head_ahead_of(&conn, consumer, key, &msg.source, &msg.id)
            .map_err(|e| Error::sqlite("read the ordering key's head", e))?
        else {
            return Ok(None);
        };
        let now = self.shared.clock.now_ms();
        let due = head.next_attempt_at.unwrap_or(head.updated_at);
        if now > due.saturating_add(clock::millis(HEAD_GRACE)) {
            log::warn!(
                consumer, message_id = msg.id.as_str();
                "consumer {:?}: message {}/{} of key {:?} passes {}/{} ({}), overdue by over {:?}",
                Esc(consumer), Esc(&msg.source), Esc(&msg.id), Esc(key),
                Esc(&head.source), Esc(&head.message_id), head.status, HEAD_GRACE
            );
            return Ok(None);
        }
        let wait = u64::try_from(due.saturating_sub(now)).unwrap_or(0);
        Ok(Some(
            Duration::from_millis(wait).clamp(HEAD_WAIT_MIN, HEAD_WAIT_MAX),
        ))
    }

    fn consumer(&self, name: &str) -> Result<Arc<Consumer>> {
        self.shared
            .consumers
            .get(name)
            .cloned()
            .ok_or_else(|| Error::UnknownConsumer {
                consumer: name.to_owned(),
            })
    }

    /// Delivers `msg` to `consumer` inline: records it in the inbox, runs
    /// the consumer's handler and stores its outbox rows, all in one
    /// transaction, and returns once that is durable. Acknowledge the
    /// message to your broker when [`Outcome::should_ack`] says so.
    ///
    /// On `Err` nothing was stored and nothing may be acknowledged; the
    /// error says what went wrong ([`Error::is_retryable`]).
    ///
    /// ```
    /// use postroom::{handler_fn, Failure, Message, Outcome, Postroom};
    ///
    /// # fn main() -> postroom::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// let room = Postroom::builder()
    ///     .consumer("greeter", handler_fn(|_tx, msg| match msg.payload() {
    ///         b"" => Err(Failure::reject("empty greeting")),
    ///         _ => Ok(()),
    ///     }))
    ///     .open(dir.path().join("app.db"))?;
    ///
    /// // In the broker's callback:
    /// let outcome = room.deliver("greeter", Message::new("chat", "m-1", "hello"))?;
    /// assert_eq!(outcome, Outcome::Processed { attempts: 1 });
    /// if outcome.should_ack() {
    ///     // broker.ack(..)
    /// } else {
    ///     // broker.nack(..), redeliver after outcome.retry_after()
    /// }
    /// let rejected = room.deliver("greeter", Message::new("chat", "m-2", ""))?;
    /// assert!(matches!(rejected, Outcome::Dead { attempts: 1, .. }));
    /// assert!(rejected.should_ack()); // parked as a dead letter: nothing lost
    /// # Ok(()) }
    /// ```
    pub fn deliver(&self, consumer: &str, msg: Message) -> Result<Outcome> {
        let started = Instant::now();
        let outcome = self.deliver_now(consumer, msg);
        if let Ok(outcome) = &outcome {
            telemetry::outcome(consumer, outcome);
            telemetry::deliver_latency(consumer, started.elapsed());
        }
        outcome
    }

    fn deliver_now(&self, consumer: &str, msg: Message) -> Result<Outcome> {
        let consumer = self.consumer(consumer)?;
        let ConsumerKind::Transactional(handler) = consumer.kind.clone() else {
            return Err(Error::invalid(
                "consumer",
                format!(
                    "{:?} has an effectful handler; send it messages with receive()",
                    consumer.name
                ),
            ));
        };
        self.shared.config.check_message(&msg)?;
        let hash = *blake3::hash(&msg.payload).as_bytes();
        self.check_caller()?;
        // A message whose fate is already committed is answered from a read,
        // on the caller's thread, without a batch: on the write connection
        // when this caller may lead, else from the read pool rather than
        // queueing behind other callers' batches. A new message is looked
        // up again inside the batch (the operator's CLI may have changed
        // the row in between): one index probe, against a write transaction
        // and its locks for every duplicate.
        let mut leader = self.shared.writer.lead();
        let known = match &mut leader {
            Some(leader) => answer_if_settled(leader.conn(), &consumer.name, &msg, &hash),
            None => self
                .reader()
                .ok()
                .and_then(|conn| answer_if_settled(&conn, &consumer.name, &msg, &hash)),
        };
        if let Some(outcome) = known {
            return Ok(outcome);
        }
        // Counted from here, with a job to hand in: a batch waits for the
        // callers it counts (a redelivery answered above hands in none).
        let _caller = self.shared.writer.caller();
        // Runs again, in a fresh transaction, when one job's SQL rolled the
        // shared one back: a delivery whose handler did so records it as a
        // failed attempt.
        let mut rolled_back = false;
        let job = writer::rerunnable_job(move |w: &mut WriterCtx<'_>| {
            let conn = w.conn;
            let mut env = w.env();
            let step = if rolled_back {
                Step::RolledBack
            } else {
                Step::Run(&*handler)
            };
            let outcome = delivery::deliver(&mut env, &consumer.name, step, &msg, &hash);
            if matches!(outcome, Err(Error::RolledBack { .. })) && conn.is_autocommit() {
                rolled_back = true;
            }
            outcome
        });
        match leader {
            Some(leader) => leader.run_job(job),
            None => self.shared.writer.enqueue_job(job),
        }
    }

    /// Stores `msg` for `consumer`'s workers to process later (queued
    /// mode), and returns once it is durable: acknowledge it to the broker
    /// right away. A message seen before is not stored again
    /// ([`Receipt::Duplicate`], or [`Receipt::DuplicateBySequence`] when
    /// only its sequence number remembers it); one whose id was seen with
    /// another payload, or whose number conflicts, is quarantined
    /// ([`Receipt::Conflict`]).
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// use postroom::{handler_fn, Message, Postroom, Receipt};
    ///
    /// # fn main() -> postroom::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// let room = Postroom::builder()
    ///     .consumer("sync", handler_fn(|tx, msg| {
    ///         tx.execute("INSERT INTO notes (id) VALUES (?1)", [msg.id()])?;
    ///         Ok(())
    ///     }))
    ///     .open(dir.path().join("app.db"))?;
    /// room.transaction(|tx| Ok(tx.execute_batch("CREATE TABLE notes (id TEXT)")?))?;
    ///
    /// let note = Message::new("phone", "note-1", "…").with_ordering_key("notebook-7");
    /// assert_eq!(room.receive("sync", note.clone())?, Receipt::Accepted); // ack now
    /// assert_eq!(room.receive("sync", note)?, Receipt::Duplicate);
    ///
    /// // Processed in the background, in receive order per ordering key.
    /// let deadline = Instant::now() + Duration::from_secs(10);
    /// while room.stats()?.inbox["sync"].completed < 1 && Instant::now() < deadline {
    ///     std::thread::sleep(Duration::from_millis(10));
    /// }
    /// assert_eq!(room.stats()?.inbox["sync"].completed, 1);
    /// # Ok(()) }
    /// ```
    pub fn receive(&self, consumer: &str, msg: Message) -> Result<Receipt> {
        let mut receipts = self.receive_batch(consumer, vec![msg])?;
        Ok(receipts.pop().unwrap_or(Receipt::Duplicate))
    }

    /// Stores a batch of messages in one transaction (one fsync), as
    /// [`receive`](Postroom::receive) does each; receipts come in the same
    /// order. If any message is invalid, none is stored. A message repeated
    /// within the batch is stored once, the repeats being duplicates.
    pub fn receive_batch(
        &self,
        consumer: &str,
        msgs: impl IntoIterator<Item = Message>,
    ) -> Result<Vec<Receipt>> {
        let name = consumer;
        let consumer = self.consumer(consumer)?;
        let msgs: Vec<Message> = msgs.into_iter().collect();
        let brake = self.brakes.get(name);
        for (i, msg) in msgs.iter().enumerate() {
            self.shared.config.check_message(msg).map_err(|e| match e {
                Error::InvalidInput { field, reason } => Error::InvalidInput {
                    field,
                    reason: format!("message {i} of the batch: {reason}"),
                },
                other => other,
            })?;
        }
        let hashes: Vec<[u8; 32]> = msgs
            .iter()
            .map(|m| *blake3::hash(&m.payload).as_bytes())
            .collect();
        self.check_caller()?;
        if let Some(brake) = brake {
            brake.admit(|| self.reader())?;
        }
        // Runs again if another job's SQL rolls the shared transaction back.
        let receipts = self
            .shared
            .writer
            .submit_job(writer::rerunnable_job(move |w| {
                let now = w.clock.now_ms();
                let receipts = msgs
                    .iter()
                    .zip(&hashes)
                    .map(|(msg, hash)| {
                        queue::receive(w.conn, &consumer.name, msg, hash, now)
                            .map_err(|e| Error::sqlite("store received message", e))
                    })
                    .collect::<Result<Vec<_>>>()?;
                failpoint::hit("receive.after_insert")?;
                Ok(receipts)
            }))?;
        let accepted = receipts.iter().filter(|r| **r == Receipt::Accepted).count();
        if accepted > 0 {
            self.shared.wake();
        }
        if let Some(brake) = brake {
            brake.stored(accepted as u64);
        }
        for receipt in &receipts {
            telemetry::receipt(name, receipt);
        }
        Ok(receipts)
    }

    /// Runs `f` in a write transaction of its own (sharing a group commit
    /// with concurrent deliveries), for application writes that are not
    /// caused by an incoming message, such as publishing from a user action:
    /// domain rows and [`Tx::publish`]ed messages commit together.
    ///
    /// If `f` fails or panics its writes are rolled back and the failure is
    /// returned as [`Error::Aborted`] (or the SQLite error it carried).
    /// `f` gets the same [`Tx`] a handler does, under the same rules: SQL
    /// for the application's tables, no connection settings.
    pub fn transaction<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Tx<'_>) -> Result<T, Failure> + Send + 'static,
    {
        self.submit(move |w| {
            let guard = w.guard;
            // In a savepoint of its own, as a handler runs: a transaction
            // SQLite rolled back under it, and one it began after that,
            // are found by the savepoint missing.
            delivery::exec(w.conn, "SAVEPOINT postroom_handler")?;
            let mut tx = Tx::new(w.conn, w.config, guard, w.clock.now_ms(), None);
            let result = panic::catch_unwind(AssertUnwindSafe(|| guard.run(|| f(&mut tx))));
            // As after a handler (see `delivery::run_user_step`); a
            // refused statement is the first cause, whatever it left.
            let succeeded = matches!(result, Ok(Ok(_)));
            let broken = match delivery::check_left_state(w.conn, guard, succeeded)? {
                // SQLite rolled back by itself (see `guard`).
                delivery::Left::Lost => {
                    return Err(delivery::rolled_back(
                        "transaction",
                        result.ok().and_then(Result::err),
                    ))
                }
                delivery::Left::Broken(failure) => Some(failure),
                delivery::Left::Sound => None,
            };
            let refused = match &result {
                Ok(Err(failure)) => delivery::refusal(guard, failure),
                _ => None,
            };
            let fails = broken.is_some() || !matches!(result, Ok(Ok(_)));
            if !delivery::end_savepoint(w.conn, fails)? {
                return Err(delivery::rolled_back("transaction", None));
            }
            if let Some(failure) = refused.or(broken) {
                return Err(Error::Aborted {
                    reason: failure.to_string(),
                });
            }
            match result {
                Ok(Ok(value)) => Ok(value),
                Ok(Err(Failure::Sqlite(e))) => Err(Error::sqlite("transaction", e)),
                Ok(Err(failure)) => Err(Error::Aborted {
                    reason: failure.to_string(),
                }),
                Err(panic) => Err(Error::Aborted {
                    reason: format!("closure panicked: {}", panic_message(panic.as_ref())),
                }),
            }
        })
    }

    /// Test support, not part of the API: sets the write connection's page
    /// quota (`PRAGMA max_page_count`), which is how the tests fill the
    /// disk on demand, and returns the quota now in force. User code cannot
    /// set it (it is connection state; see [`Tx`]).
    #[doc(hidden)]
    pub fn set_max_page_count_for_tests(&self, pages: u32) -> Result<u64> {
        self.submit(move |w| {
            // The engine's own change: the value user code is held to now.
            let set = w
                .guard
                .set_max_page_count(w.conn, pages)
                .map_err(|e| Error::sqlite("set max_page_count", e))?;
            Ok(u64::try_from(set).unwrap_or(0))
        })
    }

    /// Test support (feature `testkit`, crate-private): the leases this
    /// process holds expire now and a reaper pass runs, as if the steps
    /// holding them had outlived them; returns the leases expired. Their
    /// rows come due again while the steps still run, whose results the
    /// lease fence then discards.
    #[cfg(feature = "testkit")]
    pub(crate) fn expire_leases_for_tests(&self) -> Result<u64> {
        self.shared.leases.expire_all(Instant::now());
        reaper::run_once(&self.shared, &self.readers).map(|r| r.leases_expired)
    }

    /// Test support: expires the leases whose worker gave up on its claim
    /// (its result could not be recorded) and runs a reaper pass, if there
    /// was one; how many leases expired.
    #[cfg(feature = "testkit")]
    pub(crate) fn expire_given_up_leases_for_tests(&self) -> Result<u64> {
        if !self.shared.leases.expire_given_up(Instant::now()) {
            return Ok(0);
        }
        reaper::run_once(&self.shared, &self.readers).map(|r| r.leases_expired)
    }

    /// Counts per status per consumer, outbox backlog, conflicts and file
    /// sizes, read through the read pool (it does not wait for the writer).
    ///
    /// Cost: one pass over the inbox and one over the outbox, in proportion
    /// to the rows retained (docs/BENCHMARKS.md has what that costs at
    /// millions of rows), and the WAL cannot be restarted past the read
    /// while it runs. At millions of rows, poll it every few seconds at most.
    pub fn stats(&self) -> Result<Stats> {
        let conn = self.reader()?;
        let mut stats = stats::read(&conn, &self.shared.path)?;
        stats.batches_committed = self.counters.batches.load(Ordering::Relaxed);
        stats.jobs_committed = self.counters.jobs.load(Ordering::Relaxed);
        stats.wal_checkpoints_blocked = self.counters.checkpoints_blocked.load(Ordering::Relaxed);
        stats.slow_handlers = self.counters.slow_handlers.load(Ordering::Relaxed);
        stats.wal_frames_written = self.counters.wal_frames.load(Ordering::Relaxed);
        stats.wal_checkpoints = self.counters.checkpoints.load(Ordering::Relaxed);
        stats.wal_checkpoints_inline = self.counters.inline_checkpoints.load(Ordering::Relaxed);
        stats.wal_paused = Duration::from_micros(self.counters.paused_us.load(Ordering::Relaxed));
        stats.wal_paused_max =
            Duration::from_micros(self.counters.paused_max_us.load(Ordering::Relaxed));
        let now = self.shared.clock.now_ms();
        for (consumer, counts) in &stats.inbox {
            let age = counts.oldest_waiting_for_redelivery_ms.map(|at| {
                Duration::from_millis(u64::try_from(now.saturating_sub(at)).unwrap_or(0))
            });
            telemetry::waiting_for_redelivery(consumer, counts.waiting_for_redelivery, age);
        }
        Ok(stats)
    }

    /// Starts `consumer`'s sequence stream `stream` (the source, for
    /// [`Message::with_sequence`]) afresh at `next`: for a sender whose
    /// counter was reset (a new epoch), or one whose numbers do not start
    /// at 1. Everything below `next` counts as settled from now on, nothing
    /// above it; the stream's retained rows keep deduplicating by key but
    /// lose their numbers, so the new epoch's numbers conflict with none
    /// of them. Returns false when the stream was not known (it is
    /// created); [`Error::UnknownConsumer`] for a consumer this engine does
    /// not have.
    ///
    /// Careful: a message of the old epoch below `next` that never
    /// settled and whose row is gone is answered as a duplicate after
    /// this. Reset once the old epoch is drained (`stats().sequences`
    /// shows what it is missing), or name a new stream instead
    /// ([`Message::with_sequence_in`]).
    pub fn reset_sequence(&self, consumer: &str, stream: &str, next: u64) -> Result<bool> {
        // A consumer of this engine: a typo must not create a stream.
        self.consumer(consumer)?;
        crate::config::check_name("sequence stream", stream)?;
        crate::config::check_sequence(next)?;
        let (consumer, stream) = (consumer.to_owned(), stream.to_owned());
        self.submit(move |w| {
            crate::store::watermark::reset(w.conn, &consumer, &stream, next)
                .map_err(|e| Error::sqlite("reset sequence stream", e))
        })
    }

    /// Where a puller of `consumer`'s sequence stream `stream` (the source,
    /// for [`Message::with_sequence`]) resumes: every sequence at or below
    /// the answer has settled, or is stored for queued processing
    /// ([`receive`](Postroom::receive)), so asking the sender for the
    /// changes after it loses nothing, whatever happened to the puller (a
    /// kill, a reboot). A message taken inline ([`deliver`](Postroom::deliver))
    /// counts once it settled: until then its sender must deliver it again.
    /// 0 for a stream nothing has been stored in yet.
    ///
    /// One read (one snapshot) of the stream's watermark and of the rows
    /// just above it (at most [`RESUME_WALK`](crate::RESUME_WALK); past
    /// that the answer stops short and the puller pulls some again, each
    /// repeat a duplicate — unless the stream has
    /// [`unrecorded`](crate::StreamWatermark::unrecorded) sequences whose
    /// rows retention removed: those are taken as new; reset it). As
    /// durable as the receives it counts: at `Durability::Normal` a power
    /// cut can take the last commits, and the answer with them.
    /// [`Error::UnknownConsumer`] for a consumer this engine does not have.
    pub fn resume_point(&self, consumer: &str, stream: &str) -> Result<u64> {
        self.consumer(consumer)?;
        crate::config::check_name("sequence stream", stream)?;
        let conn = self.reader()?;
        crate::store::watermark::resume_point(&conn, consumer, stream)
            .map_err(|e| Error::sqlite("read the resume point", e))
    }

    /// The file's instance id (128 random bits as hex, given when the file
    /// was created, or anew when it was found to be a copy): what tells
    /// two databases apart across a fleet.
    #[cfg(feature = "nats")]
    pub(crate) fn instance_id(&self) -> Result<String> {
        let conn = self.reader()?;
        crate::store::identity::instance_id(&conn)
            .map_err(|e| Error::sqlite("read the instance id", e))
    }

    /// Creates `consumer`'s stream `stream` starting at `next` unless it
    /// exists (for [`InboxSink`](crate::InboxSink)'s first batch from an
    /// upstream).
    pub(crate) fn start_sequence(&self, consumer: &str, stream: &str, next: u64) -> Result<()> {
        crate::config::check_sequence(next)?;
        let (consumer, stream) = (consumer.to_owned(), stream.to_owned());
        self.submit(move |w| {
            crate::store::watermark::start(w.conn, &consumer, &stream, next)
                .map_err(|e| Error::sqlite("start sequence stream", e))
        })
    }

    #[cfg_attr(not(feature = "mqtt"), allow(dead_code))] // used by the MQTT intake
    /// Whether an intake can hand `consumer` its messages, inline
    /// ([`deliver`](Postroom::deliver)) or queued: an unknown consumer is
    /// [`Error::UnknownConsumer`], an effectful one inline
    /// [`Error::InvalidInput`] (it takes messages through `receive` only).
    /// Intakes ask when they start, so that a misconfiguration is refused
    /// there rather than found out per message.
    pub(crate) fn check_intake(&self, consumer: &str, inline: bool) -> Result<()> {
        let found = self.consumer(consumer)?;
        if inline && matches!(found.kind, ConsumerKind::Effectful(_)) {
            return Err(Error::invalid(
                "consumer",
                format!(
                    "{consumer:?} has an effectful handler, which takes messages through \
                     receive() only: make the intake queued"
                ),
            ));
        }
        Ok(())
    }

    #[cfg_attr(not(feature = "mqtt"), allow(dead_code))] // used by the MQTT intake
    /// Stores a message an intake cannot hand on as it is (the engine
    /// refuses it: [`Error::InvalidInput`]) straight into `consumer`'s dead
    /// letters, with its payload and `reason`, and returns once that is
    /// durable: the intake may then acknowledge it. What makes it storable
    /// (a replaced id, a dropped sequence, a cut payload) is added to the
    /// reason (`config::storable`). A resend of it is a
    /// [`Receipt::Duplicate`], not a second dead letter. An operator sees it
    /// in `postroom dead list` and may redrive it (the workers then run it
    /// as it was stored) or discard it.
    pub(crate) fn receive_dead(
        &self,
        consumer: &str,
        msg: Message,
        reason: &str,
    ) -> Result<Receipt> {
        let consumer = self.consumer(consumer)?;
        // The digest of the payload as it came: a resend finds the row.
        let hash = *blake3::hash(&msg.payload).as_bytes();
        let (msg, reason) = crate::config::storable(msg, reason);
        self.check_caller()?;
        self.shared
            .writer
            .submit_job(writer::rerunnable_job(move |w| {
                let now = w.clock.now_ms();
                queue::receive_dead(w.conn, &consumer.name, &msg, &hash, &reason, now)
                    .map_err(|e| Error::sqlite("store a refused message as a dead letter", e))
            }))
    }

    /// Dead-lettered inbox messages, oldest first, of one consumer or all,
    /// at most `limit`.
    pub fn dead_letters(&self, consumer: Option<&str>, limit: usize) -> Result<Vec<DeadLetter>> {
        let conn = self.reader()?;
        queue::dead_letters(&conn, consumer, limit)
            .map_err(|e| Error::sqlite("list dead letters", e))
    }

    /// Sends a dead letter (by [`DeadLetter::id`]) back to be processed by
    /// the workers, with its attempts reset. Returns false when there is no
    /// dead letter with that id.
    pub fn redrive(&self, id: i64) -> Result<bool> {
        let redriven = self.submit(move |w| {
            queue::redrive(w.conn, id, w.clock.now_ms()).map_err(|e| Error::sqlite("redrive", e))
        })?;
        if redriven {
            self.shared.wake();
        }
        Ok(redriven)
    }

    /// Gives up on a dead letter for good: it is marked completed without
    /// its effects (payload dropped, reason kept), so a redelivery is a
    /// `Duplicate` rather than a new attempt. Returns false when there is no
    /// dead letter with that id.
    pub fn discard(&self, id: i64) -> Result<bool> {
        self.submit(move |w| {
            queue::discard(w.conn, id, w.clock.now_ms()).map_err(|e| Error::sqlite("discard", e))
        })
    }

    /// The inbox row of one message of `consumer` (the key a redelivery is
    /// matched on: source and message id), without its payload: its row id
    /// (what [`retry_now`](Postroom::retry_now), [`cancel`](Postroom::cancel)
    /// and [`redrive`](Postroom::redrive) take), status, attempts and last
    /// error. `None` when there is none (never received, or deleted by
    /// retention). One index seek.
    ///
    /// ```
    /// use postroom::{handler_fn, Message, Postroom, Status};
    ///
    /// # fn main() -> postroom::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// let room = Postroom::builder()
    ///     .consumer("greeter", handler_fn(|_tx, _msg| Ok(())))
    ///     .open(dir.path().join("app.db"))?;
    /// room.deliver("greeter", Message::new("chat", "m-1", "hello"))?;
    /// let row = room.find_message("greeter", "chat", "m-1")?.expect("stored");
    /// assert_eq!(row.status, Status::Completed);
    /// assert!(room.find_message("greeter", "chat", "m-2")?.is_none());
    /// # Ok(()) }
    /// ```
    pub fn find_message(
        &self,
        consumer: &str,
        source: &str,
        message_id: &str,
    ) -> Result<Option<crate::store::inbox::InboxEntry>> {
        let conn = self.reader()?;
        crate::store::inbox::entry_by_key(&conn, consumer, source, message_id)
            .map_err(|e| Error::sqlite("find a message", e))
    }

    /// Retries a failed inbox row (by its row id) now rather than at its
    /// next attempt's time: the workers take it at once, its attempts
    /// still counted. A row delivered inline becomes the workers' to retry,
    /// as a redriven one does; its broker's redelivery is then answered
    /// from the row. Returns false when the row is not failed (pending,
    /// being processed, finished or gone).
    pub fn retry_now(&self, id: i64) -> Result<bool> {
        let due = self.submit(move |w| {
            queue::retry_now(w.conn, id, w.clock.now_ms())
                .map_err(|e| Error::sqlite("retry now", e))
        })?;
        if due {
            self.shared.wake();
        }
        Ok(due)
    }

    /// Gives up on an inbox row (by its row id) that is pending or failed
    /// and that no worker holds: it becomes a dead letter, its payload
    /// kept and `reason` in its last error (`cancelled by operator: …`), so
    /// nothing retries it and [`redrive`](Postroom::redrive) brings it back.
    /// Its key's later messages go on, except under
    /// [`strict_order`](crate::Builder::strict_order), where a dead letter
    /// holds its key until it is redriven or discarded. Returns false when
    /// the row is not pending or failed.
    pub fn cancel(&self, id: i64, reason: &str) -> Result<bool> {
        let reason = reason.to_owned();
        let cancelled = self.submit(move |w| {
            queue::cancel(w.conn, id, &reason, w.clock.now_ms())
                .map_err(|e| Error::sqlite("cancel", e))
        })?;
        if cancelled {
            self.shared.wake();
        }
        Ok(cancelled)
    }

    /// Outbox messages the relay gave up on, oldest first, at most `limit`.
    pub fn outbox_dead_letters(&self, limit: usize) -> Result<Vec<OutboxMessage>> {
        let conn = self.reader()?;
        outbox::dead_letters(&conn, limit).map_err(|e| Error::sqlite("list outbox dead letters", e))
    }

    /// Sends a dead outbox message (by [`OutboxMessage::seq`]) back to the
    /// relay with its attempts reset. Returns false when there is no dead
    /// outbox message with that seq.
    pub fn redrive_outbox(&self, seq: i64) -> Result<bool> {
        self.submit(move |w| outbox::redrive(w.conn, seq).map_err(|e| Error::sqlite("redrive", e)))
    }

    /// Gives up on a dead outbox message: it will not be sent. It is marked
    /// `sent` without being handed over (payload dropped, `last_error` says
    /// "discarded by operator"), and retention deletes it like any sent
    /// row; its `seq` is never given out again. Returns false when there is
    /// no dead outbox message with that seq.
    pub fn discard_outbox(&self, seq: i64) -> Result<bool> {
        self.submit(move |w| {
            outbox::discard(w.conn, seq, w.clock.now_ms()).map_err(|e| Error::sqlite("discard", e))
        })
    }

    /// Runs a reaper pass now: expired leases, then retention.
    pub fn cleanup(&self) -> Result<CleanupReport> {
        self.check_caller()?;
        reaper::run_once(&self.shared, &self.readers)
    }

    /// Stops the engine: no new work is accepted, the dispatcher stops
    /// claiming, workers finish the message in hand (claims not yet started
    /// are handed back), the relay hands over what is due, queued writes are
    /// committed, and every thread is joined, waiting at most `deadline` in
    /// all. A thread still running at the deadline is left detached and
    /// named in the report; rows it left `processing` are recovered at the
    /// next open. Calling it again returns [`Error::Closed`]. Any deadline
    /// is taken; one past what the clock can count (`Duration::MAX`) waits
    /// as long as the threads take.
    pub fn shutdown(&self, deadline: Duration) -> Result<ShutdownReport> {
        let report = self.control.shutdown(deadline);
        // Nothing of the engine keeps the database open once this returns:
        // also when the signal thread shut it down first (`Closed`). Not
        // from inside a handler, whose batch still runs.
        if !self.shared.writer.held_here() {
            crate::runtime::close_readers(&self.readers, &self.readers_closed);
        }
        report
    }

    fn reader(&self) -> Result<r2d2::PooledConnection<ReadManager>> {
        if self.control.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        read_connection(&self.readers)
    }

    fn check_caller(&self) -> Result<()> {
        if self.control.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        self.control.casualty.check()?;
        if self.shared.writer.held_here() {
            return Err(Error::invalid(
                "caller",
                "called from inside a handler; that would wait on itself forever",
            ));
        }
        Ok(())
    }

    /// Runs `work` in a batch (leading it, or queued for the writer thread)
    /// and returns its answer, which comes after that batch has committed.
    fn submit<T, F>(&self, work: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut WriterCtx<'_>) -> Result<T> + Send + 'static,
    {
        self.check_caller()?;
        self.shared.writer.submit(work)
    }
}

impl Control {
    fn lock_threads(&self) -> std::sync::MutexGuard<'_, Threads> {
        self.threads
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn shutdown(&self, deadline: Duration) -> Result<ShutdownReport> {
        if self.closed.swap(true, Ordering::AcqRel) {
            return Err(Error::Closed);
        }
        self.shared.stopping.store(true, Ordering::Release);
        self.shared.wake();
        if self.shared.writer.held_here() {
            // A handler cannot wait for the batch it runs in. The writer
            // stops once the jobs queued so far are done.
            self.shared.writer.stop();
            return Err(Error::invalid(
                "caller",
                "shutdown called from inside a handler; the engine stops after this batch",
            ));
        }
        // The writer commits what the others leave queued (the relay's
        // marks, the workers' last results) and closes the database: it
        // always gets its share. The others share the rest, so a thread
        // stuck in user code (a sink's `send`, a handler) costs only its
        // own place in the report.
        // Shares of the deadline as an `Instant` holds it (`Duration::MAX`
        // is a century), not of the `Duration`: a share of `MAX` taken from
        // a century ahead would land before now.
        let now = Instant::now();
        let deadline = deadline_after(deadline);
        let total = deadline.saturating_duration_since(now);
        let writer_share = total
            .mul_f64(WRITER_SHARE)
            .max((total / 2).min(WRITER_SHARE_FLOOR));
        let others = deadline.checked_sub(writer_share).unwrap_or(now);
        let mut threads = std::mem::take(&mut *self.lock_threads());
        let mut report = ShutdownReport::default();
        if let Some((running, handle)) = threads.signals.take() {
            handle.close();
            // The signal thread may be the one shutting us down.
            if running.handle.thread().id() != thread::current().id() {
                running.join(others, &mut report);
            }
        }
        drop(threads.timers_stop.take());
        if let Some(t) = threads.dispatcher.take() {
            t.join(others, &mut report);
        }
        for t in threads.workers.drain(..) {
            t.join(others, &mut report);
        }
        if let Some(t) = threads.reaper.take() {
            t.join(others, &mut report);
        }
        if let Some(t) = threads.checkpointer.take() {
            t.join(others, &mut report);
        }
        // The relay flushes what is due (workers may just have published)
        // until shortly before its share ends; it needs the writer to mark
        // what it sent, so it stops a tenth of its time early.
        if let Some(stop) = threads.relay_stop.take() {
            let left = others.saturating_duration_since(Instant::now());
            let _ = stop.try_send(Instant::now() + left.mul_f64(0.9));
        }
        if let Some(t) = threads.relay.take() {
            t.join(others, &mut report);
        }
        self.shared.writer.stop();
        if let Some(t) = threads.writer.take() {
            t.join(deadline, &mut report);
        }
        Ok(report)
    }
}

impl Drop for Postroom {
    fn drop(&mut self) {
        if let Ok(report) = self.control.shutdown(self.shared.config.drop_deadline) {
            if !report.is_clean() {
                log::error!("postroom: shutdown on drop: {report:?}");
            }
        }
    }
}

/// The answer for a message whose fate is already committed: completed, or
/// dead, with the same payload digest. Those states are final (only an
/// operator's redrive leaves `dead`, and a redelivery racing a redrive may
/// be told either), so a duplicate storm costs one indexed read per
/// message. Anything else, or any error, is `None`: the writer decides.
///
/// A sequenced message is also answered here when its number says it
/// settled ([`Outcome::DuplicateBySequence`]), and left to the writer when
/// its number conflicts (quarantining writes).
fn answer_if_settled(
    conn: &Connection,
    consumer: &str,
    msg: &Message,
    hash: &[u8; 32],
) -> Option<Outcome> {
    match admission::peek(conn, consumer, msg, hash).ok()? {
        Admission::Duplicate => Some(Outcome::Duplicate),
        Admission::DuplicateBySequence { sequence } => {
            Some(Outcome::DuplicateBySequence { sequence })
        }
        Admission::Stored { row, .. } => delivery::final_outcome(row),
        Admission::New | Admission::Conflict(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::store::inflight::StartedClaim;

    /// A claim slot left stale by a power cut names an earlier lease of the
    /// row: only the lease it names counts an attempt.
    #[test]
    fn recovery_counts_a_started_claim_only_under_its_own_lease() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let config = Config::default();
        crate::store::schema::create_private(&path).unwrap();
        let mut conn = crate::store::schema::open_writer(&path, &config).unwrap();
        crate::store::schema::migrate(&mut conn).unwrap();
        let msg = Message::new("s", "m", "p");
        let hash = *blake3::hash(msg.payload()).as_bytes();
        let status = |conn: &Connection| -> (String, u32) {
            conn.query_row("SELECT status, attempts FROM postroom_inbox", [], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .unwrap()
        };
        queue::receive(&conn, "c", &msg, &hash, 0).unwrap();
        let claim = |conn: &Connection, token| {
            let due = queue::Due {
                consumer: "c",
                order: crate::config::KeyOrder::DeadReleases,
                limit: 1,
                now_ms: 0,
                max_attempts: 5,
            };
            let claimed = queue::claim(conn, due, 60_000, token).unwrap();
            assert_eq!(claimed.len(), 1);
            claimed[0].row_id
        };
        let row_id = claim(&conn, 7);
        assert_eq!(status(&conn), ("processing".into(), 1));

        // The slot names lease 3 (an earlier, finished attempt): the
        // current lease only waited, and is handed back uncounted.
        let stale = [StartedClaim { row_id, token: 3 }];
        crate::recovery::recover_after_crash(&conn, &config, 10, None, &stale).unwrap();
        assert_eq!(status(&conn), ("pending".into(), 0));

        // The slot names the current lease: its user code ran, counted.
        claim(&conn, 8);
        let ran = [StartedClaim { row_id, token: 8 }];
        crate::recovery::recover_after_crash(&conn, &config, 20, None, &ran).unwrap();
        assert_eq!(status(&conn), ("failed".into(), 1));
    }
}
