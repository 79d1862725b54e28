//! The NATS outbox sink ([`NatsSink`]): each row published to a JetStream
//! stream with the hop contract in headers and `Nats-Msg-Id` = its outbox
//! id, `Sent` only on the stream's publish acknowledgement.
//!
//! Invariants: a row the server could never take (a subject that is not
//! one, a header NATS refuses) is dead before anything is sent; up to a
//! window of publishes are outstanding, never two of one key, and after a
//! row of a key fails the later rows of that key in the batch are not
//! published; a server that cannot be reached or does not answer in time
//! makes the unanswered rows unavailable (retried, no attempt counted).

use std::collections::{HashMap, HashSet, VecDeque};
use std::str::FromStr;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, context::PublishAckFuture, context::PublishErrorKind};
use async_nats::{HeaderMap, HeaderName, HeaderValue};

use super::{connect, runtime, Backoff, MAX_WAIT, MSG_ID};
use crate::escape::Esc;
use crate::hop;
use crate::sink::{SendResult, Sink};
use crate::store::outbox::OutboxMessage;

/// Why `subject` cannot be published to: empty, an empty token, a
/// wildcard token (`*`, `>`), or a character outside printable ASCII
/// other than space (an allowlist: NATS splits its protocol on whitespace,
/// and subjects are ASCII by convention of every client).
fn subject_problem(subject: &str) -> Option<String> {
    if subject.is_empty() {
        return Some("the NATS subject is empty".into());
    }
    if let Some(c) = subject.chars().find(|c| !c.is_ascii_graphic()) {
        return Some(format!(
            "the NATS subject {subject:?} holds {c:?}, which NATS does not take in a subject \
             (printable ASCII without spaces only)"
        ));
    }
    for token in subject.split('.') {
        if token.is_empty() {
            return Some(format!("the NATS subject {subject:?} has an empty token"));
        }
        if token == "*" || token == ">" {
            return Some(format!("the NATS subject {subject:?} holds a wildcard"));
        }
    }
    None
}

/// The NATS headers of a row: the hop contract, the row's own headers, and
/// [`MSG_ID`] = the outbox id; or why a server would never take them (a
/// name NATS refuses, a value with a line break, a header of NATS's own).
fn headers_of(msg: &OutboxMessage, source: Option<&str>) -> std::result::Result<HeaderMap, String> {
    let mut headers = HeaderMap::new();
    for (name, value) in hop::slots(msg, source) {
        if name.len() >= 5 && name[..5].eq_ignore_ascii_case("nats-") {
            return Err(format!(
                "the header {name:?} is one of NATS's own (Nats-…), which steer the server: \
                 rename it"
            ));
        }
        let header = HeaderName::from_str(&name).map_err(|_| {
            format!("the header name {name:?} is not one NATS takes (printable ASCII, no ':')")
        })?;
        let value = HeaderValue::from_str(&value)
            .map_err(|_| format!("the header {name:?} has a line break in its value"))?;
        headers.insert(header, value);
    }
    let id = HeaderValue::from_str(&stream_dedupe_id(msg, source))
        .map_err(|_| format!("the message id {:?} has a line break", msg.id))?;
    headers.insert(MSG_ID, id);
    Ok(headers)
}

/// The [`MSG_ID`] of a row: the message's identity as the receiving inbox
/// sees it, its source (the sink's `source`, else the row's topic) and its
/// id together, so two devices' outboxes sharing a stream never have one
/// of their messages dropped as the other's duplicate (an outbox id is
/// unique within one database only). Length-prefixed, so no two
/// (source, id) pairs give the same text.
fn stream_dedupe_id(msg: &OutboxMessage, source: Option<&str>) -> String {
    let source = source.unwrap_or(&msg.topic);
    format!("{}:{source}:{}", source.len(), msg.id)
}

type SubjectFn = Box<dyn Fn(&OutboxMessage) -> String + Send>;

/// An outbox [`Sink`] publishing each row to a JetStream stream; a row is
/// `Sent` only on the stream's publish acknowledgement. The payload
/// travels as it is, the hop contract in headers ([`crate::hop::header`])
/// and the outbox id also as [`MSG_ID`].
///
/// The subject of a row is its outbox topic (see
/// [`subject_prefix`](NatsSink::subject_prefix),
/// [`subject_with`](NatsSink::subject_with)); a stream must take it
/// (JetStream answers "no responders" otherwise, which the sink treats as
/// the stream being unavailable: retried, no attempt counted, logged).
/// Up to [`window`](NatsSink::window) publishes are outstanding at once,
/// never two of one key: a row waits for the acknowledgement of the row of
/// its key before it, so a failure cannot let a later row of the key into
/// the stream ahead of it.
pub struct NatsSink {
    url: String,
    subject: SubjectFn,
    source: Option<String>,
    ack_timeout: Duration,
    window: usize,
    backoff: Backoff,
    rt: Option<tokio::runtime::Runtime>,
    link: Option<(jetstream::Context, Instant)>,
}

/// A connection idle this long is dropped and made again: nobody drove it
/// in between (the runtime runs only inside `send`), so the server may have
/// closed it as stale.
const IDLE_RECONNECT: Duration = Duration::from_secs(60);

impl NatsSink {
    /// Publishes through the server(s) at `url` (`nats://host:port`, or a
    /// comma-separated list).
    pub fn new(url: impl Into<String>) -> Self {
        NatsSink {
            url: url.into(),
            subject: Box::new(|m: &OutboxMessage| m.topic.clone()),
            source: None,
            ack_timeout: Duration::from_secs(10),
            window: 64,
            backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(5)),
            rt: None,
            link: None,
        }
    }

    /// The subject of a row is `prefix` followed by its outbox topic.
    pub fn subject_prefix(mut self, prefix: impl Into<String>) -> Self {
        let prefix = prefix.into();
        self.subject = Box::new(move |m: &OutboxMessage| format!("{prefix}{}", m.topic));
        self
    }

    /// The subject of a row is `f(row)`. A subject that cannot be published
    /// to (empty, a wildcard, a space) makes that row dead.
    pub fn subject_with(mut self, f: impl Fn(&OutboxMessage) -> String + Send + 'static) -> Self {
        self.subject = Box::new(f);
        self
    }

    /// Names this outbox in every message (`postroom-source`): the intake
    /// then uses it as the inbox message's source instead of the row's
    /// topic.
    pub fn source(mut self, name: impl Into<String>) -> Self {
        self.source = Some(name.into());
        self
    }

    /// How long the sink waits to connect and for each publish
    /// acknowledgement (10 s by default, kept within 100 ms and an hour)
    /// before it counts the server unavailable.
    pub fn ack_timeout(mut self, timeout: Duration) -> Self {
        self.ack_timeout = timeout.clamp(Duration::from_millis(100), MAX_WAIT);
        self
    }

    /// Publishes outstanding at once (64 by default, at least 1).
    pub fn window(mut self, window: usize) -> Self {
        self.window = window.max(1);
        self
    }

    /// The backoff while the server cannot be reached: from `min`, doubled
    /// per failure, up to `max` (100 ms to 5 s by default).
    pub fn backoff(mut self, min: Duration, max: Duration) -> Self {
        self.backoff = Backoff::new(min, max);
        self
    }

    /// Publishes `todo` (index, subject, headers) with their payloads from
    /// `batch`, recording the answers in `results`. An error means the
    /// server is unavailable; the rows not answered stay as they are.
    fn publish_all(
        &mut self,
        batch: &[OutboxMessage],
        todo: Vec<(usize, String, HeaderMap)>,
        results: &mut [SendResult],
    ) -> std::result::Result<(), String> {
        let Some(rt) = self.rt.as_ref() else {
            return Err("nats: no runtime".into());
        };
        if self
            .link
            .as_ref()
            .is_some_and(|(_, used)| used.elapsed() > IDLE_RECONNECT)
        {
            self.link = None;
        }
        let ack_timeout = self.ack_timeout;
        let window = self.window;
        let url = self.url.clone();
        let link = &mut self.link;
        rt.block_on(async move {
            let (js, used) = connected(link, &url, ack_timeout).await?;
            let mut flight = Flight::new(batch, results, window, ack_timeout, js.clone());
            for row in todo {
                if !flight.publish(js, row).await {
                    break;
                }
            }
            flight.drain().await;
            *used = Instant::now();
            match flight.outage {
                Some(reason) => Err(reason),
                None => Ok(()),
            }
        })
    }
}

/// The sink's JetStream context, connected first when it is not.
async fn connected<'l>(
    link: &'l mut Option<(jetstream::Context, Instant)>,
    url: &str,
    ack_timeout: Duration,
) -> std::result::Result<&'l mut (jetstream::Context, Instant), String> {
    if link.is_none() {
        let client = connect(url, ack_timeout).await?;
        let js = jetstream::ContextBuilder::new()
            .timeout(ack_timeout)
            .build(client);
        *link = Some((js, Instant::now()));
    }
    link.as_mut()
        .ok_or_else(|| "nats: no connection".to_owned())
}

/// One `send`'s publishes: those outstanding, oldest first, and what the
/// answers so far decided. Invariants: never two rows of one key
/// outstanding, never more than `window`; once `outage` is set nothing more
/// is published or waited for.
struct Flight<'b> {
    batch: &'b [OutboxMessage],
    results: &'b mut [SendResult],
    window: usize,
    ack_timeout: Duration,
    /// Published, not yet answered, in order: (index, key, ack).
    pending: VecDeque<(usize, Option<String>, PublishAckFuture)>,
    /// Outstanding publishes per key (at most one each).
    in_flight_keys: HashMap<String, usize>,
    /// Keys with a row that failed: their later rows are not published.
    failed_keys: HashSet<String>,
    /// Why the server counts as unavailable, from the first sign of it.
    outage: Option<String>,
    /// For looking up what a `duplicate` publish ack points at.
    js: jetstream::Context,
}

impl<'b> Flight<'b> {
    fn new(
        batch: &'b [OutboxMessage],
        results: &'b mut [SendResult],
        window: usize,
        ack_timeout: Duration,
        js: jetstream::Context,
    ) -> Self {
        Flight {
            js,
            batch,
            results,
            window,
            ack_timeout,
            pending: VecDeque::new(),
            in_flight_keys: HashMap::new(),
            failed_keys: HashSet::new(),
            outage: None,
        }
    }

    /// Takes the oldest publish's answer; false when none is outstanding.
    async fn answer_one(&mut self) -> bool {
        let Some((i, key, ack)) = self.pending.pop_front() else {
            return false;
        };
        if let Some(k) = &key {
            if let Some(n) = self.in_flight_keys.get_mut(k) {
                *n -= 1;
                if *n == 0 {
                    self.in_flight_keys.remove(k);
                }
            }
        }
        let result = match ack.await {
            Ok(ack) if ack.duplicate => self.check_duplicate(i, &ack).await,
            Ok(_) => SendResult::Sent,
            Err(e) => match e.kind() {
                PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe => {
                    self.outage
                        .get_or_insert_with(|| format!("nats: no publish acknowledgement: {e}"));
                    SendResult::retry("not handed over")
                }
                PublishErrorKind::StreamNotFound => {
                    let id = &self.batch[i].id;
                    self.outage.get_or_insert_with(|| {
                        format!(
                            "nats: no JetStream stream takes the subject of message {id:?} \
                             (no responders): create one (docs/SINKS.md)"
                        )
                    });
                    SendResult::retry("not handed over")
                }
                PublishErrorKind::MaxPayloadExceeded => SendResult::dead(format!("nats: {e}")),
                _ => SendResult::retry(format!("nats: the server refused it: {e}")),
            },
        };
        if result != SendResult::Sent {
            if let Some(k) = key {
                self.failed_keys.insert(k);
            }
        }
        self.results[i] = result;
        true
    }

    /// A publish ack flagged `duplicate`: the stream holds a message under
    /// row `i`'s [`MSG_ID`] already, within its duplicate window. It is this
    /// row's only if it carries the same payload; another message under the
    /// same source and id (a restored database, two devices given one
    /// source name) makes the row dead with the reason, never `Sent` for
    /// what the stream does not hold. A message gone from the stream since
    /// (its limits) cannot be compared: `Sent`, as the stream took it. A
    /// lookup that fails otherwise makes the server unavailable (retried,
    /// no attempt counted).
    async fn check_duplicate(
        &mut self,
        i: usize,
        ack: &jetstream::publish::PublishAck,
    ) -> SendResult {
        let row = &self.batch[i];
        let js = self.js.clone();
        let lookup = async {
            let stream = js
                .get_stream(&ack.stream)
                .await
                .map_err(|e| e.to_string())?;
            match stream.get_raw_message(ack.sequence).await {
                Ok(stored) => Ok(Some(stored)),
                Err(e) if e.kind() == jetstream::stream::RawMessageErrorKind::NoMessageFound => {
                    Ok(None)
                }
                Err(e) => Err(e.to_string()),
            }
        };
        match tokio::time::timeout(self.ack_timeout, lookup).await {
            Ok(Ok(Some(stored))) if stored.payload[..] == row.payload[..] => SendResult::Sent,
            Ok(Ok(Some(_))) => SendResult::dead(format!(
                "nats: the stream {} already holds another message under this row's \
                 Nats-Msg-Id (stream seq {}): same source and id, another payload (two \
                 outboxes given one source name, or a restored database?); nothing was stored",
                ack.stream, ack.sequence
            )),
            Ok(Ok(None)) => SendResult::Sent,
            Ok(Err(e)) => {
                self.outage.get_or_insert_with(|| {
                    format!("nats: looking up the message a duplicate ack points at: {e}")
                });
                SendResult::retry("not handed over")
            }
            Err(_) => {
                self.outage.get_or_insert_with(|| {
                    "nats: looking up the message a duplicate ack points at timed out".to_owned()
                });
                SendResult::retry("not handed over")
            }
        }
    }

    /// Takes answers while `more` holds and the server is not known
    /// unavailable.
    async fn answer_while(&mut self, more: impl Fn(&Self) -> bool) {
        while self.outage.is_none() && more(self) {
            if !self.answer_one().await {
                break;
            }
        }
    }

    /// Publishes one row (index, subject, headers) once the row of its key
    /// before it is answered and the window has room; false once the
    /// server is unavailable (nothing more is published).
    async fn publish(
        &mut self,
        js: &jetstream::Context,
        (i, subject, headers): (usize, String, HeaderMap),
    ) -> bool {
        if self.outage.is_some() {
            return false;
        }
        let key = self.batch[i].key.clone();
        if let Some(k) = &key {
            // Never two of one key outstanding: this row waits for the one
            // before it.
            self.answer_while(|f| f.in_flight_keys.contains_key(k))
                .await;
            if self.outage.is_some() {
                return false;
            }
            if self.failed_keys.contains(k) {
                self.results[i] = SendResult::retry("behind an earlier failure of its key");
                return true;
            }
        }
        self.answer_while(|f| f.pending.len() >= f.window).await;
        if self.outage.is_some() {
            return false;
        }
        let payload = self.batch[i].payload.clone().into();
        // Bounded: a client whose connection is down queues the publish,
        // and waits once its queue is full.
        let sent = tokio::time::timeout(
            self.ack_timeout,
            js.publish_with_headers(subject, headers, payload),
        )
        .await
        .unwrap_or_else(|_| {
            Err(jetstream::context::PublishError::new(
                PublishErrorKind::TimedOut,
            ))
        });
        match sent {
            Ok(ack) => {
                if let Some(k) = &key {
                    *self.in_flight_keys.entry(k.clone()).or_insert(0) += 1;
                }
                self.pending.push_back((i, key, ack));
            }
            Err(e) => {
                let result = match e.kind() {
                    PublishErrorKind::MaxPayloadExceeded => SendResult::dead(format!("nats: {e}")),
                    _ => {
                        self.outage
                            .get_or_insert_with(|| format!("nats: publish: {e}"));
                        SendResult::retry("not handed over")
                    }
                };
                if result != SendResult::Sent {
                    self.failed_keys.extend(key);
                }
                self.results[i] = result;
            }
        }
        true
    }

    /// Waits for the answers still outstanding. Once the server is known
    /// unavailable the rest are not waited for one by one (each could take
    /// `ack_timeout`): they stay "not handed over", unavailable, and a
    /// re-send is deduplicated.
    async fn drain(&mut self) {
        self.answer_while(|f| !f.pending.is_empty()).await;
    }
}

impl Sink for NatsSink {
    fn send(&mut self, batch: &[OutboxMessage]) -> Vec<SendResult> {
        let mut results = vec![SendResult::retry("not handed over"); batch.len()];
        if self.rt.is_none() {
            match runtime() {
                Ok(rt) => self.rt = Some(rt),
                Err(e) => {
                    let after = self.backoff.fail();
                    return vec![SendResult::unavailable(e, after); batch.len()];
                }
            }
        }
        // What the server would never take is dead before anything is
        // sent, holding nothing back.
        let mut todo = Vec::with_capacity(batch.len());
        for (i, msg) in batch.iter().enumerate() {
            let subject = (self.subject)(msg);
            let checked = match subject_problem(&subject) {
                Some(problem) => Err(problem),
                None => headers_of(msg, self.source.as_deref()),
            };
            match checked {
                Ok(headers) => todo.push((i, subject, headers)),
                Err(problem) => results[i] = SendResult::dead(problem),
            }
        }
        if todo.is_empty() {
            return results;
        }
        let indexes: Vec<usize> = todo.iter().map(|(i, _, _)| *i).collect();
        match self.publish_all(batch, todo, &mut results) {
            Ok(()) => self.backoff.reset(),
            Err(reason) => {
                log::warn!("postroom nats sink: {}; reconnecting", Esc(&reason));
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Two devices' rows with one id are two messages to the stream's
    /// duplicate window, as to the receiving inbox; a re-send of one is one.
    #[test]
    fn the_stream_dedupe_id_is_the_source_and_the_id_together() {
        let row = |topic: &str, id: &str| OutboxMessage {
            seq: 1,
            id: id.into(),
            topic: topic.into(),
            key: None,
            payload: b"x".to_vec(),
            headers: Default::default(),
            attempts: 0,
            created_at: 0,
            last_error: None,
            origin: "db-1".into(),
            unsettled_from: 1,
        };
        let a = row("readings", "reading-2024-06-01");
        assert_ne!(
            stream_dedupe_id(&a, Some("device-a")),
            stream_dedupe_id(&a, Some("device-c"))
        );
        assert_eq!(
            stream_dedupe_id(&a, Some("device-a")),
            stream_dedupe_id(&a.clone(), Some("device-a"))
        );
        // No source: the topic stands in, as at the intake.
        assert_ne!(
            stream_dedupe_id(&a, None),
            stream_dedupe_id(&row("other", "reading-2024-06-01"), None)
        );
        // The prefix keeps ("a:b", "c") and ("a", "b:c") apart.
        assert_ne!(
            stream_dedupe_id(&row("t", "c"), Some("a:b")),
            stream_dedupe_id(&row("t", "b:c"), Some("a"))
        );
    }

    #[test]
    fn subjects_are_checked_by_allowlist() {
        assert!(subject_problem("orders.eu.1").is_none());
        for bad in [
            "", "a..b", ".a", "a.", "a.*", "a.>", "a b", "a\tb", "ünï", "a\r\nb",
        ] {
            assert!(subject_problem(bad).is_some(), "{bad:?}");
        }
    }
}
