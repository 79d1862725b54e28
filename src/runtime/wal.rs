//! The WAL's bounds and durability: when it is copied back and truncated
//! (scaled down on a small filesystem), and what makes its commits durable
//! before rows leave the database. Shared by the writer (its inline
//! copy-back), the checkpointer and the relay; no thread of its own.

use std::ffi::c_int;
use std::path::Path;

use rusqlite::Connection;

use crate::config::Durability;

/// Frames in the WAL at which the checkpointer is asked to copy it back:
/// SQLite's own automatic checkpoint threshold. Scaled down on a small
/// filesystem, as the others: see [`WalBounds`].
pub(crate) const CHECKPOINT_PAGES: c_int = 1000;
/// Frames from which the writer copies the WAL back itself, right after
/// each commit, as SQLite would: the checkpointer is far behind (or gone,
/// and then the limit is [`CHECKPOINT_PAGES`]).
pub(crate) const INLINE_CHECKPOINT_PAGES: c_int = 8 * CHECKPOINT_PAGES;
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
        let bounds = WalBounds::new(
            checkpoint_wal_bytes,
            crate::platform::filesystem_bytes(db),
            page_size,
        );
        log::debug!("postroom: WAL bounds for {}: {bounds:?}", db.display());
        bounds
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
    // Opened for writing too: Windows flushes only a handle with write
    // access (`FlushFileBuffers`); elsewhere any descriptor would do.
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(wal)
        .and_then(|file| file.sync_data())
    {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        synced => synced,
    }
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
