//! Regression (review of the leader lock): after the writer thread has closed,
//! the callers' queue stays connected (every WriterHandle holds a Receiver of
//! it), so a job submitted after close is never taken off it. Each such caller
//! is told `Closed`, but its job stays queued; once `max_batch` of them have
//! piled up, the next `send` blocks forever. Before the change the writer
//! thread owned the only Receiver: send failed with `Closed` once it was gone.
//!
//! Stray submitters after close: worker threads that missed the shutdown
//! deadline (a slow effect), then submit their transactional step.

mod common;

use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use common::*;
use postroom::{EffectContext, EffectHandler, Failure, Message, Postroom, Tx};

struct Slow(Arc<AtomicU32>);
impl EffectHandler for Slow {
    type Output = ();
    fn effect(&self, _: &EffectContext<'_>, _: &Message) -> Result<(), Failure> {
        self.0.fetch_add(1, SeqCst);
        thread::sleep(Duration::from_millis(1500));
        Ok(())
    }
    fn apply(&self, _: &mut Tx<'_>, _: &Message, _: ()) -> Result<(), Failure> {
        Ok(())
    }
}

fn worker_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|c| c.starts_with("postroom-worke"))
        .count()
}

fn stray_workers_left(max_batch: usize, workers: usize) -> usize {
    let before = worker_threads();
    let dir = tempfile::tempdir().unwrap();
    let started = Arc::new(AtomicU32::new(0));
    let room = Postroom::builder()
        .workers(workers)
        .max_batch(max_batch)
        .poll_interval(Duration::from_millis(5))
        .effectful_consumer("e", Slow(Arc::clone(&started)))
        .open(dir.path().join("app.db"))
        .unwrap();
    let msgs: Vec<Message> = (0..workers)
        .map(|i| Message::new("s", format!("m{i}"), "x"))
        .collect();
    for m in msgs {
        room.receive("e", m).unwrap();
    }
    eventually(10, "every worker in its effect", || {
        started.load(SeqCst) as usize == workers
    });
    let report = room.shutdown(Duration::from_millis(200)).unwrap();
    eprintln!("max_batch {max_batch}: shutdown report {report:?}");
    drop(room);
    // The effects end ~1.3 s later; the workers then submit and should exit.
    thread::sleep(Duration::from_secs(4));
    worker_threads() - before
}

#[test]
fn stray_submitters_after_close_are_answered_not_blocked() {
    let _ = raw; // keep common's helpers linked
    let roomy = stray_workers_left(8, 3);
    eprintln!("max_batch 8, 3 stray workers: {roomy} still running after 4 s");
    let tight = stray_workers_left(1, 3);
    eprintln!("max_batch 1, 3 stray workers: {tight} still running after 4 s");
    assert_eq!(roomy, 0);
    assert_eq!(
        tight, 0,
        "{tight} worker thread(s) blocked forever in WriterHandle::enqueue's send \
         (queue full of jobs nobody will ever take)"
    );
}
