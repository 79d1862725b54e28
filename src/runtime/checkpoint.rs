//! The checkpointer thread: copies the WAL back into the database, off
//! the callers' path, and gives the `-wal` file's disk space back.
//!
//! SQLite's automatic checkpoint copies the WAL back inside whichever commit
//! crosses 1000 frames: a caller's, which then waits for the copy and its
//! fsync. The writer's WAL hook replaces it and wakes this thread instead,
//! which copies from its own connection while commits go on, then makes one
//! last pass with writes paused. Invariant: the WAL restarts from its
//! beginning after every paused pass. A checkpoint that never catches up
//! with the writer never lets it restart, every commit then extends the
//! file, and each fsync pays for the size change. With writes
//! paused the pass is complete (unless a reader still needs old frames),
//! and the next commit restarts the WAL. Because callers wait for it (its
//! fsync included), it waits up to 25 ms for a 1 ms lull in their traffic
//! and is otherwise left for the next wake, until the WAL passes
//! [`FORCE_PAGES`]; the writer copies back inline from 8000 frames.
//!
//! That fsync is most of the paused pass: SQLite syncs the database file
//! only after a pass that reached the WAL's live end, so the live passes'
//! pages are all still to write (why not sync after each live pass:
//! docs/BENCHMARKS.md).
//!
//! At `Durability::Normal` commits are not fsynced, so this thread is also
//! what bounds a power cut's loss: see [`NORMAL_SYNC`].
//!
//! The restart reuses the WAL's space but never shrinks the file, which
//! after a burst (or a retention pass) can stay large. This thread
//! truncates it too — only when the engine has been idle for a tick and a
//! passive pass copied everything, because `TRUNCATE` makes new writers
//! wait while it runs.
//!
//! Those thresholds are made for large disks: the first copy-back waits
//! for 1000 frames (about 4 MiB), which is the whole of a small flash
//! filesystem. [`WalBounds`] scales them all down to a share of the
//! filesystem's size when it is small (and the writer gives the WAL back
//! when a commit finds the disk full: see `WriterState::give_wal_back`).
//!
//! It is also the engine's one periodic timer, and only while idle: every
//! other thread sleeps until its data says something comes due, or until a
//! commit of this engine wakes it. What neither can tell them — a commit of
//! another process (the CLI's `redeliver`, a `sqlite3` beside the engine)
//! or a step of the wall clock, which stored due times are read against —
//! this thread checks at most once a [`WATCH`] (`PRAGMA data_version`, one
//! read of shared memory) and wakes the dispatcher, the relay and the
//! reaper when either happened (see [`Watch`]). The same check keeps the
//! live gauges (`runtime::gauges`): read again only when `data_version`
//! changed, so never while nothing changes. It ticks every [`TICK`]
//! while commits go on, a handler runs or a `Normal` commit waits for its
//! fsync, and every [`WATCH`] otherwise.
//!
//! Being the engine's timer that never runs user code, this thread also
//! watches the handler holding the writer (see [`Checkpointer::watch`]):
//! one that has held it past `slow_handler` is logged, counted and named
//! in the engine file for `postroom status`/`top`, until it returns. (While
//! this thread itself waits for the writer, for a forced paused pass, it
//! does not watch; a slow handler leaves the WAL no growth to force one.)

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use rusqlite::{Connection, OpenFlags};

use crate::clock::{self, Clock};
use crate::config::{Config, Durability};
use crate::guard::UserCodeGuard;
use crate::runtime::gauges::Gauges;
use crate::runtime::wal::{self, WalBounds};
use crate::runtime::writer::{Counters, WriterHandle};
use crate::store::inflight::{SlowHandler, SlowRecord};

/// How often the WAL size is looked at while the engine commits.
const TICK: Duration = Duration::from_millis(100);
/// How often, at most, the file is checked for another process's commits
/// and the wall clock for a step; also the idle tick. Over a second, so
/// that an idle engine's whole budget (this tick, plus the 5-minute safety
/// nets and the preemptions a busy machine adds) stays under one wakeup a
/// second: at exactly 1 s it measured 1.04-1.17/s.
pub(crate) const WATCH: Duration = Duration::from_millis(1250);
/// A wall clock that moved this much further than the monotonic clock
/// stepped forward: due times read before it may have come already.
const CLOCK_STEP: Duration = Duration::from_millis(250);
/// At `Durability::Normal` commits are not fsynced: a copy-back syncs the
/// WAL first, and without one a slow trickle of commits (which never
/// reaches the writer's 1000-frame hook) would stay unsynced for as long
/// as it lasts — hours of acknowledged messages on a device that receives
/// one a minute, all lost to one power cut. So at most this long after a
/// commit, this thread fsyncs the WAL file. A plain fsync, not a passive
/// checkpoint: that also synced it, but held up the hook's copy-backs (one
/// checkpoint at a time) and let the WAL outgrow its bound in
/// `the_wal_stays_bounded_while_writes_never_stop`.
const NORMAL_SYNC: Duration = Duration::from_secs(1);
/// Above this many commits per tick the writer's hook copies the WAL back
/// (syncing it) within about a second anyway (every commit writes several
/// frames), and a pass of this thread's own would only hold up those
/// copy-backs: SQLite runs one checkpoint at a time.
const TRICKLE_BATCHES: u64 = 10;
/// Passes made while commits go on before the paused one: each copies
/// what the commits added during the previous, so the paused pass (which
/// callers wait for) has little left.
const LIVE_PASSES: usize = 2;
/// What the thread needs.
pub(crate) struct Checkpointer {
    pub db: PathBuf,
    pub config: Config,
    pub bounds: WalBounds,
    pub counters: Arc<Counters>,
    pub writer: WriterHandle,
    /// The writer's "the WAL has grown" signal.
    pub wake: Receiver<()>,
    /// Disconnects when the engine closes.
    pub stop: Receiver<()>,
    /// Names the handler running on the write connection.
    pub guard: UserCodeGuard,
    /// Where a slow handler is recorded for the CLI; `None` if the engine
    /// file could not be opened again for it (then it is only logged).
    pub slow_record: Option<SlowRecord>,
    /// Who is woken when another process changed the file.
    pub watch: Watch,
}

/// What the other threads cannot see while asleep: commits of another
/// process, and steps of the wall clock. Each is woken (a `try_send` on a
/// bounded channel of one: a wake already pending is enough) when either
/// happened since the last check. A commit of this engine changes
/// `data_version` too (the checkpointer has its own connection), so while
/// the engine is busy they are woken about once a [`WATCH`], which costs
/// them one look at their due rows.
pub(crate) struct Watch {
    /// The dispatcher's, the relay's and the reaper's wakes.
    pub wake: Vec<Sender<()>>,
    /// The engine's clock, that stored due times are read against.
    pub clock: Arc<dyn Clock>,
    /// The live gauges, read again when the data changed.
    pub gauges: Gauges,
}

impl Watch {
    /// A watch waking `wake`, reading due times against `clock`, with the
    /// live gauges of `consumers` over the database at `db`.
    pub fn new(
        wake: Vec<Sender<()>>,
        clock: Arc<dyn Clock>,
        consumers: Vec<String>,
        db: &std::path::Path,
    ) -> Self {
        Watch {
            wake,
            clock,
            gauges: Gauges::new(consumers, db),
        }
    }
}

/// The watch's state between checks.
struct Watching {
    version: Option<i64>,
    checked: Instant,
    wall_ms: i64,
}

impl Watch {
    /// The baseline, and the gauges' first read.
    fn start(&mut self, conn: &Connection) -> Watching {
        let version = data_version(conn);
        let wall_ms = self.clock.now_ms();
        self.gauges.refresh(conn, wall_ms);
        Watching {
            version,
            checked: Instant::now(),
            wall_ms,
        }
    }

    /// Wakes every watched thread (a wake already pending is enough).
    fn wake_all(&self) {
        for wake in &self.wake {
            let _ = wake.try_send(());
        }
    }

    /// Checks, if the last check is [`WATCH`] old (less a little, so that
    /// an idle tick of exactly [`WATCH`] finds it due).
    /// The gauges are read again only after a change (see `runtime::gauges`).
    fn check(&mut self, conn: &Connection, last: &mut Watching) {
        let elapsed = last.checked.elapsed();
        if elapsed < WATCH.mul_f64(0.9) {
            return;
        }
        let version = data_version(conn);
        let wall_ms = self.clock.now_ms();
        let stepped = wall_ms.saturating_sub(last.wall_ms) > clock::millis(elapsed + CLOCK_STEP);
        // An error reads as a change: waking them is harmless.
        let changed = version.is_none() || version != last.version;
        if changed || stepped {
            self.wake_all();
        }
        if changed {
            self.gauges.refresh(conn, wall_ms);
        } else {
            self.gauges.tick(wall_ms);
        }
        *last = Watching {
            version,
            checked: Instant::now(),
            wall_ms,
        };
    }
}

/// The watch alone, for a checkpointer that could not open its
/// connection, until `stop` disconnects: every [`WATCH`] it tries again
/// and, until it can read `data_version`, wakes the watched threads (it
/// cannot tell whether anything changed: as an error in [`Watch::check`],
/// that reads as a change). Once open, it checks as the checkpointer does.
fn watch_only(watch: &mut Watch, stop: &Receiver<()>, db: &Path, config: &Config) {
    let mut opened: Option<(Connection, Watching)> = None;
    loop {
        match &mut opened {
            Some((conn, watching)) => watch.check(conn, watching),
            None => {
                match open(db, config) {
                    Ok(conn) => {
                        let watching = watch.start(&conn);
                        opened = Some((conn, watching));
                    }
                    Err(e) => log::debug!("postroom checkpointer: opening again: {e}"),
                }
                // After the baseline, if any: what changed before it is
                // read by the woken threads.
                watch.wake_all();
            }
        }
        match stop.recv_timeout(WATCH) {
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// The connection's `PRAGMA data_version`: changes whenever another
/// connection committed. `None` when it cannot be read.
fn data_version(conn: &Connection) -> Option<i64> {
    conn.query_row("PRAGMA data_version", [], |r| r.get(0))
        .map_err(|e| log::warn!("postroom checkpointer: reading data_version: {e}"))
        .ok()
}

impl Checkpointer {
    /// The thread's body, until `stop` disconnects.
    pub fn run(mut self) {
        let conn = match self.open_connection() {
            Ok(conn) => conn,
            Err(e) => return self.watch_without_connection(&e),
        };
        let wal = crate::store::wal_path(&self.db);
        let mut last_batches = self.counters.batches.load(Ordering::Relaxed);
        // Batches committed when a pass last synced the WAL, and when.
        let mut synced_batches = last_batches;
        let mut synced_at = Instant::now();
        let never = crossbeam_channel::never();
        let mut woken_gone = false;
        // The handler run reported slow, if it still runs.
        let mut reported = None;
        let mut watching = self.watch.start(&conn);
        // A commit of another process after the other threads' first read
        // of their due times but before this baseline changes nothing the
        // watch can see: one wake after it, so they read again.
        self.watch.wake_all();
        // Whether the last tick saw commits.
        let mut busy = false;
        loop {
            self.watch(&mut reported);
            self.watch.check(&conn, &mut watching);
            let wake = if woken_gone { &never } else { &self.wake };
            // Ticks fast only while there is something to time: commits
            // (the WAL to truncate once they stop), a handler to report
            // slow, a `Normal` commit to fsync.
            let unsynced = self.config.durability == Durability::Normal
                && self.counters.batches.load(Ordering::Relaxed) != synced_batches;
            let tick = if busy || unsynced || self.guard.running().is_some() {
                TICK
            } else {
                WATCH
            };
            crossbeam_channel::select! {
                recv(self.stop) -> _ => {
                    if reported.is_some() {
                        self.clear_slow_record();
                    }
                    return;
                }
                recv(wake) -> woken => {
                    if woken.is_err() {
                        // The writer is gone; only the stop is left to wait for.
                        woken_gone = true;
                    } else {
                        self.copy_back(&conn);
                        synced_batches = self.counters.batches.load(Ordering::Relaxed);
                        synced_at = Instant::now();
                    }
                    continue;
                }
                default(tick) => {}
            }
            let batches = self.counters.batches.load(Ordering::Relaxed);
            let idle = batches == last_batches;
            busy = !idle;
            let trickle = batches - last_batches <= TRICKLE_BATCHES;
            last_batches = batches;
            if self.config.durability == Durability::Normal
                && trickle
                && batches != synced_batches
                && synced_at.elapsed() >= NORMAL_SYNC
            {
                if let Err(e) = wal::sync_wal(&wal) {
                    log::warn!("postroom checkpointer: WAL fsync failed: {e}");
                }
                synced_batches = batches;
                synced_at = Instant::now();
            }
            let size = std::fs::metadata(&wal).map(|m| m.len()).unwrap_or(0);
            if size <= self.bounds.truncate_bytes {
                continue;
            }
            // Only when idle: copy whatever is left without blocking anyone,
            // then truncate a fully copied WAL, so TRUNCATE has nothing to do
            // while new writers wait on it.
            if idle && checkpoint(&conn, "PASSIVE").is_some_and(|(log, done)| log == done) {
                checkpoint(&conn, "TRUNCATE");
            }
        }
    }

    /// This thread's own connection. `checkpoint.open`: a test-only
    /// failpoint (not in the crash matrix), for an open that fails (out of
    /// file descriptors, say).
    fn open_connection(&self) -> std::result::Result<Connection, String> {
        crate::failpoint::hit("checkpoint.open")
            .map_err(|e| e.to_string())
            .and_then(|()| open(&self.db, &self.config).map_err(|e| e.to_string()))
    }

    /// Without a connection: dropping the wake's receiver, the writer sees
    /// it gone and copies the WAL back itself. The watch goes on, though:
    /// without it the other threads would sleep to their safety nets (the
    /// reaper has none) whatever another process commits (see
    /// `watch_only`).
    fn watch_without_connection(self, e: &str) {
        log::error!(
            "postroom checkpointer: cannot open the database: {e}; \
             the writer copies the WAL back itself"
        );
        let Checkpointer {
            wake,
            stop,
            mut watch,
            db,
            config,
            ..
        } = self;
        drop(wake);
        watch_only(&mut watch, &stop, &db, &config);
    }

    /// Reports the handler holding the writer once it has held it past
    /// `slow_handler`: a warning naming its consumer and message id
    /// (escaped: ids are anyone's bytes), `postroom_slow_handlers_total`,
    /// and the engine file's record, cleared when it returns. `reported`
    /// is the run reported and still recorded.
    fn watch(&mut self, reported: &mut Option<(u64, Instant)>) {
        let threshold = self.config.slow_handler;
        let slow = self
            .guard
            .running()
            .and_then(|r| r.since.filter(|s| s.elapsed() >= threshold).map(|s| (r, s)));
        if let Some((run, since)) = *reported {
            if slow.as_ref().map(|(r, _)| r.run) != Some(run) {
                log::info!(
                    "postroom: the slow handler returned after about {:.1} s",
                    since.elapsed().as_secs_f64()
                );
                self.clear_slow_record();
                *reported = None;
            }
        }
        let Some((running, since)) = slow else {
            return;
        };
        if reported.is_some() {
            return;
        }
        *reported = Some((running.run, since));
        let held = since.elapsed();
        log::warn!(
            consumer = running.consumer.as_str(), message_id = running.message_id.as_str();
            "postroom: a handler of consumer {:?} has held the writer for {:.1} s (message \
             {:?}); every write of the engine waits for it. Move slow work to an effectful \
             consumer, whose external step runs outside the transaction",
            running.consumer,
            held.as_secs_f64(),
            running.message_id
        );
        self.counters.slow_handlers.fetch_add(1, Ordering::Relaxed);
        crate::telemetry::slow_handler(&running.consumer);
        let since_ms = std::time::SystemTime::now()
            .checked_sub(held)
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        if let Some(record) = &mut self.slow_record {
            let slow = SlowHandler {
                consumer: running.consumer,
                message_id: running.message_id,
                since_ms,
            };
            if let Err(e) = record.write(&slow) {
                log::warn!("postroom: recording the slow handler in the engine file: {e}");
            }
        }
    }

    fn clear_slow_record(&mut self) {
        if let Some(record) = &mut self.slow_record {
            if let Err(e) = record.clear() {
                log::warn!("postroom: clearing the slow handler's record: {e}");
            }
        }
    }

    /// Copies the WAL back: live passes, then one with writes paused.
    fn copy_back(&self, conn: &Connection) {
        let mut frames = 0;
        for _ in 0..LIVE_PASSES {
            match checkpoint(conn, "PASSIVE") {
                Some((log, _)) => frames = log,
                None => return,
            }
        }
        let force = frames >= self.bounds.force_pages;
        let paused = self.writer.with_writes_paused(force, || {
            let started = Instant::now();
            let pass = checkpoint(conn, "PASSIVE");
            let held = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
            self.counters.paused_us.fetch_add(held, Ordering::Relaxed);
            self.counters
                .paused_max_us
                .fetch_max(held, Ordering::Relaxed);
            pass
        });
        if paused.is_some() {
            self.counters.checkpoints.fetch_add(1, Ordering::Relaxed);
            // Wakes sent while this ran asked for what was just done.
            while self.wake.try_recv().is_ok() {}
        }
    }
}

/// Runs one checkpoint; returns (frames in the WAL, frames checkpointed).
fn checkpoint(conn: &Connection, mode: &str) -> Option<(i64, i64)> {
    let result = conn.query_row(&format!("PRAGMA wal_checkpoint({mode})"), [], |r| {
        Ok((
            r.get::<_, i64>(0)?,
            r.get::<_, i64>(1)?,
            r.get::<_, i64>(2)?,
        ))
    });
    match result {
        Ok((busy, log_frames, done)) => {
            log::debug!(
                "postroom checkpointer: {mode}: busy {busy}, {done} of {log_frames} frames"
            );
            Some((log_frames, done))
        }
        Err(e) => {
            log::warn!("postroom checkpointer: {mode} checkpoint failed: {e}");
            None
        }
    }
}

/// At open, before any thread runs: copy back and truncate a WAL that a
/// previous process left large (a process killed young never reaches its
/// checkpointer's first tick, so crash loops would otherwise grow it), that
/// is, larger than `threshold` ([`WalBounds::truncate_bytes`]). Waits at
/// most briefly for readers of other processes; best effort.
pub(crate) fn at_open(conn: &Connection, db: &Path, threshold: u64, busy_timeout: Duration) {
    let size = std::fs::metadata(crate::store::wal_path(db))
        .map(|m| m.len())
        .unwrap_or(0);
    if size <= threshold {
        return;
    }
    let _ = conn.busy_timeout(Duration::from_millis(100));
    checkpoint(conn, "TRUNCATE");
    let _ = conn.busy_timeout(busy_timeout);
}

fn open(db: &Path, config: &Config) -> rusqlite::Result<Connection> {
    let conn = Connection::open_with_flags(
        db,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    // A checkpoint syncs (or not) as the connection running it is told.
    crate::store::schema::set_durability(&conn, config.durability)?;
    // TRUNCATE waits this long for the writer at most, and only when idle.
    conn.busy_timeout(Duration::from_millis(20))?;
    Ok(conn)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    /// Makes the next check due, as a [`WATCH`] later.
    fn due(last: &mut Watching) {
        last.checked = Instant::now().checked_sub(WATCH).unwrap();
    }

    /// The gauges read the database at start and after a change only, and
    /// a check reads nothing before its [`WATCH`] is up.
    #[test]
    fn the_gauges_are_read_again_only_after_a_change() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("app.db");
        let mut writer = Connection::open(&db).unwrap();
        crate::store::schema::migrate(&mut writer).unwrap();
        let conn = Connection::open(&db).unwrap();
        let mut watch = Watch {
            wake: Vec::new(),
            clock: Arc::new(ManualClock::new(0)),
            gauges: Gauges::new(vec!["c".into()], &db),
        };
        let mut last = watch.start(&conn);
        assert_eq!(watch.gauges.reads(), 1, "the first read");
        for _ in 0..3 {
            due(&mut last);
            watch.check(&conn, &mut last);
        }
        assert_eq!(watch.gauges.reads(), 1, "nothing changed");

        let write = |n: i64| {
            writer
                .execute(
                    "INSERT OR REPLACE INTO postroom_meta (key, value) VALUES ('gauges', ?1)",
                    [n.to_string()],
                )
                .unwrap();
        };
        write(1);
        watch.check(&conn, &mut last);
        assert_eq!(watch.gauges.reads(), 1, "the watch is not due yet");
        due(&mut last);
        watch.check(&conn, &mut last);
        assert_eq!(watch.gauges.reads(), 2, "read after the change");
        due(&mut last);
        watch.check(&conn, &mut last);
        assert_eq!(watch.gauges.reads(), 2, "once per change");
    }
}
