//! Below the client library: a message a JetStream consumer holds that
//! async-nats cannot hand on. Its protocol reader drops the connection on a
//! header block it cannot parse (not UTF-8, a line without `:`, a header
//! name NATS refuses), and its pull consumer takes a header block with a
//! status line (`NATS/1.0 404`, `408`, `503`, `100`) for the server's own
//! control message; it drops the connection on a subject that is not UTF-8
//! too (the server stores any bytes). Either way the intake never sees the message, the
//! server redelivers it every ack wait, and the consumer's ack floor stays
//! below it for good.
//!
//! What the protocol offers finds and settles such a message instead: the
//! consumer's state (its ack floor and the highest sequence delivered), the
//! stream's message API (`STREAM.MSG.GET`, which returns the stored header
//! block base64-encoded inside a JSON reply any client reads) and the
//! message's acknowledgement subject (`$JS.ACK.<stream>.<consumer>.…`,
//! which carries the stream sequence the server acts on).
//!
//! Invariants: only the lowest message above the ack floor that the intake
//! does not hold (received, or terminated), delivered and still
//! unacknowledged, is ever examined, and it is settled only when
//! [`refusal`] (or its subject) says the client cannot hand it on, so a
//! message the intake can receive is never taken from it. It is terminated (`+TERM`) only
//! after its dead letter (payload as stored, the header block as base64 in
//! the header [`RAW_HEADERS`], the reason) is durable; a dead letter is
//! stored once (its id is the stream, sequence and bytes), so a TERM lost
//! and sent again stores nothing twice.

use std::str::FromStr;
use std::time::Duration;

use async_nats::jetstream::{self, response::Response, stream::RawMessage};
use base64::Engine;
use serde::Deserialize;

use crate::hop::Arrived;
use crate::store::outbox::digest_hex;

/// The dead letter's header holding the stored header block, base64
/// (standard alphabet, padded): exactly the bytes the stream holds.
pub const RAW_HEADERS: &str = "nats-raw-headers";

/// The JetStream error code for "no message found".
const NO_MESSAGE_FOUND: u64 = 10037;

/// How long one request of the probe may take.
const REQUEST_WAIT: Duration = Duration::from_secs(5);

/// Why async-nats 0.51 would not hand a stored message with this header
/// block on as a message; `None` when it would. The rules are its
/// protocol reader's, in its order, over the same types it parses with
/// (`HeaderName`, `StatusCode`); a status line other than 200 is refused:
/// the pull consumer takes it for the server's control message. (A server
/// may pass a stored status line on as a plain header: nats-server 2.15
/// does. So a refusal here is a suspicion, settled only once the message
/// has stayed undelivered for an ack wait: see the intake.)
pub(crate) fn refusal(block: &[u8]) -> Option<String> {
    if block.is_empty() {
        return None;
    }
    let text = match std::str::from_utf8(block) {
        Ok(text) => text,
        Err(e) => {
            return Some(format!(
                "its header block is not UTF-8 (byte {})",
                e.valid_up_to()
            ))
        }
    };
    let mut lines = text.lines().peekable();
    let version = lines.next().unwrap_or("");
    let Some(suffix) = version.strip_prefix("NATS/1.0").map(str::trim) else {
        return Some("its header block does not begin with NATS/1.0".to_owned());
    };
    let status = suffix.split_once(' ').map_or(suffix, |(s, _)| s.trim());
    if !status.is_empty() {
        match async_nats::StatusCode::from_str(status) {
            Ok(async_nats::StatusCode::OK) => {}
            Ok(code) => {
                return Some(format!(
                    "its header block carries the protocol status {code} (read as the server's \
                     control message, never as a message)"
                ))
            }
            Err(_) => {
                return Some(format!(
                    "its header block's status {status:?} is not a status code"
                ))
            }
        }
    }
    while let Some(line) = lines.next() {
        if line.is_empty() {
            continue;
        }
        let Some((name, _)) = line.split_once(':') else {
            return Some(format!("a header line has no ':' ({line:?})"));
        };
        if async_nats::HeaderName::from_str(name).is_err() {
            return Some(format!("the header name {name:?} is not one NATS takes"));
        }
        while lines
            .next_if(|s| s.starts_with(char::is_whitespace))
            .is_some()
        {}
    }
    None
}

/// A stored message the client cannot hand on, read raw from the stream.
pub(crate) struct Stuck {
    pub(crate) seq: u64,
    subject: String,
    headers_b64: String,
    payload: Vec<u8>,
    reason: String,
}

impl Stuck {
    /// Its dead letter: source = the subject, id = `nats-` + 128 bits of
    /// blake3 over stream, sequence, subject, header block and payload
    /// (two stored copies are two dead letters; one read twice is one).
    pub(crate) fn arrived(&self, stream: &str) -> Arrived {
        let mut came = Arrived::unwrapped("nats", &self.subject, &self.payload);
        came.msg.id = format!(
            "nats-{}",
            digest_hex(
                b"postroom-nats-raw\0",
                &[
                    stream,
                    &self.seq.to_string(),
                    &self.subject,
                    &self.headers_b64
                ],
                &self.payload,
            )
        );
        came.msg
            .headers
            .insert(RAW_HEADERS.to_owned(), self.headers_b64.clone());
        came.unreadable = Some(format!(
            "stream {stream:?} sequence {}: async-nats cannot hand this message on: {}",
            self.seq, self.reason
        ));
        came
    }
}

#[derive(Deserialize)]
struct Got {
    message: RawMessage,
}

/// The lowest message above `consumer`'s ack floor that the intake does
/// not hold (`held` answers, for a sequence it holds, where its run of
/// held sequences ends), when it was delivered, is unacknowledged and the
/// client cannot hand it on; `None` otherwise (nothing pending, or that
/// one is a message the client reads).
pub(crate) async fn stuck(
    js: &jetstream::Context,
    stream: &str,
    consumer: &jetstream::consumer::Consumer<jetstream::consumer::pull::Config>,
    held: impl Fn(u64) -> Option<u64>,
) -> std::result::Result<Option<Stuck>, String> {
    let info = tokio::time::timeout(REQUEST_WAIT, consumer.get_info())
        .await
        .map_err(|_| "nats: no consumer info in time".to_owned())?
        .map_err(|e| format!("nats: consumer info: {e}"))?;
    let floor = info.ack_floor.stream_sequence;
    let top = info.delivered.stream_sequence;
    if info.num_ack_pending == 0 || floor >= top {
        return Ok(None);
    }
    // The consumer's own filter (an existing consumer is used as it is):
    // the next message it was delivered, not the stream's next. (Several
    // filters, nats-server 2.10's `filter_subjects`, are not in this
    // client's config: such a consumer reads as unfiltered here.)
    let filter = match info.config.filter_subject.as_str() {
        "" => ">".to_owned(),
        f => f.to_owned(),
    };
    // One request per run of held sequences passed: the runs are few
    // (what came early behind a restart, in stream order).
    let mut from = floor + 1;
    let raw = loop {
        let request = serde_json::json!({ "seq": from, "next_by_subj": filter });
        let got: Response<Got> = tokio::time::timeout(
            REQUEST_WAIT,
            js.request(format!("STREAM.MSG.GET.{stream}"), &request),
        )
        .await
        .map_err(|_| "nats: no stream message in time".to_owned())?
        .map_err(|e| format!("nats: stream message {from}: {e}"))?;
        let raw = match got {
            Response::Ok(got) => got.message,
            Response::Err { error } if error.error_code().0 == NO_MESSAGE_FOUND => return Ok(None),
            Response::Err { error } => return Err(format!("nats: stream message {from}: {error}")),
        };
        if raw.sequence > top {
            return Ok(None);
        }
        match held(raw.sequence) {
            Some(past) if past > raw.sequence => from = past,
            Some(_) => return Ok(None),
            None => break raw,
        }
    };
    let b64 = base64::engine::general_purpose::STANDARD;
    let headers_b64 = raw.headers.unwrap_or_default();
    let block = b64
        .decode(&headers_b64)
        .map_err(|e| format!("nats: stream message {}: its headers: {e}", raw.sequence))?;
    // Go's JSON writes bytes that are not UTF-8 as U+FFFD: a subject that
    // shows one may be a real U+FFFD the client reads; the intake settles
    // only what stays undelivered for an ack wait.
    let reason = match refusal(&block) {
        Some(reason) => reason,
        None if raw.subject.contains('\u{FFFD}') => {
            "its subject is not UTF-8 (the server's reply shows U+FFFD for the bytes it could \
             not write)"
                .to_owned()
        }
        None => return Ok(None),
    };
    let payload = b64
        .decode(&raw.payload)
        .map_err(|e| format!("nats: stream message {}: its payload: {e}", raw.sequence))?;
    Ok(Some(Stuck {
        seq: raw.sequence,
        subject: raw.subject,
        headers_b64,
        payload,
        reason,
    }))
}

/// Terminates stream sequence `seq` at `consumer` of `stream`: never
/// delivered again, and the ack floor passes it. The acknowledgement
/// subject's delivery and consumer sequences are set to values the server
/// does not act on for an explicit-ack consumer (it takes the consumer
/// sequence from its own pending record; 0 matches no ack floor when the
/// message is not pending).
pub(crate) async fn terminate(
    client: &async_nats::Client,
    stream: &str,
    consumer: &str,
    seq: u64,
) -> std::result::Result<(), String> {
    let subject = format!("$JS.ACK.{stream}.{consumer}.1.{seq}.0.0.0");
    tokio::time::timeout(REQUEST_WAIT, client.request(subject, "+TERM".into()))
        .await
        .map_err(|_| format!("nats: no answer to the termination of sequence {seq} in time"))?
        .map_err(|e| format!("nats: terminating sequence {seq}: {e}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::refusal;

    #[test]
    fn what_the_client_reads_passes_and_what_it_cannot_is_named() {
        assert_eq!(refusal(b""), None);
        assert_eq!(refusal(b"NATS/1.0\r\n\r\n"), None);
        assert_eq!(
            refusal(b"NATS/1.0\r\nA: b\r\n  c\r\nNats-Msg-Id: 1\r\n\r\n"),
            None
        );
        let named = |block: &[u8], word: &str| {
            let why = refusal(block).unwrap_or_default();
            assert!(why.contains(word), "{block:?}: {why:?}");
        };
        named(b"NATS/1.0\r\nX: \xff\r\n\r\n", "UTF-8");
        named(b"NATS/1.1\r\n\r\n", "NATS/1.0");
        named(b"NATS/1.0\r\nnothing\r\n\r\n", "':'");
        named(b"NATS/1.0\r\nA B: c\r\n\r\n", "name");
        named(b"NATS/1.0 404 No Messages\r\n\r\n", "status 404");
        named(b"NATS/1.0 503\r\n\r\n", "status 503");
        named(b"NATS/1.0 1000\r\n\r\n", "not a status code");
        // The pull consumer hands a 200 on as a message.
        assert_eq!(refusal(b"NATS/1.0 200 OK\r\nA: b\r\n\r\n"), None);
        named(b"NATS/1.0 200\r\nA B: c\r\n\r\n", "name");
    }
}
