//! `postroom`: the operator CLI for a postroom database (feature `cli`).
//!
//! It works on a database while an application has it open: it never opens
//! a `Postroom` engine and never takes the engine's lock file
//! (`<db>-postroom`). It opens a connection of its own (busy timeout
//! `--busy-timeout-ms`, 5 s by default): `query_only` for the read commands,
//! read-write only for `dead redrive`, `dead discard`, `conflicts discard` and `cleanup`, whose
//! writes run in short `BEGIN IMMEDIATE` transactions serialized with the
//! engine's writer. It never creates a file. Everything it does is in
//! [`postroom::admin`], for your own tooling.
//!
//! ```text
//! postroom <DB> status
//! postroom <DB> inbox list [--consumer C] [--status S] [--source S] [--since MS] [--until MS] [--limit N]
//! postroom <DB> inbox show ID
//! postroom <DB> dead list [--outbox | --consumer C] [--limit N]
//! postroom <DB> dead redrive [--outbox] ID
//! postroom <DB> dead discard [--outbox] ID
//! postroom <DB> conflicts list [--limit N]
//! postroom <DB> conflicts show ID
//! postroom <DB> conflicts discard ID
//! postroom <DB> cleanup [--retention-secs N] [--dead-retention-secs N]
//!                       [--conflict-retention-secs N] [--dry-run]
//! postroom <DB> check [--full]
//! postroom <DB> metrics
//! ```
//! `--json` (anywhere) gives JSON on stdout for every command, and a JSON
//! object `{"error", "exit_code"}` on stderr for an error.
//!
//! Exit codes:
//!
//! | code | meaning |
//! |---|---|
//! | 0 | success |
//! | 1 | operational error: database busy past the timeout, I/O, other SQLite errors |
//! | 2 | usage error (bad arguments; clap's own code) |
//! | 3 | bad database: missing file, not SQLite, not a postroom database, newer schema, corrupt (including `check` finding SQLite-level damage) |
//! | 4 | `check` found broken postroom invariants |
//! | 5 | the row named by ID does not exist (for `dead redrive`/`dead discard`: is not a dead letter) |
#![forbid(unsafe_code)]

use std::fmt::Write as _;
use std::io::{self, Write as _};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use postroom::admin::{self, Payload};
use postroom::{Error, Status};
use serde::Serialize;
use serde_json::json;

const EXIT_OK: u8 = 0;
const EXIT_ERROR: u8 = 1;
const EXIT_USAGE: u8 = 2;
const EXIT_BAD_DATABASE: u8 = 3;
const EXIT_CHECK_FAILED: u8 = 4;
const EXIT_NOT_FOUND: u8 = 5;

const EXIT_CODES_HELP: &str = "\
Exit codes:
  0  success
  1  operational error (database busy past the timeout, I/O, other SQLite errors)
  2  usage error (bad arguments)
  3  bad database: missing file, not SQLite, not a postroom database, newer schema, corrupt
  4  check found broken postroom invariants
  5  the row named by ID does not exist (redrive/discard: is not a dead letter)

The tool works beside a running application: it never takes the engine's lock and
never creates a file; read commands use a query_only connection, and redrive,
discard and cleanup write in short BEGIN IMMEDIATE transactions.";

/// Operator tool for a postroom database (inbox/outbox in one SQLite file).
#[derive(Debug, Parser)]
#[command(name = "postroom", version, after_help = EXIT_CODES_HELP)]
struct Cli {
    /// The database file (must exist; never created)
    db: PathBuf,
    /// Machine-readable JSON output (errors: a JSON object on stderr)
    #[arg(long, global = true)]
    json: bool,
    /// How long to wait for the running engine's write lock (at most 2147483647)
    #[arg(long, global = true, value_name = "MS", default_value_t = 5000,
          value_parser = clap::value_parser!(u64).range(0..=i32::MAX as u64))]
    busy_timeout_ms: u64,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Counts per consumer and status, backlog ages, attempts, outbox, conflicts, file sizes
    Status,
    /// Inbox rows
    #[command(subcommand)]
    Inbox(InboxCommand),
    /// Dead letters of the inbox (default) or the outbox
    #[command(subcommand)]
    Dead(DeadCommand),
    /// Quarantined deliveries (same id, different payload)
    #[command(subcommand)]
    Conflicts(ConflictsCommand),
    /// Delete completed inbox rows and sent outbox rows older than the retention
    /// (and, when asked, old dead letters and conflicts)
    Cleanup {
        /// Keep rows finished within this many seconds (default: 7 days)
        #[arg(long, value_name = "N", default_value_t = admin::DEFAULT_RETENTION.as_secs())]
        retention_secs: u64,
        /// Also delete inbox dead letters that died more than this many
        /// seconds ago (default: keep them)
        #[arg(long, value_name = "N")]
        dead_retention_secs: Option<u64>,
        /// Also delete conflicts last seen more than this many seconds ago
        /// (default: keep them)
        #[arg(long, value_name = "N")]
        conflict_retention_secs: Option<u64>,
        /// Only count what would be deleted
        #[arg(long)]
        dry_run: bool,
    },
    /// SQLite's quick_check (integrity_check with --full) and postroom's invariants
    Check {
        /// Run the full (slower) PRAGMA integrity_check
        #[arg(long)]
        full: bool,
    },
    /// The status numbers in the Prometheus text format
    Metrics,
}

#[derive(Debug, Subcommand)]
enum InboxCommand {
    /// Inbox rows in receive order, filtered
    List(InboxListArgs),
    /// One inbox row in full: payload, headers, attempts, last error, timestamps
    Show {
        /// Row id (from `inbox list`)
        id: i64,
    },
}

#[derive(Debug, Args)]
struct InboxListArgs {
    /// Only this consumer
    #[arg(long)]
    consumer: Option<String>,
    /// Only this status: pending, processing, completed, failed or dead
    #[arg(long, value_parser = parse_status)]
    status: Option<Status>,
    /// Only this source
    #[arg(long)]
    source: Option<String>,
    /// Only rows received at or after this time (unix ms)
    #[arg(long, value_name = "MS")]
    since: Option<i64>,
    /// Only rows received before this time (unix ms)
    #[arg(long, value_name = "MS")]
    until: Option<i64>,
    /// At most this many rows
    #[arg(long, value_name = "N", default_value_t = 100)]
    limit: usize,
}

#[derive(Debug, Subcommand)]
enum DeadCommand {
    /// Dead letters, oldest first
    List {
        /// Dead outbox rows instead of inbox messages
        #[arg(long, conflicts_with = "consumer")]
        outbox: bool,
        /// Only this consumer's dead letters
        #[arg(long)]
        consumer: Option<String>,
        /// At most this many
        #[arg(long, value_name = "N", default_value_t = 100)]
        limit: usize,
    },
    /// Send a dead letter back to be processed (pending, attempts reset)
    Redrive {
        /// ID is an outbox seq instead of an inbox row id
        #[arg(long)]
        outbox: bool,
        /// Inbox row id (or outbox seq with --outbox)
        id: i64,
    },
    /// Give up on a dead letter (inbox: completed without effects; outbox: marked sent, never sent)
    Discard {
        /// ID is an outbox seq instead of an inbox row id
        #[arg(long)]
        outbox: bool,
        /// Inbox row id (or outbox seq with --outbox)
        id: i64,
    },
}

#[derive(Debug, Subcommand)]
enum ConflictsCommand {
    /// Quarantined deliveries, oldest first
    List {
        /// At most this many
        #[arg(long, value_name = "N", default_value_t = 100)]
        limit: usize,
    },
    /// One quarantined delivery in full, beside the stored message
    Show {
        /// Conflict id (from `conflicts list`)
        id: i64,
    },
    /// Delete a quarantined delivery (its payload too); its id is not reused
    Discard {
        /// Conflict id (from `conflicts list`)
        id: i64,
    },
}

fn parse_status(s: &str) -> Result<Status, String> {
    s.parse()
}

/// A failure with the exit code it maps to.
struct Failed {
    code: u8,
    message: String,
}

impl From<Error> for Failed {
    fn from(e: Error) -> Self {
        let code = match &e {
            Error::NotADatabase { .. }
            | Error::SchemaTooNew { .. }
            | Error::Corrupt { .. }
            | Error::ReadOnly { .. } => EXIT_BAD_DATABASE,
            Error::InvalidInput { field, .. } if *field == "database" => EXIT_BAD_DATABASE,
            Error::Io { source, .. } if source.kind() == io::ErrorKind::NotFound => {
                EXIT_BAD_DATABASE
            }
            Error::InvalidInput { .. } => EXIT_USAGE,
            _ => EXIT_ERROR,
        };
        Failed {
            code,
            message: e.to_string(),
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut out = String::new();
    let code = match run(&cli, &mut out) {
        Ok(code) => code,
        Err(f) => {
            let mut err = io::stderr().lock();
            if cli.json {
                let _ = writeln!(
                    err,
                    "{}",
                    json!({ "error": f.message, "exit_code": f.code })
                );
            } else {
                let _ = writeln!(err, "postroom: {}", f.message);
            }
            f.code
        }
    };
    // A closed pipe (`| head`) is not an error worth a panic.
    let _ = io::stdout().lock().write_all(out.as_bytes());
    ExitCode::from(code)
}

fn open(cli: &Cli, writable: bool) -> Result<rusqlite::Connection, Failed> {
    Ok(admin::open_with_timeout(
        &cli.db,
        writable,
        Duration::from_millis(cli.busy_timeout_ms),
    )?)
}

fn to_json(out: &mut String, value: &impl Serialize) {
    // Our output types always serialize.
    out.push_str(&serde_json::to_string_pretty(value).unwrap_or_default());
    out.push('\n');
}

fn run(cli: &Cli, out: &mut String) -> Result<u8, Failed> {
    match &cli.command {
        Command::Status => {
            let conn = open(cli, false)?;
            let report = admin::status(&conn, &cli.db)?;
            if cli.json {
                to_json(out, &report);
            } else {
                print_status(out, &report);
                print_sequences(out, &admin::sequences(&conn)?);
            }
        }
        Command::Metrics => {
            let conn = open(cli, false)?;
            let report = admin::status(&conn, &cli.db)?;
            if cli.json {
                to_json(out, &report);
            } else {
                out.push_str(&admin::prometheus(&report));
                out.push_str(&admin::sequences_prometheus(&admin::sequences(&conn)?));
            }
        }
        Command::Inbox(InboxCommand::List(args)) => {
            let conn = open(cli, false)?;
            let filter = admin::InboxFilter {
                consumer: args.consumer.clone(),
                status: args.status,
                source: args.source.clone(),
                since_ms: args.since,
                until_ms: args.until,
                limit: args.limit,
            };
            let rows = admin::inbox_list(&conn, &filter)?;
            if cli.json {
                to_json(out, &rows);
            } else {
                let mut t = Table::new(&[
                    "ID",
                    "CONSUMER",
                    "SOURCE",
                    "MESSAGE ID",
                    "STATUS",
                    "ATTEMPTS",
                    "RECEIVED",
                    "PAYLOAD",
                    "LAST ERROR",
                ]);
                t.right(&[0, 5, 7]);
                for r in &rows {
                    t.row(vec![
                        r.id.to_string(),
                        r.consumer.clone(),
                        r.source.clone(),
                        clip(&r.message_id, 40),
                        r.status.to_string(),
                        r.attempts.to_string(),
                        fmt_time(r.received_at),
                        r.payload_bytes.map_or("-".into(), |n| n.to_string()),
                        clip(r.last_error.as_deref().unwrap_or(""), 60),
                    ]);
                }
                t.render(out);
                let _ = writeln!(out, "{} row(s)", rows.len());
            }
        }
        Command::Inbox(InboxCommand::Show { id }) => {
            let conn = open(cli, false)?;
            let Some(d) = admin::inbox_show(&conn, *id)? else {
                return Err(not_found(format!("no inbox row with id {id}")));
            };
            if cli.json {
                to_json(out, &d);
            } else {
                print_inbox_detail(out, &d);
            }
        }
        Command::Dead(DeadCommand::List {
            outbox,
            consumer,
            limit,
        }) => {
            let conn = open(cli, false)?;
            if *outbox {
                dead_outbox(cli, out, &admin::outbox_dead_letters(&conn, *limit)?);
            } else {
                let rows = admin::dead_letters(&conn, consumer.as_deref(), *limit)?;
                dead_inbox(cli, out, &rows);
            }
        }
        Command::Dead(DeadCommand::Redrive { outbox, id }) => {
            let conn = open(cli, true)?;
            let done = if *outbox {
                admin::redrive_outbox(&conn, *id)?
            } else {
                admin::redrive(&conn, *id, admin::now_ms())?
            };
            if !done {
                return Err(not_a_dead_letter(&conn, *outbox, *id));
            }
            let what = if *outbox {
                format!(
                    "outbox row {id} redriven: pending again, attempts reset; the relay sends it \
                     at its next poll"
                )
            } else {
                format!(
                    "inbox row {id} redriven: pending again, attempts reset; a running engine's \
                     workers process it at their next poll"
                )
            };
            mutation(cli, out, "redrive", dead_table(*outbox), *id, &what);
        }
        Command::Dead(DeadCommand::Discard { outbox, id }) => {
            let conn = open(cli, true)?;
            let done = if *outbox {
                admin::discard_outbox(&conn, *id, admin::now_ms())?
            } else {
                admin::discard(&conn, *id, admin::now_ms())?
            };
            if !done {
                return Err(not_a_dead_letter(&conn, *outbox, *id));
            }
            let what = if *outbox {
                format!("outbox row {id} discarded: marked sent without being sent, retention deletes it")
            } else {
                format!(
                    "inbox row {id} discarded: completed without effects, a redelivery is a \
                     duplicate"
                )
            };
            mutation(cli, out, "discard", dead_table(*outbox), *id, &what);
        }
        Command::Conflicts(ConflictsCommand::List { limit }) => {
            let conn = open(cli, false)?;
            let rows = admin::conflicts_list(&conn, *limit)?;
            if cli.json {
                to_json(out, &rows);
            } else {
                let mut t = Table::new(&[
                    "ID",
                    "CONSUMER",
                    "SOURCE",
                    "MESSAGE ID",
                    "DELIVERIES",
                    "PAYLOAD",
                    "FIRST SEEN",
                    "LAST SEEN",
                ]);
                t.right(&[0, 4, 5]);
                for r in &rows {
                    t.row(vec![
                        r.id.to_string(),
                        r.consumer.clone(),
                        r.source.clone(),
                        clip(&r.message_id, 40),
                        r.deliveries.to_string(),
                        r.payload_bytes.to_string(),
                        fmt_time(r.first_seen_at),
                        fmt_time(r.last_seen_at),
                    ]);
                }
                t.render(out);
                let _ = writeln!(out, "{} conflict(s)", rows.len());
            }
        }
        Command::Conflicts(ConflictsCommand::Show { id }) => {
            let conn = open(cli, false)?;
            let Some(d) = admin::conflicts_show(&conn, *id)? else {
                return Err(not_found(format!("no conflict with id {id}")));
            };
            if cli.json {
                to_json(out, &d);
            } else {
                print_conflict(out, &d);
            }
        }
        Command::Conflicts(ConflictsCommand::Discard { id }) => {
            let conn = open(cli, true)?;
            if !admin::conflicts_discard(&conn, *id)? {
                return Err(not_found(format!("no conflict with id {id}")));
            }
            let what = format!("conflict {id} discarded: deleted with its payload");
            mutation(cli, out, "discard", "conflicts", *id, &what);
        }
        Command::Cleanup {
            retention_secs,
            dead_retention_secs,
            conflict_retention_secs,
            dry_run,
        } => {
            let conn = open(cli, !*dry_run)?;
            let retention = Duration::from_secs(*retention_secs);
            let policy = admin::Retention::new(retention)
                .dead(dead_retention_secs.map(Duration::from_secs))
                .conflicts(conflict_retention_secs.map(Duration::from_secs));
            let s = admin::cleanup(&conn, admin::now_ms(), policy, *dry_run)?;
            if cli.json {
                to_json(out, &s);
            } else {
                let verb = if s.dry_run { "would delete" } else { "deleted" };
                let _ = writeln!(
                    out,
                    "{}{verb} {} completed inbox row(s) and {} sent outbox row(s) finished before \
                     {} (retention {})",
                    if s.dry_run { "dry run: " } else { "" },
                    s.inbox_deleted,
                    s.outbox_deleted,
                    fmt_time(s.cutoff_ms),
                    fmt_age(i64::try_from(retention.as_millis()).unwrap_or(i64::MAX)),
                );
                if let (Some(n), Some(cutoff)) = (s.dead_deleted, s.dead_cutoff_ms) {
                    let _ = writeln!(
                        out,
                        "{verb} {n} dead letter(s) dead before {}",
                        fmt_time(cutoff)
                    );
                }
                if let (Some(n), Some(cutoff)) = (s.conflicts_deleted, s.conflicts_cutoff_ms) {
                    let _ = writeln!(
                        out,
                        "{verb} {n} conflict(s) last seen before {}",
                        fmt_time(cutoff)
                    );
                }
                if !s.dry_run {
                    let _ = writeln!(
                        out,
                        "{} inbox key entr{} deleted after the rows, {} transaction(s)",
                        s.keys_deleted,
                        if s.keys_deleted == 1 { "y" } else { "ies" },
                        s.transactions
                    );
                }
            }
        }
        Command::Check { full } => {
            let conn = open(cli, false)?;
            let report = admin::check(&conn, *full)?;
            if cli.json {
                to_json(out, &report);
            } else {
                print_check(out, &report);
            }
            if !report.integrity_ok {
                return Ok(EXIT_BAD_DATABASE);
            }
            if !report.is_ok() {
                return Ok(EXIT_CHECK_FAILED);
            }
        }
    }
    Ok(EXIT_OK)
}

fn not_found(message: String) -> Failed {
    Failed {
        code: EXIT_NOT_FOUND,
        message,
    }
}

/// Why a redrive or discard found nothing to do: the row is missing, or in
/// another status.
fn not_a_dead_letter(conn: &rusqlite::Connection, outbox: bool, id: i64) -> Failed {
    let (table, key) = if outbox {
        ("postroom_outbox", "seq")
    } else {
        ("postroom_inbox", "id")
    };
    // Table and column names come from the two constants above, never from input.
    let status: Option<String> = conn
        .query_row(
            &format!("SELECT status FROM {table} WHERE {key} = ?1"),
            [id],
            |r| r.get(0),
        )
        .ok();
    let what = if outbox { "outbox row" } else { "inbox row" };
    not_found(match status {
        Some(status) => format!("{what} {id} is not a dead letter (it is {status})"),
        None => format!("no {what} with {key} {id}"),
    })
}

/// The table a `dead` command's ID names, as `--json` reports it.
fn dead_table(outbox: bool) -> &'static str {
    if outbox {
        "outbox"
    } else {
        "inbox"
    }
}

#[derive(Serialize)]
struct Mutation<'a> {
    action: &'a str,
    table: &'a str,
    id: i64,
    done: bool,
    message: &'a str,
}

fn mutation(cli: &Cli, out: &mut String, action: &str, table: &str, id: i64, message: &str) {
    if cli.json {
        to_json(
            out,
            &Mutation {
                action,
                table,
                id,
                done: true,
                message,
            },
        );
    } else {
        let _ = writeln!(out, "{message}");
    }
}

/// An inbox dead letter as `dead list --json` shows it.
#[derive(Serialize)]
struct DeadInbox<'a> {
    id: i64,
    consumer: &'a str,
    source: &'a str,
    message_id: &'a str,
    ordering_key: Option<&'a str>,
    attempts: u32,
    last_error: Option<&'a str>,
    received_at: i64,
    died_at: i64,
    headers: &'a postroom::Headers,
    payload: Payload,
}

fn dead_inbox(cli: &Cli, out: &mut String, rows: &[postroom::DeadLetter]) {
    if cli.json {
        let view: Vec<DeadInbox<'_>> = rows
            .iter()
            .map(|d| DeadInbox {
                id: d.id,
                consumer: &d.consumer,
                source: d.message.source(),
                message_id: d.message.id(),
                ordering_key: d.message.ordering_key(),
                attempts: d.attempts,
                last_error: d.last_error.as_deref(),
                received_at: d.received_at,
                died_at: d.updated_at,
                headers: d.message.headers(),
                payload: Payload(d.message.payload().to_vec()),
            })
            .collect();
        to_json(out, &view);
        return;
    }
    let mut t = Table::new(&[
        "ID",
        "CONSUMER",
        "SOURCE",
        "MESSAGE ID",
        "ATTEMPTS",
        "DIED",
        "PAYLOAD",
        "LAST ERROR",
    ]);
    t.right(&[0, 4, 6]);
    for d in rows {
        t.row(vec![
            d.id.to_string(),
            d.consumer.clone(),
            d.message.source().to_owned(),
            clip(d.message.id(), 40),
            d.attempts.to_string(),
            fmt_time(d.updated_at),
            d.message.payload().len().to_string(),
            clip(d.last_error.as_deref().unwrap_or(""), 60),
        ]);
    }
    t.render(out);
    let _ = writeln!(out, "{} dead letter(s)", rows.len());
}

/// A dead outbox row as `dead list --outbox --json` shows it.
#[derive(Serialize)]
struct DeadOutbox<'a> {
    seq: i64,
    message_id: &'a str,
    topic: &'a str,
    key: Option<&'a str>,
    attempts: u32,
    last_error: Option<&'a str>,
    created_at: i64,
    headers: &'a postroom::Headers,
    payload: Payload,
}

fn dead_outbox(cli: &Cli, out: &mut String, rows: &[postroom::OutboxMessage]) {
    if cli.json {
        let view: Vec<DeadOutbox<'_>> = rows
            .iter()
            .map(|m| DeadOutbox {
                seq: m.seq,
                message_id: &m.id,
                topic: &m.topic,
                key: m.key.as_deref(),
                attempts: m.attempts,
                last_error: m.last_error.as_deref(),
                created_at: m.created_at,
                headers: &m.headers,
                payload: Payload(m.payload.clone()),
            })
            .collect();
        to_json(out, &view);
        return;
    }
    let mut t = Table::new(&[
        "SEQ",
        "TOPIC",
        "KEY",
        "MESSAGE ID",
        "ATTEMPTS",
        "CREATED",
        "PAYLOAD",
        "LAST ERROR",
    ]);
    t.right(&[0, 4, 6]);
    for m in rows {
        t.row(vec![
            m.seq.to_string(),
            m.topic.clone(),
            m.key.clone().unwrap_or_default(),
            m.id.clone(),
            m.attempts.to_string(),
            fmt_time(m.created_at),
            m.payload.len().to_string(),
            clip(m.last_error.as_deref().unwrap_or(""), 60),
        ]);
    }
    t.render(out);
    let _ = writeln!(out, "{} dead outbox row(s)", rows.len());
}

fn print_status(out: &mut String, r: &admin::StatusReport) {
    let _ = writeln!(out, "database   {}", r.path);
    let _ = writeln!(out, "schema     {}", r.schema_version);
    let _ = writeln!(
        out,
        "size       {} database, {} WAL",
        fmt_bytes(r.db_bytes),
        fmt_bytes(r.wal_bytes)
    );
    let _ = writeln!(out, "conflicts  {}", r.conflicts);
    let _ = writeln!(out);
    let mut t = Table::new(&[
        "CONSUMER",
        "PENDING",
        "PROCESSING",
        "COMPLETED",
        "FAILED",
        "DEAD",
        "TOTAL",
        "OLDEST PENDING",
        "EXPIRED LEASES",
        "ATTEMPTS:ROWS",
    ]);
    t.right(&[1, 2, 3, 4, 5, 6, 7, 8]);
    for c in &r.consumers {
        t.row(vec![
            c.consumer.clone(),
            c.pending.to_string(),
            c.processing.to_string(),
            c.completed.to_string(),
            c.failed.to_string(),
            c.dead.to_string(),
            c.total.to_string(),
            c.oldest_pending_age_ms.map_or("-".into(), fmt_age),
            c.expired_leases.to_string(),
            c.attempts
                .iter()
                .map(|b| format!("{}:{}", b.attempts, b.rows))
                .collect::<Vec<_>>()
                .join(" "),
        ]);
    }
    if r.consumers.is_empty() {
        let _ = writeln!(out, "inbox: empty");
    } else {
        t.render(out);
    }
    let _ = writeln!(out);
    let mut t = Table::new(&["OUTBOX", "PENDING", "SENT", "DEAD", "OLDEST PENDING"]);
    t.right(&[1, 2, 3, 4]);
    t.row(vec![
        String::new(),
        r.outbox.pending.to_string(),
        r.outbox.sent.to_string(),
        r.outbox.dead.to_string(),
        r.outbox.oldest_pending_age_ms.map_or("-".into(), fmt_age),
    ]);
    t.render(out);
}

/// The sequence watermarks, when there are any: an operator reads
/// "missing 41-45" per stream.
fn print_sequences(out: &mut String, streams: &[postroom::StreamWatermark]) {
    if streams.is_empty() {
        return;
    }
    let _ = writeln!(out);
    let mut t = Table::new(&[
        "SEQUENCES",
        "STREAM",
        "WATERMARK",
        "HIGHEST",
        "LISTED",
        "UNRECORDED",
        "MISSING",
    ]);
    t.right(&[2, 3, 4, 5]);
    for w in streams {
        t.row(vec![
            w.consumer.clone(),
            w.stream.clone(),
            w.watermark.to_string(),
            w.highest.map_or("-".into(), |h| h.to_string()),
            w.listed.to_string(),
            w.unrecorded.to_string(),
            match w.missing_text() {
                text if text.is_empty() => "-".into(),
                text => text,
            },
        ]);
    }
    t.render(out);
}

fn print_payload(out: &mut String, label: &str, p: Option<&Payload>) {
    match p {
        None => {
            let _ = writeln!(out, "{label}: not kept");
        }
        Some(p) => {
            let kind = match p.decode() {
                admin::Decoded::Json(_) => "JSON",
                admin::Decoded::Text(_) => "text",
                _ => "binary, hex dump",
            };
            let _ = writeln!(out, "{label} ({} bytes, {kind}):", p.as_bytes().len());
            let body = p.pretty();
            out.push_str(&body);
            if !body.ends_with('\n') {
                out.push('\n');
            }
        }
    }
}

fn print_headers(out: &mut String, headers: &postroom::Headers) {
    if headers.is_empty() {
        let _ = writeln!(out, "headers: none");
    } else {
        let _ = writeln!(out, "headers:");
        for (k, v) in headers {
            let _ = writeln!(out, "  {k}: {v}");
        }
    }
}

fn opt_time(t: Option<i64>) -> String {
    t.map_or("-".into(), fmt_time)
}

fn print_inbox_detail(out: &mut String, d: &admin::InboxDetail) {
    let e = &d.entry;
    let fields: Vec<(&str, String)> = vec![
        ("id", e.id.to_string()),
        ("consumer", e.consumer.clone()),
        ("source", e.source.clone()),
        ("message id", e.message_id.clone()),
        ("status", e.status.to_string()),
        ("attempts", e.attempts.to_string()),
        ("ordering key", e.ordering_key.clone().unwrap_or("-".into())),
        ("last error", e.last_error.clone().unwrap_or("-".into())),
        ("received at", fmt_time(e.received_at)),
        ("updated at", fmt_time(e.updated_at)),
        (
            "next attempt at",
            match (e.next_attempt_at, e.status) {
                (None, Status::Pending | Status::Failed) => "at once".into(),
                (at, _) => opt_time(at),
            },
        ),
        ("processed at", opt_time(e.processed_at)),
        ("lease until", opt_time(d.lease_until)),
        (
            "lease token",
            d.lease_token.map_or("-".into(), |t| t.to_string()),
        ),
        (
            "payload digest",
            format!(
                "{}{}",
                d.payload_hash,
                match d.payload_hash_ok {
                    Some(true) => " (matches the payload)",
                    Some(false) => " (DOES NOT MATCH the stored payload)",
                    None => "",
                }
            ),
        ),
        (
            "outbox rows",
            if d.caused_outbox.is_empty() {
                "-".into()
            } else {
                d.caused_outbox
                    .iter()
                    .map(|s| s.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            },
        ),
    ];
    key_values(out, &fields);
    print_headers(out, &d.headers);
    print_payload(out, "payload", d.payload.as_ref());
}

fn print_conflict(out: &mut String, d: &admin::ConflictDetail) {
    let e = &d.entry;
    key_values(
        out,
        &[
            ("conflict id", e.id.to_string()),
            ("consumer", e.consumer.clone()),
            ("source", e.source.clone()),
            ("message id", e.message_id.clone()),
            ("deliveries", e.deliveries.to_string()),
            ("first seen", fmt_time(e.first_seen_at)),
            ("last seen", fmt_time(e.last_seen_at)),
            ("stored digest", e.stored_hash.clone()),
            ("new digest", e.payload_hash.clone()),
            (
                "stored row",
                match &d.stored {
                    Some(s) => format!("inbox row {} ({})", s.id, s.status),
                    None => "deleted by retention".into(),
                },
            ),
        ],
    );
    print_headers(out, &d.headers);
    print_payload(out, "quarantined payload", Some(&d.payload));
    if d.stored.is_some() {
        print_payload(out, "stored payload", d.stored_payload.as_ref());
    }
}

fn print_check(out: &mut String, r: &admin::CheckReport) {
    if r.integrity_ok {
        let _ = writeln!(out, "{}: ok", r.integrity_check);
    } else {
        let _ = writeln!(out, "{}: FAILED", r.integrity_check);
        for line in r.integrity_errors.iter().flat_map(|e| e.lines()) {
            let _ = writeln!(out, "  {line}");
        }
        let _ = writeln!(out, "postroom invariants not checked: the file is damaged");
        return;
    }
    let _ = writeln!(
        out,
        "checked {} inbox row(s), {} outbox row(s), {} payload digest(s)",
        r.inbox_rows, r.outbox_rows, r.payloads_hashed
    );
    for (title, list, total) in [
        ("violations", &r.violations, r.violations_total),
        ("warnings", &r.warnings, r.warnings_total),
    ] {
        if total == 0 {
            continue;
        }
        let _ = writeln!(out, "\n{title} ({total}):");
        let mut t = Table::new(&["KIND", "TABLE", "ID", "DETAIL"]);
        t.right(&[2]);
        for f in list {
            t.row(vec![
                f.kind.to_string(),
                f.table.to_owned(),
                f.id.to_string(),
                f.detail.clone(),
            ]);
        }
        t.render(out);
        if (list.len() as u64) < total {
            let _ = writeln!(out, "… and {} more", total - list.len() as u64);
        }
    }
    let _ = writeln!(
        out,
        "\n{}",
        if r.is_ok() {
            format!("check: OK ({} warning(s))", r.warnings_total)
        } else {
            format!("check: {} VIOLATION(S)", r.violations_total)
        }
    );
}

fn key_values(out: &mut String, fields: &[(&str, String)]) {
    let width = fields.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (k, v) in fields {
        let _ = writeln!(out, "{k:<width$}  {v}");
    }
}

/// Left-aligned text columns, right-aligned number columns, two spaces apart.
struct Table {
    headers: Vec<String>,
    right: Vec<bool>,
    rows: Vec<Vec<String>>,
}

impl Table {
    fn new(headers: &[&str]) -> Self {
        Table {
            headers: headers.iter().map(|h| (*h).to_owned()).collect(),
            right: vec![false; headers.len()],
            rows: Vec::new(),
        }
    }

    fn right(&mut self, columns: &[usize]) {
        for &c in columns {
            self.right[c] = true;
        }
    }

    fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    fn render(&self, out: &mut String) {
        let width = |s: &str| s.chars().count();
        let mut widths: Vec<usize> = self.headers.iter().map(|h| width(h)).collect();
        for row in &self.rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(width(cell));
            }
        }
        let last = self.headers.len().saturating_sub(1);
        for row in std::iter::once(&self.headers).chain(&self.rows) {
            let mut line = String::new();
            for (i, cell) in row.iter().enumerate() {
                let pad = widths[i].saturating_sub(width(cell));
                if self.right[i] {
                    line.push_str(&" ".repeat(pad));
                    line.push_str(cell);
                } else {
                    line.push_str(cell);
                    if i != last {
                        line.push_str(&" ".repeat(pad));
                    }
                }
                if i != last {
                    line.push_str("  ");
                }
            }
            let _ = writeln!(out, "{}", line.trim_end());
        }
    }
}

/// At most `max` characters, control characters shown as spaces, with `…`
/// when cut.
fn clip(s: &str, max: usize) -> String {
    let clean: String = s
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if clean.chars().count() <= max {
        clean
    } else {
        let mut cut: String = clean.chars().take(max.saturating_sub(1)).collect();
        cut.push('…');
        cut
    }
}

fn fmt_bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

/// A duration in ms as `850ms`, `12s`, `3m12s`, `5h03m`, `2d04h`.
fn fmt_age(ms: i64) -> String {
    let ms = ms.max(0);
    let s = ms / 1000;
    match s {
        _ if ms < 1000 => format!("{ms}ms"),
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m{:02}s", s / 60, s % 60),
        3600..=86_399 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{:02}h", s / 86_400, s % 86_400 / 3600),
    }
}

/// Unix ms as `YYYY-MM-DD hh:mm:ss.mmmZ` (UTC).
fn fmt_time(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let millis = ms.rem_euclid(1000);
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}.{millis:03}Z",
        tod / 3600,
        tod % 3600 / 60,
        tod % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn times_and_ages_format() {
        assert_eq!(fmt_time(0), "1970-01-01 00:00:00.000Z");
        assert_eq!(fmt_time(951_782_400_123), "2000-02-29 00:00:00.123Z");
        assert_eq!(fmt_time(1_700_000_000_000), "2023-11-14 22:13:20.000Z");
        assert_eq!(fmt_age(850), "850ms");
        assert_eq!(fmt_age(192_000), "3m12s");
        assert_eq!(fmt_age(2 * 86_400_000 + 4 * 3_600_000), "2d04h");
        assert_eq!(clip("abcdef", 4), "abc…");
    }

    #[test]
    fn the_path_is_used_as_given() {
        let cli = Cli::parse_from(["postroom", "x.db", "status", "--json"]);
        assert_eq!(cli.db, Path::new("x.db"));
        assert!(cli.json);
    }
}
