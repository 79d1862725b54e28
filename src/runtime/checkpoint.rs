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

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::ffi::c_int;

use crossbeam_channel::Receiver;
use rusqlite::{Connection, OpenFlags};

use crate::config::{Config, Durability};
use crate::runtime::writer::{Counters, WriterHandle, CHECKPOINT_PAGES, INLINE_CHECKPOINT_PAGES};

/// How often the WAL size is looked at.
const TICK: Duration = Duration::from_millis(100);
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
/// Frames past which the paused pass is made even if callers never leave
/// the writer quiet: it holds them up for its fsync, so below this it waits
/// for a pause in their traffic, and the WAL keeps growing meanwhile.
const FORCE_PAGES: i64 = 4000;

/// On a small filesystem, the WAL frames from which the writer copies back
/// inline (the WAL's practical bound) take at most this share of the
/// filesystem; the other thresholds keep their large-disk proportions to it.
/// Filesystems too small for the large-disk thresholds (8000 frames of
/// 4 KiB pages: about 264 MiB) get smaller ones.
const SMALL_FS_WAL_SHARE: u64 = 8;
/// The least inline threshold, in frames, however small the filesystem: a
/// few commits' worth, so the WAL is not copied back after every commit.
const MIN_INLINE_PAGES: u64 = 16;
/// A WAL frame's header, beside its page.
const FRAME_HEADER: u64 = 24;

/// When the WAL is copied back and truncated, in frames of the database's
/// pages (bytes for the file). Fixed at open from the filesystem's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WalBounds {
    /// The checkpointer is woken once per this many frames of growth.
    pub wake_pages: c_int,
    /// Its paused pass is made even without a lull in callers' traffic
    /// from this many frames.
    pub force_pages: i64,
    /// The writer copies back itself, after each commit, from this many.
    pub inline_pages: c_int,
    /// A `-wal` file larger than this is truncated when the engine is idle,
    /// and at open: `checkpoint_wal_bytes`, or less on a small filesystem.
    pub truncate_bytes: u64,
}

impl WalBounds {
    /// The bounds for a database with `page_size` pages on a filesystem of
    /// `fs_bytes` (`None`: unknown, taken as large), with the configured
    /// `checkpoint_wal_bytes`.
    pub fn new(checkpoint_wal_bytes: u64, fs_bytes: Option<u64>, page_size: u64) -> WalBounds {
        let large = WalBounds {
            wake_pages: CHECKPOINT_PAGES,
            force_pages: FORCE_PAGES,
            inline_pages: INLINE_CHECKPOINT_PAGES,
            truncate_bytes: checkpoint_wal_bytes,
        };
        let Some(fs_bytes) = fs_bytes else {
            return large;
        };
        let share = fs_bytes / SMALL_FS_WAL_SHARE;
        let inline = (share / (page_size.max(512) + FRAME_HEADER)).max(MIN_INLINE_PAGES);
        if inline >= INLINE_CHECKPOINT_PAGES as u64 {
            return large;
        }
        // In the large-disk proportions: wake at 1/8 of the inline
        // threshold, force the paused pass at 1/2, and truncate an idle WAL
        // above half of its share (below its bound, so an idle engine hands
        // back what a burst took).
        let inline = c_int::try_from(inline).unwrap_or(INLINE_CHECKPOINT_PAGES);
        WalBounds {
            wake_pages: (inline / 8).max(1),
            force_pages: i64::from(inline / 2),
            inline_pages: inline,
            truncate_bytes: checkpoint_wal_bytes.min(share / 2),
        }
    }

    /// The bounds for the database at `db`, open on `conn`.
    pub fn for_database(conn: &Connection, db: &Path, checkpoint_wal_bytes: u64) -> WalBounds {
        let page_size = conn
            .query_row("PRAGMA page_size", [], |r| r.get::<_, i64>(0))
            .ok()
            .and_then(|size| u64::try_from(size).ok())
            .unwrap_or(4096);
        let bounds = WalBounds::new(checkpoint_wal_bytes, filesystem_bytes(db), page_size);
        log::debug!("postroom: WAL bounds for {}: {bounds:?}", db.display());
        bounds
    }
}

/// The size of the filesystem `path` is on; `None` when it cannot be told.
#[cfg(unix)]
fn filesystem_bytes(path: &Path) -> Option<u64> {
    let fs = rustix::fs::statvfs(path).ok()?;
    fs.f_blocks.checked_mul(fs.f_frsize).filter(|&b| b > 0)
}

#[cfg(not(unix))]
fn filesystem_bytes(_path: &Path) -> Option<u64> {
    None
}

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
}

impl Checkpointer {
    /// The thread's body, until `stop` disconnects.
    pub fn run(self) {
        let conn = match open(&self.db, &self.config) {
            Ok(conn) => conn,
            Err(e) => {
                // Returning drops the wake's receiver: the writer sees it
                // gone and copies the WAL back itself.
                log::error!(
                    "postroom checkpointer: cannot open the database: {e}; \
                     the writer copies the WAL back itself"
                );
                return;
            }
        };
        let wal = crate::store::wal_path(&self.db);
        let mut last_batches = self.counters.batches.load(Ordering::Relaxed);
        // Batches committed when a pass last synced the WAL, and when.
        let mut synced_batches = last_batches;
        let mut synced_at = Instant::now();
        let never = crossbeam_channel::never();
        let mut wake = &self.wake;
        loop {
            crossbeam_channel::select! {
                recv(self.stop) -> _ => return,
                recv(wake) -> woken => {
                    if woken.is_err() {
                        // The writer is gone; only the stop is left to wait for.
                        wake = &never;
                    } else {
                        self.copy_back(&conn);
                        synced_batches = self.counters.batches.load(Ordering::Relaxed);
                        synced_at = Instant::now();
                    }
                    continue;
                }
                default(TICK) => {}
            }
            let batches = self.counters.batches.load(Ordering::Relaxed);
            let idle = batches == last_batches;
            let trickle = batches - last_batches <= TRICKLE_BATCHES;
            last_batches = batches;
            if self.config.durability == Durability::Normal
                && trickle
                && batches != synced_batches
                && synced_at.elapsed() >= NORMAL_SYNC
            {
                if let Err(e) = sync_wal(&wal) {
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

/// Makes every commit so far durable before its rows leave the database
/// (the relay hands them to a sink). At `Full` they already are. At
/// `Normal` commits are not fsynced, and a sink must not get a row a power
/// cut could still take back: it would keep an effect this database lost,
/// and the message's redelivery would publish it again under a new id. So
/// the WAL is synced first: one fsync per relay batch.
pub(crate) fn durable_before_handover(durability: Durability, wal: &Path) -> std::io::Result<()> {
    match durability {
        Durability::Full => Ok(()),
        Durability::Normal => sync_wal(wal),
    }
}

/// Fsyncs the WAL file: every frame written so far is on disk, and a torn
/// commit that was being written meanwhile is what recovery already drops
/// (checksums). Its own descriptor: SQLite keeps no locks on the `-wal`
/// file, so opening and closing one disturbs nothing. No WAL file: every
/// commit is in the database, synced by the checkpoint that copied it.
pub(crate) fn sync_wal(wal: &Path) -> std::io::Result<()> {
    match std::fs::File::open(wal).and_then(|file| file.sync_data()) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        synced => synced,
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
    conn.pragma_update(None, "synchronous", config.durability.pragma())?;
    // TRUNCATE waits this long for the writer at most, and only when idle.
    conn.busy_timeout(Duration::from_millis(20))?;
    Ok(conn)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1024 * 1024;

    #[test]
    fn the_wal_bounds_scale_down_on_a_small_filesystem_only() {
        let large = WalBounds {
            wake_pages: CHECKPOINT_PAGES,
            force_pages: FORCE_PAGES,
            inline_pages: INLINE_CHECKPOINT_PAGES,
            truncate_bytes: 4 * MIB,
        };
        // Unknown or large: the thresholds made for large disks.
        assert_eq!(WalBounds::new(4 * MIB, None, 4096), large);
        assert_eq!(WalBounds::new(4 * MIB, Some(100 << 30), 4096), large);
        assert_eq!(WalBounds::new(4 * MIB, Some(300 * MIB), 4096), large);
        // 4 MiB: the inline copy-back at an eighth of it (512 KiB).
        let small = WalBounds::new(4 * MIB, Some(4 * MIB), 4096);
        assert_eq!(
            small,
            WalBounds {
                wake_pages: 15,
                force_pages: 63,
                inline_pages: 127,
                truncate_bytes: 256 * 1024,
            }
        );
        assert!(u64::try_from(small.inline_pages).unwrap() * (4096 + FRAME_HEADER) <= MIB / 2);
        // In between: proportional (64 MiB: a quarter of the large ones).
        let medium = WalBounds::new(4 * MIB, Some(64 * MIB), 4096);
        assert_eq!((medium.wake_pages, medium.inline_pages), (254, 2036));
        assert_eq!(medium.truncate_bytes, 4 * MIB);
        // A smaller configured truncation threshold is kept.
        assert_eq!(
            WalBounds::new(64 * 1024, Some(4 * MIB), 4096).truncate_bytes,
            64 * 1024
        );
        // Larger pages: fewer frames for the same share.
        assert_eq!(
            WalBounds::new(4 * MIB, Some(4 * MIB), 65536).inline_pages,
            16
        );
        // However small, a few commits' worth of frames.
        let tiny = WalBounds::new(4 * MIB, Some(256 * 1024), 4096);
        assert_eq!((tiny.wake_pages, tiny.inline_pages), (2, 16));
    }
}
