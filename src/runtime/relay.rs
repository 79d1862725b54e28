//! The relay: hands committed outbox rows to a [`Sink`], at least once, in
//! per-key commit order, and records what became of each.
//!
//! It reads due rows through a read-only connection of its own, calls the
//! sink outside any transaction, and marks the results through the writer.
//! The writer wakes it right after a commit that added outbox rows; a
//! retry wakes it when it comes due (read from the data), and rows written
//! by another process when the checkpointer sees the file change: an idle
//! relay does not wake at all.
//!
//! Ordering invariant: rows of one key are handed over in `seq` order, and
//! once a row of a key is not `Sent`, later rows of that key are neither
//! marked sent nor counted in that batch — they are handed over again after
//! the failed row has gone through. A sink must therefore not deliver later
//! messages of a key after failing an earlier one in the same batch (the
//! built-in sinks do not).

use crate::escape::Esc;
use std::collections::HashSet;
use std::panic::{self, AssertUnwindSafe};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use rusqlite::{Connection, OpenFlags};

use crate::clock;
use crate::config::Config;
use crate::delivery::panic_message;
use crate::error::{Error, Result};
use crate::failpoint;
use crate::runtime::workers::{Shared, Stalled, PARTIAL_RECHECK};
use crate::sink::{SendResult, Sink};
use crate::store::due::{self, NextDue};
use crate::store::outbox::{self, OutboxMessage};
use crate::telemetry;

/// How the relay thread is told to stop: flush what is due until the
/// deadline, then return.
pub(crate) type StopAt = Instant;

/// The relay thread's body.
pub(crate) fn relay(
    shared: Arc<Shared>,
    mut sink: Box<dyn Sink>,
    wake: Receiver<()>,
    stop: Receiver<StopAt>,
) {
    let Some(conn) = open_until_stopped(&shared, &stop) else {
        return;
    };
    let wal = crate::store::wal_path(&shared.path);
    let mut stop_at: Option<Instant> = None;
    let mut stalled = Stalled::new(shared.clock.now_ms());
    loop {
        if stop_at.is_some_and(|at| Instant::now() >= at) {
            return;
        }
        let now = shared.clock.now_ms();
        let fetched = match outbox::fetch_due(&conn, now, shared.config.relay_batch) {
            Ok(fetched) => fetched,
            Err(e) => {
                // Look again shortly: no due time was read to sleep until.
                log::warn!("postroom relay: reading the outbox: {}", Esc(&e));
                if stop_at.is_some() || !pause_after_failure(&shared, &stop, &mut stop_at) {
                    return;
                }
                continue;
            }
        };
        if fetched.is_empty() {
            if stop_at.is_some() {
                return; // flushed
            }
            sleep_until_due(
                &conn,
                &shared,
                now,
                &mut stalled,
                &wake,
                &stop,
                &mut stop_at,
            );
            continue;
        }
        let Some((batch, results)) = hand_over(&shared, &mut *sink, fetched, &wal) else {
            if !pause_after_failure(&shared, &stop, &mut stop_at) {
                return;
            }
            continue;
        };
        // While flushing for shutdown, a batch the sink took none of ends
        // the flush: retrying a dead sink until the deadline would only eat
        // the time the writer needs to stop.
        // A row settled either way (sent, or dead) is progress.
        let progress = results
            .iter()
            .any(|r| !matches!(r, SendResult::Retry { .. } | SendResult::Unavailable { .. }));
        let recorded =
            failpoint::hit("relay.after_send").and_then(|()| record(&shared, batch, results));
        match recorded {
            Ok(()) => {}
            Err(Error::Closed) => return,
            Err(e) => {
                // Nothing marked: the rows are handed over again (at least
                // once), after a pause.
                log::warn!("postroom relay: recording results: {}", Esc(&e));
                if !pause_after_failure(&shared, &stop, &mut stop_at) {
                    return;
                }
            }
        }
        if stop_at.is_some() && !progress {
            return;
        }
        if stop_at.is_none() {
            if let Ok(at) = stop.try_recv() {
                stop_at = Some(at);
            }
        }
    }
}

/// The relay's read connection, opened again and again until it opens
/// (out of file descriptors, say): giving up would leave the outbox
/// unrelayed for the life of the process, with no error anywhere but the
/// log. `None` once the engine stops meanwhile.
fn open_until_stopped(shared: &Shared, stop: &Receiver<StopAt>) -> Option<Connection> {
    let mut pause = Duration::from_millis(100);
    loop {
        let opened = failpoint::hit("relay.open").and_then(|()| {
            open_reader(&shared.path, shared.config.busy_timeout)
                .map_err(|e| Error::sqlite("open relay connection", e))
        });
        match opened {
            Ok(conn) => return Some(conn),
            Err(e) => {
                log::error!("postroom relay: cannot open the database: {e}; again in {pause:?}");
                match stop.recv_timeout(pause) {
                    Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
                    _ => return None,
                }
                pause = (pause * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// Nothing due: asleep until the next row comes due, a commit of this
/// engine adds one, or the checkpointer saw another process change the
/// file (see `checkpoint::Watch`); `relay_poll` bounds the sleep. A stop
/// received meanwhile is noted in `stop_at`.
fn sleep_until_due(
    conn: &Connection,
    shared: &Shared,
    now: i64,
    stalled: &mut Stalled,
    wake: &Receiver<()>,
    stop: &Receiver<StopAt>,
    stop_at: &mut Option<Instant>,
) {
    let next = due::outbox(conn, now).unwrap_or_else(|e| {
        log::warn!("postroom relay: reading the next due time: {}", Esc(&e));
        NextDue {
            at: None,
            partial: true,
        }
    });
    let wait = next.wait(now, shared.config.relay_poll, PARTIAL_RECHECK);
    let wait = stalled.wait(now, wait, shared.config.relay_poll);
    crossbeam_channel::select! {
        recv(wake) -> _ => {}
        recv(stop) -> at => *stop_at = Some(at.unwrap_or_else(|_| Instant::now())),
        default(wait) => {}
    }
}

/// Hands the due rows to the sink (or dead-letters an undecodable one);
/// the rows and their results to record. `None` (logged) when the WAL
/// could not be made durable first: nothing handed over, pause and retry.
fn hand_over(
    shared: &Shared,
    sink: &mut dyn Sink,
    fetched: Vec<(OutboxMessage, Option<&'static str>)>,
    wal: &Path,
) -> Option<(Vec<OutboxMessage>, Vec<SendResult>)> {
    match triage(fetched) {
        Fetched::Undecodable(msg, column) => {
            let reason = crate::store::text::undecodable(column);
            log::error!(
                "postroom relay: outbox row {}: {}; dead-lettered",
                msg.seq,
                Esc(&reason)
            );
            Some((vec![msg], vec![SendResult::Dead { reason }]))
        }
        Fetched::Send(batch) => {
            // The relay is woken at COMMIT: what it read may not be on
            // disk yet (see `wal::durable_before_handover`).
            if let Err(e) =
                crate::runtime::wal::durable_before_handover(shared.config.durability, wal)
            {
                log::warn!("postroom relay: WAL fsync failed: {e}; batch held back");
                return None;
            }
            let results = panic::catch_unwind(AssertUnwindSafe(|| sink.send(&batch)))
                .unwrap_or_else(|panic| {
                    let reason = format!("sink panicked: {}", panic_message(panic.as_ref()));
                    vec![SendResult::retry(reason); batch.len()]
                });
            Some((batch, results))
        }
    }
}

/// What the relay does with a fetched batch.
enum Fetched {
    /// Hand these to the sink.
    Send(Vec<OutboxMessage>),
    /// Dead-letter this row, whose named column did not decode.
    Undecodable(OutboxMessage, &'static str),
}

/// The rows before the first that did not decode go to the sink. When that
/// row is the first, it alone is dead-lettered; the rows after it wait for
/// the next batch, so none of its key goes ahead of it.
fn triage(mut fetched: Vec<(OutboxMessage, Option<&'static str>)>) -> Fetched {
    let first_damaged = fetched
        .iter()
        .enumerate()
        .find_map(|(i, (_, damage))| damage.map(|column| (i, column)));
    match first_damaged {
        Some((0, column)) => Fetched::Undecodable(fetched.swap_remove(0).0, column),
        first => {
            fetched.truncate(first.map_or(fetched.len(), |(i, _)| i));
            Fetched::Send(fetched.into_iter().map(|(msg, _)| msg).collect())
        }
    }
}

/// Pauses after a failure, so a failing disk is not hammered, taking a stop
/// that arrives meanwhile (a failing disk must not hang shutdown). False
/// when the engine is gone.
fn pause_after_failure(
    shared: &Shared,
    stop: &Receiver<StopAt>,
    stop_at: &mut Option<Instant>,
) -> bool {
    match stop.recv_timeout(shared.config.relay_poll.min(Duration::from_secs(1))) {
        Ok(at) => {
            stop_at.get_or_insert(at);
            true
        }
        Err(crossbeam_channel::RecvTimeoutError::Timeout) => true,
        Err(crossbeam_channel::RecvTimeoutError::Disconnected) => false,
    }
}

/// Marks a batch's results through the writer, in one job; once that has
/// committed, reports them to the metrics recorder.
fn record(shared: &Shared, batch: Vec<OutboxMessage>, results: Vec<SendResult>) -> Result<()> {
    let marked = shared.writer.submit_uncounted(move |w| {
        let now = w.clock.now_ms();
        record_results(w.conn, w.config, now, &batch, &results)
    })?;
    for lag_ms in marked.sent_lag_ms {
        telemetry::relayed(lag_ms);
    }
    for _ in 0..marked.dead {
        telemetry::outbox_dead();
    }
    Ok(())
}

/// What [`record_results`] marked, for the metrics.
#[derive(Debug, Default)]
pub(crate) struct Marked {
    /// Per message marked sent: milliseconds from its commit.
    pub sent_lag_ms: Vec<i64>,
    /// Messages now dead.
    pub dead: u64,
}

/// Marks what became of each message of a batch. A message after a failed
/// one of the same key is left alone: not sent, no attempt counted.
pub(crate) fn record_results(
    conn: &Connection,
    config: &Config,
    now: i64,
    batch: &[OutboxMessage],
    results: &[SendResult],
) -> Result<Marked> {
    let mut marked = Marked::default();
    let mut held: HashSet<&str> = HashSet::new();
    let sql = |e| Error::sqlite("record relay result", e);
    for (i, msg) in batch.iter().enumerate() {
        if msg.key.as_deref().is_some_and(|key| held.contains(key)) {
            continue;
        }
        let result = results
            .get(i)
            .cloned()
            .unwrap_or_else(|| SendResult::retry("the sink returned no result"));
        match result {
            SendResult::Sent => {
                if outbox::mark_sent(conn, msg.seq, now).map_err(sql)? {
                    marked.sent_lag_ms.push(now.saturating_sub(msg.created_at));
                }
            }
            SendResult::Retry { reason, after } => {
                let attempt = msg.attempts.saturating_add(1);
                let delay = after.unwrap_or_else(|| {
                    config.retry.delay(attempt, resend_jitter(msg.seq, attempt))
                });
                let next = now.saturating_add(clock::millis(delay));
                if outbox::mark_failed(conn, msg.seq, &reason, next, config.max_attempts, false)
                    .map_err(sql)?
                {
                    marked.dead += 1;
                }
                if let Some(key) = msg.key.as_deref() {
                    held.insert(key);
                }
            }
            SendResult::Unavailable { reason, after } => {
                let next = now.saturating_add(clock::millis(after));
                outbox::mark_unavailable(conn, msg.seq, &reason, next).map_err(sql)?;
                if let Some(key) = msg.key.as_deref() {
                    held.insert(key);
                }
            }
            SendResult::Dead { reason } => {
                if outbox::mark_failed(conn, msg.seq, &reason, now, config.max_attempts, true)
                    .map_err(sql)?
                {
                    marked.dead += 1;
                }
                log::warn!(
                    "postroom relay: outbox message {} dead: {}",
                    Esc(&msg.id),
                    Esc(&reason)
                );
                // Later rows of the key were held back by the sink in this
                // batch; they go next time (a dead row blocks nothing).
                if let Some(key) = msg.key.as_deref() {
                    held.insert(key);
                }
            }
        }
    }
    Ok(marked)
}

fn resend_jitter(seq: i64, attempt: u32) -> u64 {
    let h = blake3::hash(&[seq.to_le_bytes(), i64::from(attempt).to_le_bytes()].concat());
    u64::from_le_bytes(h.as_bytes()[..8].try_into().expect("8 bytes"))
}

fn open_reader(path: &Path, busy_timeout: Duration) -> rusqlite::Result<Connection> {
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    conn.busy_timeout(busy_timeout)?;
    conn.pragma_update(None, "query_only", true)?;
    Ok(conn)
}
