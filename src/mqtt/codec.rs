//! What goes on the wire: the allowlist of what brokers take in a string,
//! the exact size of a PUBLISH packet, and MQTT 3.1.1 and 5 behind one
//! connection type ([`Wire`]) and one event type ([`Ev`]). Invariant: a
//! row that a broker would answer by dropping the connection is found here
//! before anything is sent ([`outbound_problem`], [`too_large`]).

use std::time::{Duration, Instant};

use rumqttc::{
    v5, Client, ConnectReturnCode, Connection, Event, MqttOptions, Outgoing, Packet, Publish, QoS,
    RecvTimeoutError,
};

use super::property;

/// Whether `c` may stand in an MQTT string (a topic, a user property's
/// name or value): an allowlist of what brokers are known to take. MQTT 5
/// (§1.5.4) forbids U+0000 and says control characters (U+0001..U+001F,
/// U+007F..U+009F) and non-characters SHOULD NOT appear; mosquitto refuses
/// every one of them (`mosquitto_validate_utf8`) and drops the connection
/// of a client that sends one, so a message holding one can never go
/// through. Surrogates cannot occur in a Rust string.
pub(super) fn mqtt_char_ok(c: char) -> bool {
    let n = u32::from(c);
    matches!(n, 0x20..=0x7E | 0xA0..=0xFDCF | 0xFDF0..=0x10_FFFF) && n & 0xFFFE != 0xFFFE
}

/// Why `text` cannot travel as an MQTT string (`what` names it): longer
/// than 65,535 bytes, or holding a character outside [`mqtt_char_ok`].
pub(super) fn string_problem(what: &str, text: &str) -> Option<String> {
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
pub(super) fn topic_problem(topic: &str) -> Option<String> {
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
pub(super) fn outbound_problem(out: &Outbound) -> Option<String> {
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
pub(super) fn too_large(out: &Outbound, max: usize) -> Option<String> {
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

/// A client's options, for the protocol version it speaks (one per sink
/// or intake: the sizes do not matter).
#[derive(Clone)]
#[allow(clippy::large_enum_variant)]
pub(super) enum Options {
    V4(MqttOptions),
    V5(v5::MqttOptions),
}

impl Options {
    pub(super) fn keep_alive(&self) -> Duration {
        match self {
            Options::V4(o) => o.keep_alive(),
            Options::V5(o) => o.keep_alive(),
        }
    }

    /// Publishes outstanding at once.
    pub(super) fn window(&self) -> usize {
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
    pub(super) fn connect(&self, channel: usize) -> Wire {
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
pub(super) const MQTT_MAX_PACKET: usize = 268_435_455;

/// rumqttc refuses packets over 10 KiB by default (as a connection error,
/// which the sink would retry for ever): the bridge leaves the limit to the
/// broker.
pub(super) fn lift_packet_limit(options: &mut MqttOptions) {
    options.set_max_packet_size(MQTT_MAX_PACKET, MQTT_MAX_PACKET);
}

pub(super) fn lift_packet_limit_v5(options: &mut v5::MqttOptions) {
    options.set_max_packet_size(u32::try_from(MQTT_MAX_PACKET).ok());
}

/// One message to publish: where, what, and (MQTT 5) its user properties.
pub(super) struct Outbound {
    pub(super) index: usize,
    pub(super) topic: String,
    pub(super) payload: Vec<u8>,
    pub(super) properties: Vec<(String, String)>,
    /// MQTT 5: the packet carries a properties section.
    pub(super) v5: bool,
}

impl Outbound {
    /// The size of its PUBLISH packet at QoS 1, fixed header included:
    /// what a broker's Maximum Packet Size bounds.
    pub(super) fn packet_size(&self) -> usize {
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
pub(super) enum Received {
    V4(Publish),
    V5(v5::mqttbytes::v5::Publish),
}

impl Received {
    pub(super) fn topic(&self) -> String {
        match self {
            Received::V4(p) => p.topic.clone(),
            Received::V5(p) => String::from_utf8_lossy(&p.topic).into_owned(),
        }
    }

    pub(super) fn payload(&self) -> &[u8] {
        match self {
            Received::V4(p) => &p.payload,
            Received::V5(p) => &p.payload,
        }
    }

    pub(super) fn dup(&self) -> bool {
        match self {
            Received::V4(p) => p.dup,
            Received::V5(p) => p.dup,
        }
    }

    pub(super) fn user_properties(&self) -> &[(String, String)] {
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
pub(super) enum Ev {
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
pub(super) enum Wire {
    V4(Client, Connection),
    V5(v5::Client, v5::Connection),
}

impl Wire {
    /// Asks for a QoS 1 publish; false when the request channel is full.
    pub(super) fn try_publish(&self, out: &Outbound) -> std::result::Result<bool, String> {
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
    pub(super) fn try_ack(&self, publish: &Received) -> bool {
        match (self, publish) {
            (Wire::V4(client, _), Received::V4(p)) => client.try_ack(p).is_ok(),
            (Wire::V5(client, _), Received::V5(p)) => client.try_ack(p).is_ok(),
            // A publish of another connection: nothing to acknowledge here.
            _ => true,
        }
    }

    pub(super) fn try_subscribe(&self, filters: &[String]) -> std::result::Result<(), String> {
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

    pub(super) fn try_disconnect(&self) -> bool {
        match self {
            Wire::V4(client, _) => client.try_disconnect().is_ok(),
            Wire::V5(client, _) => client.try_disconnect().is_ok(),
        }
    }

    /// The next event, `None` when none came within `wait`; an error when
    /// the connection failed (polling again reconnects).
    pub(super) fn next(&mut self, wait: Duration) -> std::result::Result<Option<Ev>, String> {
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

pub(super) fn ev_outgoing(out: Outgoing) -> Ev {
    match out {
        Outgoing::Publish(pkid) => Ev::Published(pkid),
        Outgoing::AwaitAck(pkid) => Ev::AwaitAck(pkid),
        Outgoing::PubAck(_) => Ev::AckWritten,
        _ => Ev::Other,
    }
}

pub(super) fn ev_v4(event: Event) -> std::result::Result<Ev, String> {
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

pub(super) fn ev_v5(event: v5::Event) -> std::result::Result<Ev, String> {
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
pub(super) fn wait_connack(
    wire: &mut Wire,
    timeout: Duration,
) -> std::result::Result<usize, String> {
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
