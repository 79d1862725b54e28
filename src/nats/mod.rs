//! The NATS JetStream bridge (feature `nats`): an outbox [`Sink`](crate::Sink) that
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
//! time, makes the unacknowledged rows [`SendResult::Unavailable`](crate::SendResult::Unavailable):
//! retried with backoff, no attempt counted. A row the server could never
//! take (a subject that is not one, a header name NATS refuses, a header of
//! NATS's own (`Nats-…`), larger than the server's max payload) is dead at
//! once, before anything is sent. Per-key order: a row is published only
//! once every earlier row of its key is acknowledged, and after a row of a
//! key fails, the later rows of that key in the batch are not published.
//!
//! In: [`NatsIntake`] pulls from a durable consumer with explicit
//! acknowledgements and hands each message to
//! [`deliver`](crate::Postroom::deliver) (or [`receive`](crate::Postroom::receive)).
//! Invariant: a message is acknowledged only once it is durably in the
//! inbox or in the dead letters (with its payload and the reason); one
//! that is not is never acknowledged, and is asked back (`NAK` with the
//! outcome's `retry_after`) together with every message behind it that
//! was not handed on, so per-key order holds.
//!
//! The files: `sink.rs` (the outbox sink and its publish window),
//! `intake.rs` (the pull consumer feeding an inbox), `stream.rs` (setting
//! up a stream); here what they share: the client runtime, connecting,
//! backoff.

use std::time::Duration;

pub use async_nats;

use crate::error::{Error, Result};
pub use crate::hop::IntakeStats;

mod intake;
mod raw;
mod sink;
mod stream;

pub use intake::{IntakeBuilder, NatsIntake};
pub use raw::RAW_HEADERS;
pub use sink::NatsSink;
pub use stream::ensure_stream;

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
