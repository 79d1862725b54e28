//! [`MqttIntake`]: a broker's messages into an inbox, QoS 1, manual
//! acknowledgements, a persistent session. Invariant: a message is
//! acknowledged only once it is durably in the inbox or the dead letters
//! ([`crate::hop`]'s `Lander` decides), and in the order received.

use std::collections::{HashSet, VecDeque};
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use rumqttc::{v5, MqttOptions};

use super::codec::{lift_packet_limit, lift_packet_limit_v5, Ev, Options, Received, Wire};
#[allow(unused_imports)] // doc links
use super::{property, Envelope, MqttSink};
use super::{Backoff, MAX_WAIT};
use crate::delivery::panic_message;
use crate::engine::Postroom;
use crate::error::{Error, Result};
use crate::escape::Esc;
pub use crate::hop::IntakeStats;
use crate::hop::{bump, Arrived, IntakeCounters as Counters, Landed, Lander, Mode};

/// Builds an [`MqttIntake`]; see [`MqttIntake::builder`].
pub struct IntakeBuilder {
    options: Options,
    room: Arc<Postroom>,
    consumer: String,
    filters: Vec<String>,
    mode: Mode,
    backoff: Backoff,
    sequenced: bool,
}

impl IntakeBuilder {
    /// Keeps a sequence watermark per sending outbox
    /// ([`Message::with_sequence`](crate::Message::with_sequence)): each message that carries its outbox's
    /// origin and `seq` (every `MqttSink` sends them) is numbered in the
    /// stream [`outbox_stream`](crate::outbox_stream)`(origin)`, so a
    /// re-send after this engine's retention deleted the row is still a
    /// duplicate ([`Outcome::DuplicateBySequence`](crate::Outcome::DuplicateBySequence)). A stream this engine
    /// has not seen starts where the sender's unsettled rows started.
    ///
    /// Only for an intake that receives *every* message of each sending
    /// outbox: rows it never receives (topics it does not subscribe to,
    /// rows another intake takes) are gaps that never fill, and the
    /// watermark stops below the first of them (nothing is lost; see
    /// `MAX_LISTED_SEQUENCES`). Default: off.
    ///
    /// The numbers are checked, never clamped: a message naming its origin
    /// whose `seq` or `unsettled_from` is not in 1..=`MAX_SEQUENCE`, or
    /// whose `unsettled_from` is above its `seq`, is a dead letter with the
    /// reason (acknowledged; nothing behind it held).
    pub fn sequenced(mut self) -> Self {
        self.sequenced = true;
        self
    }

    /// Subscribes to `filter` (wildcards allowed) at QoS 1; call once per
    /// filter.
    pub fn subscribe(mut self, filter: impl Into<String>) -> Self {
        self.filters.push(filter.into());
        self
    }

    /// Stores each message with [`receive`](Postroom::receive) (the
    /// engine's workers process it) instead of delivering it inline; every
    /// receipt acknowledges.
    pub fn queued(mut self) -> Self {
        self.mode = Mode::Receive;
        self
    }

    /// The wait between reconnection attempts while the broker cannot be
    /// reached: from `min`, doubled per failure, up to `max` (100 ms to
    /// 5 s by default; steps are kept within 10 ms and an hour).
    pub fn backoff(mut self, min: Duration, max: Duration) -> Self {
        self.backoff = Backoff::new(min, max);
        self
    }

    /// Starts the intake's thread (`postroom-mqtt-intake`). The options'
    /// session is made persistent (`clean_session` false) with manual
    /// acknowledgements; give each intake a client id of its own that stays
    /// the same across restarts, or the broker cannot resume its session.
    ///
    /// Refused here, not per message: no topic filter
    /// ([`Error::InvalidInput`]), a consumer the engine does not have
    /// ([`Error::UnknownConsumer`]), an effectful consumer without
    /// [`queued`](IntakeBuilder::queued) ([`Error::InvalidInput`]: it takes
    /// messages through `receive` only).
    pub fn start(self) -> Result<MqttIntake> {
        if self.filters.is_empty() {
            return Err(Error::invalid(
                "subscribe",
                "an intake needs a topic filter",
            ));
        }
        self.room
            .check_intake(&self.consumer, self.mode == Mode::Deliver)?;
        let options = match self.options {
            Options::V4(mut o) => {
                o.set_clean_session(false).set_manual_acks(true);
                lift_packet_limit(&mut o);
                Options::V4(o)
            }
            Options::V5(mut o) => {
                // MQTT 5 ends a session at disconnect unless it has an
                // expiry interval; 0xFFFFFFFF keeps it for ever.
                o.set_clean_start(false)
                    .set_session_expiry_interval(Some(u32::MAX))
                    .set_manual_acks(true);
                lift_packet_limit_v5(&mut o);
                Options::V5(o)
            }
        };
        let counters = Arc::new(Counters::default());
        let stop = Arc::new(AtomicBool::new(false));
        let (done_tx, done) = crossbeam_channel::bounded(1);
        let worker = Intake {
            options,
            filters: self.filters,
            backoff: self.backoff,
            lander: Lander {
                room: self.room,
                consumer: self.consumer,
                mode: self.mode,
                sequenced: self.sequenced.then(HashSet::new),
                label: "postroom mqtt intake",
            },
            counters: Arc::clone(&counters),
            stop: Arc::clone(&stop),
            acks: VecDeque::new(),
            unsent_acks: 0,
            redeliver_at: None,
        };
        let handle = thread::Builder::new()
            .name("postroom-mqtt-intake".into())
            .spawn(move || {
                let outcome = panic::catch_unwind(AssertUnwindSafe(|| worker.run()))
                    .map_err(|p| panic_message(p.as_ref()));
                if let Err(reason) = &outcome {
                    log::error!("postroom mqtt intake: thread panicked: {}", Esc(&reason));
                }
                let _ = done_tx.send(outcome);
            })
            .map_err(|e| Error::io("spawn thread", e))?;
        Ok(MqttIntake {
            counters,
            stop,
            handle: Some(handle),
            done,
        })
    }
}

/// Feeds an MQTT broker's messages to one consumer of a [`Postroom`]: one
/// named thread, QoS 1, manual acknowledgements, a persistent session.
/// Shut it down before the engine: an engine that is gone answers every
/// message with an error, which the intake leaves unacknowledged.
///
/// Each message's inbox id and source come from its MQTT 5 user properties
/// ([`property`]) or its [`Envelope`]: id = the `id`, source = the `source`
/// or else the outbox `topic`, with the key as ordering key and the
/// headers. A message with neither (from another publisher) gets source =
/// its MQTT topic and id = `mqtt-` + 128 bits of blake3 over topic and
/// payload: identical payloads on one topic then count as one message, so
/// such publishers should put a unique id in the payload.
///
/// Messages are handed on one at a time, in the order the broker sends
/// them, and acknowledged in that order, each only when
/// [`Outcome::should_ack`](crate::Outcome::should_ack) (or, queued, [`Receipt::should_ack`](crate::Receipt::should_ack)). One that
/// is not — the handler failed and will be retried, another worker holds
/// it, or storage failed — stays unacknowledged, and so do the messages
/// after it: MQTT wants acknowledgements in order (3.1.1 §4.6; rumqttd
/// disconnects a client that skips one), and handling later ones first
/// would break per-key order. The broker resends unacknowledged messages
/// only when the session resumes, so once the outcome's `retry_after` (1 s
/// after an error) has passed the intake reconnects, and the held message
/// and those after it come again (DUP), in order; the ones the inbox
/// already has are `Duplicate`. A message whose handler keeps failing
/// holds its subscription up until it is dead-lettered (`max_attempts`);
/// with [`queued`](IntakeBuilder::queued) every message is acknowledged
/// once stored, and the engine's workers retry it without holding the
/// others.
///
/// A message the engine refuses (a payload over `max_payload`, too many
/// headers, an id or name outside its limits, in a
/// [`sequenced`](IntakeBuilder::sequenced) intake a `seq` out of range) is
/// stored as a dead letter of the consumer with its payload and the reason,
/// then acknowledged ([`IntakeStats::refused`], `postroom dead list`).
pub struct MqttIntake {
    counters: Arc<Counters>,
    stop: Arc<AtomicBool>,
    handle: Option<thread::JoinHandle<()>>,
    done: crossbeam_channel::Receiver<std::result::Result<(), String>>,
}

impl MqttIntake {
    /// An intake into `consumer` of `room`, through a broker reached with
    /// `options`, over MQTT 3.1.1. Add at least one
    /// [`subscribe`](IntakeBuilder::subscribe).
    pub fn builder(
        options: MqttOptions,
        room: Arc<Postroom>,
        consumer: impl Into<String>,
    ) -> IntakeBuilder {
        Self::builder_for(Options::V4(options), room, consumer.into())
    }

    /// The same over MQTT 5: the message id and the rest come from the
    /// user properties an [`MqttSink::v5`] sets (see [`property`]), else
    /// from an [`Envelope`], else the fallback below.
    pub fn builder_v5(
        options: v5::MqttOptions,
        room: Arc<Postroom>,
        consumer: impl Into<String>,
    ) -> IntakeBuilder {
        Self::builder_for(Options::V5(options), room, consumer.into())
    }

    fn builder_for(options: Options, room: Arc<Postroom>, consumer: String) -> IntakeBuilder {
        IntakeBuilder {
            options,
            room,
            consumer,
            filters: Vec::new(),
            mode: Mode::Deliver,
            backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(5)),
            sequenced: false,
        }
    }

    /// What it has seen so far.
    pub fn stats(&self) -> IntakeStats {
        self.counters.snapshot()
    }

    /// Waits until the broker has granted the subscriptions on the current
    /// connection, at most `timeout`; false if it has not. Messages
    /// published before a persistent session first subscribed are not
    /// queued for it by the broker.
    pub fn wait_subscribed(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while !self.counters.ready.load(Ordering::Acquire) {
            if Instant::now() >= deadline {
                return false;
            }
            thread::sleep(Duration::from_millis(10));
        }
        true
    }

    /// Stops: sends the acknowledgements still queued, disconnects (the
    /// session stays on the broker) and joins the thread, all within
    /// `deadline`. Messages not yet acknowledged are redelivered to the
    /// next intake with the same client id. [`Error::Stopped`] when the
    /// thread had panicked, or did not stop in time (it is left running
    /// detached: a handler still running cannot be cut short).
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
                    thread: "postroom-mqtt-intake".into(),
                    reason,
                })
            }
            Err(_) => Err(Error::Stopped {
                thread: "postroom-mqtt-intake".into(),
                reason: format!("did not stop within {deadline:?}"),
            }),
        }
    }
}

impl Drop for MqttIntake {
    fn drop(&mut self) {
        if let Err(e) = self.stop_within(Duration::from_secs(5)) {
            log::warn!("postroom mqtt intake: {}", Esc(&e));
        }
    }
}

/// The inbox message an MQTT publish carries (see [`MqttIntake`]): the hop
/// contract from its MQTT 5 user properties, else from its envelope, else
/// an id derived from topic and payload.
fn inbound(publish: &Received) -> Arrived {
    let topic = publish.topic();
    Arrived::from_slots(publish.user_properties(), publish.payload(), &topic)
        .or_else(|| Arrived::from_envelope(publish.payload(), "mqtt", &topic))
        .unwrap_or_else(|| Arrived::unwrapped("mqtt", &topic, publish.payload()))
}

/// The intake thread's state.
struct Intake {
    options: Options,
    filters: Vec<String>,
    backoff: Backoff,
    /// Hands messages to the inbox and says whether to acknowledge.
    lander: Lander,
    counters: Arc<Counters>,
    stop: Arc<AtomicBool>,
    /// Acknowledgements not yet taken by the request channel.
    acks: VecDeque<Received>,
    /// Acknowledgements in the request channel, not yet written.
    unsent_acks: usize,
    /// Set by a message left unacknowledged: when to reconnect so the
    /// broker redelivers it. Until then later messages are not handed on.
    redeliver_at: Option<Instant>,
}

/// Room in the intake's request channel: acknowledgements and subscribes.
const INTAKE_CHANNEL: usize = 256;

/// How long a reconnect for redelivery waits for the acknowledgements
/// before the held message to be written.
const ACK_FLUSH_GRACE: Duration = Duration::from_secs(1);

impl Intake {
    fn run(mut self) {
        let mut wire = self.options.connect(INTAKE_CHANNEL);
        let mut flushing_since: Option<Instant> = None;
        while !self.stop.load(Ordering::Acquire) {
            if self.redeliver_at.is_some_and(|at| Instant::now() >= at) {
                let since = *flushing_since.get_or_insert_with(Instant::now);
                let flushed = self.acks.is_empty() && self.unsent_acks == 0;
                if flushed || since.elapsed() > ACK_FLUSH_GRACE {
                    // A new connection resumes the session, and the broker
                    // resends every publish still unacknowledged, from the
                    // held one on, in order.
                    self.redeliver_at = None;
                    flushing_since = None;
                    self.acks.clear();
                    self.unsent_acks = 0;
                    self.counters.ready.store(false, Ordering::Release);
                    wire = self.options.connect(INTAKE_CHANNEL);
                }
            }
            self.flush_acks(&wire);
            match wire.next(Duration::from_millis(100)) {
                Ok(Some(Ev::Connected {
                    session_present, ..
                })) => {
                    bump(&self.counters.connects);
                    self.backoff.reset();
                    // Subscribe on every connection: the broker may have
                    // lost the session (restarted without persistence).
                    if let Err(e) = wire.try_subscribe(&self.filters) {
                        log::warn!("postroom mqtt intake: subscribe: {}", Esc(&e));
                    }
                    log::debug!(
                        "postroom mqtt intake: connected, session present: {session_present}"
                    );
                }
                Ok(Some(Ev::SubAck { refused: true })) => {
                    // Not retried: a broker's ACL does not change by asking
                    // again; `wait_subscribed` stays false.
                    log::error!(
                        "postroom mqtt intake: the broker refused a subscription of {}",
                        Esc(format_args!("{:?}", self.filters))
                    );
                }
                Ok(Some(Ev::SubAck { refused: false })) => {
                    self.counters.ready.store(true, Ordering::Release);
                }
                Ok(Some(Ev::Publish(publish))) => self.handle(publish),
                Ok(Some(Ev::AckWritten)) => {
                    self.unsent_acks = self.unsent_acks.saturating_sub(1);
                }
                Ok(Some(_)) | Ok(None) => {}
                Err(e) => {
                    // rumqttc reconnects on the next poll; the acks queued
                    // for the lost connection are void (the broker resends
                    // those messages, and the inbox knows them).
                    self.acks.clear();
                    self.unsent_acks = 0;
                    self.counters.ready.store(false, Ordering::Release);
                    let pause = self.backoff.fail();
                    log::warn!(
                        "postroom mqtt intake: {}; reconnecting in {pause:?}",
                        Esc(&e)
                    );
                    let until = Instant::now() + pause;
                    while Instant::now() < until && !self.stop.load(Ordering::Acquire) {
                        thread::sleep(Duration::from_millis(20));
                    }
                }
            }
        }
        // Stopping: let the connection write the queued acknowledgements,
        // then say goodbye (the session stays on the broker).
        let until = Instant::now() + ACK_FLUSH_GRACE;
        let mut disconnecting = false;
        while Instant::now() < until {
            self.flush_acks(&wire);
            if !disconnecting && self.acks.is_empty() && self.unsent_acks == 0 {
                disconnecting = wire.try_disconnect();
            }
            match wire.next(Duration::from_millis(50)) {
                Ok(Some(Ev::AckWritten)) => {
                    self.unsent_acks = self.unsent_acks.saturating_sub(1);
                }
                Ok(Some(Ev::Disconnect)) | Err(_) => break,
                Ok(_) => {}
            }
        }
    }

    /// Moves queued acknowledgements into the request channel while it has
    /// room (polling the connection empties it).
    fn flush_acks(&mut self, wire: &Wire) {
        while let Some(publish) = self.acks.front() {
            if !wire.try_ack(publish) {
                break;
            }
            self.acks.pop_front();
            self.unsent_acks += 1;
            bump(&self.counters.acked);
        }
    }

    fn handle(&mut self, publish: Received) {
        bump(&self.counters.received);
        if publish.dup() {
            bump(&self.counters.redelivered);
        }
        if self.redeliver_at.is_some() {
            // Behind a message left unacknowledged: acknowledging this one
            // would break the broker's in-order acknowledgements (MQTT
            // 3.1.1 §4.6), and handling it first the per-key order. It
            // comes again after the reconnect.
            bump(&self.counters.held_back);
            return;
        }
        let came = inbound(&publish);
        if !came.wrapped {
            bump(&self.counters.unwrapped);
        }
        let place = publish.topic();
        match self.lander.land(came, &place, || inbound(&publish).msg) {
            Landed::Ack { duplicate, refused } => {
                if duplicate {
                    bump(&self.counters.duplicates);
                }
                if refused {
                    bump(&self.counters.refused);
                }
                self.acks.push_back(publish);
            }
            Landed::Hold { retry_after } => self.not_acked(retry_after),
        }
    }

    fn not_acked(&mut self, retry_after: Duration) {
        bump(&self.counters.not_acked);
        let at = Instant::now() + retry_after.min(MAX_WAIT);
        self.redeliver_at = Some(self.redeliver_at.map_or(at, |t| t.min(at)));
    }
}
