//! The engine: opens the database, owns the writer thread and the read
//! pool, and is what callers talk to.

use std::collections::HashMap;
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle, ThreadId};
use std::time::{Duration, Instant};

use crossbeam_channel::{RecvTimeoutError, Sender};
use r2d2_sqlite::SqliteConnectionManager;
use rusqlite::OpenFlags;

use crate::clock::Clock;
use crate::config::{Builder, Config};
use crate::delivery::{self, exec, panic_message, Env};
use crate::error::{Error, Result};
use crate::guard::UserCodeGuard;
use crate::handler::{Handler, Tx};
use crate::inflight::EngineFile;
use crate::message::{Failure, Message, Outcome};
use crate::schema;
use crate::stats::{self, Stats};
use crate::writer::{self, Command, Counters, Writer, WriterCtx};

const WRITER_THREAD: &str = "postroom-writer";

struct Consumer {
    name: String,
    handler: Arc<dyn Handler>,
}

/// A running thread, and the channel that says it has finished (sent from
/// a guard, so it also arrives when the thread panics).
struct Running {
    name: &'static str,
    handle: JoinHandle<()>,
    done: crossbeam_channel::Receiver<()>,
}

struct DoneGuard(&'static str, Sender<()>);

impl Drop for DoneGuard {
    fn drop(&mut self) {
        if thread::panicking() {
            log::error!("postroom: thread {} panicked", self.0);
        }
        let _ = self.1.send(());
    }
}

/// What [`Postroom::shutdown`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
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
    path: PathBuf,
    config: Config,
    consumers: HashMap<String, Arc<Consumer>>,
    commands: Sender<Command>,
    closed: AtomicBool,
    writer: Mutex<Option<Running>>,
    writer_thread: ThreadId,
    /// Disconnects when the writer thread ends (its sender is dropped).
    writer_alive: crossbeam_channel::Receiver<()>,
    readers: r2d2::Pool<SqliteConnectionManager>,
    counters: Arc<Counters>,
}

impl std::fmt::Debug for Postroom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Postroom")
            .field("path", &self.path)
            .field("closed", &self.closed.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Postroom {
    /// A builder with the default settings.
    pub fn builder() -> Builder {
        Builder::default()
    }

    pub(crate) fn open_with(builder: Builder, path: &Path) -> Result<Postroom> {
        let Builder {
            config,
            consumers,
            clock,
        } = builder;
        let mut engine_file = EngineFile::lock(path)?;
        schema::create_private(path)?;
        let mut conn = schema::open_writer(path, &config)?;
        if config.quick_check_on_open {
            schema::quick_check(&conn)?;
        }
        schema::migrate(&mut conn)?;
        recover(&conn, &config, &*clock, &mut engine_file)?;
        let guard =
            UserCodeGuard::install(&conn).map_err(|e| Error::sqlite("install authorizer", e))?;

        let (commands, receiver) = crossbeam_channel::bounded(config.max_batch);
        let (done_tx, done) = crossbeam_channel::bounded(1);
        let (alive_tx, writer_alive) = crossbeam_channel::bounded::<()>(0);
        let counters = Arc::new(Counters::default());
        let writer = Writer {
            counters: Arc::clone(&counters),
            conn,
            config: config.clone(),
            clock: Arc::clone(&clock),
            engine_file,
            guard,
            commands: receiver,
        };
        let handle = thread::Builder::new()
            .name(WRITER_THREAD.into())
            .spawn(move || {
                let _alive = alive_tx;
                let _done = DoneGuard(WRITER_THREAD, done_tx);
                writer.run();
            })
            .map_err(|e| Error::io("spawn writer thread", e))?;
        let writer_thread = handle.thread().id();

        let busy_timeout = config.busy_timeout;
        let manager = SqliteConnectionManager::file(path)
            .with_flags(OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX)
            .with_init(move |c| {
                c.busy_timeout(busy_timeout)?;
                c.pragma_update(None, "query_only", true)
            });
        let readers = r2d2::Pool::builder()
            .max_size(config.read_pool_size)
            .min_idle(Some(0))
            .connection_timeout(config.busy_timeout.max(Duration::from_secs(1)))
            .build_unchecked(manager);

        let consumers = consumers
            .into_iter()
            .map(|(name, handler)| {
                let consumer = Arc::new(Consumer {
                    name: name.clone(),
                    handler,
                });
                (name, consumer)
            })
            .collect();
        Ok(Postroom {
            path: path.to_path_buf(),
            config,
            consumers,
            commands,
            closed: AtomicBool::new(false),
            writer: Mutex::new(Some(Running {
                name: WRITER_THREAD,
                handle,
                done,
            })),
            writer_thread,
            writer_alive,
            readers,
            counters,
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Delivers `msg` to `consumer` inline: records it in the inbox, runs
    /// the consumer's handler and stores its outbox rows, all in one
    /// transaction, and returns once that is durable. Acknowledge the
    /// message to your broker when [`Outcome::should_ack`] says so.
    ///
    /// On `Err` nothing was stored and nothing may be acknowledged; the
    /// error says what went wrong ([`Error::is_retryable`]).
    pub fn deliver(&self, consumer: &str, msg: Message) -> Result<Outcome> {
        let consumer = self
            .consumers
            .get(consumer)
            .ok_or_else(|| Error::UnknownConsumer {
                consumer: consumer.to_owned(),
            })?
            .clone();
        self.config.check_message(&msg)?;
        let hash = *blake3::hash(&msg.payload).as_bytes();
        self.submit(move |w| {
            let mut env = Env {
                conn: w.conn,
                config: w.config,
                now_ms: w.clock.now_ms(),
                log: &mut *w.engine_file,
                guard: w.guard,
            };
            delivery::deliver(&mut env, &consumer.name, &*consumer.handler, &msg, &hash)
        })
    }

    /// Runs `f` in a write transaction of its own (sharing a group commit
    /// with concurrent deliveries), for application writes that are not
    /// caused by an incoming message, such as publishing from a user action:
    /// domain rows and [`Tx::publish`]ed messages commit together.
    ///
    /// If `f` fails or panics its writes are rolled back and the failure is
    /// returned as [`Error::Aborted`] (or the SQLite error it carried).
    pub fn transaction<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Tx<'_>) -> Result<T, Failure> + Send + 'static,
    {
        self.submit(move |w| {
            let mut tx = Tx::new(w.conn, w.config, w.clock.now_ms(), None);
            let guard = w.guard;
            let result = panic::catch_unwind(AssertUnwindSafe(|| guard.run(|| f(&mut tx))));
            if w.conn.is_autocommit() {
                // SQLite rolled back by itself (see `guard`).
                return Err(delivery::rolled_back(
                    "transaction",
                    result.ok().and_then(Result::err),
                ));
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

    /// Counts per status per consumer, outbox backlog, conflicts and file
    /// sizes, read through the read pool (it does not wait for the writer).
    pub fn stats(&self) -> Result<Stats> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        let conn = self.readers.get().map_err(|e| Error::Io {
            op: "get read connection",
            source: std::io::Error::other(e.to_string()),
        })?;
        let mut stats = stats::read(&conn, &self.path)?;
        stats.batches_committed = self.counters.batches.load(Ordering::Relaxed);
        stats.jobs_committed = self.counters.jobs.load(Ordering::Relaxed);
        Ok(stats)
    }

    /// Stops the engine: no new work is accepted, queued jobs are finished,
    /// and the writer thread is joined, waiting at most `deadline`. A thread
    /// still running at the deadline is left detached and named in the
    /// report. Calling it again returns [`Error::Closed`].
    pub fn shutdown(&self, deadline: Duration) -> Result<ShutdownReport> {
        if self.closed.swap(true, Ordering::AcqRel) {
            return Err(Error::Closed);
        }
        if thread::current().id() == self.writer_thread {
            // A handler cannot wait for the thread it runs on. The writer
            // stops once the jobs queued so far are done.
            let _ = self.commands.try_send(Command::Stop);
            return Err(Error::invalid(
                "caller",
                "shutdown called from inside a handler; the engine stops after this batch",
            ));
        }
        let start = Instant::now();
        // Queued jobs ahead of Stop are still run; later sends fail.
        let _ = self.commands.send_timeout(Command::Stop, deadline);
        let mut report = ShutdownReport::default();
        let running = self
            .writer
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take();
        if let Some(running) = running {
            let left = deadline.saturating_sub(start.elapsed());
            match running.done.recv_timeout(left) {
                Ok(()) | Err(RecvTimeoutError::Disconnected) => match running.handle.join() {
                    Ok(()) => report.joined.push(running.name.into()),
                    Err(panic) => report
                        .panicked
                        .push((running.name.into(), panic_message(panic.as_ref()))),
                },
                Err(RecvTimeoutError::Timeout) => {
                    log::warn!("postroom: {} missed the shutdown deadline", running.name);
                    report.missed_deadline.push(running.name.into());
                }
            }
        }
        Ok(report)
    }

    /// Sends `work` to the writer thread and waits for its answer, which
    /// comes after the batch it ran in has committed.
    fn submit<T, F>(&self, work: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut WriterCtx<'_>) -> Result<T> + Send + 'static,
    {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        if thread::current().id() == self.writer_thread {
            return Err(Error::invalid(
                "caller",
                "called from inside a handler; that would wait on itself forever",
            ));
        }
        let (job, answer) = writer::job(work);
        self.commands
            .send(Command::Job(job))
            .map_err(|_| Error::Closed)?;
        // A job that lands behind `Stop` is never run, and a bounded
        // channel keeps it (and its reply sender) after the writer is gone;
        // so wait on the writer's life as well as on the answer.
        crossbeam_channel::select! {
            recv(answer) -> reply => reply.map_err(|_| Error::Closed)?,
            recv(self.writer_alive) -> _ => answer.try_recv().map_err(|_| Error::Closed)?,
        }
    }
}

impl Drop for Postroom {
    fn drop(&mut self) {
        if let Ok(report) = self.shutdown(self.config.drop_deadline) {
            if !report.is_clean() {
                log::error!("postroom: shutdown on drop: {report:?}");
            }
        }
    }
}

/// Counts the attempt of a handler the previous process died in (see
/// [`crate::inflight`]), durably, then clears the marker.
fn recover(
    conn: &rusqlite::Connection,
    config: &Config,
    clock: &dyn Clock,
    engine_file: &mut EngineFile,
) -> Result<()> {
    let Some(inflight) = engine_file
        .read()
        .map_err(|e| Error::io("read in-flight marker", e))?
    else {
        return Ok(());
    };
    exec(conn, "BEGIN IMMEDIATE")?;
    let recovered = delivery::recover_inflight(conn, config, clock.now_ms(), &inflight)
        .and_then(|r| exec(conn, "COMMIT").map(|()| r));
    if recovered.is_err() && !conn.is_autocommit() {
        let _ = conn.execute_batch("ROLLBACK");
    }
    recovered?;
    engine_file
        .clear()
        .map_err(|e| Error::io("clear in-flight marker", e))
}
