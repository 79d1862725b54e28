//! The NATS inbox intake ([`NatsIntake`]): a durable JetStream pull
//! consumer's messages handed to one consumer of a [`Postroom`] on the
//! named thread `postroom-nats-intake`.
//!
//! Invariants: a message is acknowledged only once it is durably in the
//! inbox or in the dead letters; one that is not is asked back (NAK with
//! the outcome's `retry_after`) together with every message pulled behind
//! it, and nothing above a message awaited (asked back, or left unanswered
//! by a previous intake: the barrier) is handed on before it, so per-key
//! order holds. What comes at or below the barrier is kept unanswered, in
//! memory, until every message the consumer has pending there is in hand,
//! and then handed on in stream order: a stopped intake's asked-back
//! messages come again in the order their waits end, not in the stream's.
//! A message the client library cannot
//! hand on is found through the consumer's state and settled as a dead
//! letter (src/nats/raw.rs). Every wait (pull, flush, shutdown) is bounded.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer, AckKind};
use futures_util::StreamExt;

use super::raw;
use super::{connect, runtime, Backoff, IntakeStats, MAX_WAIT, MSG_ID};
use crate::delivery::panic_message;
use crate::engine::Postroom;
use crate::error::{Error, Result};
use crate::escape::Esc;
use crate::hop::{bump, Arrived, IntakeCounters as Counters, Landed, Lander, Mode};

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
    /// intake died) is redelivered. Longer than the slowest handler. A
    /// consumer that exists keeps its own, and the intake goes by that one:
    /// no message is asked back for longer (one whose retry is later comes
    /// again and is asked back again), so whatever is pending and not
    /// received for longer than it was never delivered as a message.
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
    /// (explicit acks, deliver all, the ack wait above, the filter, and a
    /// description naming the database's instance id); one that exists is
    /// used as it is, unless it would lose or split messages: acks not
    /// explicit, a `max_deliver` limit, or made by another database's
    /// intake. Then the thread ends without pulling anything
    /// ([`wait_bound`](NatsIntake::wait_bound) is false, and
    /// [`shutdown`](NatsIntake::shutdown) answers [`Error::Stopped`] with
    /// the reason). Refused here: a consumer the engine
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
        let owner = self.room.instance_id()?;
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
            wait: self.ack_wait,
            created: None,
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
            early: BTreeMap::new(),
            terminated: BTreeMap::new(),
            next_probe: Instant::now(),
            suspect: None,
            cut: false,
            owner,
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
/// after that wait, when JetStream redelivers them first, in order. After
/// a restart, what the consumer still had pending is handed on in stream
/// order, once all of it has come again, before anything newer. A
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
        .or_else(|| Arrived::from_envelope(&msg.payload, "nats", subject))
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
    /// The ack wait a consumer this intake creates gets.
    ack_wait: Duration,
    /// The bound consumer's own ack wait (the builder's until bound): what
    /// the server goes by, and the longest this intake asks a message back.
    wait: Duration,
    /// When the bound consumer was created: another time is another
    /// consumer (deleted and made again), whose pending messages are not
    /// those this intake kept or terminated. As written (the type is the
    /// client's choice of time crate).
    created: Option<String>,
    backoff: Backoff,
    lander: Lander,
    counters: Arc<Counters>,
    stop: Arc<AtomicBool>,
    /// Stream sequences asked back (NAKed) and not yet handled: nothing
    /// above the lowest is handed on before it.
    outstanding: BTreeSet<u64>,
    /// See [`Intake::bind`].
    barrier: Option<u64>,
    /// Messages at or below the barrier, by stream sequence, received and
    /// not yet answered: handed on in this order once every message the
    /// consumer has pending at or below the barrier is here
    /// ([`Intake::raise_floor`]). At most the consumer's pending messages
    /// (its `max_ack_pending`).
    early: BTreeMap<u64, jetstream::Message>,
    /// Sequences above the ack floor this intake terminated
    /// ([`Intake::settle_stuck`]), and when: still in the stream, no longer
    /// pending. Passed over by the look for stuck messages; terminated
    /// again every two ack waits while above the floor, so one the server
    /// lost (a SIGKILL before it wrote it) does not hold what is kept for
    /// ever (a termination of what is not pending changes nothing).
    terminated: BTreeMap<u64, Instant>,
    /// When [`Intake::settle_stuck`] may look next.
    next_probe: Instant,
    /// A message [`raw::stuck`] named, and when first: settled only if it
    /// is named again an ack wait later and was not received meanwhile (a
    /// server may deliver what `raw::refusal` suspects, and an ack in
    /// flight leaves a received message above the floor for a moment).
    suspect: Option<(u64, Instant)>,
    /// The last pull was cut short by the client (see [`Intake::pull`]):
    /// what the server delivered behind the cut is pending, unseen.
    cut: bool,
    /// The database's instance id, named in the durable consumer's
    /// description (see [`refusal`]).
    owner: String,
}

/// Why binding failed.
enum Bind {
    /// For now (no server, no stream yet): tried again after the backoff.
    Failed(String),
    /// For good: the consumer is set up so that pulling from it would lose
    /// or split messages ([`refusal`]).
    Refused(String),
}

/// The start of the description an intake gives the durable consumer it
/// creates; the rest is its database's instance id.
const OWNER: &str = "postroom intake of ";

/// Why an intake must not pull from a durable consumer set up so (made by
/// hand, or by another database's intake); `None` when it may. `owner` is
/// this intake's database instance id.
fn refusal(config: &consumer::Config, owner: &str) -> Option<String> {
    if config.ack_policy != consumer::AckPolicy::Explicit {
        return Some(format!(
            "its ack policy is {:?}, not explicit: a message would count as answered before the \
             inbox stored it",
            config.ack_policy
        ));
    }
    if config.max_deliver > 0 {
        return Some(format!(
            "its max_deliver is {}: a message a handler fails that often would never come again \
             and would hold every message behind it; make the consumer with max_deliver -1 \
             (unlimited), dead letters are the engine's (max_attempts)",
            config.max_deliver
        ));
    }
    match config
        .description
        .as_deref()
        .and_then(|d| d.strip_prefix(OWNER))
    {
        Some(other) if other != owner => Some(format!(
            "it belongs to the intake of another database (instance {other}): two inboxes on one \
             durable consumer would each get part of the stream; give each its own durable name \
             (a database restored into a new file or copied has a new instance id: delete the \
             old consumer if the old database is gone)"
        )),
        _ => None,
    }
}

/// The NAK delay of a message held back behind an earlier one.
const HELD_BACK_DELAY: Duration = Duration::from_millis(200);

/// A bound durable pull consumer.
type Pull = consumer::Consumer<consumer::pull::Config>;

/// How long one pull waits for messages: the bound on noticing `stop`.
const PULL_EXPIRES: Duration = Duration::from_secs(1);
/// How long after [`PULL_EXPIRES`] the server's end of a pull may come.
const PULL_GRACE: Duration = Duration::from_secs(1);

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
                match self.bind_now(&rt)? {
                    Ok(b) => bound = Some(b),
                    Err(pause) => {
                        resume_at = Some(Instant::now() + pause);
                        continue;
                    }
                }
            }
            let Some((client, c)) = bound.as_ref() else {
                continue;
            };
            // One at a time while a message this intake asked back is
            // awaited (what comes meanwhile is asked back too); a batch
            // while only the barrier stands: what comes at or below it is
            // kept, and it comes back all at once after the ack wait.
            let asked = if self.barrier.is_none() && !self.outstanding.is_empty() {
                1
            } else {
                self.batch
            };
            let pulled = match self.pull(&rt, c, asked) {
                Ok(p) => p,
                Err(e) => {
                    // The connection may have dropped on a frame the client
                    // cannot parse: look as soon as bound again.
                    self.next_probe = Instant::now();
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
            let short = pulled.len() < asked;
            for m in &pulled {
                bump(&self.counters.received);
                if m.info().is_ok_and(|i| i.delivered > 1) {
                    bump(&self.counters.redelivered);
                }
            }
            let (mut hold, mut handled) = self.hand_on(&rt, pulled);
            if std::mem::take(&mut self.cut) {
                self.fence(&rt, c);
            }
            // A short pull is also what a message the client cannot hand on
            // leaves: the server delivered it (and what came behind it in
            // that pull), the client dropped it. While an earlier message is
            // awaited, pulls come back full of those asked back behind it:
            // the awaited one may be such a message.
            if (short || self.waiting()) && Instant::now() >= self.next_probe {
                self.settle_stuck(&rt, client, c);
                self.next_probe = Instant::now() + self.probe_every();
            }
            if self.waiting() {
                let turn = self.raise_floor(&rt, c);
                if !turn.is_empty() {
                    let (h, n) = self.hand_on(&rt, turn);
                    hold = hold.or(h);
                    handled += n;
                }
            }
            if let Some(after) = hold {
                // Pull again only once they are due.
                resume_at = Some(Instant::now() + after);
            } else if handled == 0 && self.waiting() {
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

    /// Whether an earlier message is awaited: one a previous intake left
    /// unanswered (the barrier) or one this intake asked back.
    fn waiting(&self) -> bool {
        self.barrier.is_some() || !self.outstanding.is_empty()
    }

    /// Binds the durable consumer now, counting the connection; on failure
    /// the backoff's pause before the next try. `Err`: a consumer this
    /// intake must never pull from ([`refusal`]): the thread ends with it.
    #[allow(clippy::type_complexity)]
    fn bind_now(
        &mut self,
        rt: &tokio::runtime::Runtime,
    ) -> std::result::Result<std::result::Result<(async_nats::Client, Pull), Duration>, String>
    {
        Ok(match rt.block_on(self.bind()) {
            Err(Bind::Refused(reason)) => return Err(reason),
            Ok((client, c, info)) => {
                self.rebound(&info);
                bump(&self.counters.connects);
                self.counters.ready.store(true, Ordering::Release);
                self.backoff.reset();
                Ok((client, c))
            }
            Err(Bind::Failed(e)) => {
                let pause = self.backoff.fail();
                log::warn!(
                    "postroom nats intake: {}; trying again in {pause:?}",
                    Esc(&e)
                );
                Err(pause)
            }
        })
    }

    /// Takes the state of the consumer just bound. The barrier: when it has
    /// messages delivered and not yet answered (a previous intake died
    /// holding them, or asked them back and stopped, or this one's
    /// connection dropped), the highest stream sequence delivered so far;
    /// nothing above it is handed on before they are answered. What this
    /// intake kept or terminated belongs to the consumer it was bound to
    /// before: forgotten when this is another one (made again), and what
    /// it kept (received, unanswered) when the consumer has nothing
    /// pending or has delivered less than it (a server that lost its
    /// state): counted in, it would let the barrier fall before what is
    /// pending now has come.
    fn rebound(&mut self, info: &consumer::Info) {
        // Its own, however long: what is pending and not received for
        // less than it may still come (see `settle_stuck`).
        self.wait = info.config.ack_wait.max(Duration::from_secs(1));
        let top = info.delivered.stream_sequence;
        self.barrier = (info.num_ack_pending > 0).then_some(top);
        let created = info.created.to_string();
        let same = self.created.as_ref().is_none_or(|c| *c == created);
        self.created = Some(created);
        if !same {
            self.outstanding.clear();
            self.terminated.clear();
            self.early.clear();
            // Named under the other consumer: its ack wait starts again.
            self.suspect = None;
        } else if info.num_ack_pending == 0
            || self
                .early
                .last_key_value()
                .is_some_and(|(&kept, _)| kept > top)
        {
            self.early.clear();
        }
    }

    /// The wait between two looks for a message the client cannot hand on
    /// while pulls come back short: half the ack wait (the server
    /// redelivers such a message once per ack wait), at most 5 s.
    fn probe_every(&self) -> Duration {
        (self.wait / 2).min(Duration::from_secs(5))
    }

    /// After a pull the client cut short, the messages the server delivered
    /// behind the cut come again only after the ack wait: nothing above
    /// the highest sequence delivered is handed on before them (the
    /// barrier a restart sets, for the same reason).
    fn fence(&mut self, rt: &tokio::runtime::Runtime, c: &Pull) {
        match rt
            .block_on(async { tokio::time::timeout(Duration::from_secs(5), c.get_info()).await })
        {
            Ok(Ok(info)) if info.num_ack_pending > 0 => {
                let top = info.delivered.stream_sequence;
                self.barrier = Some(self.barrier.map_or(top, |b| b.max(top)));
            }
            Ok(Ok(_)) => {}
            // Not known: held as a restart would hold it.
            _ => self.cut = true,
        }
    }

    /// Settles the message just above the consumer's ack floor when the
    /// client cannot hand it on (src/nats/raw.rs): its dead letter stored
    /// first, then terminated at the server, so the floor passes it and the
    /// messages behind it come with their next delivery.
    fn settle_stuck(
        &mut self,
        rt: &tokio::runtime::Runtime,
        client: &async_nats::Client,
        c: &Pull,
    ) {
        let again = 2 * self.wait + PULL_EXPIRES + PULL_GRACE;
        let stale: Vec<u64> = self
            .terminated
            .iter()
            .filter(|(_, at)| at.elapsed() >= again)
            .map(|(&seq, _)| seq)
            .collect();
        for seq in stale {
            match rt.block_on(raw::terminate(client, &self.stream, &self.durable, seq)) {
                Ok(()) => {
                    self.terminated.insert(seq, Instant::now());
                }
                Err(e) => log::warn!("postroom nats intake: {}", Esc(&e)),
            }
        }
        let found = rt.block_on(async {
            let js = jetstream::new(client.clone());
            // Past what is kept at or below the barrier (received: the
            // client read it) and what was terminated (settled already).
            let held =
                |seq: &u64| self.early.contains_key(seq) || self.terminated.contains_key(seq);
            raw::stuck(&js, &self.stream, c, |seq| {
                held(&seq).then(|| {
                    let mut past = seq;
                    while held(&past) {
                        past += 1;
                    }
                    past
                })
            })
            .await
        });
        let stuck = match found {
            Ok(Some(stuck)) => stuck,
            Ok(None) => return,
            Err(e) => {
                log::warn!("postroom nats intake: {}", Esc(&e));
                return;
            }
        };
        if self.outstanding.contains(&stuck.seq) || self.early.contains_key(&stuck.seq) {
            // Received and asked back: the client reads it.
            return;
        }
        match self.suspect {
            Some((seq, since)) if seq == stuck.seq => {
                if since.elapsed() < self.wait + PULL_EXPIRES + PULL_GRACE {
                    return;
                }
            }
            _ => {
                self.suspect = Some((stuck.seq, Instant::now()));
                return;
            }
        }
        self.suspect = None;
        let came = stuck.arrived(&self.stream);
        let place = came.msg.source.clone();
        match self
            .lander
            .land(came, &place, || stuck.arrived(&self.stream).msg)
        {
            Landed::Ack { duplicate, .. } => {
                if duplicate {
                    // Stored before and terminated, yet still above the
                    // floor: the termination did not take.
                    log::warn!(
                        "postroom nats intake: stream sequence {} was terminated before and is \
                         still unacknowledged; terminating it again",
                        stuck.seq
                    );
                } else {
                    bump(&self.counters.unparsed);
                    bump(&self.counters.refused);
                }
                match rt.block_on(raw::terminate(
                    client,
                    &self.stream,
                    &self.durable,
                    stuck.seq,
                )) {
                    Ok(()) => {
                        self.terminated.insert(stuck.seq, Instant::now());
                        if !duplicate {
                            bump(&self.counters.acked);
                        }
                    }
                    Err(e) => log::warn!("postroom nats intake: {}", Esc(&e)),
                }
            }
            Landed::Hold { .. } => {
                log::warn!(
                    "postroom nats intake: stream sequence {} cannot be parsed by the client and \
                     its dead letter could not be stored now; looking again later",
                    stuck.seq
                );
            }
        }
    }

    /// One pull from the consumer of at most `max` messages, bounded (one
    /// while an earlier one is awaited: what comes meanwhile is asked
    /// back). The server ends a pull after [`PULL_EXPIRES`] unless it
    /// delivered `max` first. One it has not ended [`PULL_GRACE`] later
    /// lost its connection meanwhile (async-nats drops it on a frame it
    /// cannot parse, and then waits 5 s more); one that ends short before
    /// its expiry, or with an error after messages, met a stored status
    /// line the client took for the server's. Either way the pull was cut:
    /// what came is returned, the next look for a stuck message is due,
    /// and [`Intake::fence`] holds what was delivered behind the cut.
    fn pull(
        &mut self,
        rt: &tokio::runtime::Runtime,
        c: &Pull,
        max: usize,
    ) -> std::result::Result<Vec<jetstream::Message>, String> {
        let (pulled, cut) = rt.block_on(async {
            let began = tokio::time::Instant::now();
            let until = began + PULL_EXPIRES + PULL_GRACE;
            let started = tokio::time::timeout_at(
                until,
                c.fetch().max_messages(max).expires(PULL_EXPIRES).messages(),
            )
            .await;
            let mut batch = match started {
                Ok(Ok(batch)) => batch,
                Ok(Err(e)) => return (Err(format!("nats: pull: {e}")), false),
                Err(_) => return (Err("nats: a pull did not start in time".to_owned()), false),
            };
            let mut out = Vec::new();
            loop {
                match tokio::time::timeout_at(until, batch.next()).await {
                    Ok(Some(Ok(m))) => out.push(m),
                    Ok(None) => {
                        let early = began.elapsed() + PULL_GRACE / 2 < PULL_EXPIRES;
                        let cut = early && out.len() < max;
                        return (Ok(out), cut);
                    }
                    Ok(Some(Err(e))) if out.is_empty() => {
                        return (Err(format!("nats: pull: {e}")), false)
                    }
                    Ok(Some(Err(_))) => return (Ok(out), true),
                    Err(_) => return (Ok(out), true),
                }
            }
        });
        if cut {
            self.next_probe = Instant::now();
            self.cut = true;
        }
        pulled
    }

    /// Hands the pulled messages on in order, acknowledging what is stored
    /// and asking back what is not and everything behind it. Returns the
    /// wait before the next pull when one was asked back, and how many
    /// were handed on.
    fn hand_on(
        &mut self,
        rt: &tokio::runtime::Runtime,
        pulled: Vec<jetstream::Message>,
    ) -> (Option<Duration>, usize) {
        let mut hold: Option<Duration> = None;
        let mut handled = 0usize;
        for m in pulled {
            let seq = m.info().map(|i| i.stream_sequence).unwrap_or(0);
            // At or below the barrier: kept, unanswered, until every
            // message pending there is in hand (raise_floor); a second
            // delivery replaces the first.
            if seq > 0 && self.barrier.is_some_and(|b| seq <= b) {
                self.early.insert(seq, m);
                continue;
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
            if let Some(after) = self.land(rt, &m, seq) {
                hold = Some(after);
            }
        }
        (hold, handled)
    }

    /// Lands one message in the inbox and answers it: acknowledged once
    /// stored (or refused into the dead letters), else asked back after
    /// the outcome's wait, which is returned.
    fn land(
        &mut self,
        rt: &tokio::runtime::Runtime,
        m: &jetstream::Message,
        seq: u64,
    ) -> Option<Duration> {
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
                // A lost ack is harmless: the message comes again after the
                // ack wait, and the inbox knows it.
                match rt.block_on(m.ack()) {
                    Ok(()) => bump(&self.counters.acked),
                    Err(e) => log::warn!("postroom nats intake: ack: {}", Esc(&e)),
                }
                None
            }
            Landed::Hold { retry_after } => {
                bump(&self.counters.not_acked);
                // Never longer than the consumer's ack wait (see
                // `settle_stuck`): a later retry is asked back again.
                let after = retry_after.min(self.wait);
                self.outstanding.insert(seq);
                let _ = rt.block_on(m.ack_with(AckKind::Nak(Some(after))));
                Some(after)
            }
        }
    }

    /// At or below the consumer's ack floor a message is answered or gone
    /// from the stream (limits, age): a held message the stream dropped is
    /// awaited no more. The barrier falls once the floor reaches it, or
    /// once every message the consumer has pending at or below it has come
    /// (kept in `early`): those are returned, in stream order, to be
    /// handed on. Pending at or below the barrier is all that is pending
    /// but what this intake asked back above it (every message above it
    /// that came was asked back).
    fn raise_floor(&mut self, rt: &tokio::runtime::Runtime, c: &Pull) -> Vec<jetstream::Message> {
        let Ok(info) = rt.block_on(c.get_info()) else {
            return Vec::new();
        };
        let floor = info.ack_floor.stream_sequence;
        self.outstanding = self.outstanding.split_off(&(floor + 1));
        self.terminated = self.terminated.split_off(&(floor + 1));
        let Some(b) = self.barrier else {
            return Vec::new();
        };
        let above = self.outstanding.range(b + 1..).count();
        let pending_below = info.num_ack_pending.saturating_sub(above);
        let in_hand = self.early.range(floor + 1..).count();
        if floor >= b || in_hand >= pending_below {
            self.barrier = None;
            return std::mem::take(&mut self.early).into_values().collect();
        }
        Vec::new()
    }

    /// Connects and binds the durable consumer, creating it when absent,
    /// with its state ([`Intake::rebound`]).
    async fn bind(&self) -> std::result::Result<(async_nats::Client, Pull, consumer::Info), Bind> {
        let client = connect(&self.url, Duration::from_secs(5))
            .await
            .map_err(Bind::Failed)?;
        let js = jetstream::new(client.clone());
        let stream = js
            .get_stream(&self.stream)
            .await
            .map_err(|e| Bind::Failed(format!("nats: the stream {:?}: {e}", self.stream)))?;
        let consumer = stream
            .get_or_create_consumer(
                &self.durable,
                consumer::pull::Config {
                    durable_name: Some(self.durable.clone()),
                    ack_policy: consumer::AckPolicy::Explicit,
                    deliver_policy: consumer::DeliverPolicy::All,
                    ack_wait: self.ack_wait,
                    filter_subject: self.filter.clone().unwrap_or_default(),
                    description: Some(format!("{OWNER}{}", self.owner)),
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| Bind::Failed(format!("nats: the consumer {:?}: {e}", self.durable)))?;
        let info = consumer
            .get_info()
            .await
            .map_err(|e| Bind::Failed(format!("nats: the consumer {:?}: {e}", self.durable)))?;
        if let Some(reason) = refusal(&info.config, &self.owner) {
            return Err(Bind::Refused(format!(
                "nats: the durable consumer {:?} of stream {:?}: {reason}",
                self.durable, self.stream
            )));
        }
        Ok((client, consumer, info))
    }
}
