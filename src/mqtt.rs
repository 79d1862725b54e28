//! The MQTT bridge (feature `mqtt`): an outbox [`Sink`] that publishes to an
//! MQTT broker, and an [`MqttIntake`] that feeds a broker's messages to an
//! inbox. Both speak MQTT 3.1.1 or 5 through [`rumqttc`] (re-exported),
//! QoS 1.
//!
//! Every message carries its outbox row's id (stable across re-sends),
//! `seq`, topic, key and headers and the sink's source name. MQTT 3.1.1 has
//! no message headers, so there it travels in an [`Envelope`]: one line of
//! JSON, a newline, then the payload bytes untouched. Over MQTT 5 the
//! payload travels as it is and the rest as user properties ([`property`]).
//! Any consumer can drop repeats by the id; the intake does so through the
//! inbox. See docs/SINKS.md.
//!
//! Out: [`MqttSink`] answers `Sent` for a row only after the broker's
//! PUBACK. A broker that is down or does not acknowledge in time makes the
//! unacknowledged rows [`SendResult::Unavailable`]: retried with backoff,
//! no attempt counted, never dead-lettered for the outage. So a row the
//! broker would refuse by dropping the connection must never be sent: what
//! the sink would send (topic, MQTT 5 user properties, size) is checked
//! first against an allowlist of what brokers take, and such a row is dead
//! at once, holding nothing back.
//!
//! In: [`MqttIntake`] subscribes at QoS 1 with manual acknowledgements and a
//! persistent session, hands each message to
//! [`deliver`](Postroom::deliver) (or [`receive`](Postroom::receive)), and
//! acknowledges it only when the outcome says so. Invariant: a message is
//! acknowledged only once it is durably in the inbox or in the dead letters
//! (with its payload and the reason); a misconfiguration that could never
//! store one is refused at `start()`, and numbers from the wire are checked
//! before use, so no message can be dropped nor wedge the subscription for
//! what it holds. MQTT brokers resend an
//! unacknowledged message only when the session resumes, so after a "do
//! not ack" outcome the intake reconnects once the outcome's `retry_after`
//! has passed, and the broker redelivers it.

use crate::escape::Esc;
use std::collections::{HashMap, HashSet, VecDeque};
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

pub use rumqttc;
use rumqttc::{
    v5, Client, ConnectReturnCode, Connection, Event, MqttOptions, Outgoing, Packet, Publish, QoS,
    RecvTimeoutError,
};

use crate::delivery::panic_message;
use crate::engine::Postroom;
use crate::error::{Error, Result};
use crate::hop::{self, Arrived, Landed, Lander, Mode};
use crate::sink::{SendResult, Sink};
use crate::store::outbox::OutboxMessage;

/// The envelope (MQTT 3.1.1) and its version: defined by the hop contract
/// ([`crate::hop`]), re-exported here where it was first defined.
pub use crate::hop::{Envelope, ENVELOPE_VERSION};

/// Whether `c` may stand in an MQTT string (a topic, a user property's
/// name or value): an allowlist of what brokers are known to take. MQTT 5
/// (§1.5.4) forbids U+0000 and says control characters (U+0001..U+001F,
/// U+007F..U+009F) and non-characters SHOULD NOT appear; mosquitto refuses
/// every one of them (`mosquitto_validate_utf8`) and drops the connection
/// of a client that sends one, so a message holding one can never go
/// through. Surrogates cannot occur in a Rust string.
fn mqtt_char_ok(c: char) -> bool {
    let n = u32::from(c);
    matches!(n, 0x20..=0x7E | 0xA0..=0xFDCF | 0xFDF0..=0x10_FFFF) && n & 0xFFFE != 0xFFFE
}

/// Why `text` cannot travel as an MQTT string (`what` names it): longer
/// than 65,535 bytes, or holding a character outside [`mqtt_char_ok`].
fn string_problem(what: &str, text: &str) -> Option<String> {
    if text.len() > usize::from(u16::MAX) {
        return Some(format!(
            "{what} is {} bytes, longer than an MQTT string can be (65535)",
            text.len()
        ));
    }
    let c = text.chars().find(|&c| !mqtt_char_ok(c))?;
    Some(format!(
        "{what} holds {c:?} (U+{:04X}), which MQTT brokers refuse in a string \
         (NUL, control characters and non-characters)",
        u32::from(c)
    ))
}

/// Why an MQTT topic cannot be published to: empty, holding a wildcard
/// (`+`, `#`), or not a string brokers take ([`string_problem`]).
fn topic_problem(topic: &str) -> Option<String> {
    if topic.is_empty() {
        Some("the MQTT topic is empty".into())
    } else if topic.contains(['+', '#']) {
        Some(format!("the MQTT topic {topic:?} holds a wildcard"))
    } else {
        string_problem(&format!("the MQTT topic {topic:?}"), topic)
    }
}

/// Why a message cannot be published as `out`: its topic, or (MQTT 5) one
/// of its user properties, is not something a broker takes, or it is
/// larger than an MQTT packet. Checked before anything is sent: a broker
/// that gets such a packet drops the connection, and the message would be
/// retried for ever as an outage.
fn outbound_problem(out: &Outbound) -> Option<String> {
    if let Some(problem) = topic_problem(&out.topic) {
        return Some(problem);
    }
    for (name, value) in &out.properties {
        let what = if name.starts_with(property::PREFIX) {
            format!("the user property {name:?}")
        } else {
            format!("the header {name:?}")
        };
        if let Some(problem) = string_problem(&format!("{what} (its name)"), name)
            .or_else(|| string_problem(&format!("{what} (its value)"), value))
        {
            return Some(problem);
        }
    }
    too_large(out, MQTT_MAX_PACKET)
}

/// Why `out` cannot go to a broker that takes packets of at most `max`
/// bytes (an MQTT 5 broker's Maximum Packet Size, else what MQTT allows).
/// Sent, a client library refuses to write it and fails the connection.
fn too_large(out: &Outbound, max: usize) -> Option<String> {
    let size = out.packet_size();
    (size > max).then(|| {
        if max < MQTT_MAX_PACKET {
            format!(
                "the message is a {size}-byte packet, over the broker's Maximum Packet Size \
                 ({max} bytes)"
            )
        } else {
            format!("the message is a {size}-byte packet, larger than MQTT allows ({max} bytes)")
        }
    })
}

/// Exponential backoff between `min` and `max`, doubled per failure.
#[derive(Debug, Clone)]
struct Backoff {
    min: Duration,
    max: Duration,
    next: Duration,
}

/// The shortest backoff step: a zero one would spin on a broker that is
/// down.
const MIN_STEP: Duration = Duration::from_millis(10);
/// The longest backoff step or timeout: beyond it waits are settings
/// mistakes (and `Instant + Duration::MAX` overflows).
const MAX_WAIT: Duration = Duration::from_secs(3600);

impl Backoff {
    /// Steps within [`MIN_STEP`, `MAX_WAIT`], `max` at least `min`.
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

type TopicFn = Box<dyn Fn(&OutboxMessage) -> String + Send>;

/// Names of the MQTT 5 user properties the sink sets (and the intake
/// reads) beside the payload: the hop contract's header names
/// ([`crate::hop::header`]); the row's headers follow under their own
/// names. Together they carry what the [`Envelope`] carries.
pub use crate::hop::header as property;

/// A client's options, for the protocol version it speaks (one per sink
/// or intake: the sizes do not matter).
#[derive(Clone)]
#[allow(clippy::large_enum_variant)]
enum Options {
    V4(MqttOptions),
    V5(v5::MqttOptions),
}

impl Options {
    fn keep_alive(&self) -> Duration {
        match self {
            Options::V4(o) => o.keep_alive(),
            Options::V5(o) => o.keep_alive(),
        }
    }

    /// Publishes outstanding at once.
    fn window(&self) -> usize {
        let window = match self {
            Options::V4(o) => o.inflight(),
            Options::V5(o) => o.get_outgoing_inflight_upper_limit().unwrap_or(100),
        };
        usize::from(window.max(1))
    }

    /// A client and its connection (not yet connected: polling connects),
    /// with Nagle's algorithm off: publishes (and an intake's PUBACKs) go
    /// out while earlier ones are unanswered, and Nagle would hold each
    /// small one back for the peer's delayed ACK.
    fn connect(&self, channel: usize) -> Wire {
        match self {
            Options::V4(o) => {
                let (client, mut conn) = Client::new(o.clone(), channel);
                let mut network = conn.eventloop.network_options();
                network.set_tcp_nodelay(true);
                conn.eventloop.set_network_options(network);
                Wire::V4(client, conn)
            }
            Options::V5(o) => {
                let mut o = o.clone();
                let mut network = o.network_options();
                network.set_tcp_nodelay(true);
                o.set_network_options(network);
                let (client, conn) = v5::Client::new(o, channel);
                Wire::V5(client, conn)
            }
        }
    }
}

/// The largest packet MQTT can carry (its remaining length is at most
/// 268,435,455 bytes).
const MQTT_MAX_PACKET: usize = 268_435_455;

/// rumqttc refuses packets over 10 KiB by default (as a connection error,
/// which the sink would retry for ever): the bridge leaves the limit to the
/// broker.
fn lift_packet_limit(options: &mut MqttOptions) {
    options.set_max_packet_size(MQTT_MAX_PACKET, MQTT_MAX_PACKET);
}

fn lift_packet_limit_v5(options: &mut v5::MqttOptions) {
    options.set_max_packet_size(u32::try_from(MQTT_MAX_PACKET).ok());
}

/// One message to publish: where, what, and (MQTT 5) its user properties.
struct Outbound {
    index: usize,
    topic: String,
    payload: Vec<u8>,
    properties: Vec<(String, String)>,
    /// MQTT 5: the packet carries a properties section.
    v5: bool,
}

impl Outbound {
    /// The size of its PUBLISH packet at QoS 1, fixed header included:
    /// what a broker's Maximum Packet Size bounds.
    fn packet_size(&self) -> usize {
        // A variable byte integer's length (MQTT §1.5.5).
        let varint = |n: usize| match n {
            0..=127 => 1,
            128..=16_383 => 2,
            16_384..=2_097_151 => 3,
            _ => 4,
        };
        // Topic with its length, packet id.
        let mut remaining = 2 + self.topic.len() + 2 + self.payload.len();
        if self.v5 {
            // Each user property: its identifier and two prefixed strings.
            let properties: usize = self
                .properties
                .iter()
                .map(|(k, v)| 1 + 2 + k.len() + 2 + v.len())
                .sum();
            remaining += varint(properties) + properties;
        }
        1 + varint(remaining) + remaining
    }
}

/// A publish received, to read and to acknowledge.
enum Received {
    V4(Publish),
    V5(v5::mqttbytes::v5::Publish),
}

impl Received {
    fn topic(&self) -> String {
        match self {
            Received::V4(p) => p.topic.clone(),
            Received::V5(p) => String::from_utf8_lossy(&p.topic).into_owned(),
        }
    }

    fn payload(&self) -> &[u8] {
        match self {
            Received::V4(p) => &p.payload,
            Received::V5(p) => &p.payload,
        }
    }

    fn dup(&self) -> bool {
        match self {
            Received::V4(p) => p.dup,
            Received::V5(p) => p.dup,
        }
    }

    fn user_properties(&self) -> &[(String, String)] {
        match self {
            Received::V4(_) => &[],
            Received::V5(p) => p
                .properties
                .as_ref()
                .map_or(&[], |props| props.user_properties.as_slice()),
        }
    }
}

/// A connection's events, the same for both protocol versions.
enum Ev {
    /// The broker accepted the connection.
    Connected {
        session_present: bool,
        /// The largest packet the broker takes from this client (MQTT 5
        /// CONNACK's Maximum Packet Size), when it says.
        max_packet: Option<u32>,
    },
    /// The broker granted the subscriptions, or refused one.
    SubAck {
        refused: bool,
    },
    /// The next publish asked for went out under this packet id.
    Published(u16),
    /// The next publish asked for waits for this packet id to be free.
    AwaitAck(u16),
    /// The broker acknowledged this packet id; `refused` when an MQTT 5
    /// broker's reason code says it did not take the message (and whether
    /// that is for good).
    PubAck {
        pkid: u16,
        refused: Option<(String, bool)>,
    },
    /// An acknowledgement of ours was written.
    AckWritten,
    Publish(Received),
    Disconnect,
    Other,
}

/// A client and its connection, either protocol version (one of each per
/// connection: the sizes do not matter).
#[allow(clippy::large_enum_variant)]
enum Wire {
    V4(Client, Connection),
    V5(v5::Client, v5::Connection),
}

impl Wire {
    /// Asks for a QoS 1 publish; false when the request channel is full.
    fn try_publish(&self, out: &Outbound) -> std::result::Result<bool, String> {
        let payload = out.payload.clone();
        let full = match self {
            Wire::V4(client, _) => {
                match client.try_publish(out.topic.as_str(), QoS::AtLeastOnce, false, payload) {
                    Ok(()) => false,
                    Err(rumqttc::ClientError::TryRequest(_)) => true,
                    Err(e) => return Err(format!("mqtt publish: {e}")),
                }
            }
            Wire::V5(client, _) => {
                let properties = v5::mqttbytes::v5::PublishProperties {
                    user_properties: out.properties.clone(),
                    ..Default::default()
                };
                match client.try_publish_with_properties(
                    out.topic.as_str(),
                    v5::mqttbytes::QoS::AtLeastOnce,
                    false,
                    payload,
                    properties,
                ) {
                    Ok(()) => false,
                    Err(v5::ClientError::TryRequest(_)) => true,
                    Err(e) => return Err(format!("mqtt publish: {e}")),
                }
            }
        };
        Ok(!full)
    }

    /// Asks for the acknowledgement of `publish`; false when the request
    /// channel is full.
    fn try_ack(&self, publish: &Received) -> bool {
        match (self, publish) {
            (Wire::V4(client, _), Received::V4(p)) => client.try_ack(p).is_ok(),
            (Wire::V5(client, _), Received::V5(p)) => client.try_ack(p).is_ok(),
            // A publish of another connection: nothing to acknowledge here.
            _ => true,
        }
    }

    fn try_subscribe(&self, filters: &[String]) -> std::result::Result<(), String> {
        match self {
            Wire::V4(client, _) => client
                .try_subscribe_many(
                    filters
                        .iter()
                        .map(|f| rumqttc::SubscribeFilter::new(f.clone(), QoS::AtLeastOnce)),
                )
                .map_err(|e| e.to_string()),
            Wire::V5(client, _) => client
                .try_subscribe_many(filters.iter().map(|f| {
                    v5::mqttbytes::v5::Filter::new(f.clone(), v5::mqttbytes::QoS::AtLeastOnce)
                }))
                .map_err(|e| e.to_string()),
        }
    }

    fn try_disconnect(&self) -> bool {
        match self {
            Wire::V4(client, _) => client.try_disconnect().is_ok(),
            Wire::V5(client, _) => client.try_disconnect().is_ok(),
        }
    }

    /// The next event, `None` when none came within `wait`; an error when
    /// the connection failed (polling again reconnects).
    fn next(&mut self, wait: Duration) -> std::result::Result<Option<Ev>, String> {
        match self {
            Wire::V4(_, conn) => match conn.recv_timeout(wait) {
                Ok(Ok(event)) => Ok(Some(ev_v4(event)?)),
                Ok(Err(e)) => Err(format!("mqtt connection: {e}")),
                Err(RecvTimeoutError::Timeout) => Ok(None),
                Err(RecvTimeoutError::Disconnected) => Err("mqtt client closed".into()),
            },
            Wire::V5(_, conn) => match conn.recv_timeout(wait) {
                Ok(Ok(event)) => Ok(Some(ev_v5(event)?)),
                Ok(Err(e)) => Err(format!("mqtt connection: {e}")),
                Err(v5::RecvTimeoutError::Timeout) => Ok(None),
                Err(v5::RecvTimeoutError::Disconnected) => Err("mqtt client closed".into()),
            },
        }
    }
}

fn ev_outgoing(out: Outgoing) -> Ev {
    match out {
        Outgoing::Publish(pkid) => Ev::Published(pkid),
        Outgoing::AwaitAck(pkid) => Ev::AwaitAck(pkid),
        Outgoing::PubAck(_) => Ev::AckWritten,
        _ => Ev::Other,
    }
}

fn ev_v4(event: Event) -> std::result::Result<Ev, String> {
    Ok(match event {
        Event::Outgoing(out) => ev_outgoing(out),
        Event::Incoming(Packet::ConnAck(ack)) => match ack.code {
            ConnectReturnCode::Success => Ev::Connected {
                session_present: ack.session_present,
                max_packet: None,
            },
            code => return Err(format!("mqtt: the broker refused the connection: {code:?}")),
        },
        Event::Incoming(Packet::SubAck(ack)) => Ev::SubAck {
            refused: ack
                .return_codes
                .contains(&rumqttc::SubscribeReasonCode::Failure),
        },
        Event::Incoming(Packet::PubAck(ack)) => Ev::PubAck {
            pkid: ack.pkid,
            refused: None,
        },
        Event::Incoming(Packet::Publish(p)) => Ev::Publish(Received::V4(p)),
        Event::Incoming(Packet::Disconnect) => Ev::Disconnect,
        Event::Incoming(_) => Ev::Other,
    })
}

fn ev_v5(event: v5::Event) -> std::result::Result<Ev, String> {
    use v5::mqttbytes::v5::{
        ConnectReturnCode as Code, Packet as P, PubAckReason, SubscribeReasonCode,
    };
    Ok(match event {
        v5::Event::Outgoing(out) => ev_outgoing(out),
        v5::Event::Incoming(P::ConnAck(ack)) => match ack.code {
            Code::Success => Ev::Connected {
                session_present: ack.session_present,
                max_packet: ack.properties.as_ref().and_then(|p| p.max_packet_size),
            },
            code => return Err(format!("mqtt: the broker refused the connection: {code:?}")),
        },
        v5::Event::Incoming(P::SubAck(ack)) => Ev::SubAck {
            refused: !ack
                .return_codes
                .iter()
                .all(|c| matches!(c, SubscribeReasonCode::Success(_))),
        },
        v5::Event::Incoming(P::PubAck(ack)) => Ev::PubAck {
            pkid: ack.pkid,
            refused: match ack.reason {
                PubAckReason::Success | PubAckReason::NoMatchingSubscribers => None,
                reason @ (PubAckReason::NotAuthorized
                | PubAckReason::TopicNameInvalid
                | PubAckReason::PayloadFormatInvalid) => {
                    Some((format!("mqtt: the broker refused it: {reason:?}"), true))
                }
                reason => Some((format!("mqtt: the broker refused it: {reason:?}"), false)),
            },
        },
        v5::Event::Incoming(P::Publish(p)) => Ev::Publish(Received::V5(p)),
        v5::Event::Incoming(P::Disconnect(_)) => Ev::Disconnect,
        v5::Event::Incoming(_) => Ev::Other,
    })
}

/// Polls a new connection until the broker's CONNACK (accepted), an error,
/// or `timeout`.
/// Returns the largest packet the broker takes (MQTT 5 may lower it from
/// [`MQTT_MAX_PACKET`]).
fn wait_connack(wire: &mut Wire, timeout: Duration) -> std::result::Result<usize, String> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("mqtt: no CONNACK within {timeout:?}"));
        }
        if let Some(Ev::Connected { max_packet, .. }) = wire.next(left)? {
            let max = max_packet.map_or(MQTT_MAX_PACKET, |m| {
                usize::try_from(m).map_or(MQTT_MAX_PACKET, |m| m.min(MQTT_MAX_PACKET))
            });
            return Ok(max);
        }
    }
}

/// A live connection of the sink, and when it was last used.
struct Link {
    wire: Wire,
    used: Instant,
    /// The largest packet the broker takes on this connection.
    max_packet: usize,
}

/// An outbox [`Sink`] publishing each row to an MQTT broker at QoS 1; a
/// row is `Sent` only once the broker's PUBACK for it came. Over MQTT
/// 3.1.1 ([`new`](MqttSink::new)) each row travels in an [`Envelope`];
/// over MQTT 5 ([`v5`](MqttSink::v5)) the payload travels as it is, with
/// the id, `seq`, source, topic and key as user properties (see
/// [`property`]) and the headers as user properties of their own names.
///
/// Up to the options' in-flight window (`MqttOptions::set_inflight`,
/// 100 by default) publishes are outstanding at once. Per-key order holds:
/// one connection carries the batch in commit order, and an MQTT broker
/// must acknowledge QoS 1 publishes in the order it received them (3.1.1
/// §4.6), so the acknowledged rows are always a prefix of those sent on a
/// connection. When the connection fails or a PUBACK does not come within
/// [`ack_timeout`](MqttSink::ack_timeout), the sink drops the connection
/// (rumqttc's own resend of unacknowledged publishes goes with it) and the
/// unacknowledged rows are [`SendResult::Unavailable`]: the relay hands them
/// over again after the sink's backoff, in order, on a new connection.
/// Some of them may have reached the broker: consumers dedupe on the id.
/// An MQTT 5 PUBACK refusing a message makes it dead (not authorized, a
/// bad topic or payload format) or retried (any other reason). A row whose
/// MQTT topic or user properties a broker would refuse (a wildcard, NUL, a
/// control character, a string over 65,535 bytes: see docs/SINKS.md) or
/// that is larger than an MQTT packet, or over MQTT 5 than the broker's
/// Maximum Packet Size, is dead before anything is sent for it.
pub struct MqttSink {
    options: Options,
    topic: TopicFn,
    source: Option<String>,
    ack_timeout: Duration,
    link: Option<Link>,
    backoff: Backoff,
}

impl MqttSink {
    /// Publishes over MQTT 3.1.1 through a broker reached with `options`
    /// (host, port, client id, credentials, keep-alive, in-flight window).
    /// The MQTT topic is the outbox row's topic.
    pub fn new(mut options: MqttOptions) -> Self {
        lift_packet_limit(&mut options);
        Self::with(Options::V4(options))
    }

    /// Publishes over MQTT 5: the payload as it is, the rest as user
    /// properties. Consumers that speak MQTT 3.1.1 get no properties, so
    /// use [`new`](MqttSink::new) (the envelope) when any consumer might.
    pub fn v5(mut options: v5::MqttOptions) -> Self {
        lift_packet_limit_v5(&mut options);
        Self::with(Options::V5(options))
    }

    fn with(options: Options) -> Self {
        MqttSink {
            options,
            topic: Box::new(|m: &OutboxMessage| m.topic.clone()),
            source: None,
            ack_timeout: Duration::from_secs(10),
            link: None,
            backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(5)),
        }
    }

    /// The MQTT topic of a row is `prefix` followed by its outbox topic.
    pub fn topic_prefix(mut self, prefix: impl Into<String>) -> Self {
        let prefix = prefix.into();
        self.topic = Box::new(move |m: &OutboxMessage| format!("{prefix}{}", m.topic));
        self
    }

    /// The MQTT topic of a row is `f(row)` (e.g. with its key:
    /// `format!("orders/{}", m.key…)`). A topic that cannot be published to
    /// (empty, a wildcard) makes that row dead.
    pub fn topic_with(mut self, f: impl Fn(&OutboxMessage) -> String + Send + 'static) -> Self {
        self.topic = Box::new(f);
        self
    }

    /// Names this outbox in every message (`source`): the intake then uses
    /// it as the inbox message's source instead of the row's topic.
    pub fn source(mut self, name: impl Into<String>) -> Self {
        self.source = Some(name.into());
        self
    }

    /// How long the sink waits for the CONNACK and for the next PUBACK
    /// (10 s by default, kept within 100 ms and an hour) before it gives
    /// the connection up as stalled.
    pub fn ack_timeout(mut self, timeout: Duration) -> Self {
        self.ack_timeout = timeout.clamp(Duration::from_millis(100), MAX_WAIT);
        self
    }

    /// The sink's backoff while the broker cannot be reached: from `min`,
    /// doubled per failure, up to `max` (100 ms to 5 s by default; steps
    /// are kept within 10 ms and an hour).
    pub fn backoff(mut self, min: Duration, max: Duration) -> Self {
        self.backoff = Backoff::new(min, max);
        self
    }

    /// What goes on the wire for a row.
    fn outbound(&self, index: usize, msg: &OutboxMessage, topic: String) -> Outbound {
        match self.options {
            Options::V4(_) => Outbound {
                index,
                topic,
                payload: Envelope::of(msg, self.source.as_deref()).encode(),
                properties: Vec::new(),
                v5: false,
            },
            Options::V5(_) => {
                let properties = hop::slots(msg, self.source.as_deref());
                Outbound {
                    index,
                    topic,
                    payload: msg.payload.clone(),
                    properties,
                    v5: true,
                }
            }
        }
    }

    /// A connection that is up: the one kept from the last batch, unless it
    /// sat idle past half the keep-alive (nobody polled it, so the broker
    /// may have dropped it), else a new one once the broker's CONNACK came.
    fn link(&mut self) -> std::result::Result<&mut Link, String> {
        let keep_alive = self.options.keep_alive();
        if !keep_alive.is_zero()
            && self
                .link
                .as_ref()
                .is_some_and(|l| l.used.elapsed() > keep_alive / 2)
        {
            self.link = None;
        }
        if self.link.is_none() {
            let mut wire = self.options.connect(self.options.window());
            let max_packet = wait_connack(&mut wire, self.ack_timeout)?;
            self.link = Some(Link {
                max_packet,
                wire,
                used: Instant::now(),
            });
        }
        Ok(self.link.as_mut().expect("just set"))
    }

    /// Publishes `todo` in order and waits for their PUBACKs; records what
    /// the broker answered in `results`. An error means the connection is
    /// no longer usable.
    fn publish_all(
        &mut self,
        todo: Vec<Outbound>,
        results: &mut [SendResult],
    ) -> std::result::Result<(), String> {
        let ack_timeout = self.ack_timeout;
        let window = self.options.window();
        let link = self.link()?;
        // The broker's own limit is known once it answered: a row over it
        // is dead, and nothing is sent for it.
        let todo: Vec<Outbound> = todo
            .into_iter()
            .filter(|out| match too_large(out, link.max_packet) {
                None => true,
                Some(problem) => {
                    results[out.index] = SendResult::dead(problem);
                    false
                }
            })
            .collect();
        let total = todo.len();
        let mut todo = todo.into_iter().peekable();
        let mut next = 0; // entries of `todo` published
        let mut queued: VecDeque<usize> = VecDeque::new(); // published, no pkid yet
        let mut collided: Option<(u16, usize)> = None;
        let mut by_pkid: HashMap<u16, usize> = HashMap::new();
        let mut answered = 0;
        let mut last_progress = Instant::now();
        while answered < total {
            // Keep the window full; the request channel holds `window`.
            while next - answered < window {
                let Some(out) = todo.peek() else { break };
                if !link.wire.try_publish(out)? {
                    break; // the channel is full: poll first
                }
                queued.push_back(out.index);
                next += 1;
                todo.next();
            }
            let Some(event) = link.wire.next(Duration::from_millis(100))? else {
                if last_progress.elapsed() > ack_timeout {
                    return Err(format!("mqtt: no PUBACK within {ack_timeout:?}"));
                }
                continue;
            };
            match event {
                Ev::Published(pkid) => {
                    let i = match collided {
                        Some((p, i)) if p == pkid => {
                            collided = None;
                            i
                        }
                        _ => queued.pop_front().ok_or("mqtt: a publish nobody sent")?,
                    };
                    by_pkid.insert(pkid, i);
                }
                // Its packet id is still in flight: rumqttc sends it (an
                // `Outgoing::Publish` of the same id) once that one is acked.
                Ev::AwaitAck(pkid) => {
                    let i = queued.pop_front().ok_or("mqtt: a publish nobody sent")?;
                    collided = Some((pkid, i));
                }
                Ev::PubAck { pkid, refused } => {
                    if let Some(i) = by_pkid.remove(&pkid) {
                        results[i] = match refused {
                            None => SendResult::Sent,
                            Some((reason, true)) => SendResult::dead(reason),
                            Some((reason, false)) => SendResult::retry(reason),
                        };
                        answered += 1;
                        last_progress = Instant::now();
                    }
                }
                Ev::Disconnect => return Err("mqtt: the broker disconnected".into()),
                _ => {}
            }
        }
        link.used = Instant::now();
        Ok(())
    }
}

impl Sink for MqttSink {
    fn send(&mut self, batch: &[OutboxMessage]) -> Vec<SendResult> {
        let mut results = vec![SendResult::retry("not handed over"); batch.len()];
        // A row that can never go through (what a broker refuses) is dead
        // before anything is sent, and the rows behind it, of its key too,
        // go on: a dead row is settled, it holds nothing back.
        let mut todo = Vec::with_capacity(batch.len());
        for (i, msg) in batch.iter().enumerate() {
            let topic = (self.topic)(msg);
            let out = self.outbound(i, msg, topic);
            match outbound_problem(&out) {
                None => todo.push(out),
                Some(problem) => results[i] = SendResult::dead(problem),
            }
        }
        if todo.is_empty() {
            return results;
        }
        let indexes: Vec<usize> = todo.iter().map(|out| out.index).collect();
        match self.publish_all(todo, &mut results) {
            Ok(()) => self.backoff.reset(),
            Err(reason) => {
                log::warn!("postroom mqtt sink: {}; reconnecting", Esc(&reason));
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

/// What an [`MqttIntake`] has seen since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct IntakeStats {
    /// Messages received from the broker, redeliveries included.
    pub received: u64,
    /// Of those, messages the broker flagged as a redelivery (DUP).
    pub redelivered: u64,
    /// Acknowledgements handed to the connection (one the connection
    /// loses before writing it is counted too; the broker then resends
    /// that message, and the inbox knows it).
    pub acked: u64,
    /// Messages the inbox had already (`Duplicate`): absorbed, acknowledged.
    pub duplicates: u64,
    /// Messages left unacknowledged (a "do not ack" outcome or an error),
    /// for the broker to redeliver when the intake reconnects.
    pub not_acked: u64,
    /// Messages that came behind one left unacknowledged: not handed on,
    /// not acknowledged, redelivered after the reconnect.
    pub held_back: u64,
    /// Messages the engine refuses to take as they are (a payload over
    /// `max_payload`, too many headers, an id or name outside postroom's
    /// limits, a sequence number out of range in a
    /// [`sequenced`](IntakeBuilder::sequenced) intake): each stored as a
    /// dead letter with its payload and the reason, then acknowledged. A
    /// resend of one counts as a duplicate.
    pub refused: u64,
    /// Messages without an envelope, given a content-derived id.
    pub unwrapped: u64,
    /// Connections made, the first included.
    pub connects: u64,
}

#[derive(Default)]
struct Counters {
    received: AtomicU64,
    redelivered: AtomicU64,
    acked: AtomicU64,
    duplicates: AtomicU64,
    not_acked: AtomicU64,
    held_back: AtomicU64,
    refused: AtomicU64,
    unwrapped: AtomicU64,
    connects: AtomicU64,
    subscribed: AtomicBool,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

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
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        IntakeStats {
            received: get(&c.received),
            redelivered: get(&c.redelivered),
            acked: get(&c.acked),
            duplicates: get(&c.duplicates),
            not_acked: get(&c.not_acked),
            held_back: get(&c.held_back),
            refused: get(&c.refused),
            unwrapped: get(&c.unwrapped),
            connects: get(&c.connects),
        }
    }

    /// Waits until the broker has granted the subscriptions on the current
    /// connection, at most `timeout`; false if it has not. Messages
    /// published before a persistent session first subscribed are not
    /// queued for it by the broker.
    pub fn wait_subscribed(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while !self.counters.subscribed.load(Ordering::Acquire) {
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
        .or_else(|| Arrived::from_envelope(publish.payload()))
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
                    self.counters.subscribed.store(false, Ordering::Release);
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
                    self.counters.subscribed.store(true, Ordering::Release);
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
                    self.counters.subscribed.store(false, Ordering::Release);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The allowlist against what mosquitto 2.0.11 was seen to take and
    /// refuse in an MQTT 5 user property (docs/SINKS.md).
    #[test]
    fn the_string_allowlist_is_what_mosquitto_takes() {
        for c in [
            '\0',
            '\u{1}',
            '\u{7}',
            '\t',
            '\n',
            '\r',
            '\u{1f}',
            '\u{7f}',
            '\u{80}',
            '\u{9f}',
            '\u{fdd0}',
            '\u{fdef}',
            '\u{fffe}',
            '\u{ffff}',
            '\u{1fffe}',
            '\u{10ffff}',
        ] {
            assert!(!mqtt_char_ok(c), "{c:?} passes");
        }
        for c in [
            ' ',
            'a',
            '~',
            '\u{a0}',
            'é',
            '\u{d7ff}',
            '\u{e000}',
            '\u{fdcf}',
            '\u{fdf0}',
            '\u{fffd}',
            '😀',
            '\u{10fffd}',
        ] {
            assert!(mqtt_char_ok(c), "{c:?} refused");
        }
        assert!(string_problem("v", &"x".repeat(65_535)).is_none());
        assert!(string_problem("v", &"x".repeat(65_536)).is_some());
        let why = string_problem("the header \"note\" (its value)", "a\nb").unwrap();
        assert!(why.contains("U+000A"), "{why}");
        assert!(topic_problem("a/+/b").is_some());
        assert!(topic_problem("a/\u{7f}").is_some());
        assert!(topic_problem("").is_some());
        assert!(topic_problem("a/é/b").is_none());
    }

    /// The size the sink checks against a broker's Maximum Packet Size is
    /// the size rumqttc writes (and checks), for both protocol versions.
    #[test]
    fn packet_size_is_what_rumqttc_writes() {
        use v5::mqttbytes::v5::{Publish as Publish5, PublishProperties};
        for (payload, props) in [(0, 0), (100, 3), (20_000, 60), (3_000_000, 1), (200, 300)] {
            let out = Outbound {
                index: 0,
                topic: "a/b".into(),
                payload: vec![0; payload],
                properties: (0..props)
                    .map(|i| (format!("k{i}"), "v".repeat(i)))
                    .collect(),
                v5: true,
            };
            let mut p5 = Publish5::new(
                out.topic.clone(),
                v5::mqttbytes::QoS::AtLeastOnce,
                out.payload.clone(),
                Some(PublishProperties {
                    user_properties: out.properties.clone(),
                    ..Default::default()
                }),
            );
            p5.pkid = 1;
            assert_eq!(out.packet_size(), p5.size(), "v5 {payload} {props}");
            let out4 = Outbound {
                properties: Vec::new(),
                v5: false,
                ..out
            };
            let mut p4 = Publish::new(out4.topic.clone(), QoS::AtLeastOnce, out4.payload.clone());
            p4.pkid = 1;
            assert_eq!(out4.packet_size(), p4.size(), "v4 {payload}");
        }
    }
}
