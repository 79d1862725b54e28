//! [`MqttSink`]: an outbox sink publishing at QoS 1, a row `Sent` only on
//! its PUBACK. Invariants: per-key order holds because one connection
//! carries a batch in commit order and a broker acknowledges QoS 1 in
//! order; an outage is `Unavailable` (no attempt counted); what a broker
//! would refuse is dead before anything is sent.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use rumqttc::{v5, MqttOptions};

use super::codec::{
    lift_packet_limit, lift_packet_limit_v5, outbound_problem, too_large, wait_connack, Ev,
    Options, Outbound, Wire,
};
#[allow(unused_imports)] // doc links
use super::property;
use super::{Backoff, Envelope, MAX_WAIT};
use crate::escape::Esc;
use crate::hop;
use crate::sink::{SendResult, Sink};
use crate::store::outbox::OutboxMessage;

type TopicFn = Box<dyn Fn(&OutboxMessage) -> String + Send>;

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
