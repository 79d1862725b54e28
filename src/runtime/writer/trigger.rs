//! The writer's copy-back trigger: after each commit, whether the
//! checkpointer is woken, the writer copies the WAL back itself, or (the
//! storage found full) gives the WAL back. State only; the copy-backs
//! themselves are `WriterState`'s (the parent module).
//!
//! Invariants: the checkpointer is woken once per
//! [`WalBounds::wake_pages`] of WAL growth; an inline copy-back is asked
//! for only past [`WalBounds::inline_pages`] or once the checkpointer is
//! gone; a blocked `RESTART` is not tried again before its backoff ends;
//! the "past its cap" warning is logged once per doubling.

use std::ffi::c_int;
use std::time::{Duration, Instant};

use crossbeam_channel::{Sender, TrySendError};

use super::{BLOCKED_BACKOFF_MAX, BLOCKED_BACKOFF_MIN, WAL_CAP_FACTOR};
use crate::error::{Error, Result};
use crate::runtime::wal::WalBounds;

/// Who copies the WAL back after a commit: the checkpointer, woken once
/// per [`WalBounds::wake_pages`] of growth, or the writer itself when the
/// WAL has grown too far for that (or the checkpointer is gone). And when
/// the storage was found full: the writer gives the WAL back (copies it
/// back and truncates it), so that its space, and any freed since, holds
/// commits again.
pub(crate) struct CheckpointTrigger {
    /// `None` once the checkpointer is gone.
    pub(super) wake: Option<Sender<()>>,
    pub(super) bounds: WalBounds,
    /// WAL frames at which the checkpointer is woken next.
    pub(super) wake_at: c_int,
    /// WAL frames after the last commit that wrote any.
    pub(super) last_pages: c_int,
    /// A statement or commit of the running batch found the storage full.
    pub(super) full: bool,
    /// The WAL could not be given back when the storage was full (the
    /// copy-back itself needed space): tried again after each commit, which
    /// proves some space is free again.
    pub(super) owed: bool,
    /// A reader kept the last `RESTART` copy-back from completing: none is
    /// tried before this moment, only passive ones (see
    /// [`WriterState::copy_back_inline`]).
    pub(super) retry_at: Option<Instant>,
    /// The wait after the next blocked copy-back.
    pub(super) backoff: Duration,
    /// WAL frames at which the next "past its cap" warning is logged.
    pub(super) warn_at: c_int,
    /// The `-wal` file, for the warning's size.
    pub(super) wal: std::path::PathBuf,
}

impl CheckpointTrigger {
    pub fn new(wake: Sender<()>, bounds: WalBounds, wal: std::path::PathBuf) -> Self {
        CheckpointTrigger {
            wake: Some(wake),
            bounds,
            wake_at: bounds.wake_pages,
            last_pages: 0,
            full: false,
            owed: false,
            retry_at: None,
            backoff: BLOCKED_BACKOFF_MIN,
            warn_at: Self::cap(bounds),
            wal,
        }
    }

    /// The WAL's cap in frames (see [`WAL_CAP_FACTOR`]).
    pub(super) fn cap(bounds: WalBounds) -> c_int {
        bounds.inline_pages.saturating_mul(WAL_CAP_FACTOR)
    }

    /// A reader kept the copy-back made `now` from completing: the next
    /// try waits, twice as long as the last time (up to a bound).
    pub(super) fn blocked(&mut self, now: Instant) {
        self.retry_at = Some(now + self.backoff);
        self.backoff = (self.backoff * 2).min(BLOCKED_BACKOFF_MAX);
    }

    /// A copy-back completed: the next one is tried as soon as it is due.
    pub(super) fn completed(&mut self) {
        self.retry_at = None;
        self.backoff = BLOCKED_BACKOFF_MIN;
    }

    /// Past the WAL's cap (only a reader holding an old snapshot gets it
    /// there): counted per commit, and logged once per doubling, naming the
    /// cause and what to do. Said again, at info, once it is back under.
    pub(super) fn warn_past_cap(&mut self, pages: c_int) {
        let cap = Self::cap(self.bounds);
        if pages == 0 {
            return;
        }
        if pages < cap {
            if self.warn_at > cap {
                log::info!("postroom writer: the WAL is back under its cap");
                self.warn_at = cap;
            }
            return;
        }
        crate::telemetry::wal_over_cap();
        if pages >= self.warn_at {
            let bytes = std::fs::metadata(&self.wal).map_or(0, |m| m.len());
            log::warn!(
                "postroom writer: the WAL holds {pages} frames ({} MiB), past its cap of {cap}: \
                 another connection keeps a read transaction open (a DB browser, a long \
                 query, a backup), so it cannot be copied back. Commits go on and the WAL is \
                 copied back once that reader ends; end it, or the WAL grows until the disk \
                 is full",
                bytes >> 20
            );
            self.warn_at = pages.saturating_mul(2);
        }
    }

    /// Notes a job's or a batch's result: a full disk (or `max_page_count`)
    /// asks for the WAL to be given back once the batch is over.
    pub(super) fn note<T>(&mut self, result: &Result<T>) {
        if let Err(Error::StorageFull { .. }) = result {
            self.full = true;
        }
    }

    /// True (once) when the batch that just ended found the storage full.
    pub(super) fn full_now(&mut self) -> bool {
        std::mem::take(&mut self.full)
    }

    /// Frames a commit that left `pages` in the WAL appended: the growth
    /// since the last commit, or all of them when the WAL restarted in
    /// between (a restart happens only between commits).
    pub(super) fn appended(&mut self, pages: c_int) -> u64 {
        if pages == 0 {
            return 0;
        }
        let grown = if pages > self.last_pages {
            pages - self.last_pages
        } else {
            pages
        };
        self.last_pages = pages;
        u64::try_from(grown).unwrap_or(0)
    }

    /// After a commit that left `pages` frames in the WAL (0: the commit
    /// wrote nothing; SQLite calls the hook only for commits that append
    /// frames, so it says nothing of the WAL). True when the writer must
    /// copy back itself.
    pub(super) fn after_commit(&mut self, pages: c_int) -> bool {
        if pages == 0 {
            return false;
        }
        let wake_pages = self.bounds.wake_pages;
        if pages < wake_pages {
            // Restarted (or still small).
            self.wake_at = wake_pages;
            return false;
        }
        // Once per wake_pages of growth: a WAL that keeps growing while
        // the checkpointer waits for a quiet moment must not keep it
        // copying a few frames at a time.
        if pages >= self.wake_at {
            if let Some(wake) = &self.wake {
                // Full: it is already asked.
                if let Err(TrySendError::Disconnected(())) = wake.try_send(()) {
                    self.wake = None;
                }
            }
            self.wake_at = pages + wake_pages;
        }
        pages >= self.inline_at()
    }

    /// True when a copy-back may wait on readers (`RESTART`): the WAL is
    /// far behind and no reader kept the last such try from completing
    /// within its back-off.
    pub(super) fn may_restart(&self, pages: c_int) -> bool {
        self.far_behind(pages) && self.retry_at.is_none_or(|at| Instant::now() >= at)
    }

    /// Frames from which the writer copies back itself.
    pub(super) fn inline_at(&self) -> c_int {
        match self.wake {
            Some(_) => self.bounds.inline_pages,
            None => self.bounds.wake_pages,
        }
    }

    /// True when the WAL has passed twice the writer's own bound: its
    /// passive copy-backs are not getting through (the checkpointer's pass
    /// holds the checkpoint lock, and a passive checkpoint does not wait
    /// for it), so the next one must wait.
    pub(super) fn far_behind(&self, pages: c_int) -> bool {
        pages >= self.inline_at().saturating_mul(2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::wal::INLINE_CHECKPOINT_PAGES;

    #[test]
    fn the_checkpointer_is_woken_once_per_growth_and_the_writer_copies_back_when_it_is_gone() {
        let (wake, woken) = crossbeam_channel::bounded(1);
        let bounds = WalBounds::new(4 << 20, None, 4096);
        let mut trigger = CheckpointTrigger::new(wake, bounds, std::path::PathBuf::new());
        assert!(!trigger.after_commit(999));
        assert!(woken.try_recv().is_err(), "woken below the threshold");
        assert!(!trigger.after_commit(1000));
        assert!(woken.try_recv().is_ok(), "not woken at the threshold");
        // A commit that wrote nothing (0) does not re-arm the wake.
        assert!(!trigger.after_commit(0));
        assert!(!trigger.after_commit(1500));
        assert!(
            woken.try_recv().is_err(),
            "woken again before 1000 more frames"
        );
        assert!(!trigger.after_commit(2000));
        assert!(woken.try_recv().is_ok(), "not woken after 1000 more frames");
        // Far behind: the writer copies back itself.
        assert!(trigger.after_commit(INLINE_CHECKPOINT_PAGES));
        // Restarted: the threshold is back at 1000.
        assert!(!trigger.after_commit(10));
        assert!(!trigger.after_commit(1000));
        assert!(woken.try_recv().is_ok(), "not woken after a restart");
        // Gone: from then on the writer copies back from 1000 frames.
        drop(woken);
        assert!(
            trigger.after_commit(2000),
            "the loss is noticed at the next wake, and that commit copies back"
        );
        assert!(trigger.after_commit(1001));
    }
}
