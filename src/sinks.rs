//! Sinks that deliver into another postroom engine: above the engine,
//! which nothing below may import.

use std::sync::Arc;

use crate::engine::Postroom;
use crate::error::Error;
use crate::message::{Message, Outcome};
use crate::sink::{per_message, SendResult, Sink};
use crate::store::outbox::OutboxMessage;

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
