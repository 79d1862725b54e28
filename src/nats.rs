//! The NATS JetStream bridge (feature `nats`): an outbox [`Sink`] that
//! publishes to a JetStream stream, and a [`NatsIntake`] that feeds a
//! durable pull consumer's messages to an inbox. Both run on
//! [`async_nats`] (re-exported), the NATS project's own client, driven by a
//! current-thread tokio runtime on the thread that uses it (the relay's
//! thread for the sink, `postroom-nats-intake` for the intake): no thread
//! pool, and nothing runs while the bridge waits.
//!
//! Every message carries the hop contract ([`crate::hop`]) in NATS headers:
//! the outbox row's id, `seq`, topic, key, origin, unsettled-from and the
//! sink's source name as `postroom-*` headers, the row's own headers under
//! their names, the payload as it is. The id is also the message's
//! `Nats-Msg-Id`, so the stream itself drops a re-send within its
//! duplicate window; the receiving inbox drops one at any distance.
//!
//! Out: [`NatsSink`] answers `Sent` for a row only on the stream's publish
//! acknowledgement (the row is stored in the stream, or already was:
//! `duplicate`). A server that cannot be reached, or does not answer in
//! time, makes the unacknowledged rows [`SendResult::Unavailable`]:
//! retried with backoff, no attempt counted. A row the server could never
//! take (a subject that is not one, a header name NATS refuses, a header of
//! NATS's own (`Nats-…`), larger than the server's max payload) is dead at
//! once, before anything is sent. Per-key order: a row is published only
//! once every earlier row of its key is acknowledged, and after a row of a
//! key fails, the later rows of that key in the batch are not published.
//!
//! In: [`NatsIntake`] pulls from a durable consumer with explicit
//! acknowledgements and hands each message to
//! [`deliver`](Postroom::deliver) (or [`receive`](Postroom::receive)).
//! Invariant: a message is acknowledged only once it is durably in the
//! inbox or in the dead letters (with its payload and the reason); one
//! that is not is never acknowledged, and is asked back (`NAK` with the
//! outcome's `retry_after`) together with every message behind it that
//! was not handed on, so per-key order holds.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::panic::{self, AssertUnwindSafe};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

pub use async_nats;
use async_nats::jetstream::{self, consumer, context::PublishErrorKind, AckKind};
use async_nats::{HeaderMap, HeaderName, HeaderValue};
use futures_util::StreamExt;

use crate::delivery::panic_message;
use crate::engine::Postroom;
use crate::error::{Error, Result};
use crate::escape::Esc;
pub use crate::hop::IntakeStats;
use crate::hop::{self, bump, Arrived, IntakeCounters as Counters, Landed, Lander, Mode};
use crate::sink::{SendResult, Sink};
use crate::store::outbox::OutboxMessage;

/// The header JetStream dedupes on, within the stream's duplicate window.
pub const MSG_ID: &str = "Nats-Msg-Id";

/// The shortest backoff step: a zero one would spin on a server that is
/// down.
const MIN_STEP: Duration = Duration::from_millis(10);
/// The longest wait: beyond it waits are settings mistakes.
const MAX_WAIT: Duration = Duration::from_secs(3600);

/// Exponential backoff between `min` and `max`, doubled per failure.
#[derive(Debug, Clone)]
struct Backoff {
    min: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    fn new(min: Duration, max: Duration) -> Self {
        let min = min.clamp(MIN_STEP, MAX_WAIT);
        Backoff {
            min,
            max: max.clamp(min, MAX_WAIT),
            next: min,
        }
    }

    fn fail(&mut self) -> Duration {
        let now = self.next;
        self.next = (self.next * 2).min(self.max);
        now
    }

    fn reset(&mut self) {
        self.next = self.min;
    }
}

/// A current-thread runtime with timers and sockets, for the thread that
/// builds it.
fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::io("start the NATS client's runtime", e))
}

/// Connects to `url` (a NATS URL or a comma-separated list of them) within
/// `timeout`.
async fn connect(url: &str, timeout: Duration) -> std::result::Result<async_nats::Client, String> {
    let options = async_nats::ConnectOptions::new()
        .connection_timeout(timeout)
        .request_timeout(Some(timeout));
    match tokio::time::timeout(timeout * 2, options.connect(url)).await {
        Ok(Ok(client)) => Ok(client),
        Ok(Err(e)) => Err(format!("nats: cannot connect to {url}: {e}")),
        Err(_) => Err(format!("nats: no connection to {url} within {timeout:?}")),
    }
}

/// Creates the JetStream stream `name` taking `subjects`, file-backed, if
/// it does not exist (one that does is left as it is): for examples, tests
/// and first setups. Production streams are usually made by an operator
/// with the `nats` CLI or a config; see docs/SINKS.md for what they need.
pub fn ensure_stream(url: &str, name: &str, subjects: &[&str]) -> Result<()> {
    let rt = runtime()?;
    rt.block_on(async {
        let client = connect(url, Duration::from_secs(10))
            .await
            .map_err(|e| Error::invalid("nats", e))?;
        let js = jetstream::new(client);
        js.get_or_create_stream(jetstream::stream::Config {
            name: name.to_owned(),
            subjects: subjects.iter().map(|s| (*s).to_owned()).collect(),
            storage: jetstream::stream::StorageType::File,
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await
        .map(|_| ())
        .map_err(|e| Error::invalid("nats", format!("create the stream {name:?}: {e}")))
    })
}

/// Why `subject` cannot be published to: empty, an empty token, a
/// wildcard token (`*`, `>`), or a character outside printable ASCII
/// other than space (an allowlist: NATS splits its protocol on whitespace,
/// and subjects are ASCII by convention of every client).
fn subject_problem(subject: &str) -> Option<String> {
    if subject.is_empty() {
        return Some("the NATS subject is empty".into());
    }
    if let Some(c) = subject.chars().find(|c| !c.is_ascii_graphic()) {
        return Some(format!(
            "the NATS subject {subject:?} holds {c:?}, which NATS does not take in a subject \
             (printable ASCII without spaces only)"
        ));
    }
    for token in subject.split('.') {
        if token.is_empty() {
            return Some(format!("the NATS subject {subject:?} has an empty token"));
        }
        if token == "*" || token == ">" {
            return Some(format!("the NATS subject {subject:?} holds a wildcard"));
        }
    }
    None
}

/// The NATS headers of a row: the hop contract, the row's own headers, and
/// [`MSG_ID`] = the outbox id; or why a server would never take them (a
/// name NATS refuses, a value with a line break, a header of NATS's own).
fn headers_of(msg: &OutboxMessage, source: Option<&str>) -> std::result::Result<HeaderMap, String> {
    let mut headers = HeaderMap::new();
    for (name, value) in hop::slots(msg, source) {
        if name.len() >= 5 && name[..5].eq_ignore_ascii_case("nats-") {
            return Err(format!(
                "the header {name:?} is one of NATS's own (Nats-…), which steer the server: \
                 rename it"
            ));
        }
        let header = HeaderName::from_str(&name).map_err(|_| {
            format!("the header name {name:?} is not one NATS takes (printable ASCII, no ':')")
        })?;
        let value = HeaderValue::from_str(&value)
            .map_err(|_| format!("the header {name:?} has a line break in its value"))?;
        headers.insert(header, value);
    }
    let id = HeaderValue::from_str(&msg.id)
        .map_err(|_| format!("the message id {:?} has a line break", msg.id))?;
    headers.insert(MSG_ID, id);
    Ok(headers)
}

type SubjectFn = Box<dyn Fn(&OutboxMessage) -> String + Send>;

/// An outbox [`Sink`] publishing each row to a JetStream stream; a row is
/// `Sent` only on the stream's publish acknowledgement. The payload
/// travels as it is, the hop contract in headers ([`crate::hop::header`])
/// and the outbox id also as [`MSG_ID`].
///
/// The subject of a row is its outbox topic (see
/// [`subject_prefix`](NatsSink::subject_prefix),
/// [`subject_with`](NatsSink::subject_with)); a stream must take it
/// (JetStream answers "no responders" otherwise, which the sink treats as
/// the stream being unavailable: retried, no attempt counted, logged).
/// Up to [`window`](NatsSink::window) publishes are outstanding at once,
/// never two of one key: a row waits for the acknowledgement of the row of
/// its key before it, so a failure cannot let a later row of the key into
/// the stream ahead of it.
pub struct NatsSink {
    url: String,
    subject: SubjectFn,
    source: Option<String>,
    ack_timeout: Duration,
    window: usize,
    backoff: Backoff,
    rt: Option<tokio::runtime::Runtime>,
    link: Option<(jetstream::Context, Instant)>,
}

/// A connection idle this long is dropped and made again: nobody drove it
/// in between (the runtime runs only inside `send`), so the server may have
/// closed it as stale.
const IDLE_RECONNECT: Duration = Duration::from_secs(60);

impl NatsSink {
    /// Publishes through the server(s) at `url` (`nats://host:port`, or a
    /// comma-separated list).
    pub fn new(url: impl Into<String>) -> Self {
        NatsSink {
            url: url.into(),
            subject: Box::new(|m: &OutboxMessage| m.topic.clone()),
            source: None,
            ack_timeout: Duration::from_secs(10),
            window: 64,
            backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(5)),
            rt: None,
            link: None,
        }
    }

    /// The subject of a row is `prefix` followed by its outbox topic.
    pub fn subject_prefix(mut self, prefix: impl Into<String>) -> Self {
        let prefix = prefix.into();
        self.subject = Box::new(move |m: &OutboxMessage| format!("{prefix}{}", m.topic));
        self
    }

    /// The subject of a row is `f(row)`. A subject that cannot be published
    /// to (empty, a wildcard, a space) makes that row dead.
    pub fn subject_with(mut self, f: impl Fn(&OutboxMessage) -> String + Send + 'static) -> Self {
        self.subject = Box::new(f);
        self
    }

    /// Names this outbox in every message (`postroom-source`): the intake
    /// then uses it as the inbox message's source instead of the row's
    /// topic.
    pub fn source(mut self, name: impl Into<String>) -> Self {
        self.source = Some(name.into());
        self
    }

    /// How long the sink waits to connect and for each publish
    /// acknowledgement (10 s by default, kept within 100 ms and an hour)
    /// before it counts the server unavailable.
    pub fn ack_timeout(mut self, timeout: Duration) -> Self {
        self.ack_timeout = timeout.clamp(Duration::from_millis(100), MAX_WAIT);
        self
    }

    /// Publishes outstanding at once (64 by default, at least 1).
    pub fn window(mut self, window: usize) -> Self {
        self.window = window.max(1);
        self
    }

    /// The backoff while the server cannot be reached: from `min`, doubled
    /// per failure, up to `max` (100 ms to 5 s by default).
    pub fn backoff(mut self, min: Duration, max: Duration) -> Self {
        self.backoff = Backoff::new(min, max);
        self
    }

    /// Publishes `todo` (index, subject, headers) with their payloads from
    /// `batch`, recording the answers in `results`. An error means the
    /// server is unavailable; the rows not answered stay as they are.
    fn publish_all(
        &mut self,
        batch: &[OutboxMessage],
        todo: Vec<(usize, String, HeaderMap)>,
        results: &mut [SendResult],
    ) -> std::result::Result<(), String> {
        let Some(rt) = self.rt.as_ref() else {
            return Err("nats: no runtime".into());
        };
        if self
            .link
            .as_ref()
            .is_some_and(|(_, used)| used.elapsed() > IDLE_RECONNECT)
        {
            self.link = None;
        }
        let ack_timeout = self.ack_timeout;
        let window = self.window;
        let url = self.url.clone();
        let link = &mut self.link;
        rt.block_on(async move {
            if link.is_none() {
                let client = connect(&url, ack_timeout).await?;
                let js = jetstream::ContextBuilder::new()
                    .timeout(ack_timeout)
                    .build(client);
                *link = Some((js, Instant::now()));
            }
            let Some((js, used)) = link.as_mut() else {
                return Err("nats: no connection".to_owned());
            };
            // Published, not yet answered, in order: (index, key, ack).
            let mut flight: std::collections::VecDeque<(usize, Option<String>, _)> =
                std::collections::VecDeque::new();
            let mut in_flight_keys: HashMap<String, usize> = HashMap::new();
            let mut failed_keys: HashSet<String> = HashSet::new();
            let mut outage: Option<String> = None;

            // Takes the oldest publish's answer.
            macro_rules! answer_one {
                () => {{
                    let (i, key, ack): (usize, Option<String>, jetstream::context::PublishAckFuture) =
                        flight.pop_front().expect("flight is not empty");
                    if let Some(k) = &key {
                        if let Some(n) = in_flight_keys.get_mut(k) {
                            *n -= 1;
                            if *n == 0 {
                                in_flight_keys.remove(k);
                            }
                        }
                    }
                    let result = match ack.await {
                        Ok(_) => SendResult::Sent,
                        Err(e) => match e.kind() {
                            PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe => {
                                outage.get_or_insert_with(|| format!("nats: no publish acknowledgement: {e}"));
                                SendResult::retry("not handed over")
                            }
                            PublishErrorKind::StreamNotFound => {
                                outage.get_or_insert_with(|| format!(
                                    "nats: no JetStream stream takes the subject of message {:?} \
                                     (no responders): create one (docs/SINKS.md)",
                                    batch[i].id
                                ));
                                SendResult::retry("not handed over")
                            }
                            PublishErrorKind::MaxPayloadExceeded => SendResult::dead(format!("nats: {e}")),
                            _ => SendResult::retry(format!("nats: the server refused it: {e}")),
                        },
                    };
                    if result != SendResult::Sent {
                        if let Some(k) = key {
                            failed_keys.insert(k);
                        }
                    }
                    results[i] = result;
                }};
            }

            for (i, subject, headers) in todo {
                if outage.is_some() {
                    break;
                }
                let key = batch[i].key.clone();
                if let Some(k) = &key {
                    // Never two of one key outstanding: this row waits for
                    // the one before it.
                    while in_flight_keys.contains_key(k) && outage.is_none() {
                        answer_one!();
                    }
                    if outage.is_some() {
                        break;
                    }
                    if failed_keys.contains(k) {
                        results[i] = SendResult::retry("behind an earlier failure of its key");
                        continue;
                    }
                }
                while flight.len() >= window && outage.is_none() {
                    answer_one!();
                }
                if outage.is_some() {
                    break;
                }
                let payload = batch[i].payload.clone().into();
                // Bounded: a client whose connection is down queues the
                // publish, and waits once its queue is full.
                let sent = tokio::time::timeout(
                    ack_timeout,
                    js.publish_with_headers(subject, headers, payload),
                )
                .await
                .unwrap_or_else(|_| {
                    Err(jetstream::context::PublishError::new(
                        PublishErrorKind::TimedOut,
                    ))
                });
                match sent {
                    Ok(ack) => {
                        if let Some(k) = &key {
                            *in_flight_keys.entry(k.clone()).or_insert(0) += 1;
                        }
                        flight.push_back((i, key, ack));
                    }
                    Err(e) => {
                        let result = match e.kind() {
                            PublishErrorKind::MaxPayloadExceeded => {
                                SendResult::dead(format!("nats: {e}"))
                            }
                            _ => {
                                outage.get_or_insert_with(|| format!("nats: publish: {e}"));
                                SendResult::retry("not handed over")
                            }
                        };
                        if result != SendResult::Sent {
                            failed_keys.extend(key);
                        }
                        results[i] = result;
                    }
                }
            }
            // Once the server is known unavailable the rest are not waited
            // for one by one (each could take `ack_timeout`): they stay "not
            // handed over", unavailable, and a re-send is deduplicated.
            while !flight.is_empty() && outage.is_none() {
                answer_one!();
            }
            *used = Instant::now();
            match outage {
                Some(reason) => Err(reason),
                None => Ok(()),
            }
        })
    }
}

impl Sink for NatsSink {
    fn send(&mut self, batch: &[OutboxMessage]) -> Vec<SendResult> {
        let mut results = vec![SendResult::retry("not handed over"); batch.len()];
        if self.rt.is_none() {
            match runtime() {
                Ok(rt) => self.rt = Some(rt),
                Err(e) => {
                    let after = self.backoff.fail();
                    return vec![SendResult::unavailable(e, after); batch.len()];
                }
            }
        }
        // What the server would never take is dead before anything is
        // sent, holding nothing back.
        let mut todo = Vec::with_capacity(batch.len());
        for (i, msg) in batch.iter().enumerate() {
            let subject = (self.subject)(msg);
            let checked = match subject_problem(&subject) {
                Some(problem) => Err(problem),
                None => headers_of(msg, self.source.as_deref()),
            };
            match checked {
                Ok(headers) => todo.push((i, subject, headers)),
                Err(problem) => results[i] = SendResult::dead(problem),
            }
        }
        if todo.is_empty() {
            return results;
        }
        let indexes: Vec<usize> = todo.iter().map(|(i, _, _)| *i).collect();
        match self.publish_all(batch, todo, &mut results) {
            Ok(()) => self.backoff.reset(),
            Err(reason) => {
                log::warn!("postroom nats sink: {}; reconnecting", Esc(&reason));
                self.link = None;
                let after = self.backoff.fail();
                for i in indexes {
                    if results[i] == SendResult::retry("not handed over") {
                        results[i] = SendResult::unavailable(&reason, after);
                    }
                }
            }
        }
        results
    }
}

/// Builds a [`NatsIntake`]; see [`NatsIntake::builder`].
pub struct IntakeBuilder {
    url: String,
    room: Arc<Postroom>,
    consumer: String,
    stream: String,
    durable: String,
    filter: Option<String>,
    mode: Mode,
    backoff: Backoff,
    sequenced: bool,
    batch: usize,
    ack_wait: Duration,
}

impl IntakeBuilder {
    /// Only the stream's messages on `subject` (wildcards allowed); all of
    /// them by default. Fixed when the durable consumer is created.
    pub fn filter_subject(mut self, subject: impl Into<String>) -> Self {
        self.filter = Some(subject.into());
        self
    }

    /// Stores each message with [`receive`](Postroom::receive) (the
    /// engine's workers process it) instead of delivering it inline; every
    /// receipt acknowledges.
    pub fn queued(mut self) -> Self {
        self.mode = Mode::Receive;
        self
    }

    /// Keeps a sequence watermark per sending outbox, as
    /// the MQTT intake's `sequenced` does (the same contract:
    /// only for an intake that receives every message of each sending
    /// outbox; numbers out of range make a dead letter).
    pub fn sequenced(mut self) -> Self {
        self.sequenced = true;
        self
    }

    /// Messages pulled at once (64 by default, 1 to 10,000).
    pub fn batch(mut self, n: usize) -> Self {
        self.batch = n.clamp(1, 10_000);
        self
    }

    /// The consumer's ack wait, set when it is created (30 s by default):
    /// a message pulled and neither acknowledged nor NAKed within it (the
    /// intake died) is redelivered. Longer than the slowest handler.
    pub fn ack_wait(mut self, wait: Duration) -> Self {
        self.ack_wait = wait.clamp(Duration::from_secs(1), MAX_WAIT);
        self
    }

    /// The wait between reconnection attempts while the server cannot be
    /// reached: from `min`, doubled per failure, up to `max` (100 ms to
    /// 5 s by default).
    pub fn backoff(mut self, min: Duration, max: Duration) -> Self {
        self.backoff = Backoff::new(min, max);
        self
    }

    /// Starts the intake's thread (`postroom-nats-intake`). The durable
    /// consumer is created on the stream when it does not exist
    /// (explicit acks, deliver all, the ack wait above, the filter); one
    /// that exists is used as it is. Refused here: a consumer the engine
    /// does not have ([`Error::UnknownConsumer`]), an effectful consumer
    /// without [`queued`](IntakeBuilder::queued), an empty stream or
    /// durable name ([`Error::InvalidInput`]).
    pub fn start(self) -> Result<NatsIntake> {
        if self.stream.is_empty() || self.durable.is_empty() {
            return Err(Error::invalid(
                "nats",
                "an intake needs a stream and a durable consumer name",
            ));
        }
        self.room
            .check_intake(&self.consumer, self.mode == Mode::Deliver)?;
        let counters = Arc::new(Counters::default());
        let stop = Arc::new(AtomicBool::new(false));
        let (done_tx, done) = crossbeam_channel::bounded(1);
        let worker = Intake {
            url: self.url,
            stream: self.stream,
            durable: self.durable,
            filter: self.filter,
            batch: self.batch,
            ack_wait: self.ack_wait,
            backoff: self.backoff,
            lander: Lander {
                room: self.room,
                consumer: self.consumer,
                mode: self.mode,
                sequenced: self.sequenced.then(HashSet::new),
                label: "postroom nats intake",
            },
            counters: Arc::clone(&counters),
            stop: Arc::clone(&stop),
            outstanding: BTreeSet::new(),
            barrier: None,
        };
        let handle = thread::Builder::new()
            .name("postroom-nats-intake".into())
            .spawn(move || {
                let outcome = panic::catch_unwind(AssertUnwindSafe(|| worker.run()))
                    .map_err(|p| panic_message(p.as_ref()))
                    .and_then(|r| r);
                if let Err(reason) = &outcome {
                    log::error!("postroom nats intake: {}", Esc(&reason));
                }
                let _ = done_tx.send(outcome);
            })
            .map_err(|e| Error::io("spawn thread", e))?;
        Ok(NatsIntake {
            counters,
            stop,
            handle: Some(handle),
            done,
        })
    }
}

/// Feeds a JetStream durable pull consumer's messages to one consumer of a
/// [`Postroom`]: one named thread, explicit acknowledgements.
/// Shut it down before the engine.
///
/// Each message's inbox id and source come from its hop headers
/// ([`crate::hop::header`]: id = `postroom-id`, source = `postroom-source`
/// or else `postroom-topic`), or, from a publisher that does not speak the
/// contract (nor an [`Envelope`](crate::hop::Envelope) payload), source =
/// the subject and id = its [`MSG_ID`] when it set one,
/// else `nats-` + 128 bits of blake3 over subject and payload. Headers of
/// NATS's own (`Nats-…`) are not kept.
///
/// Messages are handed on one at a time in the order pulled, and each is
/// acknowledged only when [`Outcome::should_ack`](crate::Outcome::should_ack)
/// (queued: once stored). One that is not (the handler failed and will be
/// retried, storage failed) is NAKed with its `retry_after`, and so is
/// every message pulled after it, unhandled; the intake pulls again only
/// after that wait, when JetStream redelivers them first, in order. A
/// message the engine refuses is stored as a dead letter with the reason,
/// then acknowledged.
pub struct NatsIntake {
    counters: Arc<Counters>,
    stop: Arc<AtomicBool>,
    handle: Option<thread::JoinHandle<()>>,
    done: crossbeam_channel::Receiver<std::result::Result<(), String>>,
}

impl NatsIntake {
    /// An intake into `consumer` of `room`, pulling from the durable
    /// consumer `durable` of the JetStream stream `stream` through the
    /// server(s) at `url`. Give each intake a durable name of its own that
    /// stays the same across restarts: JetStream keeps its position.
    pub fn builder(
        url: impl Into<String>,
        room: Arc<Postroom>,
        consumer: impl Into<String>,
        stream: impl Into<String>,
        durable: impl Into<String>,
    ) -> IntakeBuilder {
        IntakeBuilder {
            url: url.into(),
            room,
            consumer: consumer.into(),
            stream: stream.into(),
            durable: durable.into(),
            filter: None,
            mode: Mode::Deliver,
            backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(5)),
            sequenced: false,
            batch: 64,
            ack_wait: Duration::from_secs(30),
        }
    }

    /// What it has seen so far.
    pub fn stats(&self) -> IntakeStats {
        self.counters.snapshot()
    }

    /// Waits until the intake is bound to its durable consumer, at most
    /// `timeout`; false if it is not.
    pub fn wait_bound(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while !self.counters.ready.load(Ordering::Acquire) {
            if Instant::now() >= deadline {
                return false;
            }
            thread::sleep(Duration::from_millis(10));
        }
        true
    }

    /// Stops and joins the thread within `deadline`. Messages pulled and
    /// not acknowledged come again after the consumer's ack wait.
    /// [`Error::Stopped`] when the thread had panicked or did not stop in
    /// time.
    pub fn shutdown(mut self, deadline: Duration) -> Result<()> {
        self.stop_within(deadline)
    }

    fn stop_within(&mut self, deadline: Duration) -> Result<()> {
        self.stop.store(true, Ordering::Release);
        let Some(handle) = self.handle.take() else {
            return Ok(());
        };
        match self.done.recv_timeout(deadline) {
            Ok(outcome) => {
                let _ = handle.join();
                outcome.map_err(|reason| Error::Stopped {
                    thread: "postroom-nats-intake".into(),
                    reason,
                })
            }
            Err(_) => Err(Error::Stopped {
                thread: "postroom-nats-intake".into(),
                reason: format!("did not stop within {deadline:?}"),
            }),
        }
    }
}

impl Drop for NatsIntake {
    fn drop(&mut self) {
        if let Err(e) = self.stop_within(Duration::from_secs(5)) {
            log::warn!("postroom nats intake: {}", Esc(&e));
        }
    }
}

/// The inbox message a JetStream message carries (see [`NatsIntake`]).
fn inbound(msg: &async_nats::Message) -> Arrived {
    let mut slots: Vec<(String, String)> = Vec::new();
    let mut msg_id = None;
    if let Some(headers) = &msg.headers {
        for (name, values) in headers.iter() {
            let name: &str = name.as_ref();
            if name.eq_ignore_ascii_case(MSG_ID) {
                msg_id = values.first().map(|v| v.as_str().to_owned());
            }
            if name.len() >= 5 && name[..5].eq_ignore_ascii_case("nats-") {
                continue;
            }
            if let Some(value) = values.last() {
                slots.push((name.to_owned(), value.as_str().to_owned()));
            }
        }
    }
    let subject = msg.subject.as_str();
    if let Some(came) = Arrived::from_slots(&slots, &msg.payload, subject)
        .or_else(|| Arrived::from_envelope(&msg.payload))
    {
        return came;
    }
    match msg_id {
        Some(id) if !id.is_empty() => {
            let mut came = Arrived::unwrapped("nats", subject, &msg.payload);
            came.msg.id = id;
            came.msg.headers = slots.into_iter().collect();
            came
        }
        _ => {
            let mut came = Arrived::unwrapped("nats", subject, &msg.payload);
            came.msg.headers = slots.into_iter().collect();
            came
        }
    }
}

/// The intake thread's state.
struct Intake {
    url: String,
    stream: String,
    durable: String,
    filter: Option<String>,
    batch: usize,
    ack_wait: Duration,
    backoff: Backoff,
    lander: Lander,
    counters: Arc<Counters>,
    stop: Arc<AtomicBool>,
    /// Stream sequences asked back (NAKed) and not yet handled: nothing
    /// above the lowest is handed on before it.
    outstanding: BTreeSet<u64>,
    /// See [`Intake::bind`].
    barrier: Option<u64>,
}

/// The NAK delay of a message held back behind an earlier one.
const HELD_BACK_DELAY: Duration = Duration::from_millis(200);

/// A bound durable pull consumer.
type Pull = consumer::Consumer<consumer::pull::Config>;

/// How long one pull waits for messages: the bound on noticing `stop`.
const PULL_EXPIRES: Duration = Duration::from_secs(1);

impl Intake {
    fn run(mut self) -> std::result::Result<(), String> {
        let rt = runtime().map_err(|e| e.to_string())?;
        let mut bound: Option<(async_nats::Client, Pull)> = None;
        let mut resume_at: Option<Instant> = None;
        while !self.stop.load(Ordering::Acquire) {
            if let Some(at) = resume_at {
                if Instant::now() < at {
                    thread::sleep(Duration::from_millis(20));
                    continue;
                }
                resume_at = None;
            }
            if bound.is_none() {
                match rt.block_on(self.bind()) {
                    Ok((client, c, barrier)) => {
                        let c = (client, c);
                        self.barrier = barrier;
                        bump(&self.counters.connects);
                        self.counters.ready.store(true, Ordering::Release);
                        self.backoff.reset();
                        bound = Some(c);
                    }
                    Err(e) => {
                        let pause = self.backoff.fail();
                        log::warn!(
                            "postroom nats intake: {}; trying again in {pause:?}",
                            Esc(&e)
                        );
                        resume_at = Some(Instant::now() + pause);
                        continue;
                    }
                }
            }
            let Some((_, c)) = bound.as_ref() else {
                continue;
            };
            // While an earlier message is awaited, one at a time: what
            // comes meanwhile is asked back.
            let waiting_batch = if self.barrier.is_some() || !self.outstanding.is_empty() {
                1
            } else {
                self.batch
            };
            let pulled = rt.block_on(async {
                tokio::time::timeout(PULL_EXPIRES * 10, async {
                    let mut batch = c
                        .fetch()
                        .max_messages(waiting_batch)
                        .expires(PULL_EXPIRES)
                        .messages()
                        .await
                        .map_err(|e| format!("nats: pull: {e}"))?;
                    let mut out = Vec::new();
                    while let Some(m) = batch.next().await {
                        match m {
                            Ok(m) => out.push(m),
                            Err(e) => {
                                if out.is_empty() {
                                    return Err(format!("nats: pull: {e}"));
                                }
                                break;
                            }
                        }
                    }
                    Ok(out)
                })
                .await
                .unwrap_or_else(|_| Err("nats: a pull did not end within 10 s".to_owned()))
            });
            let pulled = match pulled {
                Ok(p) => p,
                Err(e) => {
                    self.counters.ready.store(false, Ordering::Release);
                    bound = None;
                    let pause = self.backoff.fail();
                    log::warn!(
                        "postroom nats intake: {}; binding again in {pause:?}",
                        Esc(&e)
                    );
                    resume_at = Some(Instant::now() + pause);
                    continue;
                }
            };
            let mut hold: Option<Duration> = None;
            let mut handled = 0usize;
            for m in pulled {
                bump(&self.counters.received);
                let (seq, delivered) = m
                    .info()
                    .map(|i| (i.stream_sequence, i.delivered))
                    .unwrap_or((0, 1));
                if delivered > 1 {
                    bump(&self.counters.redelivered);
                }
                // Behind a message not acknowledged (one this intake asked
                // back, or one a previous intake pulled and never answered):
                // handing it on first would break per-key order. Asked back,
                // to come again after the earlier one.
                let behind = self.barrier.is_some_and(|b| seq > b)
                    || self.outstanding.range(..seq).next().is_some();
                if behind || hold.is_some() {
                    bump(&self.counters.held_back);
                    self.outstanding.insert(seq);
                    let after = hold.unwrap_or(HELD_BACK_DELAY);
                    let _ = rt.block_on(m.ack_with(AckKind::Nak(Some(after))));
                    continue;
                }
                handled += 1;
                let came = inbound(&m.message);
                if !came.wrapped {
                    bump(&self.counters.unwrapped);
                }
                let place = m.message.subject.to_string();
                match self.lander.land(came, &place, || inbound(&m.message).msg) {
                    Landed::Ack { duplicate, refused } => {
                        if duplicate {
                            bump(&self.counters.duplicates);
                        }
                        if refused {
                            bump(&self.counters.refused);
                        }
                        self.outstanding.remove(&seq);
                        // A lost ack is harmless: the message comes again
                        // after the ack wait, and the inbox knows it.
                        match rt.block_on(m.ack()) {
                            Ok(()) => bump(&self.counters.acked),
                            Err(e) => log::warn!("postroom nats intake: ack: {}", Esc(&e)),
                        }
                    }
                    Landed::Hold { retry_after } => {
                        bump(&self.counters.not_acked);
                        let after = retry_after.min(MAX_WAIT);
                        self.outstanding.insert(seq);
                        let _ = rt.block_on(m.ack_with(AckKind::Nak(Some(after))));
                        hold = Some(after);
                    }
                }
            }
            if self.barrier.is_some() || !self.outstanding.is_empty() {
                if let Some((_, c)) = bound.as_ref() {
                    // At or below the consumer's ack floor a message is
                    // answered or gone from the stream (limits, age): the
                    // previous intake's messages are all answered once the
                    // floor reaches the barrier, and a held message the
                    // stream dropped is awaited no more.
                    if let Ok(info) = rt.block_on(c.get_info()) {
                        let floor = info.ack_floor.stream_sequence;
                        if self.barrier.is_some_and(|b| floor >= b) {
                            self.barrier = None;
                        }
                        self.outstanding = self.outstanding.split_off(&(floor + 1));
                    }
                }
            }
            if let Some(after) = hold {
                // Pull again only once they are due.
                resume_at = Some(Instant::now() + after);
            } else if handled == 0 && (self.barrier.is_some() || !self.outstanding.is_empty()) {
                // Waiting for an earlier message to come again: pull
                // slowly meanwhile.
                resume_at = Some(Instant::now() + HELD_BACK_DELAY);
            }
        }
        // Flush what was acknowledged before going (bounded).
        rt.block_on(async {
            let _ = tokio::time::timeout(Duration::from_secs(1), async {
                if let Some((client, _)) = bound.as_ref() {
                    let _ = client.flush().await;
                }
            })
            .await;
        });
        Ok(())
    }

    /// Connects and binds the durable consumer, creating it when absent.
    /// With the barrier: when the consumer has messages delivered and not
    /// yet answered (a previous intake died holding them), the highest
    /// stream sequence delivered so far; nothing above it is handed on
    /// before they are answered.
    #[allow(clippy::type_complexity)]
    async fn bind(&self) -> std::result::Result<(async_nats::Client, Pull, Option<u64>), String> {
        let client = connect(&self.url, Duration::from_secs(5)).await?;
        let js = jetstream::new(client.clone());
        let stream = js
            .get_stream(&self.stream)
            .await
            .map_err(|e| format!("nats: the stream {:?}: {e}", self.stream))?;
        let consumer = stream
            .get_or_create_consumer(
                &self.durable,
                consumer::pull::Config {
                    durable_name: Some(self.durable.clone()),
                    ack_policy: consumer::AckPolicy::Explicit,
                    deliver_policy: consumer::DeliverPolicy::All,
                    ack_wait: self.ack_wait,
                    filter_subject: self.filter.clone().unwrap_or_default(),
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| format!("nats: the consumer {:?}: {e}", self.durable))?;
        let info = consumer
            .get_info()
            .await
            .map_err(|e| format!("nats: the consumer {:?}: {e}", self.durable))?;
        let barrier = (info.num_ack_pending > 0).then_some(info.delivered.stream_sequence);
        Ok((client, consumer, barrier))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_are_checked_by_allowlist() {
        assert!(subject_problem("orders.eu.1").is_none());
        for bad in [
            "", "a..b", ".a", "a.", "a.*", "a.>", "a b", "a\tb", "ünï", "a\r\nb",
        ] {
            assert!(subject_problem(bad).is_some(), "{bad:?}");
        }
    }
}
