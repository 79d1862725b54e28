//! Operator functions over a plain [`rusqlite::Connection`]: what the
//! `postroom` command-line tool does, for your own tooling too.
//!
//! These work on a database **while an application has it open**: they
//! never open a [`Postroom`](crate::Postroom) engine and never touch the
//! engine's lock file (`<db>-postroom`). [`open`] gives a connection of
//! their own with a busy timeout; read functions only read (open with
//! `writable = false` for a `query_only` connection), and each mutation runs
//! in its own short `BEGIN IMMEDIATE` transaction, so it waits for — and is
//! serialized with — the running engine's writer.
//!
//! ```
//! # fn main() -> postroom::Result<()> {
//! # let dir = tempfile::tempdir().unwrap();
//! # let path = dir.path().join("app.db");
//! # postroom::Postroom::builder().open(&path)?.shutdown(std::time::Duration::from_secs(5))?;
//! use postroom::admin;
//!
//! let conn = admin::open(&path, false)?;          // read-only
//! let status = admin::status(&conn, &path)?;
//! assert_eq!(status.conflicts, 0);
//! print!("{}", admin::prometheus(&status));
//!
//! let report = admin::check(&conn, false)?;
//! assert!(report.is_ok());
//! # Ok(()) }
//! ```
//!
//! Times are unix milliseconds, as stored. Names and ids are always bound
//! as SQL parameters.

use std::fmt::{self, Write as _};
use std::io;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rusqlite::{
    params, Connection, ErrorCode, OpenFlags, OptionalExtension, Transaction, TransactionBehavior,
};
use serde::ser::SerializeStruct;
use serde::{Serialize, Serializer};

use crate::clock;
use crate::error::{Error, Result};
use crate::inbox::{self, Status};
use crate::message::Headers;
use crate::outbox::{self, OutboxMessage};
use crate::queue::{self, DeadLetter};
use crate::retired;
use crate::schema;
use crate::stats;
use crate::watermark::StreamWatermark;

/// How long [`open`] waits for another connection's lock (the engine's
/// writer) before a statement fails with [`Error::Busy`].
pub const DEFAULT_BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// Rows deleted per transaction by [`cleanup`] (as the engine's retention).
pub const CLEANUP_BATCH: usize = 256;

/// The engine's default retention, 7 days: the dedupe horizon.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// At most this many findings of each kind (violations, warnings) are kept
/// in a [`CheckReport`]; the totals count all of them.
pub const MAX_FINDINGS: usize = 100;

/// The tables postroom's schema creates; a file without all of them is not
/// a postroom database.
const TABLES: [&str; 6] = [
    "postroom_meta",
    "postroom_inbox",
    "postroom_inbox_keys",
    "postroom_retired_keys",
    "postroom_outbox",
    "postroom_conflicts",
];

/// The wall clock in unix milliseconds, as the engine's `SystemClock`.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(clock::millis)
        .unwrap_or(0)
}

/// Opens an existing postroom database for operator work, with
/// [`DEFAULT_BUSY_TIMEOUT`]. See [`open_with_timeout`].
pub fn open(path: impl AsRef<Path>, writable: bool) -> Result<Connection> {
    open_with_timeout(path, writable, DEFAULT_BUSY_TIMEOUT)
}

/// Opens an existing postroom database for operator work: never creates a
/// file, never changes the journal mode, never takes the engine's lock.
///
/// With `writable = false` the connection is `query_only`: any write
/// through it fails. Refuses, changing nothing:
/// * a `busy_timeout` over 2,147,483,647 ms: [`Error::InvalidInput`] with
///   field `"busy_timeout"`;
/// * a missing path: [`Error::Io`] with [`io::ErrorKind::NotFound`];
/// * a path that is not a regular file, or a SQLite database without
///   postroom's tables: [`Error::InvalidInput`] with field `"database"`;
/// * a file that is not SQLite: [`Error::NotADatabase`];
/// * a schema newer than this library's: [`Error::SchemaTooNew`];
/// * an older or unknown schema version (the engine migrates on open; this
///   does not): [`Error::InvalidInput`] with field `"database"`.
pub fn open_with_timeout(
    path: impl AsRef<Path>,
    writable: bool,
    busy_timeout: Duration,
) -> Result<Connection> {
    let path = path.as_ref();
    // SQLite counts it in milliseconds, in a C int.
    if busy_timeout > Duration::from_millis(i32::MAX as u64) {
        return Err(Error::invalid(
            "busy_timeout",
            format!("{busy_timeout:?} is too large: must be at most 2147483647 ms"),
        ));
    }
    let meta = std::fs::metadata(path).map_err(|e| {
        if e.kind() == io::ErrorKind::NotFound {
            Error::Io {
                op: "open database",
                source: io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("{} does not exist", path.display()),
                ),
            }
        } else {
            Error::io("open database", e)
        }
    })?;
    if !meta.is_file() {
        return Err(Error::invalid(
            "database",
            format!("{} is not a regular file", path.display()),
        ));
    }
    // READ_WRITE without CREATE: an existing file only. SQLite falls back
    // to read-only by itself when the file is write-protected; read
    // commands still need the `-shm` file of a WAL database.
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(path, flags)
        .map_err(|e| schema::open_error(path, "open database", e))?;
    conn.busy_timeout(busy_timeout)
        .map_err(|e| schema::open_error(path, "set busy_timeout", e))?;
    if !writable {
        conn.pragma_update(None, "query_only", true)
            .map_err(|e| schema::open_error(path, "set query_only", e))?;
    }
    let version =
        schema::stored_version(&conn).map_err(|e| schema::open_error(path, "read schema", e))?;
    match version {
        None => {
            return Err(Error::invalid(
                "database",
                format!(
                    "{} is not a postroom database (it has no postroom_meta table)",
                    path.display()
                ),
            ))
        }
        Some(found) => schema::check_version(found)?,
    }
    let mut missing = Vec::new();
    for table in TABLES {
        let found: bool = conn
            .query_row(
                "SELECT count(*) > 0 FROM sqlite_master WHERE type = 'table' AND name = ?1",
                [table],
                |r| r.get(0),
            )
            .map_err(|e| schema::open_error(path, "read schema", e))?;
        if !found {
            missing.push(table);
        }
    }
    if !missing.is_empty() {
        return Err(Error::invalid(
            "database",
            format!(
                "{} is not a complete postroom database: missing {}",
                path.display(),
                missing.join(", ")
            ),
        ));
    }
    Ok(conn)
}

/// Runs `f` in one read transaction (one snapshot) unless the caller
/// already has a transaction open.
fn snapshot<T>(conn: &Connection, f: impl FnOnce() -> Result<T>) -> Result<T> {
    if !conn.is_autocommit() {
        return f();
    }
    let tx = Transaction::new_unchecked(conn, TransactionBehavior::Deferred)
        .map_err(|e| Error::sqlite("begin read transaction", e))?;
    let out = f()?;
    // Ending a read transaction cannot lose anything; a failure to end it
    // is still reported.
    tx.commit()
        .map_err(|e| Error::sqlite("end read transaction", e))?;
    Ok(out)
}

/// How often a mutation tries again for the write lock while another
/// writer holds it. SQLite's own busy handler backs off to 100 ms between
/// tries, and an engine that commits back to back leaves the lock free only
/// for moments in between: against one thread delivering in a loop (debug
/// build), `BEGIN IMMEDIATE` waited up to 3.3 s of its 5 s that way, and at
/// most 50 ms trying every millisecond.
const WRITE_LOCK_RETRY: Duration = Duration::from_millis(1);

/// Runs `f` in its own `BEGIN IMMEDIATE` transaction: it waits (up to the
/// busy timeout, trying every [`WRITE_LOCK_RETRY`]) for the engine's
/// writer, then holds the write lock only for `f`. Rolled back when `f`
/// fails.
fn write<T>(
    conn: &Connection,
    op: &'static str,
    f: impl FnOnce(&Connection) -> rusqlite::Result<T>,
) -> Result<T> {
    let tx = begin_immediate(conn).map_err(|e| Error::sqlite(op, e))?;
    let out = f(&tx).map_err(|e| Error::sqlite(op, e))?;
    tx.commit().map_err(|e| Error::sqlite(op, e))?;
    Ok(out)
}

/// `BEGIN IMMEDIATE`, tried every [`WRITE_LOCK_RETRY`] until the
/// connection's busy timeout has passed; the timeout is set back after. A
/// connection without one (none set, or a busy handler of the caller's
/// own, which reads as 0) is left as it is: one try, through its handler.
fn begin_immediate(conn: &Connection) -> rusqlite::Result<Transaction<'_>> {
    let timeout_ms: i64 = conn.pragma_query_value(None, "busy_timeout", |r| r.get(0))?;
    let timeout = Duration::from_millis(u64::try_from(timeout_ms).unwrap_or(0));
    if timeout.is_zero() {
        return Transaction::new_unchecked(conn, TransactionBehavior::Immediate);
    }
    let deadline = Instant::now() + timeout;
    conn.busy_timeout(Duration::ZERO)?;
    let begun = loop {
        match Transaction::new_unchecked(conn, TransactionBehavior::Immediate) {
            Err(e)
                if e.sqlite_error_code() == Some(ErrorCode::DatabaseBusy)
                    && Instant::now() < deadline =>
            {
                std::thread::sleep(WRITE_LOCK_RETRY)
            }
            begun => break begun,
        }
    };
    conn.busy_timeout(timeout)?;
    begun
}

fn sql(op: &'static str) -> impl Fn(rusqlite::Error) -> Error {
    move |e| Error::sqlite(op, e)
}

fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

fn limit_param(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}

fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

fn parse_headers(text: Option<&str>) -> Headers {
    text.and_then(|t| serde_json::from_str(t).ok())
        .unwrap_or_default()
}

fn serialize_status<S: Serializer>(status: &Status, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(status.as_str())
}

// ---------------------------------------------------------------- status

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
    /// Rows stored, waiting for a worker.
    pub pending: u64,
    /// Rows claimed by a worker.
    pub processing: u64,
    /// Rows done (until retention deletes them).
    pub completed: u64,
    /// Rows waiting for a retry.
    pub failed: u64,
    /// Dead letters.
    pub dead: u64,
    /// All rows.
    pub total: u64,
    /// `received_at` of the oldest message not yet done (pending,
    /// processing or failed): how far behind the consumer is.
    pub oldest_pending_ms: Option<i64>,
    /// Its age at the time of the report, in milliseconds.
    pub oldest_pending_age_ms: Option<i64>,
    /// `processing` rows whose lease has passed: the engine's reaper (or its
    /// next open) turns them into retries.
    pub expired_leases: u64,
    /// Rows by attempts made, fewest first.
    pub attempts: Vec<AttemptsBucket>,
}

impl ConsumerStatus {
    /// The count for one status.
    pub fn get(&self, status: Status) -> u64 {
        match status {
            Status::Pending => self.pending,
            Status::Processing => self.processing,
            Status::Completed => self.completed,
            Status::Failed => self.failed,
            Status::Dead => self.dead,
        }
    }
}

/// The outbox, as [`status`] sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct OutboxStatus {
    /// Rows not yet handed to the sink: the relay's backlog.
    pub pending: u64,
    /// Rows handed over, or discarded by an operator (`last_error` says
    /// so), until retention deletes them.
    pub sent: u64,
    /// Rows the relay gave up on.
    pub dead: u64,
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
    crate::watermark::read_all(conn).map_err(sql("read sequence watermarks"))
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
}

/// Counts by status per consumer, oldest unfinished message and attempts
/// histogram per consumer, outbox backlog and its oldest row, conflicts,
/// and file sizes. One read transaction making four passes over the inbox:
/// 0.76 s at a million rows, 4.2 s at five million (page cache warm, 2-core
/// VM), during which the checkpointer cannot restart the WAL past the read.
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
                pending: c.pending,
                processing: c.processing,
                completed: c.completed,
                failed: c.failed,
                dead: c.dead,
                total: c.total(),
                oldest_pending_ms: None,
                oldest_pending_age_ms: None,
                expired_leases: 0,
                attempts: Vec::new(),
            })
            .collect();
        let find = |consumers: &[ConsumerStatus], name: &str| {
            consumers.iter().position(|c| c.consumer == name)
        };

        let mut stmt = conn
            .prepare(
                "SELECT consumer, min(received_at) FROM postroom_inbox
                 WHERE status IN ('pending', 'processing', 'failed') GROUP BY consumer",
            )
            .map_err(sql("read oldest pending"))?;
        let rows = stmt
            .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))
            .map_err(sql("read oldest pending"))?;
        for row in rows {
            let (name, oldest) = row.map_err(sql("read oldest pending"))?;
            if let Some(i) = find(&consumers, &name) {
                consumers[i].oldest_pending_ms = Some(oldest);
                consumers[i].oldest_pending_age_ms = Some(now.saturating_sub(oldest).max(0));
            }
        }

        let mut stmt = conn
            .prepare(
                "SELECT consumer, count(*) FROM postroom_inbox
                 WHERE status = 'processing' AND (lease_until IS NULL OR lease_until < ?1)
                 GROUP BY consumer",
            )
            .map_err(sql("read leases"))?;
        let rows = stmt
            .query_map([now], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))
            .map_err(sql("read leases"))?;
        for row in rows {
            let (name, n) = row.map_err(sql("read leases"))?;
            if let Some(i) = find(&consumers, &name) {
                consumers[i].expired_leases = count(n);
            }
        }

        let mut stmt = conn
            .prepare(
                "SELECT consumer, attempts, count(*) FROM postroom_inbox
                 GROUP BY consumer, attempts ORDER BY consumer, attempts",
            )
            .map_err(sql("read attempts"))?;
        let rows = stmt
            .query_map([], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, u32>(1)?,
                    r.get::<_, i64>(2)?,
                ))
            })
            .map_err(sql("read attempts"))?;
        for row in rows {
            let (name, attempts, n) = row.map_err(sql("read attempts"))?;
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
                pending: st.outbox.pending,
                sent: st.outbox.sent,
                dead: st.outbox.dead,
                oldest_pending_ms: st.oldest_pending_outbox_ms,
                oldest_pending_age_ms: st
                    .oldest_pending_outbox_ms
                    .map(|t| now.saturating_sub(t).max(0)),
            },
            conflicts: st.conflicts,
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
/// | `postroom_inbox_attempts` | `consumer`, `attempts` | gauge (rows per attempts count) |
/// | `postroom_outbox_messages` | `status` | gauge |
/// | `postroom_outbox_oldest_pending_seconds` | | gauge |
/// | `postroom_conflicts` | | gauge (rows; `conflict_retention`, `conflicts discard` and `cleanup` delete them) |
/// | `postroom_db_bytes`, `postroom_wal_bytes` | | gauge |
/// | `postroom_schema_version` | | gauge |
pub fn prometheus(report: &StatusReport) -> String {
    let mut out = String::new();
    let consumer = |c: &ConsumerStatus| format!("consumer=\"{}\"", label(&c.consumer));
    family(
        &mut out,
        "postroom_inbox_messages",
        "gauge",
        "Inbox rows by consumer and status.",
        report.consumers.iter().flat_map(|c| {
            Status::ALL.into_iter().map(move |s| {
                (
                    format!("{},status=\"{s}\"", consumer(c)),
                    c.get(s).to_string(),
                )
            })
        }),
    );
    family(
        &mut out,
        "postroom_oldest_pending_seconds",
        "gauge",
        "Age of the oldest inbox message not yet done (pending, processing or failed); 0 when none.",
        report
            .consumers
            .iter()
            .map(|c| (consumer(c), seconds(c.oldest_pending_age_ms))),
    );
    family(
        &mut out,
        "postroom_expired_leases",
        "gauge",
        "Processing inbox rows whose lease has passed (recovered by the reaper or at next open).",
        report
            .consumers
            .iter()
            .map(|c| (consumer(c), c.expired_leases.to_string())),
    );
    family(
        &mut out,
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
    family(
        &mut out,
        "postroom_outbox_messages",
        "gauge",
        "Outbox rows by status.",
        [
            ("pending", report.outbox.pending),
            ("sent", report.outbox.sent),
            ("dead", report.outbox.dead),
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
        family(&mut out, name, kind, help, [(String::new(), value)]);
    }
    out
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

// ---------------------------------------------------------------- payloads

/// A stored payload. Serializes (JSON) as
/// `{"bytes": n, "encoding": "json" | "text" | "hex", "value": …}`: the
/// payload itself when it is JSON, a string when it is UTF-8 text, else its
/// bytes in hex.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payload(pub Vec<u8>);

/// How a [`Payload`] is shown.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Decoded {
    /// The payload parses as JSON.
    Json(serde_json::Value),
    /// Not JSON, but valid UTF-8.
    Text(String),
    /// Neither: lowercase hex digits.
    Hex(String),
}

impl Payload {
    /// The raw bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// JSON if it parses, else UTF-8 text, else hex.
    pub fn decode(&self) -> Decoded {
        if let Ok(value) = serde_json::from_slice::<serde_json::Value>(&self.0) {
            Decoded::Json(value)
        } else if let Ok(text) = std::str::from_utf8(&self.0) {
            Decoded::Text(text.to_owned())
        } else {
            Decoded::Hex(hex(&self.0))
        }
    }

    /// For people: pretty-printed JSON, or the text, or a hex dump (offset,
    /// 16 bytes in hex, and their printable ASCII).
    pub fn pretty(&self) -> String {
        match self.decode() {
            Decoded::Json(v) => serde_json::to_string_pretty(&v).unwrap_or_default(),
            Decoded::Text(t) => t,
            Decoded::Hex(_) => {
                let mut s = String::new();
                for (n, chunk) in self.0.chunks(16).enumerate() {
                    let _ = write!(s, "{:08x}  ", n * 16);
                    for i in 0..16 {
                        match chunk.get(i) {
                            Some(b) => {
                                let _ = write!(s, "{b:02x} ");
                            }
                            None => s.push_str("   "),
                        }
                    }
                    s.push(' ');
                    for &b in chunk {
                        s.push(if b.is_ascii_graphic() || b == b' ' {
                            char::from(b)
                        } else {
                            '.'
                        });
                    }
                    s.push('\n');
                }
                s
            }
        }
    }
}

impl Serialize for Payload {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("Payload", 3)?;
        st.serialize_field("bytes", &self.0.len())?;
        match self.decode() {
            Decoded::Json(v) => {
                st.serialize_field("encoding", "json")?;
                st.serialize_field("value", &v)?;
            }
            Decoded::Text(t) => {
                st.serialize_field("encoding", "text")?;
                st.serialize_field("value", &t)?;
            }
            Decoded::Hex(h) => {
                st.serialize_field("encoding", "hex")?;
                st.serialize_field("value", &h)?;
            }
        }
        st.end()
    }
}

// ---------------------------------------------------------------- inbox

/// Which inbox rows [`inbox_list`] returns. Every filter is optional;
/// `limit` defaults to 100.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxFilter {
    /// Only this consumer's rows.
    pub consumer: Option<String>,
    /// Only rows in this status.
    pub status: Option<Status>,
    /// Only rows from this source.
    pub source: Option<String>,
    /// Only rows received at or after this time (unix ms).
    pub since_ms: Option<i64>,
    /// Only rows received before this time (unix ms).
    pub until_ms: Option<i64>,
    /// At most this many rows.
    pub limit: usize,
}

impl Default for InboxFilter {
    fn default() -> Self {
        InboxFilter {
            consumer: None,
            status: None,
            source: None,
            since_ms: None,
            until_ms: None,
            limit: 100,
        }
    }
}

/// An inbox row without its payload, as [`inbox_list`] returns it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct InboxEntry {
    /// Row id: what `inbox show`, `redrive` and `discard` take.
    pub id: i64,
    /// The consumer it was delivered to.
    pub consumer: String,
    /// The stream it came from.
    pub source: String,
    /// The message id.
    pub message_id: String,
    /// Its state.
    #[serde(serialize_with = "serialize_status")]
    pub status: Status,
    /// Attempts made.
    pub attempts: u32,
    /// Its ordering key, if any.
    pub ordering_key: Option<String>,
    /// Stored payload size; `None` when the payload was not kept.
    pub payload_bytes: Option<u64>,
    /// The last failure (or the discard note).
    pub last_error: Option<String>,
    /// When it was first received (unix ms).
    pub received_at: i64,
    /// When the row last changed (unix ms).
    pub updated_at: i64,
    /// When a pending or failed row is next due: a time while it waits out
    /// a backoff, `None` when it is due at once (and for finished rows).
    pub next_attempt_at: Option<i64>,
    /// When it completed, if it did.
    pub processed_at: Option<i64>,
}

const ENTRY_COLUMNS: &str = "id, consumer, source, message_id, status, attempts, ordering_key,
     length(payload), last_error, received_at, updated_at, next_attempt_at, processed_at";

fn entry_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<InboxEntry> {
    // Lossy: a row whose text does not decode is shown, not an error.
    let text = |idx| inbox::lossy_text(r, idx).map(Option::unwrap_or_default);
    Ok(InboxEntry {
        id: r.get(0)?,
        consumer: text(1)?,
        source: text(2)?,
        message_id: text(3)?,
        status: r.get(4)?,
        attempts: r.get(5)?,
        ordering_key: inbox::lossy_text(r, 6)?,
        payload_bytes: r.get::<_, Option<i64>>(7)?.map(count),
        last_error: r.get(8)?,
        received_at: r.get(9)?,
        updated_at: r.get(10)?,
        next_attempt_at: r.get(11)?,
        processed_at: r.get(12)?,
    })
}

/// Inbox rows matching `filter`, in receive order (row id).
pub fn inbox_list(conn: &Connection, filter: &InboxFilter) -> Result<Vec<InboxEntry>> {
    let mut stmt = conn
        .prepare(&format!(
            "SELECT {ENTRY_COLUMNS} FROM postroom_inbox
             WHERE (?1 IS NULL OR consumer = ?1) AND (?2 IS NULL OR status = ?2)
               AND (?3 IS NULL OR source = ?3) AND (?4 IS NULL OR received_at >= ?4)
               AND (?5 IS NULL OR received_at < ?5)
             ORDER BY id LIMIT ?6"
        ))
        .map_err(sql("list inbox"))?;
    let rows = stmt
        .query_map(
            params![
                filter.consumer,
                filter.status,
                filter.source,
                filter.since_ms,
                filter.until_ms,
                limit_param(filter.limit),
            ],
            entry_from_row,
        )
        .map_err(sql("list inbox"))?;
    rows.collect::<rusqlite::Result<_>>()
        .map_err(sql("list inbox"))
}

/// One inbox row in full, from [`inbox_show`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct InboxDetail {
    /// Everything [`inbox_list`] shows.
    #[serde(flatten)]
    pub entry: InboxEntry,
    /// The payload, when kept (failed and dead rows always keep theirs).
    pub payload: Option<Payload>,
    /// blake3 digest of the first payload accepted under this key, in hex.
    pub payload_hash: String,
    /// Whether the stored payload still matches `payload_hash` (`None`
    /// when no payload is kept).
    pub payload_hash_ok: Option<bool>,
    /// The message's headers.
    pub headers: Headers,
    /// Lease end (processing rows), unix ms.
    pub lease_until: Option<i64>,
    /// Lease token (processing rows).
    pub lease_token: Option<i64>,
    /// `seq` of the outbox rows its handler published (while kept).
    pub caused_outbox: Vec<i64>,
}

/// The inbox row with this id, in full; `None` when there is none.
pub fn inbox_show(conn: &Connection, id: i64) -> Result<Option<InboxDetail>> {
    snapshot(conn, || {
        let found = conn
            .query_row(
                &format!(
                    "SELECT {ENTRY_COLUMNS}, payload, payload_hash, headers, lease_until,
                            lease_token
                     FROM postroom_inbox WHERE id = ?1"
                ),
                [id],
                |r| {
                    let payload: Option<Vec<u8>> = r.get(13)?;
                    let hash: Vec<u8> = r.get(14)?;
                    let headers: Option<String> = r.get(15)?;
                    let payload_hash_ok = payload
                        .as_ref()
                        .map(|p| blake3::hash(p).as_bytes().as_slice() == hash.as_slice());
                    Ok(InboxDetail {
                        entry: entry_from_row(r)?,
                        payload: payload.map(Payload),
                        payload_hash: hex(&hash),
                        payload_hash_ok,
                        headers: parse_headers(headers.as_deref()),
                        lease_until: r.get(16)?,
                        lease_token: r.get(17)?,
                        caused_outbox: Vec::new(),
                    })
                },
            )
            .optional()
            .map_err(sql("show inbox row"))?;
        let Some(mut detail) = found else {
            return Ok(None);
        };
        let mut stmt = conn
            .prepare(
                "SELECT seq FROM postroom_outbox
                 WHERE cause_consumer = ?1 AND cause_source = ?2 AND cause_message_id = ?3
                 ORDER BY seq",
            )
            .map_err(sql("show inbox row"))?;
        detail.caused_outbox = stmt
            .query_map(
                params![
                    detail.entry.consumer,
                    detail.entry.source,
                    detail.entry.message_id
                ],
                |r| r.get(0),
            )
            .and_then(|rows| rows.collect())
            .map_err(sql("show inbox row"))?;
        Ok(Some(detail))
    })
}

// ---------------------------------------------------------------- dead letters

/// Dead inbox messages, oldest first, of one consumer or all, at most
/// `limit`, with payloads (as [`Postroom::dead_letters`](crate::Postroom::dead_letters)).
pub fn dead_letters(
    conn: &Connection,
    consumer: Option<&str>,
    limit: usize,
) -> Result<Vec<DeadLetter>> {
    queue::dead_letters(conn, consumer, limit).map_err(sql("list dead letters"))
}

/// Dead outbox messages, oldest first, at most `limit` (as
/// [`Postroom::outbox_dead_letters`](crate::Postroom::outbox_dead_letters)).
pub fn outbox_dead_letters(conn: &Connection, limit: usize) -> Result<Vec<OutboxMessage>> {
    outbox::dead_letters(conn, limit).map_err(sql("list outbox dead letters"))
}

/// Sends the dead letter with row id `id` back to `pending`, attempts
/// reset, due at once whatever the engine's clock reads (`now_ms` stamps
/// `updated_at`): a running engine's workers pick it up at their next
/// poll. Returns false (changing nothing) when `id` is not a dead
/// letter. One `BEGIN IMMEDIATE` transaction.
pub fn redrive(conn: &Connection, id: i64, now_ms: i64) -> Result<bool> {
    write(conn, "redrive", |c| queue::redrive(c, id, now_ms))
}

/// Gives up on the dead letter with row id `id` for good: it becomes
/// `completed` without its effects (payload dropped, reason kept), so a
/// redelivery is a duplicate. Returns false (changing nothing) when `id` is
/// not a dead letter. One `BEGIN IMMEDIATE` transaction.
pub fn discard(conn: &Connection, id: i64, now_ms: i64) -> Result<bool> {
    write(conn, "discard", |c| queue::discard(c, id, now_ms))
}

/// Sends the dead outbox row `seq` back to the relay, attempts reset, due
/// at once whatever the engine's clock reads. Returns false (changing
/// nothing) when it is not a dead outbox row.
pub fn redrive_outbox(conn: &Connection, seq: i64) -> Result<bool> {
    write(conn, "redrive outbox row", |c| outbox::redrive(c, seq))
}

/// Gives up on the dead outbox row `seq`: it will not be sent. As
/// [`Postroom::discard_outbox`](crate::Postroom::discard_outbox): marked
/// `sent` without being handed over (payload dropped, reason kept), deleted
/// later by retention. Returns false (changing nothing) when it is not a
/// dead outbox row.
pub fn discard_outbox(conn: &Connection, seq: i64, now_ms: i64) -> Result<bool> {
    write(conn, "discard outbox row", |c| {
        outbox::discard(c, seq, now_ms)
    })
}

// ---------------------------------------------------------------- conflicts

/// A quarantined delivery without its payload, from [`conflicts_list`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ConflictEntry {
    /// Row id in `postroom_conflicts` (the `conflict_id` of the outcome).
    pub id: i64,
    /// The consumer it was delivered to.
    pub consumer: String,
    /// The stream it came from.
    pub source: String,
    /// The reused message id.
    pub message_id: String,
    /// Digest of the stored message's payload, in hex.
    pub stored_hash: String,
    /// Digest of this delivery's payload, in hex.
    pub payload_hash: String,
    /// Size of this delivery's payload.
    pub payload_bytes: u64,
    /// First delivery of this payload under the id (unix ms).
    pub first_seen_at: i64,
    /// Latest delivery of it (unix ms).
    pub last_seen_at: i64,
    /// How many times it was delivered.
    pub deliveries: u64,
}

const CONFLICT_COLUMNS: &str = "id, consumer, source, message_id, stored_hash, payload_hash,
     length(payload), first_seen_at, last_seen_at, deliveries";

fn conflict_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<ConflictEntry> {
    Ok(ConflictEntry {
        id: r.get(0)?,
        consumer: r.get(1)?,
        source: r.get(2)?,
        message_id: r.get(3)?,
        stored_hash: hex(&r.get::<_, Vec<u8>>(4)?),
        payload_hash: hex(&r.get::<_, Vec<u8>>(5)?),
        payload_bytes: count(r.get(6)?),
        first_seen_at: r.get(7)?,
        last_seen_at: r.get(8)?,
        deliveries: count(r.get(9)?),
    })
}

/// Quarantined deliveries, oldest first, at most `limit`.
pub fn conflicts_list(conn: &Connection, limit: usize) -> Result<Vec<ConflictEntry>> {
    let mut stmt = conn
        .prepare(&format!(
            "SELECT {CONFLICT_COLUMNS} FROM postroom_conflicts ORDER BY id LIMIT ?1"
        ))
        .map_err(sql("list conflicts"))?;
    let rows = stmt
        .query_map([limit_param(limit)], conflict_from_row)
        .map_err(sql("list conflicts"))?;
    rows.collect::<rusqlite::Result<_>>()
        .map_err(sql("list conflicts"))
}

/// One quarantined delivery in full, beside the stored message it
/// collided with, from [`conflicts_show`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ConflictDetail {
    /// Everything [`conflicts_list`] shows.
    #[serde(flatten)]
    pub entry: ConflictEntry,
    /// This delivery's headers.
    pub headers: Headers,
    /// This delivery's payload.
    pub payload: Payload,
    /// The stored inbox row under the same key, if retention has not
    /// deleted it.
    pub stored: Option<InboxEntry>,
    /// The stored row's payload, when kept.
    pub stored_payload: Option<Payload>,
}

/// The conflict with this id, in full; `None` when there is none.
pub fn conflicts_show(conn: &Connection, id: i64) -> Result<Option<ConflictDetail>> {
    snapshot(conn, || {
        let found = conn
            .query_row(
                &format!(
                    "SELECT {CONFLICT_COLUMNS}, headers, payload FROM postroom_conflicts
                     WHERE id = ?1"
                ),
                [id],
                |r| {
                    let headers: Option<String> = r.get(10)?;
                    Ok(ConflictDetail {
                        entry: conflict_from_row(r)?,
                        headers: parse_headers(headers.as_deref()),
                        payload: Payload(r.get(11)?),
                        stored: None,
                        stored_payload: None,
                    })
                },
            )
            .optional()
            .map_err(sql("show conflict"))?;
        let Some(mut detail) = found else {
            return Ok(None);
        };
        let stored = conn
            .query_row(
                &format!(
                    // The key too: a retired entry's inbox_id may since
                    // have been reused by another message's row.
                    "SELECT {ENTRY_COLUMNS}, payload FROM postroom_inbox
                     WHERE id = (SELECT inbox_id FROM postroom_inbox_keys
                                 WHERE consumer = ?1 AND source = ?2 AND message_id = ?3)
                       AND consumer = ?1 AND source = ?2 AND message_id = ?3"
                ),
                params![
                    detail.entry.consumer,
                    detail.entry.source,
                    detail.entry.message_id
                ],
                |r| Ok((entry_from_row(r)?, r.get::<_, Option<Vec<u8>>>(13)?)),
            )
            .optional()
            .map_err(sql("show conflict"))?;
        if let Some((entry, payload)) = stored {
            detail.stored = Some(entry);
            detail.stored_payload = payload.map(Payload);
        }
        Ok(Some(detail))
    })
}

/// Deletes the conflict `id`, its payload with it: an operator looked at it
/// and is done. Returns false (changing nothing) when there is none. Its id
/// is never given to a later conflict; a redelivery of the same payload is
/// quarantined anew. One `BEGIN IMMEDIATE` transaction.
pub fn conflicts_discard(conn: &Connection, id: i64) -> Result<bool> {
    write(conn, "discard conflict", |c| inbox::discard_conflict(c, id))
}

// ---------------------------------------------------------------- cleanup

/// How long [`cleanup`] keeps finished rows: the engine's `retention`,
/// `dead_retention` and `conflict_retention` settings, for running
/// retention from outside the engine (the CLI's `cleanup`). A bare
/// [`Duration`] converts into one that keeps dead letters and conflicts,
/// as the engine's defaults do.
///
/// ```
/// use std::time::Duration;
/// use postroom::admin::Retention;
///
/// let day = Duration::from_secs(24 * 3600);
/// let policy = Retention::new(7 * day).dead(Some(30 * day)).conflicts(Some(30 * day));
/// assert_eq!(policy.dead, Some(30 * day));
/// assert_eq!(Retention::from(7 * day).conflicts, None);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Retention {
    /// Completed inbox rows processed, and sent outbox rows sent, longer
    /// ago than this are deleted: the dedupe horizon.
    pub completed: Duration,
    /// Dead letters (inbox) that died longer ago than this are deleted;
    /// `None` (the default) keeps them.
    pub dead: Option<Duration>,
    /// Quarantined deliveries last seen longer ago than this are deleted;
    /// `None` (the default) keeps them.
    pub conflicts: Option<Duration>,
}

impl Retention {
    /// Deletes completed and sent rows older than `completed`; keeps dead
    /// letters and conflicts.
    pub fn new(completed: Duration) -> Self {
        Retention {
            completed,
            dead: None,
            conflicts: None,
        }
    }

    /// Also delete dead letters older than this (`None`: keep them).
    pub fn dead(mut self, dead: Option<Duration>) -> Self {
        self.dead = dead;
        self
    }

    /// Also delete conflicts last seen longer ago than this (`None`: keep
    /// them).
    pub fn conflicts(mut self, conflicts: Option<Duration>) -> Self {
        self.conflicts = conflicts;
        self
    }
}

impl From<Duration> for Retention {
    fn from(completed: Duration) -> Self {
        Retention::new(completed)
    }
}

/// What [`cleanup`] deleted, or would delete.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct CleanupSummary {
    /// Completed and sent rows finished before this time (unix ms) are past
    /// retention.
    pub cutoff_ms: i64,
    /// Dead letters that died before this time are past
    /// [`Retention::dead`]; `None` when it is `None`.
    pub dead_cutoff_ms: Option<i64>,
    /// Conflicts last seen before this time are past
    /// [`Retention::conflicts`]; `None` when it is `None`.
    pub conflicts_cutoff_ms: Option<i64>,
    /// True when nothing was deleted, only counted.
    pub dry_run: bool,
    /// Completed inbox rows deleted (or that would be).
    pub inbox_deleted: u64,
    /// Their key entries deleted, after the rows, in key order (0 for a
    /// dry run): as many, plus any an interrupted pass left; fewer if the
    /// engine's reaper deleted some first.
    pub keys_deleted: u64,
    /// Sent outbox rows deleted (or that would be).
    pub outbox_deleted: u64,
    /// Inbox dead letters deleted (or that would be); `None` when
    /// [`Retention::dead`] is `None`.
    pub dead_deleted: Option<u64>,
    /// Conflicts deleted (or that would be); `None` when
    /// [`Retention::conflicts`] is `None`.
    pub conflicts_deleted: Option<u64>,
    /// Write transactions used (0 for a dry run).
    pub transactions: u64,
}

/// Applies retention as the engine's reaper does: completed inbox rows
/// processed, and sent outbox rows sent, before `now_ms - completed`; with
/// [`Retention::dead`] / [`Retention::conflicts`], dead letters and
/// conflicts too. Pending, failed and processing rows are never touched,
/// nor the newest row of the inbox or the outbox (so no row id or `seq` is
/// given out twice). `retention` is a [`Retention`] or a bare [`Duration`]
/// (completed and sent rows only).
///
/// With `dry_run`, only counts, with the statements a run deletes with
/// (read-only). Otherwise deletes [`CLEANUP_BATCH`] rows per
/// `BEGIN IMMEDIATE` transaction, pausing between batches as long as the
/// batch took, so a running engine's writer gets the lock at least half of
/// the time.
pub fn cleanup(
    conn: &Connection,
    now_ms: i64,
    retention: impl Into<Retention>,
    dry_run: bool,
) -> Result<CleanupSummary> {
    let retention = retention.into();
    let cutoff_of = |keep: Duration| now_ms.saturating_sub(clock::millis(keep));
    let cutoff = cutoff_of(retention.completed);
    let dead_cutoff = retention.dead.map(cutoff_of);
    let conflicts_cutoff = retention.conflicts.map(cutoff_of);
    let mut summary = CleanupSummary {
        cutoff_ms: cutoff,
        dead_cutoff_ms: dead_cutoff,
        conflicts_cutoff_ms: conflicts_cutoff,
        dry_run,
        inbox_deleted: 0,
        keys_deleted: 0,
        outbox_deleted: 0,
        dead_deleted: None,
        conflicts_deleted: None,
        transactions: 0,
    };
    if dry_run {
        return snapshot(conn, || {
            let expired = |statement, cutoff| {
                queue::count_expired(conn, statement, cutoff).map_err(sql("count expired rows"))
            };
            summary.inbox_deleted = expired(queue::DELETE_COMPLETED, cutoff)?;
            summary.outbox_deleted = expired(outbox::DELETE_SENT, cutoff)?;
            if let Some(c) = dead_cutoff {
                summary.dead_deleted = Some(expired(queue::DELETE_DEAD, c)?);
            }
            if let Some(c) = conflicts_cutoff {
                summary.conflicts_deleted = Some(expired(inbox::DELETE_CONFLICTS, c)?);
            }
            Ok(summary)
        });
    }
    // Both closures count transactions.
    let transactions = std::cell::Cell::new(0);
    (summary.inbox_deleted, summary.keys_deleted) = retired::retire(
        |max| {
            let op = "delete expired inbox rows";
            let sql = queue::DELETE_COMPLETED;
            delete_in_batches(conn, op, sql, cutoff, max, &transactions)
        },
        || drain_retired(conn, &transactions),
    )?;
    let all = |op, sql, cutoff| {
        delete_in_batches(conn, op, sql, cutoff, u64::MAX, &transactions).map(|(n, _)| n)
    };
    summary.outbox_deleted = all("delete expired outbox rows", outbox::DELETE_SENT, cutoff)?;
    if let Some(c) = dead_cutoff {
        summary.dead_deleted = Some(all("delete expired dead letters", queue::DELETE_DEAD, c)?);
    }
    if let Some(c) = conflicts_cutoff {
        let op = "delete expired conflicts";
        summary.conflicts_deleted = Some(all(op, inbox::DELETE_CONFLICTS, c)?);
    }
    summary.transactions = transactions.get();
    Ok(summary)
}

/// Deletes what `sql` (one of retention's statements) finds before
/// `cutoff`, [`CLEANUP_BATCH`] rows per transaction, until none is left
/// (`(deleted, true)`) or at least `max` were deleted (`(deleted, false)`).
fn delete_in_batches(
    conn: &Connection,
    op: &'static str,
    sql: &'static str,
    cutoff: i64,
    max: u64,
    transactions: &std::cell::Cell<u64>,
) -> Result<(u64, bool)> {
    let mut total = 0;
    loop {
        let started = Instant::now();
        let n = write(conn, op, |c| {
            queue::delete_expired(c, sql, cutoff, CLEANUP_BATCH)
        })?;
        transactions.set(transactions.get() + 1);
        total += n as u64;
        if n < CLEANUP_BATCH {
            return Ok((total, true));
        }
        pause_after(started);
        if total >= max {
            return Ok((total, false));
        }
    }
}

/// Lets a running engine's writer have the lock at least half of the time.
fn pause_after(started: Instant) {
    std::thread::sleep(started.elapsed().max(Duration::from_millis(1)));
}

/// [`cleanup`]'s share of `retired::drain`, counting its transactions.
fn drain_retired(conn: &Connection, transactions: &std::cell::Cell<u64>) -> Result<u64> {
    retired::drain(
        || retired::read(conn).map_err(sql("read retired keys")),
        |batch| {
            let started = Instant::now();
            let n = write(conn, "delete retired keys", |c| retired::apply(c, &batch))?;
            transactions.set(transactions.get() + 1);
            pause_after(started);
            Ok(n)
        },
    )
}

// ---------------------------------------------------------------- check

/// What a [`Finding`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum FindingKind {
    /// A stored inbox payload does not match its stored blake3 digest.
    PayloadDigest,
    /// A quarantined payload does not match its stored digest.
    ConflictDigest,
    /// An inbox or outbox row's columns contradict its status (e.g. a
    /// completed row without `processed_at`, a dead row without payload or
    /// error, a processing row without a lease).
    StatusFields,
    /// An outbox row names a cause whose inbox row exists but is not
    /// completed: its effects committed without the message being done.
    CauseNotCompleted,
    /// The inbox's key table (`postroom_inbox_keys`) disagrees with the
    /// inbox: an entry missing, wrong or without its row. Dedupe answers
    /// come from that table, so this breaks exactly-once.
    KeyTable,
    /// A `processing` row whose lease has passed. Not a violation: the
    /// reaper, or the engine's next open, retries it.
    ExpiredLease,
}

impl fmt::Display for FindingKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FindingKind::PayloadDigest => "payload_digest",
            FindingKind::ConflictDigest => "conflict_digest",
            FindingKind::StatusFields => "status_fields",
            FindingKind::CauseNotCompleted => "cause_not_completed",
            FindingKind::KeyTable => "key_table",
            FindingKind::ExpiredLease => "expired_lease",
        })
    }
}

/// One problem found by [`check`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Finding {
    /// What kind of problem.
    pub kind: FindingKind,
    /// The table of the row.
    pub table: &'static str,
    /// The row's id (`seq` for the outbox).
    pub id: i64,
    /// What is wrong, for people.
    pub detail: String,
}

/// The result of [`check`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct CheckReport {
    /// `"quick_check"` or `"integrity_check"`.
    pub integrity_check: &'static str,
    /// True when SQLite's check answered `ok`.
    pub integrity_ok: bool,
    /// What SQLite's check reported otherwise (at most 100 lines).
    pub integrity_errors: Vec<String>,
    /// False when the file failed SQLite's check: postroom's invariants
    /// were then not checked (the rows cannot be trusted).
    pub invariants_checked: bool,
    /// Inbox rows looked at.
    pub inbox_rows: u64,
    /// Stored payloads (inbox and conflicts) whose digest was recomputed.
    pub payloads_hashed: u64,
    /// Outbox rows looked at.
    pub outbox_rows: u64,
    /// Broken invariants (at most [`MAX_FINDINGS`]).
    pub violations: Vec<Finding>,
    /// All broken invariants found.
    pub violations_total: u64,
    /// Worth knowing, not broken (at most [`MAX_FINDINGS`]).
    pub warnings: Vec<Finding>,
    /// All warnings found.
    pub warnings_total: u64,
}

impl CheckReport {
    /// True when SQLite's check passed and no invariant is broken
    /// (warnings allowed).
    pub fn is_ok(&self) -> bool {
        self.integrity_ok && self.violations_total == 0
    }

    fn violation(&mut self, f: Finding) {
        self.violations_total += 1;
        if self.violations.len() < MAX_FINDINGS {
            self.violations.push(f);
        }
    }

    fn warning(&mut self, f: Finding) {
        self.warnings_total += 1;
        if self.warnings.len() < MAX_FINDINGS {
            self.warnings.push(f);
        }
    }
}

/// Checks the database: SQLite's `PRAGMA quick_check` (or the slower, more
/// thorough `integrity_check` when `full`), then, if that passed,
/// postroom's own invariants, in one read transaction:
///
/// * every stored inbox and conflict payload matches its blake3 digest;
/// * each row's columns fit its status (schema.sql's invariants);
/// * an outbox row caused by an inbox message whose row still exists (and
///   was received before the outbox row was written) points to a
///   completed row — rows deleted by retention are fine;
/// * every inbox row has its entry in the key table, only they do, and the
///   triggers that keep it so exist (a missing one is reported with id 0);
/// * `processing` rows whose lease has passed are reported as warnings:
///   the reaper or the engine's next open recovers them.
///
/// Reads every stored payload; on a live database the read transaction
/// keeps the WAL from being checkpointed past it while it runs.
pub fn check(conn: &Connection, full: bool) -> Result<CheckReport> {
    let now = now_ms();
    let pragma = if full {
        "integrity_check"
    } else {
        "quick_check"
    };
    let mut report = CheckReport {
        integrity_check: pragma,
        integrity_ok: false,
        integrity_errors: Vec::new(),
        invariants_checked: false,
        inbox_rows: 0,
        payloads_hashed: 0,
        outbox_rows: 0,
        violations: Vec::new(),
        violations_total: 0,
        warnings: Vec::new(),
        warnings_total: 0,
    };
    let lines: Vec<String> = {
        let mut stmt = conn
            .prepare(&format!("PRAGMA {pragma}(100)"))
            .map_err(sql("integrity check"))?;
        let rows = stmt
            .query_map([], |r| r.get::<_, String>(0))
            .map_err(sql("integrity check"))?;
        rows.collect::<rusqlite::Result<_>>()
            .map_err(sql("integrity check"))?
    };
    report.integrity_ok = lines.len() == 1 && lines[0] == "ok";
    if !report.integrity_ok {
        report.integrity_errors = lines;
        return Ok(report);
    }
    snapshot(conn, || check_invariants(conn, now, &mut report))?;
    report.invariants_checked = true;
    Ok(report)
}

fn check_invariants(conn: &Connection, now: i64, report: &mut CheckReport) -> Result<()> {
    for name in schema::missing_triggers(conn).map_err(sql("check inbox keys"))? {
        report.violation(Finding {
            kind: FindingKind::KeyTable,
            table: "postroom_inbox",
            id: 0,
            detail: format!("trigger {name} is missing"),
        });
    }
    inbox::key_mismatches(conn, |table, id, what| {
        report.violation(Finding {
            kind: FindingKind::KeyTable,
            table,
            id,
            detail: what.to_string(),
        })
    })
    .map_err(sql("check inbox keys"))?;
    let op = sql("check inbox");
    let mut stmt = conn
        .prepare(
            "SELECT id, status, payload, payload_hash, last_error, processed_at, lease_until,
                    lease_token
             FROM postroom_inbox ORDER BY id",
        )
        .map_err(&op)?;
    let mut rows = stmt.query([]).map_err(&op)?;
    while let Some(r) = rows.next().map_err(&op)? {
        report.inbox_rows += 1;
        let id: i64 = r.get(0).map_err(&op)?;
        let status: Status = r.get(1).map_err(&op)?;
        let payload: Option<Vec<u8>> = r.get(2).map_err(&op)?;
        let hash: Vec<u8> = r.get(3).map_err(&op)?;
        let last_error: Option<String> = r.get(4).map_err(&op)?;
        let processed_at: Option<i64> = r.get(5).map_err(&op)?;
        let lease_until: Option<i64> = r.get(6).map_err(&op)?;
        let lease_token: Option<i64> = r.get(7).map_err(&op)?;
        if let Some(p) = &payload {
            report.payloads_hashed += 1;
            let actual = blake3::hash(p);
            if actual.as_bytes().as_slice() != hash.as_slice() {
                report.violation(Finding {
                    kind: FindingKind::PayloadDigest,
                    table: "postroom_inbox",
                    id,
                    detail: format!(
                        "stored payload ({} bytes) hashes to {}, stored digest is {}",
                        p.len(),
                        actual.to_hex(),
                        hex(&hash)
                    ),
                });
            }
        }
        let mut wrong = Vec::new();
        match status {
            Status::Completed if processed_at.is_none() => wrong.push("no processed_at"),
            Status::Failed | Status::Dead => {
                if payload.is_none() {
                    wrong.push("no payload");
                }
                if last_error.is_none() {
                    wrong.push("no last_error");
                }
            }
            Status::Processing if lease_until.is_none() || lease_token.is_none() => {
                wrong.push("no lease")
            }
            _ => {}
        }
        if !wrong.is_empty() {
            report.violation(Finding {
                kind: FindingKind::StatusFields,
                table: "postroom_inbox",
                id,
                detail: format!("{status} row with {}", wrong.join(" and ")),
            });
        }
        if status == Status::Processing {
            if let Some(until) = lease_until.filter(|&u| u < now) {
                report.warning(Finding {
                    kind: FindingKind::ExpiredLease,
                    table: "postroom_inbox",
                    id,
                    detail: format!(
                        "lease expired {} ms ago; retried after the reaper's next pass or \
                         the engine's next open",
                        now - until
                    ),
                });
            }
        }
    }
    drop(rows);

    let op = sql("check conflicts");
    let mut stmt = conn
        .prepare("SELECT id, payload, payload_hash FROM postroom_conflicts ORDER BY id")
        .map_err(&op)?;
    let mut rows = stmt.query([]).map_err(&op)?;
    while let Some(r) = rows.next().map_err(&op)? {
        let id: i64 = r.get(0).map_err(&op)?;
        let payload: Vec<u8> = r.get(1).map_err(&op)?;
        let hash: Vec<u8> = r.get(2).map_err(&op)?;
        report.payloads_hashed += 1;
        let actual = blake3::hash(&payload);
        if actual.as_bytes().as_slice() != hash.as_slice() {
            report.violation(Finding {
                kind: FindingKind::ConflictDigest,
                table: "postroom_conflicts",
                id,
                detail: format!(
                    "quarantined payload ({} bytes) hashes to {}, stored digest is {}",
                    payload.len(),
                    actual.to_hex(),
                    hex(&hash)
                ),
            });
        }
    }
    drop(rows);

    let op = sql("check outbox");
    let mut stmt = conn
        .prepare(
            "SELECT o.seq, o.status, o.sent_at, o.last_error, i.id, i.status
             FROM postroom_outbox o
             LEFT JOIN postroom_inbox_keys k
               ON k.consumer = o.cause_consumer AND k.source = o.cause_source
              AND k.message_id = o.cause_message_id
             LEFT JOIN postroom_inbox i
               ON i.id = k.inbox_id AND i.consumer = k.consumer AND i.source = k.source
              AND i.message_id = k.message_id AND i.received_at <= o.created_at
             ORDER BY o.seq",
        )
        .map_err(&op)?;
    let mut rows = stmt.query([]).map_err(&op)?;
    while let Some(r) = rows.next().map_err(&op)? {
        report.outbox_rows += 1;
        let seq: i64 = r.get(0).map_err(&op)?;
        let status: String = r.get(1).map_err(&op)?;
        let sent_at: Option<i64> = r.get(2).map_err(&op)?;
        let last_error: Option<String> = r.get(3).map_err(&op)?;
        let cause: Option<(i64, Status)> = match r.get::<_, Option<i64>>(4).map_err(&op)? {
            Some(id) => Some((id, r.get(5).map_err(&op)?)),
            None => None,
        };
        let wrong = match status.as_str() {
            "sent" if sent_at.is_none() => Some("no sent_at"),
            "dead" if last_error.is_none() => Some("no last_error"),
            _ => None,
        };
        if let Some(wrong) = wrong {
            report.violation(Finding {
                kind: FindingKind::StatusFields,
                table: "postroom_outbox",
                id: seq,
                detail: format!("{status} row with {wrong}"),
            });
        }
        if let Some((inbox_id, inbox_status)) = cause {
            if inbox_status != Status::Completed {
                report.violation(Finding {
                    kind: FindingKind::CauseNotCompleted,
                    table: "postroom_outbox",
                    id: seq,
                    detail: format!(
                        "published while handling inbox row {inbox_id}, which is {inbox_status}, \
                         not completed"
                    ),
                });
            }
        }
    }
    Ok(())
}
