//! What `postroom status` and `postroom metrics` show: counts per consumer
//! and status, the outbox backlog, attempts, sequences, sizes, as a
//! report and as Prometheus text; and a slow handler a running engine
//! records. Invariant: every number of one report comes from one
//! snapshot, and reading it writes nothing.

use std::fmt::Write as _;
use std::path::Path;

use rusqlite::Connection;
use serde::Serialize;

use crate::error::Result;
use crate::store::inbox::Status;
use crate::store::schema;
use crate::store::stats::{self, OutboxCounts, StatusCounts};
use crate::store::strict;
use crate::store::watermark::StreamWatermark;

use super::open::now_ms;
use super::{count, snapshot, sql};

/// Rows of one attempts count, in a consumer's attempts histogram.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct AttemptsBucket {
    /// Attempts made.
    pub attempts: u32,
    /// Inbox rows (of any status) with that many attempts.
    pub rows: u64,
}

/// The inbox of one consumer, as [`status`] sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ConsumerStatus {
    /// The consumer's name.
    pub consumer: String,
    /// Rows by status: the engine's own [`StatusCounts`] (JSON: its fields
    /// inline, `"pending"`, `"processing"`, …).
    #[serde(flatten)]
    pub counts: StatusCounts,
    /// All rows.
    pub total: u64,
    /// `received_at` of the oldest message not yet done (pending,
    /// processing or failed): how far behind the consumer is.
    pub oldest_pending_ms: Option<i64>,
    /// Its age at the time of the report, in milliseconds.
    pub oldest_pending_age_ms: Option<i64>,
    /// Age of the oldest row waiting for a redelivery (`counts`'
    /// `waiting_for_redelivery`), since its last attempt, in milliseconds.
    pub oldest_waiting_for_redelivery_age_ms: Option<i64>,
    /// `processing` rows whose lease has passed: the engine's reaper (or its
    /// next open) turns them into retries.
    pub expired_leases: u64,
    /// Rows by attempts made, fewest first.
    pub attempts: Vec<AttemptsBucket>,
    /// The last engine that opened the file kept strict order for this
    /// consumer (`Builder::strict_order`): a dead letter holds its key.
    pub strict_order: bool,
    /// With strict order, ordering keys held by a dead letter (no later
    /// message of the key runs until it is redriven or discarded); 0
    /// without.
    pub held_keys: u64,
    /// Age of the oldest dead letter holding a key, since it died, in
    /// milliseconds.
    pub oldest_held_age_ms: Option<i64>,
}

/// The outbox, as [`status`] sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct OutboxStatus {
    /// Rows by status: the engine's own [`OutboxCounts`] (JSON: its fields
    /// inline, `"pending"`, `"sent"`, `"dead"`).
    #[serde(flatten)]
    pub counts: OutboxCounts,
    /// `created_at` of the oldest pending row.
    pub oldest_pending_ms: Option<i64>,
    /// Its age at the time of the report, in milliseconds.
    pub oldest_pending_age_ms: Option<i64>,
}

/// Per consumer and sequence stream: the watermark, the highest sequence
/// stored, what is listed settled above the watermark and the missing
/// ranges ([`Message::with_sequence`](crate::Message::with_sequence)), in
/// consumer and stream order. Empty for a file without sequenced messages
/// (or not yet at schema version 6). Reads at most 4096 listed sequences
/// per stream.
pub fn sequences(conn: &Connection) -> Result<Vec<StreamWatermark>> {
    crate::store::watermark::read_all(conn).map_err(sql("read sequence watermarks"))
}

/// [`sequences`] in the Prometheus text format, to append to
/// [`prometheus`]'s: `postroom_sequence_watermark`,
/// `postroom_sequence_highest`, `postroom_sequence_listed`,
/// `postroom_sequence_unrecorded` and `postroom_sequence_missing` (the
/// count of sequences in the missing ranges shown), gauges labelled
/// `consumer` and `stream`; nothing when there are no streams.
pub fn sequences_prometheus(streams: &[StreamWatermark]) -> String {
    let mut out = String::new();
    if streams.is_empty() {
        // No family at all: the output of a file without sequences is as
        // before.
        return out;
    }
    let labels = |w: &StreamWatermark| {
        format!(
            "consumer=\"{}\",stream=\"{}\"",
            label(&w.consumer),
            label(&w.stream)
        )
    };
    type Field = fn(&StreamWatermark) -> u64;
    let families: [(&str, &str, Field); 5] = [
        (
            "postroom_sequence_watermark",
            "Every sequence up to this one has settled (completed or dead).",
            |w| w.watermark,
        ),
        (
            "postroom_sequence_highest",
            "The highest sequence stored; 0 when none since a reset.",
            |w| w.highest.unwrap_or(0),
        ),
        (
            "postroom_sequence_listed",
            "Settled sequences listed above the watermark (at most 4096).",
            |w| w.listed,
        ),
        (
            "postroom_sequence_unrecorded",
            "Settled sequences past the listing bound; non-zero: reset the stream.",
            |w| w.unrecorded,
        ),
        (
            "postroom_sequence_missing",
            "Sequences up to the highest that have not settled, in the ranges shown.",
            |w| w.missing.iter().map(|&(lo, hi)| hi - lo + 1).sum(),
        ),
    ];
    for (name, help, field) in families {
        family(
            &mut out,
            name,
            "gauge",
            help,
            streams.iter().map(|w| (labels(w), field(w).to_string())),
        );
    }
    out
}

/// What is in a postroom database, from [`status`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct StatusReport {
    /// The database file.
    pub path: String,
    /// When the report was made (unix ms); ages are measured from here.
    pub now_ms: i64,
    /// The schema version stored in the file.
    pub schema_version: i64,
    /// Per consumer, in name order. Only consumers with rows appear.
    pub consumers: Vec<ConsumerStatus>,
    /// The outbox.
    pub outbox: OutboxStatus,
    /// Rows in `postroom_conflicts`: quarantined deliveries.
    pub conflicts: u64,
    /// Size of the database file, in bytes.
    pub db_bytes: u64,
    /// Size of the `-wal` file, in bytes (0 when absent).
    pub wal_bytes: u64,
    /// Per consumer and sequence stream: the watermark, the highest
    /// sequence seen and what is missing (see [`sequences`]).
    pub sequences: Vec<StreamWatermark>,
}

/// Counts by status per consumer, oldest unfinished message and attempts
/// histogram per consumer, outbox backlog and its oldest row, conflicts,
/// and file sizes. One read transaction making four passes over the inbox
/// (seconds at millions of rows), during which the checkpointer cannot
/// restart the WAL past the read.
/// `path` is the database file (for the sizes).
pub fn status(conn: &Connection, path: &Path) -> Result<StatusReport> {
    let now = now_ms();
    snapshot(conn, || {
        let version = schema::stored_version(conn)
            .map_err(sql("read schema version"))?
            .unwrap_or(0);
        let st = stats::read(conn, path)?;
        let mut consumers: Vec<ConsumerStatus> = st
            .inbox
            .iter()
            .map(|(name, c)| ConsumerStatus {
                consumer: name.clone(),
                counts: *c,
                total: c.total(),
                oldest_pending_ms: None,
                oldest_pending_age_ms: None,
                oldest_waiting_for_redelivery_age_ms: c
                    .oldest_waiting_for_redelivery_ms
                    .map(|at| now.saturating_sub(at).max(0)),
                expired_leases: 0,
                attempts: Vec::new(),
                strict_order: false,
                held_keys: 0,
                oldest_held_age_ms: None,
            })
            .collect();
        let find = |consumers: &[ConsumerStatus], name: &str| {
            consumers.iter().position(|c| c.consumer == name)
        };

        let oldest = stats::oldest_unfinished(conn).map_err(sql("read oldest pending"))?;
        for (name, oldest) in oldest {
            if let Some(i) = find(&consumers, &name) {
                consumers[i].oldest_pending_ms = Some(oldest);
                consumers[i].oldest_pending_age_ms = Some(now.saturating_sub(oldest).max(0));
            }
        }
        let expired = stats::expired_leases(conn, now).map_err(sql("read leases"))?;
        for (name, n) in expired {
            if let Some(i) = find(&consumers, &name) {
                consumers[i].expired_leases = count(n);
            }
        }
        let strict = strict::recorded(conn).map_err(sql("read strict-order consumers"))?;
        for c in consumers
            .iter_mut()
            .filter(|c| strict.contains(&c.consumer))
        {
            let held = strict::held(conn, &c.consumer).map_err(sql("read held keys"))?;
            c.strict_order = true;
            c.held_keys = held.keys;
            c.oldest_held_age_ms = held.oldest_dead_ms.map(|at| now.saturating_sub(at).max(0));
        }
        let buckets = stats::attempts(conn).map_err(sql("read attempts"))?;
        for (name, attempts, n) in buckets {
            if let Some(i) = find(&consumers, &name) {
                consumers[i].attempts.push(AttemptsBucket {
                    attempts,
                    rows: count(n),
                });
            }
        }

        Ok(StatusReport {
            path: path.display().to_string(),
            now_ms: now,
            schema_version: version,
            consumers,
            outbox: OutboxStatus {
                counts: st.outbox,
                oldest_pending_ms: st.oldest_pending_outbox_ms,
                oldest_pending_age_ms: st
                    .oldest_pending_outbox_ms
                    .map(|t| now.saturating_sub(t).max(0)),
            },
            conflicts: st.conflicts,
            sequences: st.sequences,
            db_bytes: st.db_bytes,
            wal_bytes: st.wal_bytes,
        })
    })
}

// ---------------------------------------------------------------- metrics

fn label(value: &str) -> String {
    let mut s = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

fn seconds(ms: Option<i64>) -> String {
    let ms = ms.unwrap_or(0).max(0);
    format!("{}.{:03}", ms / 1000, ms % 1000)
}

/// The numbers of a [`StatusReport`] in the Prometheus text exposition
/// format (version 0.0.4), each family with `# HELP` and `# TYPE` lines:
///
/// | metric | labels | type |
/// |---|---|---|
/// | `postroom_inbox_messages` | `consumer`, `status` | gauge |
/// | `postroom_oldest_pending_seconds` | `consumer` | gauge (0 when nothing waits) |
/// | `postroom_expired_leases` | `consumer` | gauge |
/// | `postroom_strict_held_keys`, `postroom_strict_oldest_held_seconds` | `consumer` | gauge (strict-order consumers only; absent when there are none) |
/// | `postroom_inbox_attempts` | `consumer`, `attempts` | gauge (rows per attempts count) |
/// | `postroom_outbox_messages` | `status` | gauge |
/// | `postroom_outbox_oldest_pending_seconds` | | gauge |
/// | `postroom_conflicts` | | gauge (rows; `conflict_retention`, `conflicts discard` and `cleanup` delete them) |
/// | `postroom_db_bytes`, `postroom_wal_bytes` | | gauge |
/// | `postroom_schema_version` | | gauge |
pub fn prometheus(report: &StatusReport) -> String {
    let mut out = String::new();
    consumer_families(&mut out, report);
    outbox_and_file_families(&mut out, report);
    out
}

/// The families labelled by consumer.
fn consumer_families(out: &mut String, report: &StatusReport) {
    let consumer = |c: &ConsumerStatus| format!("consumer=\"{}\"", label(&c.consumer));
    family(
        out,
        "postroom_inbox_messages",
        "gauge",
        "Inbox rows by consumer and status.",
        report.consumers.iter().flat_map(|c| {
            Status::ALL.into_iter().map(move |s| {
                (
                    format!("{},status=\"{s}\"", consumer(c)),
                    c.counts.get(s).to_string(),
                )
            })
        }),
    );
    family(
        out,
        "postroom_oldest_pending_seconds",
        "gauge",
        "Age of the oldest inbox message not yet done (pending, processing or failed); 0 when none.",
        report
            .consumers
            .iter()
            .map(|c| (consumer(c), seconds(c.oldest_pending_age_ms))),
    );
    family(
        out,
        "postroom_waiting_for_redelivery",
        "gauge",
        "Failed inbox rows no worker retries (delivered inline, or counted by crash recovery \
         before their receipt committed): only their sender's redelivery revives them.",
        report
            .consumers
            .iter()
            .map(|c| (consumer(c), c.counts.waiting_for_redelivery.to_string())),
    );
    family(
        out,
        "postroom_oldest_waiting_for_redelivery_seconds",
        "gauge",
        "Age of the oldest row waiting for a redelivery, since its last attempt; 0 when none.",
        report
            .consumers
            .iter()
            .map(|c| (consumer(c), seconds(c.oldest_waiting_for_redelivery_age_ms))),
    );
    // Strict order: only when some consumer keeps it (a file without one
    // reads as before).
    let strict: Vec<&ConsumerStatus> = report.consumers.iter().filter(|c| c.strict_order).collect();
    if !strict.is_empty() {
        family(
            out,
            "postroom_strict_held_keys",
            "gauge",
            "Strict order: ordering keys a dead letter holds (nothing later of the key runs until \
             it is redriven or discarded).",
            strict
                .iter()
                .map(|c| (consumer(c), c.held_keys.to_string())),
        );
        family(
            out,
            "postroom_strict_oldest_held_seconds",
            "gauge",
            "Strict order: age of the oldest dead letter holding a key, since it died; 0 when none.",
            strict.iter().map(|c| (consumer(c), seconds(c.oldest_held_age_ms))),
        );
    }
    family(
        out,
        "postroom_expired_leases",
        "gauge",
        "Processing inbox rows whose lease has passed (recovered by the reaper or at next open).",
        report
            .consumers
            .iter()
            .map(|c| (consumer(c), c.expired_leases.to_string())),
    );
    family(
        out,
        "postroom_inbox_attempts",
        "gauge",
        "Inbox rows by consumer and number of attempts made.",
        report.consumers.iter().flat_map(|c| {
            c.attempts.iter().map(move |b| {
                (
                    format!("{},attempts=\"{}\"", consumer(c), b.attempts),
                    b.rows.to_string(),
                )
            })
        }),
    );
}

/// The outbox's families and the file's scalars.
fn outbox_and_file_families(out: &mut String, report: &StatusReport) {
    family(
        out,
        "postroom_outbox_messages",
        "gauge",
        "Outbox rows by status.",
        [
            ("pending", report.outbox.counts.pending),
            ("sent", report.outbox.counts.sent),
            ("dead", report.outbox.counts.dead),
        ]
        .into_iter()
        .map(|(s, n)| (format!("status=\"{s}\""), n.to_string())),
    );
    let scalars: [(&str, &str, &str, String); 5] = [
        (
            "postroom_outbox_oldest_pending_seconds",
            "gauge",
            "Age of the oldest pending outbox row; 0 when none.",
            seconds(report.outbox.oldest_pending_age_ms),
        ),
        (
            "postroom_conflicts",
            "gauge",
            "Quarantined deliveries (same id, different payload) in postroom_conflicts.",
            report.conflicts.to_string(),
        ),
        (
            "postroom_db_bytes",
            "gauge",
            "Size of the database file in bytes.",
            report.db_bytes.to_string(),
        ),
        (
            "postroom_wal_bytes",
            "gauge",
            "Size of the write-ahead log file in bytes.",
            report.wal_bytes.to_string(),
        ),
        (
            "postroom_schema_version",
            "gauge",
            "Schema version stored in the database.",
            report.schema_version.to_string(),
        ),
    ];
    for (name, kind, help, value) in scalars {
        family(out, name, kind, help, [(String::new(), value)]);
    }
}

/// One metric family: HELP, TYPE, then a sample per `(labels, value)`,
/// `labels` without braces (empty for none).
fn family(
    out: &mut String,
    name: &str,
    kind: &str,
    help: &str,
    samples: impl IntoIterator<Item = (String, String)>,
) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    for (labels, value) in samples {
        if labels.is_empty() {
            let _ = writeln!(out, "{name} {value}");
        } else {
            let _ = writeln!(out, "{name}{{{labels}}} {value}");
        }
    }
}

/// A handler that has held a running engine's writer longer than its
/// `slow_handler` threshold: every write of that engine waits for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct SlowHandler {
    /// Its consumer.
    pub consumer: String,
    /// The message it handles (a very long id is cut).
    pub message_id: String,
    /// When it started (unix ms).
    pub since_ms: i64,
}

/// The slow handler that the engine running on the database at `path`
/// records in its engine file, if any. `None` also when no engine runs
/// (a record left by a process that died is stale; its next open clears
/// it) or the record cannot be read.
pub fn slow_handler(path: &Path) -> Option<SlowHandler> {
    let path = schema::resolve(path).ok()?;
    let running = crate::platform::engine_running(&path, &crate::store::beside(&path, "-postroom"));
    if running == Some(false) {
        return None;
    }
    let slow = crate::store::inflight::read_slow_handler(&path).ok()??;
    Some(SlowHandler {
        consumer: slow.consumer,
        message_id: slow.message_id,
        since_ms: slow.since_ms,
    })
}
