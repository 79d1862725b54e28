//! Sinks that deliver into another postroom engine: above the engine,
//! which nothing below may import.

use std::collections::HashSet;
use std::sync::Arc;

use crate::engine::Postroom;
use crate::error::{Error, Result};
use crate::message::{Message, Outcome};
use crate::sink::{per_message, SendResult, Sink};
use crate::store::outbox::{outbox_stream, OutboxMessage};

/// A [`Sink`] that delivers into another postroom engine — two components
/// on one device chained exactly-once end to end. Each message becomes a
/// [`Message`] with source = topic, id = the outbox message id (so the
/// target deduplicates re-sends), the same headers, ordering key = key,
/// and the outbox `seq` as its sequence in the stream
/// [`outbox_stream`]`(origin)`: the target keeps a watermark per upstream
/// database, so a re-send after its retention is still a duplicate.
///
/// By default a batch is stored with one `receive_batch` (queued: the
/// target's workers process it). [`InboxSink::inline`] delivers each message
/// inline instead, and only counts it sent once the target says to ack.
pub struct InboxSink {
    target: Arc<Postroom>,
    consumer: String,
    inline: bool,
    /// Whether messages carry the outbox `seq` (see [`InboxSink::unsequenced`]).
    sequenced: bool,
    /// The sequence streams this sink has made sure exist at the target.
    started: HashSet<String>,
}

impl InboxSink {
    /// Sends into `consumer` of `target`.
    pub fn new(target: Arc<Postroom>, consumer: impl Into<String>) -> Self {
        InboxSink {
            target,
            consumer: consumer.into(),
            inline: false,
            sequenced: true,
            started: HashSet::new(),
        }
    }

    /// Forward messages without their outbox `seq` (deduplicated by id
    /// alone, kept until the target's retention): for a sink that gets only
    /// some of its upstream's rows (a filter in front, or several targets
    /// sharing the rows), where the rows sent elsewhere would be gaps in
    /// the target's watermark that never fill.
    pub fn unsequenced(mut self) -> Self {
        self.sequenced = false;
        self
    }

    /// Makes sure the target knows the streams of `batch`, each starting
    /// where its upstream's unsettled rows start (see
    /// [`OutboxMessage::unsettled_from`]), for a target that has not seen
    /// them: a stream the target knows is left alone. Once per stream per
    /// sink.
    fn start_streams(&mut self, batch: &[OutboxMessage]) -> Result<()> {
        if !self.sequenced {
            return Ok(());
        }
        for msg in batch {
            if msg.origin.is_empty() || self.started.contains(&msg.origin) {
                continue;
            }
            let lowest = batch
                .iter()
                .filter(|m| m.origin == msg.origin)
                .map(|m| m.seq)
                .min()
                .unwrap_or(msg.seq);
            let next = u64::try_from(msg.unsettled_from.min(lowest)).unwrap_or(1);
            self.target
                .start_sequence(&self.consumer, &outbox_stream(&msg.origin), next.max(1))?;
            self.started.insert(msg.origin.clone());
        }
        Ok(())
    }

    /// Deliver each message inline (`deliver`) rather than queue the batch.
    pub fn inline(mut self) -> Self {
        self.inline = true;
        self
    }

    fn message(&self, msg: &OutboxMessage) -> Message {
        let mut m = Message::new(msg.topic.clone(), msg.id.clone(), msg.payload.clone());
        m.headers = msg.headers.clone();
        m.ordering_key = msg.key.clone();
        // The upstream's seq numbers all its topics at once: one stream per
        // upstream database (docs/DESIGN.md, "Sequence watermarks").
        if let (true, false, Ok(seq)) = (
            self.sequenced,
            msg.origin.is_empty(),
            u64::try_from(msg.seq),
        ) {
            m = m.with_sequence_in(outbox_stream(&msg.origin), seq);
        }
        m
    }
}

impl Sink for InboxSink {
    fn send(&mut self, batch: &[OutboxMessage]) -> Vec<SendResult> {
        if let Err(e) = self.start_streams(batch) {
            let reason = format!("target: {e}");
            return vec![SendResult::retry(reason); batch.len()];
        }
        if self.inline {
            return per_message(batch, |msg| {
                match self.target.deliver(&self.consumer, self.message(msg)) {
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
            let msg = self.message(out);
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
