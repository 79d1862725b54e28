//! The relay: hands committed outbox rows to a [`Sink`], at least once, in
//! per-key commit order, and records what became of each.
//!
//! It reads due rows through a read-only connection of its own, calls the
//! sink outside any transaction, and marks the results through the writer.
//! The writer wakes it right after a commit that added outbox rows; a slow
//! poll catches rows written by another process.
//!
//! Ordering invariant: rows of one key are handed over in `seq` order, and
//! once a row of a key is not `Sent`, later rows of that key are neither
//! marked sent nor counted in that batch — they are handed over again after
//! the failed row has gone through. A sink must therefore not deliver later
//! messages of a key after failing an earlier one in the same batch (the
//! built-in sinks do not).

use std::collections::HashSet;
use std::io::Write;
use std::panic::{self, AssertUnwindSafe};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use rusqlite::{Connection, OpenFlags};

use crate::checkpoint;
use crate::clock;
use crate::config::{Config, Durability};
use crate::delivery::panic_message;
use crate::engine::Postroom;
use crate::error::{Error, Result};
use crate::failpoint;
use crate::inbox;
use crate::message::{Message, Outcome};
use crate::outbox::{self, OutboxMessage};
use crate::workers::Shared;

/// What became of one message handed to a [`Sink`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SendResult {
    /// Handed over; the row is marked sent.
    Sent,
    /// Not handed over this time; try again after `after` (or the backoff).
    Retry {
        /// Stored as the row's `last_error`.
        reason: String,
        /// When to try again; `None` uses exponential backoff.
        after: Option<Duration>,
    },
    /// Will never go through: the row is dead at once.
    Dead {
        /// Stored as the row's `last_error`.
        reason: String,
    },
    /// The destination could not be reached (a broker that is down, a
    /// connection lost before the message was acknowledged): nothing is
    /// known against the message itself. The row stays pending and is
    /// handed over again after `after`, and no attempt is counted, so an
    /// outage however long never dead-letters a row. A sink must return it
    /// only for failures that are not the message's fault, or a message the
    /// destination refuses would be retried for ever.
    Unavailable {
        /// Stored as the row's `last_error`.
        reason: String,
        /// When to try again.
        after: Duration,
    },
}

impl SendResult {
    /// A retryable failure with the default backoff.
    pub fn retry(reason: impl std::fmt::Display) -> Self {
        SendResult::Retry {
            reason: reason.to_string(),
            after: None,
        }
    }

    /// The destination is unreachable: try again after `after`, counting
    /// no attempt (see [`SendResult::Unavailable`]).
    pub fn unavailable(reason: impl std::fmt::Display, after: Duration) -> Self {
        SendResult::Unavailable {
            reason: reason.to_string(),
            after,
        }
    }

    /// A permanent failure.
    pub fn dead(reason: impl std::fmt::Display) -> Self {
        SendResult::Dead {
            reason: reason.to_string(),
        }
    }
}

/// Where the relay sends outbox messages. Owned by the relay thread.
///
/// `send` gets a batch in commit order and returns one result per message,
/// in the same order. Messages of one key appear in commit order; after
/// failing one, do not deliver later messages of the same key in that
/// batch (return `Retry` for them): the relay hands them over again once
/// the failed one went through. A missing result counts as `Retry`.
pub trait Sink: Send + 'static {
    /// Hands `batch` over.
    fn send(&mut self, batch: &[OutboxMessage]) -> Vec<SendResult>;
}

/// Calls `each` per message in order, skipping (as `Retry`) later messages
/// of a key once one of that key was not sent.
pub(crate) fn per_message(
    batch: &[OutboxMessage],
    mut each: impl FnMut(&OutboxMessage) -> SendResult,
) -> Vec<SendResult> {
    let mut failed_keys: HashSet<&str> = HashSet::new();
    batch
        .iter()
        .map(|msg| {
            if let Some(key) = msg.key.as_deref() {
                if failed_keys.contains(key) {
                    return held_back();
                }
            }
            let result = each(msg);
            if result != SendResult::Sent {
                if let Some(key) = msg.key.as_deref() {
                    failed_keys.insert(key);
                }
            }
            result
        })
        .collect()
}

fn held_back() -> SendResult {
    SendResult::retry("held back behind an earlier message of its key")
}

/// A [`Sink`] made from a closure called once per message; see [`sink_fn`].
pub struct FnSink<F>(F);

/// Makes a [`Sink`] from a closure called once per message, in order. After
/// a message of some key is not `Sent`, the closure is not called for later
/// messages of that key in the batch.
pub fn sink_fn<F>(f: F) -> FnSink<F>
where
    F: FnMut(&OutboxMessage) -> SendResult + Send + 'static,
{
    FnSink(f)
}

impl<F> Sink for FnSink<F>
where
    F: FnMut(&OutboxMessage) -> SendResult + Send + 'static,
{
    fn send(&mut self, batch: &[OutboxMessage]) -> Vec<SendResult> {
        per_message(batch, &mut self.0)
    }
}

/// A [`Sink`] that sends each message into a crossbeam channel. A full
/// channel makes the relay wait up to `timeout` per batch (default 1 s),
/// then retry what did not fit; a disconnected one is retried too.
#[derive(Debug, Clone)]
pub struct ChannelSink {
    tx: Sender<OutboxMessage>,
    timeout: Duration,
}

impl ChannelSink {
    /// Sends into `tx`.
    pub fn new(tx: Sender<OutboxMessage>) -> Self {
        ChannelSink {
            tx,
            timeout: Duration::from_secs(1),
        }
    }

    /// How long one batch may wait for room in a full channel.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

impl Sink for ChannelSink {
    fn send(&mut self, batch: &[OutboxMessage]) -> Vec<SendResult> {
        // One deadline for the whole batch: a full channel holds the relay
        // (and a shutdown's flush) for `timeout`, not `timeout` per message.
        let deadline = Instant::now() + self.timeout;
        per_message(batch, |msg| {
            match self.tx.send_deadline(msg.clone(), deadline) {
                Ok(()) => SendResult::Sent,
                Err(e) => SendResult::retry(format_args!("channel: {e}")),
            }
        })
    }
}

/// A [`Sink`] writing one JSON object per line to any [`Write`] (stdout, a
/// file, a pipe), flushed after each batch: `{"id", "seq", "topic", "key",
/// "headers", "payload"}`, where `payload` is the JSON value itself when
/// the payload is JSON, else a string when it is UTF-8, else absent and
/// `payload_hex` given instead.
#[derive(Debug)]
pub struct NdjsonSink<W> {
    out: W,
}

impl<W: Write + Send + 'static> NdjsonSink<W> {
    /// Writes to `out`.
    pub fn new(out: W) -> Self {
        NdjsonSink { out }
    }
}

/// One outbox message as an NDJSON line.
pub(crate) fn ndjson_line(msg: &OutboxMessage) -> serde_json::Value {
    let mut line = serde_json::json!({
        "id": msg.id,
        "seq": msg.seq,
        "topic": msg.topic,
        "key": msg.key,
        "headers": msg.headers,
    });
    if let Ok(value) = serde_json::from_slice::<serde_json::Value>(&msg.payload) {
        line["payload"] = value;
    } else if let Ok(text) = std::str::from_utf8(&msg.payload) {
        line["payload"] = text.into();
    } else {
        let hex: String = msg.payload.iter().map(|b| format!("{b:02x}")).collect();
        line["payload_hex"] = hex.into();
    }
    line
}

impl<W: Write + Send + 'static> Sink for NdjsonSink<W> {
    fn send(&mut self, batch: &[OutboxMessage]) -> Vec<SendResult> {
        let mut buf = Vec::new();
        for msg in batch {
            // A `Value` always serializes.
            let _ = serde_json::to_writer(&mut buf, &ndjson_line(msg));
            buf.push(b'\n');
        }
        // All or nothing: a partly written batch is re-sent whole (at least
        // once), never split around a failure.
        match self.out.write_all(&buf).and_then(|()| self.out.flush()) {
            Ok(()) => vec![SendResult::Sent; batch.len()],
            Err(e) => vec![SendResult::retry(format_args!("write: {e}")); batch.len()],
        }
    }
}

/// A [`Sink`] that delivers into another postroom engine — two components
/// on one device chained exactly-once end to end. Each message becomes a
/// [`Message`] with source = topic, id = the outbox message id (so the
/// target deduplicates re-sends), the same headers, and ordering key = key.
///
/// By default a batch is stored with one `receive_batch` (queued: the
/// target's workers process it). [`InboxSink::inline`] delivers each message
/// inline instead, and only counts it sent once the target says to ack.
pub struct InboxSink {
    target: Arc<Postroom>,
    consumer: String,
    inline: bool,
}

impl InboxSink {
    /// Sends into `consumer` of `target`.
    pub fn new(target: Arc<Postroom>, consumer: impl Into<String>) -> Self {
        InboxSink {
            target,
            consumer: consumer.into(),
            inline: false,
        }
    }

    /// Deliver each message inline (`deliver`) rather than queue the batch.
    pub fn inline(mut self) -> Self {
        self.inline = true;
        self
    }

    fn message(msg: &OutboxMessage) -> Message {
        let mut m = Message::new(msg.topic.clone(), msg.id.clone(), msg.payload.clone());
        m.headers = msg.headers.clone();
        m.ordering_key = msg.key.clone();
        m
    }
}

impl Sink for InboxSink {
    fn send(&mut self, batch: &[OutboxMessage]) -> Vec<SendResult> {
        if self.inline {
            return per_message(batch, |msg| {
                match self.target.deliver(&self.consumer, Self::message(msg)) {
                    Ok(outcome) if outcome.should_ack() => SendResult::Sent,
                    Ok(Outcome::Failed {
                        error, retry_after, ..
                    }) => SendResult::Retry {
                        reason: format!("target: {error}"),
                        after: Some(retry_after),
                    },
                    Ok(other) => SendResult::Retry {
                        reason: format!("target: {other:?}"),
                        after: other.retry_after(),
                    },
                    Err(e) if e.is_retryable() => SendResult::retry(format_args!("target: {e}")),
                    Err(e @ (Error::InvalidInput { .. } | Error::UnknownConsumer { .. })) => {
                        SendResult::dead(format_args!("target: {e}"))
                    }
                    Err(e) => SendResult::retry(format_args!("target: {e}")),
                }
            });
        }
        // A message the target refuses never will be accepted: it alone is
        // dead; the rest go in one receive_batch (one commit).
        let mut results = vec![SendResult::Sent; batch.len()];
        let mut valid = Vec::with_capacity(batch.len());
        for (i, out) in batch.iter().enumerate() {
            let msg = Self::message(out);
            match self.target.check_message(&msg) {
                Ok(()) => valid.push((i, msg)),
                Err(e) => results[i] = SendResult::dead(format_args!("target: {e}")),
            }
        }
        let (indexes, msgs): (Vec<usize>, Vec<Message>) = valid.into_iter().unzip();
        if let Err(e) = self.target.receive_batch(&self.consumer, msgs) {
            let reason = format!("target: {e}");
            for i in indexes {
                results[i] = SendResult::retry(&reason);
            }
        }
        results
    }
}

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
    // Keeps trying (out of file descriptors, say): giving up would leave
    // the outbox unrelayed for the life of the process, with no error
    // anywhere but the log.
    let mut pause = Duration::from_millis(100);
    let conn = loop {
        let opened = failpoint::hit("relay.open").and_then(|()| {
            open_reader(&shared.path, shared.config.busy_timeout)
                .map_err(|e| Error::sqlite("open relay connection", e))
        });
        match opened {
            Ok(conn) => break conn,
            Err(e) => {
                log::error!("postroom relay: cannot open the database: {e}; again in {pause:?}");
                match stop.recv_timeout(pause) {
                    Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
                    _ => return,
                }
                pause = (pause * 2).min(Duration::from_secs(5));
            }
        }
    };
    let wal = checkpoint::wal_path(&shared.path);
    let mut stop_at: Option<Instant> = None;
    loop {
        if stop_at.is_some_and(|at| Instant::now() >= at) {
            return;
        }
        let now = shared.clock.now_ms();
        let fetched = match outbox::fetch_due(&conn, now, shared.config.relay_batch) {
            Ok(fetched) => fetched,
            Err(e) => {
                log::warn!("postroom relay: reading the outbox: {e}");
                Vec::new()
            }
        };
        if fetched.is_empty() {
            if stop_at.is_some() {
                return; // flushed
            }
            crossbeam_channel::select! {
                recv(wake) -> _ => {}
                recv(stop) -> at => stop_at = Some(at.unwrap_or_else(|_| Instant::now())),
                default(shared.config.relay_poll) => {}
            }
            continue;
        }
        let (batch, results) = match next(fetched) {
            Next::Undecodable(msg, column) => {
                let reason = inbox::undecodable(column);
                log::error!(
                    "postroom relay: outbox row {}: {reason}; dead-lettered",
                    msg.seq
                );
                (vec![msg], vec![SendResult::Dead { reason }])
            }
            Next::Send(batch) => {
                // At `Normal` the batch's commits may not be on disk yet (the
                // relay is woken at COMMIT). The sink must not get a row a
                // power cut could still take back: it would keep an effect
                // this database lost, and the message's redelivery would
                // publish it again under a new id. So the WAL is synced
                // first: one fsync per batch.
                if shared.config.durability == Durability::Normal {
                    if let Err(e) = checkpoint::sync_wal(&wal) {
                        log::warn!("postroom relay: WAL fsync failed: {e}; batch held back");
                        if !pause_after_failure(&shared, &stop, &mut stop_at) {
                            return;
                        }
                        continue;
                    }
                }
                let results = panic::catch_unwind(AssertUnwindSafe(|| sink.send(&batch)))
                    .unwrap_or_else(|panic| {
                        let reason = format!("sink panicked: {}", panic_message(panic.as_ref()));
                        vec![SendResult::retry(reason); batch.len()]
                    });
                (batch, results)
            }
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
                log::warn!("postroom relay: recording results: {e}");
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

/// What the relay does with a fetched batch.
enum Next {
    /// Hand these to the sink.
    Send(Vec<OutboxMessage>),
    /// Dead-letter this row, whose named column did not decode.
    Undecodable(OutboxMessage, &'static str),
}

/// The rows before the first that did not decode go to the sink. When that
/// row is the first, it alone is dead-lettered; the rows after it wait for
/// the next batch, so none of its key goes ahead of it.
fn next(mut fetched: Vec<(OutboxMessage, Option<&'static str>)>) -> Next {
    let first_damaged = fetched
        .iter()
        .enumerate()
        .find_map(|(i, (_, damage))| damage.map(|column| (i, column)));
    match first_damaged {
        Some((0, column)) => Next::Undecodable(fetched.swap_remove(0).0, column),
        first => {
            fetched.truncate(first.map_or(fetched.len(), |(i, _)| i));
            Next::Send(fetched.into_iter().map(|(msg, _)| msg).collect())
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

/// Marks a batch's results through the writer, in one job.
fn record(shared: &Shared, batch: Vec<OutboxMessage>, results: Vec<SendResult>) -> Result<()> {
    shared.writer.submit(move |w| {
        let now = w.clock.now_ms();
        record_results(w.conn, w.config, now, &batch, &results)
    })
}

/// Marks what became of each message of a batch. A message after a failed
/// one of the same key is left alone: not sent, no attempt counted.
pub(crate) fn record_results(
    conn: &Connection,
    config: &Config,
    now: i64,
    batch: &[OutboxMessage],
    results: &[SendResult],
) -> Result<()> {
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
            SendResult::Sent => outbox::mark_sent(conn, msg.seq, now).map_err(sql)?,
            SendResult::Retry { reason, after } => {
                let attempt = msg.attempts.saturating_add(1);
                let delay =
                    after.unwrap_or_else(|| config.retry.delay(attempt, jitter(msg.seq, attempt)));
                let next = now.saturating_add(clock::millis(delay));
                outbox::mark_failed(conn, msg.seq, &reason, next, config.max_attempts, false)
                    .map_err(sql)?;
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
                outbox::mark_failed(conn, msg.seq, &reason, now, config.max_attempts, true)
                    .map_err(sql)?;
                log::warn!("postroom relay: outbox message {} dead: {reason}", msg.id);
                // Later rows of the key were held back by the sink in this
                // batch; they go next time (a dead row blocks nothing).
                if let Some(key) = msg.key.as_deref() {
                    held.insert(key);
                }
            }
        }
    }
    Ok(())
}

fn jitter(seq: i64, attempt: u32) -> u64 {
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

/// Wakes the relay after a commit that added outbox rows.
pub(crate) fn wake(tx: &Sender<()>, dirty: &std::sync::atomic::AtomicBool) {
    if dirty.swap(false, Ordering::AcqRel) {
        let _ = tx.try_send(());
    }
}
