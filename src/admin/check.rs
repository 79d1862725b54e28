//! `postroom check`: SQLite's integrity check, the WAL's damaged frames,
//! then every invariant the engine keeps over its rows, one function each.
//! Invariant: read-only, all invariants read in one snapshot; findings are
//! capped ([`MAX_FINDINGS`]) while the totals count them all.

use std::fmt;
use std::path::Path;

use rusqlite::Connection;
use serde::Serialize;

use crate::error::{Error, Result};
use crate::store::check as rows;
use crate::store::inbox::{self, Status};
use crate::store::payload::hex;
use crate::store::schema;

use super::open::{now_ms, wal_damaged_frames};
use super::{snapshot, sql, MAX_FINDINGS};

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
    /// An ordering key's head (`postroom_inbox_heads`, the outbox's
    /// `head` column) is not its lowest unfinished row: the due
    /// queries read only heads, so the key would be held back for good or
    /// run out of order. Kept by triggers: the file was changed outside
    /// postroom.
    HeadTable,
    /// A `processing` row whose lease has passed. Not a violation: the
    /// reaper, or the engine's next open, retries it.
    ExpiredLease,
    /// Committed transactions in the WAL past a checksum failure, which
    /// SQLite does not read ([`wal_damaged_frames`]). A warning: the file
    /// as read is consistent, but unless an engine has already gone on past
    /// the damage, its next open drops them; keep a copy of the files.
    WalDamage,
    /// One of postroom's triggers is missing or not as the schema ships it
    /// (its SQL differs): what it keeps (the key table, the watermarks) is
    /// no longer kept. A trigger of someone else's on a postroom table is
    /// a warning of this kind: it runs inside the engine's statements.
    Trigger,
    /// A sequence watermark contradicts itself: `settled_below` under 1, a
    /// listed sequence at or below it or above the stream's `highest`, a
    /// listing without its stream, or more listed than the bound. A
    /// retained row below the watermark that has not settled is a warning
    /// of this kind (a dead letter redriven after its number settled; else
    /// the watermark passed a message that never settled).
    Watermark,
    /// Two outbox rows share a message id: a downstream inbox takes the
    /// second for a redelivery of the first (dropped as a duplicate, or
    /// quarantined as a conflict when the payloads differ). Ids the engine
    /// derives or generates are unique by construction and only named ids
    /// have a UNIQUE index (schema version 12), so this is a named id
    /// equal to a derived one, or a hand edit.
    DuplicateId,
    /// The file is not the one its instance id was given to (a copy, a
    /// restore into a new file, or made by an older build): a warning.
    /// The next engine open gives it a new instance id, and a downstream
    /// postroom numbers its outbox as a new stream.
    Identity,
}

impl fmt::Display for FindingKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FindingKind::PayloadDigest => "payload_digest",
            FindingKind::ConflictDigest => "conflict_digest",
            FindingKind::StatusFields => "status_fields",
            FindingKind::CauseNotCompleted => "cause_not_completed",
            FindingKind::KeyTable => "key_table",
            FindingKind::HeadTable => "head_table",
            FindingKind::ExpiredLease => "expired_lease",
            FindingKind::WalDamage => "wal_damage",
            FindingKind::Trigger => "trigger",
            FindingKind::Watermark => "watermark",
            FindingKind::DuplicateId => "duplicate_id",
            FindingKind::Identity => "identity",
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
    /// Frames of committed transactions in the WAL past a checksum
    /// failure ([`wal_damaged_frames`]): SQLite's check cannot see them (it
    /// reads what the WAL holds before the failure); reported as a
    /// [`FindingKind::WalDamage`] warning.
    pub wal_damaged_frames: u64,
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

/// How thorough [`check`]'s first step, SQLite's own check, is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckDepth {
    /// `PRAGMA quick_check`: what the engine runs at open.
    Quick,
    /// `PRAGMA integrity_check`: slower, and also checks that every index
    /// matches its table.
    Full,
}

/// Checks the database: SQLite's `PRAGMA quick_check` (or the slower, more
/// thorough `integrity_check` with [`CheckDepth::Full`]), then, if that passed,
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
pub fn check(conn: &Connection, depth: CheckDepth) -> Result<CheckReport> {
    let now = now_ms();
    let full = depth == CheckDepth::Full;
    let pragma = if full {
        "integrity_check"
    } else {
        "quick_check"
    };
    let mut report = CheckReport {
        integrity_check: pragma,
        integrity_ok: false,
        integrity_errors: Vec::new(),
        wal_damaged_frames: 0,
        invariants_checked: false,
        inbox_rows: 0,
        payloads_hashed: 0,
        outbox_rows: 0,
        violations: Vec::new(),
        violations_total: 0,
        warnings: Vec::new(),
        warnings_total: 0,
    };
    let lines = rows::integrity(conn, full).map_err(sql("integrity check"))?;
    report.integrity_ok = lines.len() == 1 && lines[0] == "ok";
    if !report.integrity_ok {
        report.integrity_errors = lines;
    }
    if let Some(db) = conn.path().filter(|p| !p.is_empty()) {
        report.wal_damaged_frames =
            wal_damaged_frames(&crate::store::beside(Path::new(db), "-wal"))
                .map_err(|e| Error::io("read the WAL", e))?;
    }
    if report.wal_damaged_frames > 0 {
        report.warning(Finding {
            kind: FindingKind::WalDamage,
            table: "-wal",
            id: 0,
            detail: format!(
                "{} frame(s) of committed transactions past a checksum failure, which SQLite \
                 does not read",
                report.wal_damaged_frames
            ),
        });
    }
    if !report.integrity_ok {
        return Ok(report);
    }
    snapshot(conn, || check_invariants(conn, now, &mut report))?;
    report.invariants_checked = true;
    Ok(report)
}

/// postroom's triggers against the schema's (missing key triggers are
/// reported as `key_table` findings, as before).
fn check_triggers(conn: &Connection, report: &mut CheckReport) -> Result<()> {
    use schema::TriggerFinding;
    for found in schema::audit_triggers(conn).map_err(sql("check triggers"))? {
        let finding = |detail: String| Finding {
            kind: FindingKind::Trigger,
            table: "sqlite_master",
            id: 0,
            detail,
        };
        match found {
            TriggerFinding::Missing(name) if schema::KEY_TRIGGERS.contains(&name) => {}
            TriggerFinding::Missing(name) => report.violation(finding(format!(
                "trigger {name} is missing: what it keeps is not kept"
            ))),
            TriggerFinding::Altered(name) => report.violation(finding(format!(
                "trigger {name} is not the one the schema ships (its SQL differs): what \
                     it keeps is not kept as the engine relies on; restore it from schema.sql"
            ))),
            TriggerFinding::Foreign { name, table } => report.warning(finding(format!(
                "trigger {name} on {table} is not postroom's: it runs inside the engine's \
                     statements, so make sure it neither changes nor ignores them"
            ))),
        }
    }
    for object in schema::reaching_engine_tables(conn).map_err(sql("check schema objects"))? {
        report.violation(Finding {
            kind: FindingKind::Trigger,
            table: "sqlite_master",
            id: 0,
            detail: format!(
                "the application's {object} reaches postroom's tables (a foreign key to one, \
                 or a trigger on an application table that names one): it acts on the \
                 engine's rows from outside it, and the engine refuses to open the file; \
                 drop it"
            ),
        });
    }
    Ok(())
}

/// The sequence watermarks' invariants (docs/DESIGN.md "Sequence
/// watermarks"), each a query over the two tables and the inbox.
fn check_watermarks(conn: &Connection, report: &mut CheckReport) -> Result<()> {
    rows::watermark_breaks(conn, |b| {
        let finding = Finding {
            kind: FindingKind::Watermark,
            table: b.table,
            id: 0,
            detail: format!(
                "consumer {:?}, stream {:?}: {}",
                b.consumer, b.stream, b.what
            ),
        };
        if b.violation {
            report.violation(finding);
        } else {
            report.warning(finding);
        }
    })
    .map_err(sql("check watermarks"))
}

/// The identity recorded beside the instance id against this file's.
fn check_identity(conn: &Connection, db: &Path, report: &mut CheckReport) -> Result<()> {
    let Ok(identity) = schema::file_identity(db) else {
        return Ok(());
    };
    let recorded = rows::recorded_identity(conn).map_err(sql("check identity"))?;
    if recorded.as_deref() != Some(identity.as_str()) {
        report.warning(Finding {
            kind: FindingKind::Identity,
            table: "postroom_meta",
            id: 0,
            detail: format!(
                "this file is not the one its instance id was given to ({}): the next engine \
                 open gives it a new instance id, and a downstream postroom numbers its outbox \
                 as a new stream (nothing is lost)",
                if recorded.is_some() {
                    "a copy, or a restore into a new file"
                } else {
                    "no file identity recorded: made by an older build"
                }
            ),
        });
    }
    Ok(())
}

/// Every invariant over the rows, each its own function, in one snapshot
/// (the caller's).
fn check_invariants(conn: &Connection, now: i64, report: &mut CheckReport) -> Result<()> {
    check_key_triggers(conn, report)?;
    check_triggers(conn, report)?;
    check_watermarks(conn, report)?;
    check_key_table(conn, report)?;
    check_key_heads(conn, report)?;
    check_inbox_rows(conn, now, report)?;
    check_conflict_digests(conn, report)?;
    check_outbox_rows(conn, report)?;
    check_outbox_ids(conn, report)?;
    if let Some(db) = conn.path().filter(|p| !p.is_empty()) {
        check_identity(conn, Path::new(db), report)?;
    }
    Ok(())
}

/// The triggers that keep the key table exist.
fn check_key_triggers(conn: &Connection, report: &mut CheckReport) -> Result<()> {
    for name in schema::missing_triggers(conn).map_err(sql("check inbox keys"))? {
        report.violation(Finding {
            kind: FindingKind::KeyTable,
            table: "postroom_inbox",
            id: 0,
            detail: format!("trigger {name} is missing"),
        });
    }
    Ok(())
}

/// Every inbox row has its entry in the key table, and only they do.
fn check_key_table(conn: &Connection, report: &mut CheckReport) -> Result<()> {
    inbox::key_mismatches(conn, |table, id, what| {
        report.violation(Finding {
            kind: FindingKind::KeyTable,
            table,
            id,
            detail: what.to_string(),
        })
    })
    .map_err(sql("check inbox keys"))
}

/// Each ordering key's head names its lowest unfinished row, and an outbox
/// head marked `alone` is its key's only pending row.
fn check_key_heads(conn: &Connection, report: &mut CheckReport) -> Result<()> {
    schema::head_mismatches(conn, |table, key, stored, expected| {
        let show = |id: Option<i64>| id.map_or_else(|| "none".to_owned(), |id| id.to_string());
        report.violation(Finding {
            kind: FindingKind::HeadTable,
            table,
            id: stored.or(expected).unwrap_or_default(),
            detail: format!(
                "key {key:?}: head {}, but its lowest unfinished row is {}",
                show(stored),
                show(expected)
            ),
        })
    })
    .map_err(sql("check key heads"))?;
    schema::alone_mismatches(conn, |key, seq| {
        report.violation(Finding {
            kind: FindingKind::HeadTable,
            table: "postroom_outbox",
            id: seq,
            detail: format!(
                "key {key:?}: row {seq} is marked alone, but it is not the key's only pending row"
            ),
        })
    })
    .map_err(sql("check lone heads"))
}

/// Each inbox row: its payload matches its digest, its status has the
/// fields it needs, and a lease that passed is a warning.
fn check_inbox_rows(conn: &Connection, now: i64, report: &mut CheckReport) -> Result<()> {
    rows::inbox_rows(conn, |row| {
        report.inbox_rows += 1;
        if let Some(p) = &row.payload {
            report.payloads_hashed += 1;
            let actual = blake3::hash(p);
            if actual.as_bytes().as_slice() != row.payload_hash.as_slice() {
                report.violation(Finding {
                    kind: FindingKind::PayloadDigest,
                    table: "postroom_inbox",
                    id: row.id,
                    detail: format!(
                        "stored payload ({} bytes) hashes to {}, stored digest is {}",
                        p.len(),
                        actual.to_hex(),
                        hex(&row.payload_hash)
                    ),
                });
            }
        }
        let wrong = missing_inbox_fields(&row);
        if !wrong.is_empty() {
            report.violation(Finding {
                kind: FindingKind::StatusFields,
                table: "postroom_inbox",
                id: row.id,
                detail: format!("{} row with {}", row.status, wrong.join(" and ")),
            });
        }
        if row.status == Status::Processing {
            if let Some(until) = row.lease_until.filter(|&u| u < now) {
                report.warning(Finding {
                    kind: FindingKind::ExpiredLease,
                    table: "postroom_inbox",
                    id: row.id,
                    detail: format!(
                        "lease expired {} ms ago; retried after the reaper's next pass or \
                         the engine's next open",
                        now - until
                    ),
                });
            }
        }
    })
    .map_err(sql("check inbox"))
}

/// What an inbox row in its status should have and lacks.
fn missing_inbox_fields(row: &rows::InboxRow) -> Vec<&'static str> {
    let mut wrong = Vec::new();
    match row.status {
        Status::Completed if row.processed_at.is_none() => wrong.push("no processed_at"),
        Status::Failed | Status::Dead => {
            if row.payload.is_none() {
                wrong.push("no payload");
            }
            if row.last_error.is_none() {
                wrong.push("no last_error");
            }
        }
        Status::Processing if row.lease_until.is_none() || row.lease_token.is_none() => {
            wrong.push("no lease")
        }
        _ => {}
    }
    wrong
}

/// Each quarantined payload matches its digest.
fn check_conflict_digests(conn: &Connection, report: &mut CheckReport) -> Result<()> {
    rows::conflict_rows(conn, |id, payload, hash| {
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
    })
    .map_err(sql("check conflicts"))
}

/// No two outbox rows share a message id.
fn check_outbox_ids(conn: &Connection, report: &mut CheckReport) -> Result<()> {
    rows::duplicate_outbox_ids(conn, |seq, first| {
        report.violation(Finding {
            kind: FindingKind::DuplicateId,
            table: "postroom_outbox",
            id: seq,
            detail: format!("its message id is row {first}'s too"),
        })
    })
    .map_err(sql("check outbox ids"))
}

/// Each outbox row has the fields its status needs, and the inbox row
/// whose handler published it (while stored) is completed.
fn check_outbox_rows(conn: &Connection, report: &mut CheckReport) -> Result<()> {
    rows::outbox_rows(conn, |row| {
        report.outbox_rows += 1;
        let wrong = match row.status.as_str() {
            "sent" if row.sent_at.is_none() => Some("no sent_at"),
            "dead" if row.last_error.is_none() => Some("no last_error"),
            _ => None,
        };
        if let Some(wrong) = wrong {
            report.violation(Finding {
                kind: FindingKind::StatusFields,
                table: "postroom_outbox",
                id: row.seq,
                detail: format!("{} row with {wrong}", row.status),
            });
        }
        if let Some((inbox_id, inbox_status)) = row.cause {
            if inbox_status != Status::Completed {
                report.violation(Finding {
                    kind: FindingKind::CauseNotCompleted,
                    table: "postroom_outbox",
                    id: row.seq,
                    detail: format!(
                        "published while handling inbox row {inbox_id}, which is {inbox_status}, \
                         not completed"
                    ),
                });
            }
        }
    })
    .map_err(sql("check outbox"))
}
