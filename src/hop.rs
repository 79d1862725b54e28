//! The hop contract: what travels with an outbox row from one postroom to
//! the next, whatever the transport, so the receiving inbox can drop
//! repeats and keep a watermark per sending outbox. Defined once here; each
//! bridge carries it in its transport's native slot (docs/SINKS.md, "The
//! hop contract"):
//!
//! - as header-like name/value pairs ([`slots`], names in [`header`]):
//!   MQTT 5 user properties, NATS message headers, HTTP or Kafka headers;
//! - where a transport has no headers (MQTT 3.1.1), as an [`Envelope`]: one
//!   line of JSON, a newline, then the payload bytes untouched.
//!
//! The fields: the outbox message id (stable across re-sends: dedupe on
//! it), the source name (when the sink was given one), the row's `seq`, its
//! origin (the sending database's instance id, which `seq` numbers the
//! outbox of), `unsettled-from` (the lowest unsettled `seq` when the row was
//! sent), the outbox topic, the ordering key and the row's own headers.
//!
//! Invariants: both forms carry the same fields and decode to the same
//! inbox message; a row's own header whose name starts with
//! [`header::PREFIX`] never travels (it could forge the contract's fields);
//! numbers from the wire are checked before use, never clamped
//! (`Numbers::checked`). The intake side (`Lander`) acknowledges a
//! message only once it is durably in the inbox or in the dead letters.

// The intake side is used by the bridges only (features `mqtt`, `nats`).
#![cfg_attr(not(any(feature = "mqtt", feature = "nats")), allow(dead_code))]

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::check_name;
use crate::engine::Postroom;
use crate::error::{Error, Result};
use crate::escape::Esc;
use crate::message::{Headers, Message, Outcome, Receipt};
use crate::store::outbox::{digest_hex, outbox_stream, OutboxMessage};

/// The envelope format's version, its first field (`"postroom":1`).
pub const ENVELOPE_VERSION: u32 = 1;

/// Names of the header-like slots that carry the contract beside the
/// payload; the row's headers follow under their own names. Together they
/// carry what the [`Envelope`] carries. (Lower case: HTTP/2 and Kafka
/// tooling fold header names; NATS and MQTT keep them as they are.)
pub mod header {
    /// The outbox message id: dedupe on it.
    pub const ID: &str = "postroom-id";
    /// The outbox row's `seq`, in decimal.
    pub const SEQ: &str = "postroom-seq";
    /// The sink's source name, when it was given one.
    pub const SOURCE: &str = "postroom-source";
    /// The outbox row's topic.
    pub const TOPIC: &str = "postroom-topic";
    /// The outbox row's ordering key, when it has one.
    pub const KEY: &str = "postroom-key";
    /// The sending database's instance id
    /// ([`OutboxMessage::origin`](crate::OutboxMessage::origin)): `seq`
    /// numbers its outbox.
    pub const ORIGIN: &str = "postroom-origin";
    /// The lowest `seq` of the sending outbox not yet settled when the row
    /// was sent
    /// ([`OutboxMessage::unsettled_from`](crate::OutboxMessage::unsettled_from)):
    /// where a receiver that has not seen this origin starts its watermark.
    pub const UNSETTLED_FROM: &str = "postroom-unsettled-from";
    /// The prefix of these names: a row's header starting with it is not
    /// sent.
    pub const PREFIX: &str = "postroom-";
}

/// The contract as header-like pairs for a row, in this order: id, seq,
/// topic, source (if given), key (if any), origin and unsettled-from (if
/// the row has an origin), then the row's own headers except those
/// starting with [`header::PREFIX`].
pub fn slots(msg: &OutboxMessage, source: Option<&str>) -> Vec<(String, String)> {
    let mut out = vec![
        (header::ID.to_owned(), msg.id.clone()),
        (header::SEQ.to_owned(), msg.seq.to_string()),
        (header::TOPIC.to_owned(), msg.topic.clone()),
    ];
    if let Some(source) = source {
        out.push((header::SOURCE.to_owned(), source.to_owned()));
    }
    if let Some(key) = &msg.key {
        out.push((header::KEY.to_owned(), key.clone()));
    }
    if !msg.origin.is_empty() {
        out.push((header::ORIGIN.to_owned(), msg.origin.clone()));
        out.push((
            header::UNSETTLED_FROM.to_owned(),
            msg.unsettled_from.to_string(),
        ));
    }
    out.extend(
        msg.headers
            .iter()
            .filter(|(name, _)| !name.starts_with(header::PREFIX))
            .map(|(name, value)| (name.clone(), value.clone())),
    );
    out
}

/// How an outbox message travels where there are no headers (MQTT 3.1.1):
/// this struct as one line of compact JSON, then `\n`, then the payload
/// bytes as they are (binary-safe; compact JSON never holds a raw newline):
///
/// ```text
/// {"postroom":1,"id":"9f…","seq":42,"source":"device-a","topic":"orders","key":"7","headers":{}}
/// <payload bytes>
/// ```
///
/// `id` is the outbox row's message id, the same on every re-send: dedupe
/// on it. `seq` is the row's commit order in its outbox (increasing per
/// source, with gaps). `source`, when the sink was given one, names the
/// sending outbox; `key` and `headers` are absent when empty.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Envelope {
    /// Always [`ENVELOPE_VERSION`].
    pub postroom: u32,
    /// The outbox message id.
    pub id: String,
    /// The outbox row's `seq`.
    pub seq: i64,
    /// The sending outbox's name, if the sink was given one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// The outbox row's topic (the transport's topic or subject may
    /// differ).
    pub topic: String,
    /// The outbox row's ordering key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// The outbox row's headers.
    #[serde(default, skip_serializing_if = "Headers::is_empty")]
    pub headers: Headers,
    /// The sending database's instance id, which `seq` numbers the outbox
    /// of ([`OutboxMessage::origin`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin: Option<String>,
    /// The lowest `seq` of that outbox not yet settled when the row was
    /// sent ([`OutboxMessage::unsettled_from`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unsettled_from: Option<i64>,
    /// The payload: not in the JSON line, it follows it.
    #[serde(skip)]
    pub payload: Vec<u8>,
}

impl Envelope {
    /// An envelope for a message not from a postroom outbox (another
    /// publisher speaking the format): `id` must be stable across its
    /// re-sends, `seq` increasing per source.
    pub fn new(
        id: impl Into<String>,
        seq: i64,
        topic: impl Into<String>,
        payload: impl Into<Vec<u8>>,
    ) -> Self {
        Envelope {
            postroom: ENVELOPE_VERSION,
            id: id.into(),
            seq,
            source: None,
            topic: topic.into(),
            key: None,
            headers: Headers::new(),
            origin: None,
            unsettled_from: None,
            payload: payload.into(),
        }
    }

    /// Names the sending source.
    pub fn with_source(mut self, source: impl Into<String>) -> Self {
        self.source = Some(source.into());
        self
    }

    /// The envelope of an outbox row, naming `source` when given.
    pub fn of(msg: &OutboxMessage, source: Option<&str>) -> Self {
        Envelope {
            postroom: ENVELOPE_VERSION,
            id: msg.id.clone(),
            seq: msg.seq,
            source: source.map(str::to_owned),
            topic: msg.topic.clone(),
            key: msg.key.clone(),
            headers: msg.headers.clone(),
            origin: (!msg.origin.is_empty()).then(|| msg.origin.clone()),
            unsettled_from: (!msg.origin.is_empty()).then_some(msg.unsettled_from),
            payload: msg.payload.clone(),
        }
    }

    /// The bytes that go on the wire.
    pub fn encode(&self) -> Vec<u8> {
        // A struct of strings and integers always serializes.
        let mut out = serde_json::to_vec(self).unwrap_or_default();
        out.push(b'\n');
        out.extend_from_slice(&self.payload);
        out
    }

    /// Reads `bytes` as an envelope, telling one that carries postroom's
    /// marker (its first line, or the whole when there is no newline, is a
    /// JSON object with a `postroom` member) but does not decode from a
    /// payload that is none.
    pub(crate) fn read(bytes: &[u8]) -> Read {
        let line = match bytes.iter().position(|&b| b == b'\n') {
            Some(newline) => &bytes[..newline],
            None => bytes,
        };
        let marked = serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(line)
            .is_ok_and(|object| object.contains_key("postroom"));
        if !marked {
            return Read::NotOne;
        }
        if !bytes.contains(&b'\n') {
            return Read::Unreadable(
                "a postroom envelope without the newline that ends its JSON line".into(),
            );
        }
        match serde_json::from_slice::<Envelope>(line) {
            Ok(env) if env.postroom != ENVELOPE_VERSION => Read::Unreadable(format!(
                "a postroom envelope of version {}, which this postroom does not read (it \
                 reads version {ENVELOPE_VERSION}): upgrade the receiver",
                env.postroom
            )),
            Ok(_) => match Envelope::decode(bytes) {
                Some(env) => Read::Envelope(env),
                None => Read::Unreadable("a postroom envelope that does not decode".into()),
            },
            Err(e) => Read::Unreadable(format!("a postroom envelope that does not decode: {e}")),
        }
    }

    /// Reads an envelope; `None` when `bytes` is not one (no newline, the
    /// first line is not the JSON above, or another version).
    pub fn decode(bytes: &[u8]) -> Option<Envelope> {
        let newline = bytes.iter().position(|&b| b == b'\n')?;
        let mut env: Envelope = serde_json::from_slice(&bytes[..newline]).ok()?;
        if env.postroom != ENVELOPE_VERSION {
            return None;
        }
        env.payload = bytes[newline + 1..].to_vec();
        Some(env)
    }
}

/// What [`Envelope::read`] found.
pub(crate) enum Read {
    /// No postroom marker: a foreign payload.
    NotOne,
    /// The marker, and an envelope that does not decode: why.
    Unreadable(String),
    Envelope(Envelope),
}

/// A message as an intake hands it to the inbox.
pub(crate) struct Arrived {
    pub(crate) msg: Message,
    /// The sending outbox's numbers as they came, when the sender named its
    /// origin; checked before use ([`Numbers::checked`]).
    pub(crate) numbers: Option<Numbers>,
    /// It carried the contract (slots or an envelope).
    pub(crate) wrapped: bool,
    /// It carries postroom's marker but cannot be read as what it says it
    /// is (an envelope whose numbers are out of range or of the wrong type,
    /// a future version): why, for the dead letters. Never a foreign
    /// message.
    pub(crate) unreadable: Option<String>,
}

impl Arrived {
    /// A message that carries the contract in header-like `slots` (names as
    /// in [`header`]; `None` when it names no [`header::ID`]). Without a
    /// [`header::TOPIC`] the transport's `topic` stands in.
    pub(crate) fn from_slots(
        slots: &[(String, String)],
        payload: &[u8],
        topic: &str,
    ) -> Option<Arrived> {
        let get = |name: &str| {
            slots
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        };
        let id = get(header::ID)?;
        let topic = get(header::TOPIC).unwrap_or_else(|| topic.to_owned());
        let mut msg = Message::new(get(header::SOURCE).unwrap_or(topic), id, payload.to_vec());
        msg.headers = slots
            .iter()
            .filter(|(k, _)| !k.starts_with(header::PREFIX))
            .cloned()
            .collect();
        msg.ordering_key = get(header::KEY);
        Some(Arrived {
            msg,
            numbers: Numbers::new(
                get(header::ORIGIN),
                get(header::SEQ),
                get(header::UNSETTLED_FROM),
            ),
            wrapped: true,
            unreadable: None,
        })
    }

    /// A message whose payload is an [`Envelope`]; `None` when it does not
    /// carry postroom's marker (its first line is not a JSON object with a
    /// `postroom` member). One that carries it and does not decode is
    /// [`unreadable`](Arrived::unreadable), under the id and source an
    /// unwrapped message on `topic` of `transport` would have.
    pub(crate) fn from_envelope(payload: &[u8], transport: &str, topic: &str) -> Option<Arrived> {
        let env = match Envelope::read(payload) {
            Read::NotOne => return None,
            Read::Unreadable(reason) => {
                let mut came = Arrived::unwrapped(transport, topic, payload);
                came.wrapped = true;
                came.unreadable = Some(reason);
                return Some(came);
            }
            Read::Envelope(env) => env,
        };
        let source = env.source.unwrap_or(env.topic);
        let mut msg = Message::new(source, env.id, env.payload);
        msg.headers = env.headers;
        msg.ordering_key = env.key;
        Some(Arrived {
            msg,
            numbers: Numbers::new(
                env.origin,
                Some(env.seq.to_string()),
                env.unsettled_from.map(|u| u.to_string()),
            ),
            wrapped: true,
            unreadable: None,
        })
    }

    /// A message from a publisher that does not speak the contract:
    /// source = its `topic`, id = `{transport}-` + 128 bits of blake3 over
    /// topic and payload (identical payloads on one topic count as one).
    pub(crate) fn unwrapped(transport: &str, topic: &str, payload: &[u8]) -> Arrived {
        let domain = format!("postroom-{transport}\0");
        let id = digest_hex(domain.as_bytes(), &[topic], payload);
        Arrived {
            msg: Message::new(topic, format!("{transport}-{id}"), payload.to_vec()),
            numbers: None,
            wrapped: false,
            unreadable: None,
        }
    }
}

/// Where an inbound message says it stands in its sending outbox, as it
/// came on the wire: the origin, the row's `seq`, and where the sender's
/// unsettled rows started, as text (a header may hold anything).
pub(crate) struct Numbers {
    origin: String,
    seq: Option<String>,
    unsettled_from: Option<String>,
}

/// [`Numbers`], checked.
pub(crate) struct Numbered {
    pub(crate) origin: String,
    pub(crate) seq: u64,
    pub(crate) unsettled_from: u64,
}

impl Numbers {
    pub(crate) fn new(
        origin: Option<String>,
        seq: Option<String>,
        unsettled_from: Option<String>,
    ) -> Option<Self> {
        Some(Numbers {
            origin: origin.filter(|o| !o.is_empty())?,
            seq,
            unsettled_from,
        })
    }

    /// The numbers when they make sense: `seq` a sequence number
    /// (1..=[`MAX_SEQUENCE`](crate::MAX_SEQUENCE)), `unsettled_from` one
    /// too and at most `seq` (the row itself was unsettled when sent;
    /// absent, it is `seq`); else why not. Nothing is clamped: a number out
    /// of range is a sender's bug, and guessing would file the message
    /// under a number it does not have.
    pub(crate) fn checked(self) -> std::result::Result<Numbered, String> {
        let number = |name: &str, text: &str| {
            text.parse::<u64>()
                .ok()
                .filter(|&n| crate::config::check_sequence(n).is_ok())
                .ok_or_else(|| {
                    format!(
                        "{name} {text:?} is not a sequence number (1..={})",
                        crate::MAX_SEQUENCE
                    )
                })
        };
        let text = self
            .seq
            .ok_or_else(|| format!("{} names no {}", header::ORIGIN, header::SEQ))?;
        let seq = number(header::SEQ, &text)?;
        let unsettled_from = match self.unsettled_from {
            None => seq,
            Some(text) => number(header::UNSETTLED_FROM, &text)?,
        };
        if unsettled_from > seq {
            return Err(format!(
                "{} {unsettled_from} is above the message's own {} {seq}",
                header::UNSETTLED_FROM,
                header::SEQ
            ));
        }
        Ok(Numbered {
            origin: self.origin,
            seq,
            unsettled_from,
        })
    }
}

/// How an intake hands messages to the inbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// [`Postroom::deliver`]: the handler runs inline.
    Deliver,
    /// [`Postroom::receive`]: stored for the engine's workers.
    Receive,
}

/// What an intake does with a message it handed on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Landed {
    /// It is durably in the inbox or the dead letters: acknowledge it.
    Ack {
        /// The inbox had it already.
        duplicate: bool,
        /// The engine refuses it as it is: stored as a dead letter.
        refused: bool,
    },
    /// Not stored, or stored but not done with: do not acknowledge; have
    /// the broker redeliver it after `retry_after`.
    Hold {
        /// When it should come again.
        retry_after: Duration,
    },
}

/// The inbox side of the contract, shared by the intakes: numbers a
/// message in its sending outbox's stream (when sequenced), refuses what
/// the engine would never store into the dead letters, hands the rest to
/// the consumer, and says whether the broker may be told. Invariant: only
/// [`Landed::Ack`] when the message is durably stored (inbox or dead
/// letters).
pub(crate) struct Lander {
    pub(crate) room: Arc<Postroom>,
    pub(crate) consumer: String,
    pub(crate) mode: Mode,
    /// With sequencing on: the streams started at the engine so far.
    pub(crate) sequenced: Option<HashSet<String>>,
    /// Names the intake in logs (`"postroom mqtt intake"`).
    pub(crate) label: &'static str,
}

/// How long a message held for an engine error waits before it comes again.
const ERROR_RETRY: Duration = Duration::from_secs(1);

impl Lander {
    /// Hands `came` (from `place`, named in logs) to the inbox. `again`
    /// rebuilds the message as it came, for the dead letters should the
    /// engine refuse it after all.
    pub(crate) fn land(
        &mut self,
        came: Arrived,
        place: &str,
        again: impl FnOnce() -> Message,
    ) -> Landed {
        if let Some(reason) = came.unreadable {
            return self.refuse(came.msg, &reason, place);
        }
        let msg = match self.number(came.msg, came.numbers) {
            Ok(Ok(msg)) => msg,
            Ok(Err((msg, reason))) => return self.refuse(msg, &reason, place),
            Err(e) => {
                log::warn!("{}: not acknowledged: {}", self.label, Esc(&e));
                return Landed::Hold {
                    retry_after: ERROR_RETRY,
                };
            }
        };
        // What the engine would refuse is known before it is handed on: it
        // goes to the dead letters instead, never dropped.
        if let Err(e @ Error::InvalidInput { .. }) = self.room.check_message(&msg) {
            return self.refuse(msg, &e.to_string(), place);
        }
        // Inline, an earlier message of the key unfinished in the inbox
        // (failed, waiting for its redelivery) is passed by no later one:
        // asked back until it settled. The inbox survives a restart of the
        // intake, which forgets what it asked back. (Queued, the engine's
        // workers keep the key's order themselves.)
        if self.mode == Mode::Deliver {
            match self.room.intake_key_wait(&self.consumer, &msg) {
                Ok(None) => {}
                Ok(Some(retry_after)) => return Landed::Hold { retry_after },
                Err(e) => {
                    log::warn!("{}: not acknowledged: {}", self.label, Esc(&e));
                    return Landed::Hold {
                        retry_after: ERROR_RETRY,
                    };
                }
            }
        }
        let answer = match self.mode {
            Mode::Deliver => self
                .room
                .deliver(&self.consumer, msg)
                .map(|outcome| match outcome {
                    Outcome::Duplicate | Outcome::DuplicateBySequence { .. } => (true, true, None),
                    o => (o.should_ack(), false, o.retry_after()),
                }),
            Mode::Receive => self.room.receive(&self.consumer, msg).map(|receipt| {
                let duplicate = matches!(
                    receipt,
                    Receipt::Duplicate | Receipt::DuplicateBySequence { .. }
                );
                (receipt.should_ack(), duplicate, None)
            }),
        };
        match answer {
            Ok((true, duplicate, _)) => Landed::Ack {
                duplicate,
                refused: false,
            },
            Ok((false, _, retry_after)) => Landed::Hold {
                retry_after: retry_after.unwrap_or(ERROR_RETRY),
            },
            // Not expected (the message and the consumer were checked),
            // but a refusal all the same: stored as a dead letter as it
            // came, never acknowledged without being stored.
            Err(e @ Error::InvalidInput { .. }) => self.refuse(again(), &e.to_string(), place),
            // The consumer's brakes, or a key strict order holds: flow
            // control, not a fault. Held, the broker keeps it; the intake
            // reads on once the workers drained (the key is released).
            Err(e @ (Error::Backlogged { .. } | Error::KeyHeld { .. })) => {
                log::debug!("{}: not acknowledged: {}", self.label, Esc(&e));
                Landed::Hold {
                    retry_after: ERROR_RETRY,
                }
            }
            Err(e) => {
                log::warn!("{}: not acknowledged: {}", self.label, Esc(&e));
                Landed::Hold {
                    retry_after: ERROR_RETRY,
                }
            }
        }
    }

    /// With sequencing on, numbers the message in its sending outbox's
    /// stream, first starting that stream at the engine where the sender's
    /// unsettled rows began (a stream the engine knows is left as it is).
    /// `Ok(Err(..))`: the numbers are not usable (out of range, not
    /// numbers), with the message unnumbered and the reason, for the dead
    /// letters; `Err`: the engine could not start the stream now.
    #[allow(clippy::type_complexity)]
    fn number(
        &mut self,
        msg: Message,
        numbers: Option<Numbers>,
    ) -> Result<std::result::Result<Message, (Message, String)>> {
        let (Some(started), Some(numbers)) = (self.sequenced.as_mut(), numbers) else {
            return Ok(Ok(msg));
        };
        let n = match numbers.checked() {
            Ok(n) => n,
            Err(reason) => return Ok(Err((msg, reason))),
        };
        let stream = outbox_stream(&n.origin);
        if let Err(e) = check_name("sequence stream", &stream) {
            return Ok(Err((msg, format!("{}: {e}", header::ORIGIN))));
        }
        if !started.contains(&stream) {
            match self
                .room
                .start_sequence(&self.consumer, &stream, n.unsettled_from)
            {
                Ok(()) => {}
                Err(e @ Error::InvalidInput { .. }) => return Ok(Err((msg, e.to_string()))),
                Err(e) => return Err(e),
            }
            started.insert(stream.clone());
        }
        Ok(Ok(msg.with_sequence_in(stream, n.seq)))
    }

    /// Stores a message the engine refuses as a dead letter of the
    /// consumer with `reason`: acknowledged only once that is durable; if
    /// it cannot be stored now, it is held.
    fn refuse(&mut self, msg: Message, reason: &str, place: &str) -> Landed {
        match self.room.receive_dead(&self.consumer, msg, reason) {
            Ok(receipt) => {
                let duplicate = matches!(
                    receipt,
                    Receipt::Duplicate | Receipt::DuplicateBySequence { .. }
                );
                if !duplicate {
                    log::warn!(
                        "{}: a message on {:?} is refused: {reason}; stored as a dead letter \
                         of {:?} ({receipt:?}), then acknowledged",
                        self.label,
                        place,
                        self.consumer
                    );
                }
                Landed::Ack {
                    duplicate,
                    refused: !duplicate,
                }
            }
            Err(e) => {
                log::warn!(
                    "{}: not acknowledged: a refused message ({reason}) could not be stored \
                     as a dead letter: {e}",
                    self.label
                );
                Landed::Hold {
                    retry_after: ERROR_RETRY,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A payload carrying postroom's marker is an envelope or unreadable,
    /// never a foreign message: numbers out of range or of the wrong type,
    /// a future version, a missing newline. Without the marker it is
    /// foreign, whatever JSON it holds.
    #[test]
    fn a_marked_payload_is_an_envelope_or_unreadable_never_foreign() {
        let unreadable = |line: &str| match Envelope::read(format!("{line}\npayload").as_bytes()) {
            Read::Unreadable(reason) => reason,
            Read::NotOne => panic!("{line}: taken for a foreign message"),
            Read::Envelope(env) => panic!("{line}: decoded as {env:?}"),
        };
        let base = r#""id":"m","topic":"t""#;
        for seq in [
            "9223372036854775808",
            "\"5\"",
            "5.0",
            "-9223372036854775809",
        ] {
            let reason = unreadable(&format!(r#"{{"postroom":1,{base},"seq":{seq}}}"#));
            assert!(reason.contains("does not decode"), "{seq}: {reason}");
        }
        let reason = unreadable(&format!(r#"{{"postroom":2,{base},"seq":5}}"#));
        assert!(reason.contains("version 2"), "{reason}");
        let reason = unreadable(&format!(r#"{{"postroom":"one",{base},"seq":5}}"#));
        assert!(reason.contains("does not decode"), "{reason}");
        assert!(matches!(
            Envelope::read(format!(r#"{{"postroom":1,{base},"seq":5}}"#).as_bytes()),
            Read::Unreadable(_)
        ));
        let came = Arrived::from_envelope(
            format!(r#"{{"postroom":1,{base},"seq":"5"}}"#).as_bytes(),
            "mqtt",
            "orders",
        )
        .expect("marked");
        assert!(came.wrapped && came.unreadable.is_some());
        assert!(came.msg.id.starts_with("mqtt-"), "{}", came.msg.id);
        assert!(matches!(
            Envelope::read(
                format!(r#"{{"postroom":1,{base},"seq":5}}"#)
                    .as_bytes()
                    .iter()
                    .chain(b"\nx")
                    .copied()
                    .collect::<Vec<_>>()
                    .as_slice()
            ),
            Read::Envelope(_)
        ));
        for foreign in [
            &b"plain text"[..],
            b"{\"order\":1}\nx",
            b"[1,2]\n",
            b"\xff\xfe",
        ] {
            assert!(
                matches!(Envelope::read(foreign), Read::NotOne),
                "{foreign:?}"
            );
            assert!(Arrived::from_envelope(foreign, "mqtt", "t").is_none());
        }
    }

    /// Numbers from the wire are parsed and range-checked, never clamped.
    #[test]
    fn wire_numbers_are_checked_not_clamped() {
        let check = |seq: Option<&str>, from: Option<&str>| {
            Numbers::new(
                Some("o".into()),
                seq.map(str::to_owned),
                from.map(str::to_owned),
            )
            .expect("an origin")
            .checked()
            .map(|n| (n.seq, n.unsettled_from))
        };
        assert_eq!(check(Some("7"), None), Ok((7, 7)));
        assert_eq!(check(Some("7"), Some("3")), Ok((7, 3)));
        let max = crate::MAX_SEQUENCE.to_string();
        assert_eq!(check(Some(&max), Some("1")), Ok((crate::MAX_SEQUENCE, 1)));
        for (seq, from) in [
            (Some("9223372036854775807"), None), // i64::MAX
            (Some("0"), None),
            (Some("-5"), Some("1")),
            (Some("x"), None),
            (None, Some("1")),
            (Some("3"), Some("5")),
            (Some("3"), Some("0")),
            (Some("3"), Some("-1")),
            (Some("3"), Some("9223372036854775807")),
        ] {
            let got = check(seq, from);
            assert!(
                got.as_ref()
                    .is_err_and(|why| why.contains("seq") || why.contains("unsettled")),
                "{seq:?} {from:?}: {got:?}"
            );
        }
        assert!(Numbers::new(Some(String::new()), Some("1".into()), None).is_none());
        assert!(Numbers::new(None, Some("1".into()), None).is_none());
    }

    /// The two forms of the contract decode to the same inbox message, and
    /// a row's own `postroom-` header never travels.
    #[test]
    fn slots_and_envelope_carry_the_same_message() {
        let mut headers = Headers::new();
        headers.insert("trace".into(), "abc".into());
        headers.insert("postroom-id".into(), "forged".into());
        let row = OutboxMessage {
            id: "m-1".into(),
            seq: 42,
            topic: "orders".into(),
            key: Some("k".into()),
            headers,
            payload: b"bytes\n\0".to_vec(),
            attempts: 0,
            created_at: 0,
            last_error: None,
            origin: "db-1".into(),
            unsettled_from: 40,
        };
        let pairs = slots(&row, Some("device-a"));
        assert_eq!(pairs.iter().filter(|(k, _)| k == header::ID).count(), 1);
        let a = Arrived::from_slots(&pairs, &row.payload, "wire/topic").expect("slots");
        let b = Arrived::from_envelope(&Envelope::of(&row, Some("device-a")).encode(), "mqtt", "t")
            .expect("envelope");
        for came in [&a, &b] {
            assert_eq!(came.msg.id, "m-1");
            assert_eq!(came.msg.source, "device-a");
            assert_eq!(came.msg.ordering_key.as_deref(), Some("k"));
            assert_eq!(came.msg.payload, row.payload);
            assert_eq!(
                came.msg.headers.get("trace").map(String::as_str),
                Some("abc")
            );
            let n = came.numbers.as_ref().expect("numbers");
            assert_eq!(n.origin, "db-1");
        }
        assert!(!a.msg.headers.contains_key("postroom-id"));
        let u = Arrived::unwrapped("nats", "subj", b"p");
        assert!(u.msg.id.starts_with("nats-"));
        assert!(!u.wrapped);
    }
}

/// What an intake (MQTT or NATS) has seen since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct IntakeStats {
    /// Messages received from the broker, redeliveries included.
    pub received: u64,
    /// Of those, messages the broker flagged as redelivered (MQTT's DUP;
    /// a JetStream delivery count over 1).
    pub redelivered: u64,
    /// Acknowledgements sent (for MQTT: handed to the connection; one it
    /// loses before writing is counted too, the broker then resends that
    /// message, and the inbox knows it).
    pub acked: u64,
    /// Messages the inbox had already: absorbed, acknowledged.
    pub duplicates: u64,
    /// Messages left unacknowledged (a "do not ack" outcome or an error):
    /// asked back after the outcome's `retry_after` (MQTT: by the
    /// reconnect; NATS: with a NAK).
    pub not_acked: u64,
    /// Messages that came behind one left unacknowledged: not handed on,
    /// not acknowledged, asked back with it.
    pub held_back: u64,
    /// Messages the engine refuses to take as they are (a payload over
    /// `max_payload`, too many headers, an id or name outside postroom's
    /// limits, a sequence number out of range in a sequenced intake): each
    /// stored as a dead letter with its payload and the reason, then
    /// acknowledged. A resend of one counts as a duplicate.
    pub refused: u64,
    /// Messages without the hop contract, given a content-derived id.
    pub unwrapped: u64,
    /// Messages the broker holds that the client library cannot hand on
    /// (NATS: a header block async-nats cannot parse, or one with a
    /// protocol status line), found through the consumer's state and read
    /// raw from the stream: each stored as a dead letter with its bytes and
    /// the reason, then settled for good. Also counted in `refused`.
    pub unparsed: u64,
    /// Connections made, the first included.
    pub connects: u64,
}

/// An intake's counters, shared between its handle and its thread.
#[derive(Default)]
pub(crate) struct IntakeCounters {
    pub(crate) received: AtomicU64,
    pub(crate) redelivered: AtomicU64,
    pub(crate) acked: AtomicU64,
    pub(crate) duplicates: AtomicU64,
    pub(crate) not_acked: AtomicU64,
    pub(crate) held_back: AtomicU64,
    pub(crate) refused: AtomicU64,
    pub(crate) unwrapped: AtomicU64,
    pub(crate) unparsed: AtomicU64,
    pub(crate) connects: AtomicU64,
    /// Ready to take messages: subscribed (MQTT), bound to its durable
    /// consumer (NATS).
    pub(crate) ready: AtomicBool,
}

impl IntakeCounters {
    pub(crate) fn snapshot(&self) -> IntakeStats {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        IntakeStats {
            received: get(&self.received),
            redelivered: get(&self.redelivered),
            acked: get(&self.acked),
            duplicates: get(&self.duplicates),
            not_acked: get(&self.not_acked),
            held_back: get(&self.held_back),
            refused: get(&self.refused),
            unwrapped: get(&self.unwrapped),
            unparsed: get(&self.unparsed),
            connects: get(&self.connects),
        }
    }
}

/// Counts one.
pub(crate) fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}
