//! Opening an engine: the builder's checks, the database opened, locked,
//! migrated and recovered, and the threads started.
//!
//! Invariants: a setting or a file refused here changes nothing (no file
//! this open created is left behind, no thread is started); the engine
//! file is locked before SQLite opens the database, so a second engine
//! touches nothing; the writer thread runs before any other thread, and a
//! failure after it starts drops the half-built engine, which shuts down
//! whatever was started.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rusqlite::hooks::Action;
use rusqlite::Connection;

use super::{spawn, Casualty, Control, Postroom, Running, WRITER_THREAD};
use crate::brakes::Brake;
use crate::builder::Builder;
use crate::config::check_name;
use crate::error::{Error, Result};
use crate::guard::UserCodeGuard;
use crate::recovery;
use crate::runtime::checkpoint;
use crate::runtime::wal;
use crate::runtime::workers::{Consumer, Leases, Shared};
use crate::runtime::writer::{self, Counters, WriterState};
use crate::runtime::ReadManager;
use crate::store::inflight::EngineFile;
use crate::store::schema;

impl Builder {
    /// Opens (creating if needed, with mode 0600) the database at `path`,
    /// applies or checks the schema, recovers what a crashed process left
    /// behind, and starts the writer thread.
    ///
    /// A setting outside the range its method documents is refused here
    /// with [`Error::InvalidInput`] naming it, before any file is touched.
    pub fn open(self, path: impl AsRef<Path>) -> Result<Postroom> {
        self.config.validate()?;
        let mut seen = HashMap::new();
        for (name, _) in &self.consumers {
            check_name("consumer", name)?;
            if seen.insert(name.as_str(), ()).is_some() {
                return Err(Error::invalid(
                    "consumer",
                    format!("{name:?} is registered twice"),
                ));
            }
        }
        let mut bounded = HashMap::new();
        for (name, rows) in &self.backlog_limits {
            let problem = if !seen.contains_key(name.as_str()) {
                Some(format!("no consumer {name:?} is registered"))
            } else if *rows == 0 || i64::try_from(*rows).is_err() {
                Some(format!("{rows} rows for {name:?} is outside 1..=2^63-1"))
            } else if bounded.insert(name.as_str(), ()).is_some() {
                Some(format!("{name:?} is given a bound twice"))
            } else {
                None
            };
            if let Some(problem) = problem {
                return Err(Error::invalid("backlog_limit", problem));
            }
        }
        for name in &self.config.strict_order {
            if !seen.contains_key(name.as_str()) {
                return Err(Error::invalid(
                    "strict_order",
                    format!("no consumer {name:?} is registered"),
                ));
            }
        }
        // A dead letter deleted releases its key (nothing else holds it):
        // retention would let the key's later messages run past it with no
        // operator's say.
        if !self.config.strict_order.is_empty() && self.config.dead_retention.is_some() {
            return Err(Error::invalid(
                "strict_order",
                "dead_retention deletes dead letters, and a deleted dead letter releases \
                 the ordering key it holds: leave dead_retention unset (None) on an engine \
                 with strict_order, and redrive or discard its dead letters",
            ));
        }
        Postroom::open_with(self, path.as_ref())
    }
}

impl Postroom {
    pub(crate) fn open_with(builder: Builder, path: &Path) -> Result<Postroom> {
        let Builder {
            config,
            consumers,
            clock,
            sink,
            handle_signals,
            backlog_limits,
        } = builder;
        let (resolved, mut conn, engine_file) = open_database(path, &config, &*clock)?;
        let path = resolved.as_path();
        let first_token = schema::lease_token_base(&conn)?;
        let wal_bounds = wal::WalBounds::for_database(&conn, path, config.checkpoint_wal_bytes);
        checkpoint::at_open(&conn, path, wal_bounds.truncate_bytes, config.busy_timeout);
        let guard = UserCodeGuard::install(&mut conn)
            .map_err(|e| Error::sqlite("install authorizer", e))?;
        let counters = Arc::new(Counters::default());
        let outbox_dirty = install_hooks(&mut conn)?;
        let (relay_wake, relay_woken) = crossbeam_channel::bounded(1);
        let (checkpoint_wake, checkpoint_woken) = crossbeam_channel::bounded(1);
        let worker_slots = (1..=config.workers)
            .map(|n| engine_file.slot(n))
            .collect::<Vec<_>>();
        let (wake_tx, wake_rx) = crossbeam_channel::bounded(1);
        let (reaper_wake_tx, reaper_wake_rx) = crossbeam_channel::bounded(1);
        // The checkpointer wakes these when another process changed the
        // file or the clock stepped (see `checkpoint::Watch`).
        let mut watched = vec![wake_tx.clone(), reaper_wake_tx.clone()];
        if sink.is_some() {
            watched.push(relay_wake.clone());
        }
        let names = consumers.iter().map(|(name, _)| name.clone()).collect();
        let watch = checkpoint::Watch::new(watched, Arc::clone(&clock), names, path);
        let checkpoint_inputs =
            CheckpointInputs::new(checkpoint_woken, guard.clone(), &engine_file, watch);
        let state = WriterState {
            outbox_dirty,
            relay_wake: sink.is_some().then_some(relay_wake),
            checkpoint: writer::CheckpointTrigger::new(
                checkpoint_wake,
                wal_bounds,
                crate::store::wal_path(path),
            ),
            conn,
            config: config.clone(),
            clock: Arc::clone(&clock),
            engine_file,
            guard,
            counters: Arc::clone(&counters),
            last_commit: std::time::Duration::ZERO,
        };
        let casualty = Arc::new(Casualty::default());
        let (writer, writer_running) = start_writer(state, &casualty)?;
        let readers_closed = Arc::new(AtomicBool::new(false));
        let readers = read_pool(path, &config, &readers_closed);
        let consumers: HashMap<String, Arc<Consumer>> = consumers
            .into_iter()
            .map(|(name, kind)| (name.clone(), Arc::new(Consumer { name, kind })))
            .collect();
        let shared = Arc::new(Shared {
            path: path.to_path_buf(),
            writer,
            config,
            clock,
            consumers,
            leases: Arc::new(Leases::default()),
            stopping: AtomicBool::new(false),
            wake_tx,
            wake_rx,
            reaper_wake_tx,
            reaper_wake_rx,
            reaper_armed: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            next_token: AtomicI64::new(first_token),
        });
        // From here on, a failure drops `room`, which shuts down whatever
        // threads were started.
        let room = Postroom {
            control: Arc::new(Control::new(&shared, casualty, writer_running)),
            shared: Arc::clone(&shared),
            readers,
            readers_closed,
            counters,
            brakes: backlog_limits
                .into_iter()
                .map(|(name, rows)| (name.clone(), Brake::new(name, rows)))
                .collect(),
        };
        room.start_background(
            &shared,
            sink,
            relay_woken,
            checkpoint_inputs,
            wal_bounds,
            worker_slots,
        )?;
        if handle_signals {
            room.start_signal_thread()?;
        }
        Ok(room)
    }
}

/// What the checkpointer thread is handed at open besides the shared
/// state: the writer's "the WAL has grown" signal, what it needs to
/// watch for a slow handler, and whom to wake when another process
/// changed the file.
pub(super) struct CheckpointInputs {
    pub(super) woken: crossbeam_channel::Receiver<()>,
    pub(super) guard: UserCodeGuard,
    pub(super) slow_record: Option<crate::store::inflight::SlowRecord>,
    pub(super) watch: checkpoint::Watch,
}

impl CheckpointInputs {
    fn new(
        woken: crossbeam_channel::Receiver<()>,
        guard: UserCodeGuard,
        engine_file: &EngineFile,
        watch: checkpoint::Watch,
    ) -> Self {
        // The checkpointer watches for a slow handler (see `checkpoint`).
        let slow_record = engine_file
            .slow_record()
            .map_err(|e| log::warn!("postroom: slow handlers are only logged: {e}"))
            .ok();
        CheckpointInputs {
            woken,
            guard,
            slow_record,
            watch,
        }
    }
}

/// Checks the SQLite version and resolves `given` (symlinks) before any
/// file is touched; then creates (if missing), locks, migrates, identifies
/// and recovers the database, and returns its resolved path, the writer's
/// connection and the locked engine file. A refusal changes nothing: it
/// removes what this open created (an engine file, an empty database
/// file).
fn open_database(
    given: &Path,
    config: &crate::config::Config,
    clock: &dyn crate::clock::Clock,
) -> Result<(PathBuf, Connection, EngineFile)> {
    // Before any file is touched: an old system SQLite changes nothing.
    schema::check_sqlite_version(rusqlite::version_number())?;
    let resolved = schema::resolve(given)?;
    let path = resolved.as_path();
    let named = |e| match e {
        Error::AlreadyOpen { .. } => Error::AlreadyOpen {
            path: given.to_path_buf(),
        },
        e => e,
    };
    let mut engine_file = EngineFile::lock(path).map_err(named)?;
    let mut created = false;
    let opened = (|| {
        created = schema::create_if_missing(path)?;
        // Before SQLite opens it: a second engine touches nothing.
        engine_file.lock_database(path).map_err(named)?;
        let mut conn = schema::open_writer(path, config)?;
        schema::migrate(&mut conn)?;
        // For the operator's tools (`postroom status`), which run without
        // the builder: which consumers keep strict order.
        crate::store::strict::record(&mut conn, &config.strict_order)
            .map_err(|e| Error::sqlite("record the strict-order consumers", e))?;
        // A file this open created gets its identity here too; only an
        // existing file's new id is news to an operator.
        let minted = schema::claim_identity(&mut conn, path)?;
        if let Some(minted) = minted.filter(|_| !created) {
            log::info!(
                "postroom: {} is not the file its instance id was given to (a copy, a \
                 restore, or made by an older build): new instance id {} (was {}); a \
                 downstream postroom numbers this outbox as a new stream",
                path.display(),
                minted.new,
                minted.old.as_deref().unwrap_or("none"),
            );
        }
        Ok(conn)
    })();
    match opened {
        Ok(conn) => {
            recovery::recover(&conn, config, clock, &mut engine_file)?;
            crate::store::sweep::begin_empty(&conn, clock.now_ms())
                .map_err(|e| Error::sqlite("note retention's first pass", e))?;
            Ok((resolved, conn, engine_file))
        }
        Err(e) => {
            let empty = std::fs::metadata(path).is_ok_and(|m| m.len() == 0);
            if created && empty {
                let _ = std::fs::remove_file(path);
            }
            engine_file.discard();
            Err(e)
        }
    }
}

/// Starts the writer thread over `state`; the handle other threads send
/// their work through sees the thread's end (a channel its body holds).
fn start_writer(
    state: WriterState,
    casualty: &Arc<Casualty>,
) -> Result<(writer::WriterHandle, Running)> {
    let (alive_tx, writer_alive) = crossbeam_channel::bounded::<()>(0);
    let (writer, writer_thread) = writer::writer(state, writer_alive);
    let running = spawn(WRITER_THREAD.into(), casualty, move || {
        let _alive = alive_tx;
        writer_thread.run();
    })?;
    Ok((writer, running))
}

/// The writer connection's hooks: the WAL hook that replaces SQLite's
/// automatic checkpoint (see `checkpoint`), and an update hook that marks
/// the returned flag when a batch inserted outbox rows (the relay is woken
/// after its commit).
fn install_hooks(conn: &mut Connection) -> Result<Arc<AtomicBool>> {
    conn.wal_hook(Some(writer::note_wal_pages))
        .map_err(|e| Error::sqlite("install WAL hook", e))?;
    let outbox_dirty = Arc::new(AtomicBool::new(false));
    let dirty = Arc::clone(&outbox_dirty);
    conn.update_hook(Some(move |action, _: &str, table: &str, _| {
        if action == Action::SQLITE_INSERT && table == "postroom_outbox" {
            dirty.store(true, Ordering::Release);
        }
    }))
    .map_err(|e| Error::sqlite("install update hook", e))?;
    Ok(outbox_dirty)
}

/// The read pool: at most `read_pool_size` connections, opened by one
/// named thread (r2d2's default is three, unnamed for the engine's
/// purposes), and kept rather than timed out: r2d2's reaper of idle
/// connections wakes every 30 s, and an idle engine is asleep (issue 33).
fn read_pool(
    path: &Path,
    config: &crate::config::Config,
    closed: &Arc<AtomicBool>,
) -> r2d2::Pool<ReadManager> {
    let manager = ReadManager {
        path: path.to_path_buf(),
        busy_timeout: config.busy_timeout,
        durability: config.durability,
        closed: Arc::clone(closed),
    };
    let pool_thread = scheduled_thread_pool::ScheduledThreadPool::builder()
        .num_threads(1)
        .thread_name_pattern("postroom-reads-{}")
        .build();
    r2d2::Pool::builder()
        .max_size(config.read_pool_size)
        .min_idle(Some(0))
        .idle_timeout(None)
        .max_lifetime(None)
        .thread_pool(Arc::new(pool_thread))
        .connection_timeout(config.busy_timeout.max(Duration::from_secs(1)))
        .build_unchecked(manager)
}
