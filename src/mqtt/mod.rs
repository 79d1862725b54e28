//! The MQTT bridge (feature `mqtt`): an outbox [`Sink`](crate::Sink) that publishes to an
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
//! unacknowledged rows [`SendResult::Unavailable`](crate::SendResult::Unavailable): retried with backoff,
//! no attempt counted, never dead-lettered for the outage. So a row the
//! broker would refuse by dropping the connection must never be sent: what
//! the sink would send (topic, MQTT 5 user properties, size) is checked
//! first against an allowlist of what brokers take, and such a row is dead
//! at once, holding nothing back.
//!
//! In: [`MqttIntake`] subscribes at QoS 1 with manual acknowledgements and a
//! persistent session, hands each message to
//! [`deliver`](crate::Postroom::deliver) (or [`receive`](crate::Postroom::receive)), and
//! acknowledges it only when the outcome says so. Invariant: a message is
//! acknowledged only once it is durably in the inbox or in the dead letters
//! (with its payload and the reason); a misconfiguration that could never
//! store one is refused at `start()`, and numbers from the wire are checked
//! before use, so no message can be dropped nor wedge the subscription for
//! what it holds. MQTT brokers resend an
//! unacknowledged message only when the session resumes, so after a "do
//! not ack" outcome the intake reconnects once the outcome's `retry_after`
//! has passed, and the broker redelivers it.

//!
//! Files: `codec` (what goes on the wire: the string allowlist, packet
//! sizes, both protocol versions behind one event type), `sink`
//! ([`MqttSink`]), `intake` ([`MqttIntake`]); the hop contract itself is
//! [`crate::hop`]'s.

use std::time::Duration;

mod codec;
mod intake;
mod sink;

pub use intake::{IntakeBuilder, IntakeStats, MqttIntake};
pub use rumqttc;
pub use sink::MqttSink;

/// The envelope (MQTT 3.1.1) and its version: defined by the hop contract
/// ([`crate::hop`]), re-exported here where it was first defined.
pub use crate::hop::{Envelope, ENVELOPE_VERSION};

/// Names of the MQTT 5 user properties the sink sets (and the intake
/// reads) beside the payload: the hop contract's header names
/// ([`crate::hop::header`]); the row's headers follow under their own
/// names. Together they carry what the [`Envelope`] carries.
pub use crate::hop::header as property;

/// Exponential backoff between `min` and `max`, doubled per failure.
#[derive(Debug, Clone)]
pub(super) struct Backoff {
    min: Duration,
    max: Duration,
    next: Duration,
}

/// The shortest backoff step: a zero one would spin on a broker that is
/// down.
pub(super) const MIN_STEP: Duration = Duration::from_millis(10);
/// The longest backoff step or timeout: beyond it waits are settings
/// mistakes (and `Instant + Duration::MAX` overflows).
pub(super) const MAX_WAIT: Duration = Duration::from_secs(3600);

impl Backoff {
    /// Steps within [`MIN_STEP`, `MAX_WAIT`], `max` at least `min`.
    pub(super) fn new(min: Duration, max: Duration) -> Self {
        let min = min.clamp(MIN_STEP, MAX_WAIT);
        Backoff {
            min,
            max: max.clamp(min, MAX_WAIT),
            next: min,
        }
    }

    pub(super) fn fail(&mut self) -> Duration {
        let now = self.next;
        self.next = (self.next * 2).min(self.max);
        now
    }

    pub(super) fn reset(&mut self) {
        self.next = self.min;
    }
}
