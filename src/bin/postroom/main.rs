//! `postroom`: the operator CLI for a postroom database (feature `cli`).
//!
//! It works on a database while an application has it open, and never
//! makes things worse: it never opens a `Postroom` engine, never takes the
//! engine's lock file (`<db>-postroom`) and never creates a file.
//!
//! * Read commands (`status`, `top`, `metrics`, `check`, the lists and
//!   shows, `cleanup --dry-run`, `--dry-run` of bulk actions) leave every
//!   file byte for byte as it was: read-only, or SQLite's `immutable` mode
//!   when there is no WAL to read (see `postroom::admin::open_read`). They
//!   say on stderr when a WAL is present that only the engine should
//!   recover.
//! * Write commands (`dead redrive`, `dead discard`, `conflicts discard`,
//!   `cleanup`) first run the integrity check the engine runs at open and
//!   refuse a damaged or read-only database (exit 3); their writes run in
//!   short `BEGIN IMMEDIATE` transactions serialized with the engine's
//!   writer.
//!
//! ```text
//! postroom <DB> status
//! postroom <DB> top [--interval 2s] [--iterations N]
//! postroom <DB> inbox list [--consumer C] [--status S] [--source S] [--since T] [--until T]
//!                          [--waiting-for-redelivery] [--oldest-first] [--limit N] [--after ID]
//! postroom <DB> inbox show ID
//! postroom <DB> outbox list [--status S] [--topic T] [--key K] [--since T] [--until T]
//!                           [--oldest-first] [--limit N] [--after SEQ]
//! postroom <DB> outbox show SEQ
//! postroom <DB> dead list [--outbox | --consumer C] [--error TEXT] [--since T] [--until T]
//!                         [--oldest-first] [--limit N] [--after ID]
//! postroom <DB> dead redrive [--outbox] (ID | --all | filters) [--dry-run] [--yes]
//! postroom <DB> dead discard [--outbox] (ID | --all | filters) [--dry-run] [--yes]
//! postroom <DB> conflicts list [--oldest-first] [--limit N] [--after ID]
//! postroom <DB> conflicts show ID
//! postroom <DB> conflicts discard ID
//! postroom <DB> cleanup [--retention 7d] [--dead-retention D] [--conflict-retention D] [--dry-run]
//! postroom <DB> check [--full]
//! postroom <DB> metrics
//! ```
//! Times are RFC 3339 (`2026-11-25T10:00Z`), dates (`2026-11-25`, UTC) or
//! ages (`2h`, `7d` ago); durations are `7d`, `36h`, `1h30m`. `--json`
//! (anywhere) gives JSON on stdout for every command, payloads with their
//! exact bytes (base64), and a JSON object `{"error", "exit_code"}` on
//! stderr for any error, usage errors included. Progress is drawn on
//! stderr only when it is a terminal.
//!
//! Exit codes:
//!
//! | code | meaning |
//! |---|---|
//! | 0 | success |
//! | 1 | operational error: database busy past the timeout, I/O (writing the output included), other SQLite errors |
//! | 2 | usage error (bad arguments; a bulk action without `--yes` and no terminal to confirm on) |
//! | 3 | bad database: missing or unreadable path, symbolic link loop, not SQLite, not a postroom database, newer schema, damaged, read-only for a write command |
//! | 4 | `check` found broken postroom invariants |
//! | 5 | the row named by ID does not exist (for `dead redrive`/`dead discard`: is not a dead letter) |
#![forbid(unsafe_code)]

mod pretty;
mod render;

use std::ffi::OsString;
use std::fmt::Write as _;
use std::io::{self, IsTerminal, Write as _};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use postroom::admin::{self, DeadLetterAction as Act, OutboxState, Page, ReadView};
use postroom::{Error, Status};
use rusqlite::{Connection, ErrorCode};
use serde::Serialize;
use serde_json::json;

use render::{clip, esc, esc_long, opt_time, table, time};

const EXIT_OK: u8 = 0;
const EXIT_ERROR: u8 = 1;
const EXIT_USAGE: u8 = 2;
const EXIT_BAD_DATABASE: u8 = 3;
const EXIT_CHECK_FAILED: u8 = 4;
const EXIT_NOT_FOUND: u8 = 5;

const EXIT_CODES_HELP: &str = "\
Times: RFC 3339 (2026-11-25T10:00Z), a date (2026-11-25, UTC) or an age (2h, 7d ago).
Durations: 7d, 36h, 1h30m, 90s.

Exit codes:
  0  success
  1  operational error (database busy past the timeout, I/O, writing the output, other SQLite errors)
  2  usage error (bad arguments; a bulk action without --yes and no terminal to confirm on)
  3  bad database: missing path, symlink loop, not SQLite, not a postroom database, newer
     schema, damaged, or read-only for a write command
  4  check found broken postroom invariants
  5  the row named by ID does not exist (redrive/discard: is not a dead letter)

The tool works beside a running application and never makes things worse: it never takes
the engine's lock and never creates a file; read commands leave the files byte for byte as
they were; write commands refuse a damaged database, then write in short BEGIN IMMEDIATE
transactions.";

/// Operator tool for a postroom database (inbox/outbox in one SQLite file).
#[derive(Debug, Parser)]
#[command(name = "postroom", version, after_help = EXIT_CODES_HELP)]
struct Cli {
    /// The database file (must exist; never created)
    db: PathBuf,
    /// Machine-readable JSON output (errors: a JSON object on stderr)
    #[arg(long, global = true)]
    json: bool,
    /// How long to wait for the running engine's write lock
    #[arg(long, global = true, value_name = "DURATION", default_value = "5s",
          value_parser = parse_busy_timeout)]
    busy_timeout: Duration,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Counts per consumer and status, backlog ages, attempts, outbox, conflicts, file sizes
    Status,
    /// Status refreshed in place, with rates: what the engine is doing now
    Top {
        /// Time between refreshes (at least 100ms)
        #[arg(long, value_name = "DURATION", default_value = "2s", value_parser = render::parse_duration)]
        interval: Duration,
        /// Stop after this many refreshes (default: until interrupted)
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
        iterations: Option<u64>,
    },
    /// Inbox rows
    #[command(subcommand)]
    Inbox(InboxCommand),
    /// Outbox rows: what the relay still has to send, what it sent, what is dead
    #[command(subcommand)]
    Outbox(OutboxCommand),
    /// Dead letters of the inbox (default) or the outbox
    #[command(subcommand)]
    Dead(DeadCommand),
    /// Quarantined deliveries (same id, different payload)
    #[command(subcommand)]
    Conflicts(ConflictsCommand),
    /// Delete completed inbox rows and sent outbox rows older than the retention
    /// (and, when asked, old dead letters and conflicts)
    Cleanup {
        /// Keep rows finished within this long
        #[arg(long, value_name = "DURATION", default_value = "7d", value_parser = render::parse_duration)]
        retention: Duration,
        /// Also delete inbox dead letters that died longer ago than this (default: keep them)
        #[arg(long, value_name = "DURATION", value_parser = render::parse_duration)]
        dead_retention: Option<Duration>,
        /// Also delete conflicts last seen longer ago than this (default: keep them)
        #[arg(long, value_name = "DURATION", value_parser = render::parse_duration)]
        conflict_retention: Option<Duration>,
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

#[derive(Debug, Args)]
struct PageArgs {
    /// Oldest first (default: newest first)
    #[arg(long)]
    oldest_first: bool,
    /// At most this many rows
    #[arg(long, value_name = "N", default_value_t = 100)]
    limit: usize,
    /// The next page: rows past this id (the last one the previous page showed)
    #[arg(long, value_name = "ID")]
    after: Option<i64>,
}

impl PageArgs {
    fn page(&self) -> Page {
        Page {
            oldest_first: self.oldest_first,
            after: self.after,
            limit: self.limit,
        }
    }
}

#[derive(Debug, Subcommand)]
enum InboxCommand {
    /// Inbox rows, newest first, filtered
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
    /// Only rows received at or after this time
    #[arg(long, value_name = "TIME", value_parser = render::parse_time)]
    since: Option<i64>,
    /// Only rows received before this time
    #[arg(long, value_name = "TIME", value_parser = render::parse_time)]
    until: Option<i64>,
    /// Only failed rows no worker will retry: they wait for their sender
    /// to redeliver them (delivered inline, or counted by crash recovery
    /// before their receipt committed)
    #[arg(long)]
    waiting_for_redelivery: bool,
    #[command(flatten)]
    page: PageArgs,
}

#[derive(Debug, Subcommand)]
enum OutboxCommand {
    /// Outbox rows, newest first, filtered
    List(OutboxListArgs),
    /// One outbox row in full, and which earlier row of its key holds it back
    Show {
        /// Its seq (from `outbox list`)
        seq: i64,
    },
}

#[derive(Debug, Args)]
struct OutboxListArgs {
    /// Only this status: pending, sent or dead
    #[arg(long, value_parser = parse_outbox_status)]
    status: Option<OutboxState>,
    /// Only this topic
    #[arg(long)]
    topic: Option<String>,
    /// Only this ordering key
    #[arg(long)]
    key: Option<String>,
    /// Only rows committed at or after this time
    #[arg(long, value_name = "TIME", value_parser = render::parse_time)]
    since: Option<i64>,
    /// Only rows committed before this time
    #[arg(long, value_name = "TIME", value_parser = render::parse_time)]
    until: Option<i64>,
    #[command(flatten)]
    page: PageArgs,
}

/// Which dead letters a `dead` command covers.
#[derive(Debug, Args)]
struct DeadSelect {
    /// Dead outbox rows instead of inbox messages
    #[arg(long, conflicts_with = "consumer")]
    outbox: bool,
    /// Only this consumer's dead letters
    #[arg(long)]
    consumer: Option<String>,
    /// Only those whose last error contains this text
    #[arg(long, value_name = "TEXT")]
    error: Option<String>,
    /// Only those that died (outbox: were committed) at or after this time
    #[arg(long, value_name = "TIME", value_parser = render::parse_time)]
    since: Option<i64>,
    /// Only those that died (outbox: were committed) before this time
    #[arg(long, value_name = "TIME", value_parser = render::parse_time)]
    until: Option<i64>,
}

impl DeadSelect {
    fn filter(&self) -> admin::DeadFilter {
        admin::DeadFilter {
            outbox: self.outbox,
            consumer: self.consumer.clone(),
            error_contains: self.error.clone(),
            since_ms: self.since,
            until_ms: self.until,
        }
    }

    fn narrowed(&self) -> bool {
        self.consumer.is_some()
            || self.error.is_some()
            || self.since.is_some()
            || self.until.is_some()
    }

    fn table(&self) -> &'static str {
        if self.outbox {
            "outbox"
        } else {
            "inbox"
        }
    }
}

#[derive(Debug, Args)]
struct DeadAction {
    #[command(flatten)]
    select: DeadSelect,
    /// One dead letter: inbox row id (or outbox seq with --outbox). Without
    /// it, every dead letter the filters (or --all) select.
    #[arg(conflicts_with_all = ["all", "consumer", "error", "since", "until"])]
    id: Option<i64>,
    /// Every dead letter (of the inbox, or the outbox with --outbox)
    #[arg(long)]
    all: bool,
    /// Only show what would be done
    #[arg(long)]
    dry_run: bool,
    /// Do it without asking (needed when stdin is not a terminal)
    #[arg(long)]
    yes: bool,
}

#[derive(Debug, Subcommand)]
enum DeadCommand {
    /// Dead letters, newest first
    List {
        #[command(flatten)]
        select: DeadSelect,
        #[command(flatten)]
        page: PageArgs,
    },
    /// Send dead letters back to be processed (pending, attempts reset)
    Redrive(DeadAction),
    /// Give up on dead letters (inbox: completed without effects; outbox: marked sent, never sent)
    Discard(DeadAction),
}

#[derive(Debug, Subcommand)]
enum ConflictsCommand {
    /// Quarantined deliveries, newest first
    List {
        #[command(flatten)]
        page: PageArgs,
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

fn parse_outbox_status(s: &str) -> Result<OutboxState, String> {
    s.parse()
}

fn parse_busy_timeout(s: &str) -> Result<Duration, String> {
    let d = render::parse_duration(s)?;
    if d > Duration::from_millis(i32::MAX as u64) {
        return Err(format!(
            "{s:?} is too long: SQLite waits at most 2147483647 ms"
        ));
    }
    Ok(d)
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
            // The path itself: missing, a symlink loop, a directory we may
            // not enter.
            Error::Io { op, .. } if *op == "open database" => EXIT_BAD_DATABASE,
            // A read-only mount or file met at write time.
            Error::Sqlite { source, .. }
                if matches!(source.sqlite_error_code(), Some(ErrorCode::ReadOnly)) =>
            {
                EXIT_BAD_DATABASE
            }
            Error::InvalidInput { .. } => EXIT_USAGE,
            // The linked SQLite, not the database: an operational error.
            _ => EXIT_ERROR,
        };
        Failed {
            code,
            message: e.to_string(),
        }
    }
}

fn usage(message: String) -> Failed {
    Failed {
        code: EXIT_USAGE,
        message,
    }
}

fn not_found(message: String) -> Failed {
    Failed {
        code: EXIT_NOT_FOUND,
        message,
    }
}

/// The command line parser, with `<DB>` in every subcommand's usage line.
/// clap writes a subcommand's usage as its parent's name, the parent's
/// required arguments, then its own name, so a nested one
/// (`inbox list`) loses `<DB>`. Named `postroom <DB>`, the root passes it
/// down to every level; the first level, which would then show it twice,
/// gets its usage line fixed.
fn command() -> clap::Command {
    let mut cmd = Cli::command()
        .bin_name("postroom <DB>")
        .override_usage("postroom [OPTIONS] <DB> <COMMAND>");
    cmd.build();
    let fixed: Vec<(String, String)> = cmd
        .get_subcommands_mut()
        .map(|sc| {
            let usage = sc.render_usage().to_string();
            let usage = usage.trim_start_matches("Usage: ");
            (
                sc.get_name().to_owned(),
                usage.replacen("postroom <DB> <DB>", "postroom <DB>", 1),
            )
        })
        .collect();
    fixed.into_iter().fold(cmd, |cmd, (name, usage)| {
        cmd.mut_subcommand(name, |sc| sc.override_usage(usage))
    })
}

fn main() -> ExitCode {
    let args: Vec<OsString> = std::env::args_os().collect();
    let json = args.iter().any(|a| a == "--json");
    let cli = match command()
        .try_get_matches_from(&args)
        .and_then(|m| Cli::from_arg_matches(&m))
    {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) || !json {
                e.exit();
            }
            let message = e.render().to_string();
            let message = message.trim_end().trim_start_matches("error: ");
            report(true, &usage(message.to_owned()));
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let mut ctx = Ctx {
        cli: &cli,
        out: String::new(),
    };
    let code = match run(&mut ctx) {
        Ok(code) => code,
        Err(f) => {
            report(cli.json, &f);
            f.code
        }
    };
    if let Err(f) = ctx.flush() {
        report(cli.json, &f);
        return ExitCode::from(if code == EXIT_OK { f.code } else { code });
    }
    ExitCode::from(code)
}

fn report(json: bool, f: &Failed) {
    let mut err = io::stderr().lock();
    if json {
        let _ = writeln!(
            err,
            "{}",
            json!({ "error": f.message, "exit_code": f.code })
        );
    } else {
        let _ = writeln!(err, "postroom: {}", f.message);
    }
}

/// The command line and the output, written at the end (or per frame by
/// `top`) so a failing command prints nothing partial.
struct Ctx<'a> {
    cli: &'a Cli,
    out: String,
}

impl Ctx<'_> {
    /// Writes the output. A reader that went away (`| head`) is not an
    /// error; any other failure to write (a full disk) is exit code 1.
    /// Returns false when the reader has gone.
    fn flush(&mut self) -> Result<bool, Failed> {
        let text = std::mem::take(&mut self.out);
        let mut stdout = io::stdout().lock();
        match stdout
            .write_all(text.as_bytes())
            .and_then(|()| stdout.flush())
        {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(false),
            Err(e) => Err(Failed {
                code: EXIT_ERROR,
                message: format!("writing the output: {e}"),
            }),
        }
    }

    fn json(&mut self, value: &impl Serialize) {
        // Our output types always serialize.
        self.out
            .push_str(&serde_json::to_string_pretty(value).unwrap_or_default());
        self.out.push('\n');
    }

    /// Runs a read command on a connection that changes no file, telling
    /// on stderr what the operator should know about the WAL.
    fn read<T>(
        &self,
        what: &str,
        mut f: impl FnMut(&Connection) -> postroom::Result<T>,
    ) -> Result<T, Failed> {
        let progress = Progress::spinner(what);
        let (out, view) = admin::read(&self.cli.db, self.cli.busy_timeout, |conn, _| {
            progress.watch(conn);
            f(conn)
        })?;
        progress.finish();
        notices(self.cli.json, &view);
        Ok(out)
    }

    /// A connection for a write command: refused (exit 3) when the file is
    /// damaged or read-only.
    fn write(&self, what: &str) -> Result<(Connection, Progress), Failed> {
        let progress = Progress::spinner(&format!("{what}: checking the database"));
        let mut conn = admin::open_with_timeout(&self.cli.db, true, self.cli.busy_timeout)?;
        progress.watch(&mut conn);
        progress.message(what);
        Ok((conn, progress))
    }
}

/// What the operator should know about what was read, on stderr: plain
/// lines, or under `--json` one `{"notice": …}` object per line.
fn notices(json: bool, view: &ReadView) {
    for note in view.notices() {
        if json {
            eprintln!("{}", json!({ "notice": note }));
        } else {
            eprintln!("postroom: note: {note}");
        }
    }
}

/// A spinner on stderr while SQLite works, drawn only when stderr is a
/// terminal; ticked by SQLite's progress handler, so a long statement
/// (an integrity check, a count over a million rows) shows it is alive.
struct Progress(indicatif::ProgressBar);

impl Progress {
    fn spinner(message: &str) -> Progress {
        let bar =
            indicatif::ProgressBar::with_draw_target(None, indicatif::ProgressDrawTarget::stderr());
        bar.set_style(
            indicatif::ProgressStyle::with_template("{spinner} {msg} [{elapsed}]")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
        );
        bar.set_message(message.to_owned());
        Progress(bar)
    }

    fn watch(&self, conn: &mut Connection) {
        let bar = self.0.clone();
        // Only the spinner depends on it: a refusal is not worth failing for.
        let _ = conn.progress_handler(
            100_000,
            Some(move || {
                bar.tick();
                false
            }),
        );
    }

    fn message(&self, message: &str) {
        self.0.set_message(message.to_owned());
    }

    fn finish(&self) {
        self.0.finish_and_clear();
    }
}

fn run(ctx: &mut Ctx<'_>) -> Result<u8, Failed> {
    let cli = ctx.cli;
    match &cli.command {
        Command::Status => {
            let report = ctx.read("status", |c| admin::status(c, &cli.db))?;
            if cli.json {
                ctx.json(&report);
            } else {
                print_slow_handler(&mut ctx.out, &cli.db, report.now_ms);
                print_status(&mut ctx.out, &report);
                print_sequences(&mut ctx.out, &report.sequences);
            }
        }
        Command::Top {
            interval,
            iterations,
        } => top(ctx, *interval, *iterations)?,
        Command::Metrics => {
            let report = ctx.read("metrics", |c| admin::status(c, &cli.db))?;
            if cli.json {
                ctx.json(&report);
            } else {
                ctx.out.push_str(&admin::prometheus(&report));
                ctx.out
                    .push_str(&admin::sequences_prometheus(&report.sequences));
            }
        }
        Command::Inbox(InboxCommand::List(args)) => {
            let filter = admin::InboxFilter {
                consumer: args.consumer.clone(),
                status: args.status,
                source: args.source.clone(),
                since_ms: args.since,
                until_ms: args.until,
                waiting_for_redelivery: args.waiting_for_redelivery,
                page: args.page.page(),
            };
            let rows = ctx.read("inbox list", |c| admin::inbox_list(c, &filter))?;
            if cli.json {
                ctx.json(&rows);
            } else {
                let cells = rows
                    .iter()
                    .map(|r| {
                        vec![
                            r.id.to_string(),
                            esc(&r.consumer),
                            esc(&r.source),
                            clip(&r.message_id, 40),
                            inbox_state(r),
                            r.attempts.to_string(),
                            time(r.received_at),
                            r.payload_bytes.map_or("-".into(), |n| n.to_string()),
                            clip(r.last_error.as_deref().unwrap_or(""), 60),
                        ]
                    })
                    .collect();
                table(
                    &mut ctx.out,
                    &[
                        "ID",
                        "CONSUMER",
                        "SOURCE",
                        "MESSAGE ID",
                        "STATUS",
                        "ATTEMPTS",
                        "RECEIVED",
                        "PAYLOAD",
                        "LAST ERROR",
                    ],
                    &[0, 5, 7],
                    cells,
                );
                page_footer(
                    &mut ctx.out,
                    rows.len(),
                    &args.page,
                    rows.last().map(|r| r.id),
                );
            }
        }
        Command::Inbox(InboxCommand::Show { id }) => {
            let Some(d) = ctx.read("inbox show", |c| admin::inbox_show(c, *id))? else {
                return Err(not_found(format!("no inbox row with id {id}")));
            };
            if cli.json {
                ctx.json(&d);
            } else {
                print_inbox_detail(&mut ctx.out, &d);
            }
        }
        Command::Outbox(OutboxCommand::List(args)) => {
            let filter = admin::OutboxFilter {
                status: args.status,
                topic: args.topic.clone(),
                key: args.key.clone(),
                since_ms: args.since,
                until_ms: args.until,
                page: args.page.page(),
            };
            let rows = ctx.read("outbox list", |c| admin::outbox_list(c, &filter))?;
            if cli.json {
                ctx.json(&rows);
            } else {
                let cells = rows
                    .iter()
                    .map(|r| {
                        vec![
                            r.seq.to_string(),
                            esc(&r.topic),
                            clip(r.key.as_deref().unwrap_or("-"), 24),
                            clip(&r.message_id, 32),
                            r.status.to_string(),
                            r.attempts.to_string(),
                            time(r.created_at),
                            opt_time(r.next_attempt_at.or(r.sent_at)),
                            r.payload_bytes.to_string(),
                            clip(r.last_error.as_deref().unwrap_or(""), 50),
                        ]
                    })
                    .collect();
                table(
                    &mut ctx.out,
                    &[
                        "SEQ",
                        "TOPIC",
                        "KEY",
                        "MESSAGE ID",
                        "STATUS",
                        "ATTEMPTS",
                        "CREATED",
                        "NEXT TRY / SENT",
                        "PAYLOAD",
                        "LAST ERROR",
                    ],
                    &[0, 5, 8],
                    cells,
                );
                page_footer(
                    &mut ctx.out,
                    rows.len(),
                    &args.page,
                    rows.last().map(|r| r.seq),
                );
            }
        }
        Command::Outbox(OutboxCommand::Show { seq }) => {
            let Some(d) = ctx.read("outbox show", |c| admin::outbox_show(c, *seq))? else {
                return Err(not_found(format!("no outbox row with seq {seq}")));
            };
            if cli.json {
                ctx.json(&d);
            } else {
                print_outbox_detail(&mut ctx.out, &d);
            }
        }
        Command::Dead(DeadCommand::List { select, page }) => {
            let filter = select.filter();
            let rows = ctx.read("dead list", |c| dead_rows(c, &filter, page.page()))?;
            print_dead(ctx, &rows, select.outbox);
            if !cli.json {
                let last = rows.last().map(|r| match r {
                    DeadRow::Inbox(d) => d.entry.id,
                    DeadRow::Outbox(d) => d.entry.seq,
                });
                next_page(&mut ctx.out, rows.len(), page, last);
            }
        }
        Command::Dead(DeadCommand::Redrive(action)) => dead_action(ctx, action, Act::Redrive)?,
        Command::Dead(DeadCommand::Discard(action)) => dead_action(ctx, action, Act::Discard)?,
        Command::Conflicts(ConflictsCommand::List { page }) => {
            let rows = ctx.read("conflicts list", |c| admin::conflicts_list(c, page.page()))?;
            if cli.json {
                ctx.json(&rows);
            } else {
                let cells = rows
                    .iter()
                    .map(|r| {
                        vec![
                            r.id.to_string(),
                            esc(&r.consumer),
                            esc(&r.source),
                            clip(&r.message_id, 40),
                            r.deliveries.to_string(),
                            r.payload_bytes.to_string(),
                            time(r.first_seen_at),
                            time(r.last_seen_at),
                        ]
                    })
                    .collect();
                table(
                    &mut ctx.out,
                    &[
                        "ID",
                        "CONSUMER",
                        "SOURCE",
                        "MESSAGE ID",
                        "DELIVERIES",
                        "PAYLOAD",
                        "FIRST SEEN",
                        "LAST SEEN",
                    ],
                    &[0, 4, 5],
                    cells,
                );
                let _ = writeln!(ctx.out, "{} conflict(s)", rows.len());
                next_page(&mut ctx.out, rows.len(), page, rows.last().map(|r| r.id));
            }
        }
        Command::Conflicts(ConflictsCommand::Show { id }) => {
            let Some(d) = ctx.read("conflicts show", |c| admin::conflicts_show(c, *id))? else {
                return Err(not_found(format!("no conflict with id {id}")));
            };
            if cli.json {
                ctx.json(&d);
            } else {
                print_conflict(&mut ctx.out, &d);
            }
        }
        Command::Conflicts(ConflictsCommand::Discard { id }) => {
            let (conn, progress) = ctx.write("conflicts discard")?;
            let done = admin::conflicts_discard(&conn, *id)?;
            progress.finish();
            if !done {
                return Err(not_found(format!("no conflict with id {id}")));
            }
            let what = format!("conflict {id} discarded: deleted with its payload");
            mutation(ctx, "discard", "conflicts", *id, &what);
        }
        Command::Cleanup {
            retention,
            dead_retention,
            conflict_retention,
            dry_run,
        } => {
            let policy = admin::Retention::new(*retention)
                .dead(*dead_retention)
                .conflicts(*conflict_retention);
            let s = if *dry_run {
                ctx.read("cleanup: counting expired rows", |c| {
                    admin::cleanup(c, admin::now_ms(), policy, true)
                })?
            } else {
                let (conn, progress) = ctx.write("cleanup: deleting expired rows")?;
                let s = admin::cleanup(&conn, admin::now_ms(), policy, false)?;
                progress.finish();
                s
            };
            if cli.json {
                ctx.json(&s);
            } else {
                print_cleanup(&mut ctx.out, &s, *retention);
            }
        }
        Command::Check { full } => {
            let what = if *full {
                "integrity_check"
            } else {
                "quick_check"
            };
            let report = ctx.read(what, |c| admin::check(c, *full))?;
            if cli.json {
                ctx.json(&report);
            } else {
                print_check(&mut ctx.out, &report);
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

fn page_footer(out: &mut String, shown: usize, page: &PageArgs, last: Option<i64>) {
    let _ = write!(out, "{shown} row(s)");
    match last {
        Some(last) if shown == page.limit => {
            let _ = writeln!(out, "; next page: --after {last}");
        }
        _ => out.push('\n'),
    }
}

/// For a listing that counts its rows itself: the next page, when the
/// page was full.
fn next_page(out: &mut String, shown: usize, page: &PageArgs, last: Option<i64>) {
    if let Some(last) = last.filter(|_| shown == page.limit) {
        let _ = writeln!(out, "next page: --after {last}");
    }
}

// ---------------------------------------------------------------- dead letters

/// A dead letter as `dead list` shows it: the row in full.
#[derive(Serialize)]
#[serde(untagged)]
enum DeadRow {
    Inbox(admin::InboxDetail),
    Outbox(admin::OutboxDetail),
}

fn dead_rows(
    conn: &Connection,
    filter: &admin::DeadFilter,
    page: Page,
) -> postroom::Result<Vec<DeadRow>> {
    let mut rows = Vec::new();
    for id in admin::dead_select(conn, filter, page)? {
        let row = if filter.outbox {
            admin::outbox_show(conn, id)?.map(DeadRow::Outbox)
        } else {
            admin::inbox_show(conn, id)?.map(DeadRow::Inbox)
        };
        rows.extend(row);
    }
    Ok(rows)
}

fn print_dead(ctx: &mut Ctx<'_>, rows: &[DeadRow], outbox: bool) {
    if ctx.cli.json {
        ctx.json(&rows);
        return;
    }
    let cells = rows
        .iter()
        .map(|row| match row {
            DeadRow::Inbox(d) => vec![
                d.entry.id.to_string(),
                esc(&d.entry.consumer),
                esc(&d.entry.source),
                clip(&d.entry.message_id, 40),
                d.entry.attempts.to_string(),
                time(d.entry.updated_at),
                d.entry.payload_bytes.unwrap_or(0).to_string(),
                clip(d.entry.last_error.as_deref().unwrap_or(""), 60),
            ],
            DeadRow::Outbox(d) => vec![
                d.entry.seq.to_string(),
                esc(&d.entry.topic),
                clip(d.entry.key.as_deref().unwrap_or("-"), 24),
                clip(&d.entry.message_id, 40),
                d.entry.attempts.to_string(),
                time(d.entry.created_at),
                d.entry.payload_bytes.to_string(),
                clip(d.entry.last_error.as_deref().unwrap_or(""), 60),
            ],
        })
        .collect();
    let headers = if outbox {
        [
            "SEQ",
            "TOPIC",
            "KEY",
            "MESSAGE ID",
            "ATTEMPTS",
            "CREATED",
            "PAYLOAD",
            "LAST ERROR",
        ]
    } else {
        [
            "ID",
            "CONSUMER",
            "SOURCE",
            "MESSAGE ID",
            "ATTEMPTS",
            "DIED",
            "PAYLOAD",
            "LAST ERROR",
        ]
    };
    table(&mut ctx.out, &headers, &[0, 4, 6], cells);
    let _ = writeln!(ctx.out, "{} dead letter(s)", rows.len());
}

/// Dead letters a bulk dry run shows in full.
const PREVIEW_ROWS: usize = 20;

#[derive(Serialize)]
struct Mutation<'a> {
    action: &'a str,
    table: &'a str,
    id: i64,
    done: bool,
    message: &'a str,
}

fn mutation(ctx: &mut Ctx<'_>, action: &str, table: &str, id: i64, message: &str) {
    if ctx.cli.json {
        ctx.json(&Mutation {
            action,
            table,
            id,
            done: true,
            message,
        });
    } else {
        let _ = writeln!(ctx.out, "{message}");
    }
}

/// What a bulk redrive or discard did, or would do.
#[derive(Serialize)]
struct BulkReport<'a> {
    action: &'a str,
    table: &'a str,
    dry_run: bool,
    matched: usize,
    ids: &'a [i64],
    done: u64,
    skipped: u64,
}

fn dead_action(ctx: &mut Ctx<'_>, action: &DeadAction, act: Act) -> Result<(), Failed> {
    let sel = &action.select;
    if let Some(id) = action.id {
        if action.dry_run {
            return Err(usage(
                "--dry-run is for bulk actions; `dead list` shows one dead letter".into(),
            ));
        }
        return dead_one(ctx, sel.outbox, id, act);
    }
    if !action.all && !sel.narrowed() {
        return Err(usage(format!(
            "name a dead letter by ID, or select several with --consumer, --error, --since, \
             --until or --all (try `postroom <DB> dead {} --all --dry-run`)",
            act.as_str()
        )));
    }
    let filter = sel.filter();
    let verb = act.as_str();
    // Ids only (a bulk action may cover many rows, each with a payload of up
    // to a MiB); the dry run shows the first few in full.
    let (ids, preview) = ctx.read("selecting dead letters", |c| {
        let ids = admin::dead_select(c, &filter, Page::all())?;
        let preview = if action.dry_run && !ctx.cli.json {
            dead_rows(
                c,
                &filter,
                Page {
                    limit: PREVIEW_ROWS,
                    ..Page::all()
                },
            )?
        } else {
            Vec::new()
        };
        Ok((ids, preview))
    })?;
    let mut report = BulkReport {
        action: verb,
        table: sel.table(),
        dry_run: action.dry_run,
        matched: ids.len(),
        ids: &ids,
        done: 0,
        skipped: 0,
    };
    if action.dry_run || ids.is_empty() {
        if ctx.cli.json {
            ctx.json(&report);
        } else if action.dry_run {
            print_dead(ctx, &preview, sel.outbox);
            if ids.len() > preview.len() {
                let _ = writeln!(ctx.out, "… the first {} shown", preview.len());
            }
            let _ = writeln!(
                ctx.out,
                "dry run: would {verb} {} {} dead letter(s); run again without --dry-run to do it",
                ids.len(),
                sel.table()
            );
        } else {
            let _ = writeln!(
                ctx.out,
                "no {} dead letter matches: nothing to {verb}",
                sel.table()
            );
        }
        return Ok(());
    }
    if !action.yes {
        confirm(&format!(
            "{verb} {} {} dead letter(s)?",
            ids.len(),
            sel.table()
        ))?;
    }
    let (conn, progress) = ctx.write(&format!("{verb}: 0 of {}", ids.len()))?;
    let total = ids.len();
    let mut on_batch = |n: u64| progress.message(&format!("{verb}: {n} of {total}"));
    let s =
        admin::act_on_dead_letters(&conn, act, sel.outbox, &ids, admin::now_ms(), &mut on_batch)?;
    progress.finish();
    report.done = s.done;
    report.skipped = s.skipped;
    if ctx.cli.json {
        ctx.json(&report);
    } else {
        let _ = writeln!(
            ctx.out,
            "{verb}: {} {} dead letter(s) done, {} skipped (no longer dead), {} transaction(s)",
            s.done,
            sel.table(),
            s.skipped,
            s.transactions
        );
    }
    Ok(())
}

/// Asks on the terminal; refuses (usage error) when stdin is not one.
fn confirm(question: &str) -> Result<(), Failed> {
    if !io::stdin().is_terminal() {
        return Err(usage(format!(
            "{question} Not without --yes: stdin is not a terminal to confirm on \
             (see what it would do with --dry-run)"
        )));
    }
    eprint!("{question} [y/N] ");
    let _ = io::stderr().flush();
    let mut answer = String::new();
    io::stdin().read_line(&mut answer).map_err(|e| Failed {
        code: EXIT_ERROR,
        message: format!("reading the answer: {e}"),
    })?;
    if matches!(answer.trim(), "y" | "Y" | "yes") {
        Ok(())
    } else {
        Err(Failed {
            code: EXIT_ERROR,
            message: "not confirmed: nothing was changed".into(),
        })
    }
}

fn dead_one(ctx: &mut Ctx<'_>, outbox: bool, id: i64, act: Act) -> Result<(), Failed> {
    let (conn, progress) = ctx.write(act.as_str())?;
    let s = admin::act_on_dead_letters(&conn, act, outbox, &[id], admin::now_ms(), &mut |_| {})?;
    progress.finish();
    if s.done == 0 {
        return Err(not_a_dead_letter(&conn, outbox, id));
    }
    let what = match (act, outbox) {
        (Act::Redrive, true) => format!(
            "outbox row {id} redriven: pending again, attempts reset; the relay sends it at its \
             next poll"
        ),
        (Act::Redrive, false) => format!(
            "inbox row {id} redriven: pending again, attempts reset; a running engine's workers \
             process it at their next poll"
        ),
        (Act::Discard, true) => format!(
            "outbox row {id} discarded: marked sent without being sent, retention deletes it"
        ),
        (Act::Discard, false) => format!(
            "inbox row {id} discarded: completed without effects, a redelivery is a duplicate"
        ),
    };
    let table = if outbox { "outbox" } else { "inbox" };
    mutation(ctx, act.as_str(), table, id, &what);
    Ok(())
}

/// Why a redrive or discard found nothing to do: the row is missing, or in
/// another status.
fn not_a_dead_letter(conn: &Connection, outbox: bool, id: i64) -> Failed {
    let key = if outbox { "seq" } else { "id" };
    let status = if outbox {
        admin::outbox_show(conn, id).map(|row| row.map(|r| r.entry.status.to_string()))
    } else {
        admin::inbox_show(conn, id).map(|row| row.map(|r| r.entry.status.to_string()))
    };
    let status = match status {
        Ok(status) => status,
        Err(e) => return Failed::from(e),
    };
    let what = if outbox { "outbox row" } else { "inbox row" };
    not_found(match status {
        Some(status) => format!("{what} {id} is not a dead letter (it is {status})"),
        None => format!("no {what} with {key} {id}"),
    })
}

// ---------------------------------------------------------------- top

/// One frame of `top --json`.
#[derive(Serialize)]
struct Frame<'a> {
    status: &'a admin::StatusReport,
    /// Per second since the previous frame; absent in the first.
    rates: Option<Rates>,
    engine_running: Option<bool>,
}

#[derive(Serialize, Clone, Copy)]
struct Rates {
    completed_per_sec: f64,
    dead_per_sec: f64,
    received_per_sec: f64,
    sent_per_sec: f64,
}

/// Totals the rates are differences of.
#[derive(Clone, Copy)]
struct Totals {
    at: Instant,
    completed: u64,
    dead: u64,
    received: u64,
    sent: u64,
}

impl Totals {
    fn of(r: &admin::StatusReport) -> Totals {
        let sum = |f: fn(&admin::ConsumerStatus) -> u64| r.consumers.iter().map(f).sum();
        Totals {
            at: Instant::now(),
            completed: sum(|c| c.counts.completed),
            dead: sum(|c| c.counts.dead),
            received: sum(|c| c.total),
            sent: r.outbox.counts.sent,
        }
    }

    /// Rates from `earlier` to `self`. Retention deleting rows can make a
    /// total shrink: that interval counts as 0, not negative.
    fn rates_since(&self, earlier: &Totals) -> Rates {
        let secs = self.at.duration_since(earlier.at).as_secs_f64().max(1e-3);
        let rate = |now: u64, then: u64| now.saturating_sub(then) as f64 / secs;
        Rates {
            completed_per_sec: rate(self.completed, earlier.completed),
            dead_per_sec: rate(self.dead, earlier.dead),
            received_per_sec: rate(self.received, earlier.received),
            sent_per_sec: rate(self.sent, earlier.sent),
        }
    }
}

/// The shortest refresh `top` makes: each one reads the whole inbox.
const TOP_MIN_INTERVAL: Duration = Duration::from_millis(100);

fn top(ctx: &mut Ctx<'_>, interval: Duration, iterations: Option<u64>) -> Result<(), Failed> {
    let interval = interval.max(TOP_MIN_INTERVAL);
    let tty = io::stdout().is_terminal() && !ctx.cli.json;
    let mut previous: Option<Totals> = None;
    let mut frame = 0u64;
    loop {
        // A fresh connection per frame: an engine that opened meanwhile is
        // read through its WAL.
        let (report, view) = admin::read(&ctx.cli.db, ctx.cli.busy_timeout, |c, _| {
            admin::status(c, &ctx.cli.db)
        })?;
        let totals = Totals::of(&report);
        let rates = previous.map(|p| totals.rates_since(&p));
        previous = Some(totals);
        if ctx.cli.json {
            let line = serde_json::to_string(&Frame {
                status: &report,
                rates,
                engine_running: view.engine_running,
            })
            .unwrap_or_default();
            let _ = writeln!(ctx.out, "{line}");
        } else {
            if tty {
                // Home and clear: the frame is redrawn in place.
                ctx.out.push_str("\x1b[H\x1b[2J");
            } else if frame > 0 {
                ctx.out.push('\n');
            }
            let _ = writeln!(
                ctx.out,
                "postroom top — {} — every {} — engine {}",
                time(report.now_ms),
                render::span(interval),
                match view.engine_running {
                    Some(true) => "running",
                    Some(false) => "not running",
                    None => "unknown",
                }
            );
            match rates {
                Some(r) => {
                    let _ = writeln!(
                        ctx.out,
                        "rates/s    received {:.1}  completed {:.1}  dead {:.1}  sent {:.1}",
                        r.received_per_sec, r.completed_per_sec, r.dead_per_sec, r.sent_per_sec
                    );
                }
                None => {
                    let _ = writeln!(ctx.out, "rates/s    (after the next refresh)");
                }
            }
            let _ = writeln!(
                ctx.out,
                "relay lag  {}",
                report
                    .outbox
                    .oldest_pending_age_ms
                    .map_or("none (nothing pending)".into(), render::age)
            );
            print_slow_handler(&mut ctx.out, &ctx.cli.db, report.now_ms);
            print_status(&mut ctx.out, &report);
            print_sequences(&mut ctx.out, &report.sequences);
            for note in view.notices() {
                let _ = writeln!(ctx.out, "note: {note}");
            }
        }
        if !ctx.flush()? {
            // The reader went away (`| head`): done.
            return Ok(());
        }
        frame += 1;
        if iterations.is_some_and(|n| frame >= n) {
            return Ok(());
        }
        std::thread::sleep(interval);
    }
}

// ---------------------------------------------------------------- printing

/// The handler holding a running engine's writer past its `slow_handler`
/// threshold, if one does: every write of that engine waits for it.
fn print_slow_handler(out: &mut String, db: &std::path::Path, now_ms: i64) {
    if let Some(slow) = admin::slow_handler(db) {
        let _ = writeln!(
            out,
            "SLOW HANDLER running for {}: {}/{} (every write of the engine waits for it)",
            render::age(now_ms.saturating_sub(slow.since_ms)),
            esc(&slow.consumer),
            esc(&slow.message_id)
        );
    }
}

/// An inbox row's state for people: its status, and for a failed row that
/// no worker retries, that it waits for its sender's redelivery.
fn inbox_state(e: &admin::InboxEntry) -> String {
    if e.waiting_for_redelivery {
        format!("{} (waiting for redelivery)", e.status)
    } else {
        e.status.to_string()
    }
}

fn print_status(out: &mut String, r: &admin::StatusReport) {
    let _ = writeln!(out, "database   {}", esc(&r.path));
    let _ = writeln!(out, "schema     {}", r.schema_version);
    let _ = writeln!(
        out,
        "size       {} database, {} WAL",
        render::bytes(r.db_bytes),
        render::bytes(r.wal_bytes)
    );
    let _ = writeln!(out, "conflicts  {}", r.conflicts);
    let _ = writeln!(out);
    if r.consumers.is_empty() {
        let _ = writeln!(out, "inbox: empty");
    } else {
        let cells = r
            .consumers
            .iter()
            .map(|c| {
                vec![
                    esc(&c.consumer),
                    c.counts.pending.to_string(),
                    c.counts.processing.to_string(),
                    c.counts.completed.to_string(),
                    c.counts.failed.to_string(),
                    c.counts.waiting_for_redelivery.to_string(),
                    c.oldest_waiting_for_redelivery_age_ms
                        .map_or("-".into(), render::age),
                    c.counts.dead.to_string(),
                    c.total.to_string(),
                    c.oldest_pending_age_ms.map_or("-".into(), render::age),
                    c.expired_leases.to_string(),
                    c.attempts
                        .iter()
                        .map(|b| format!("{}:{}", b.attempts, b.rows))
                        .collect::<Vec<_>>()
                        .join(" "),
                ]
            })
            .collect();
        table(
            out,
            &[
                "CONSUMER",
                "PENDING",
                "PROCESSING",
                "COMPLETED",
                "FAILED",
                "AWAITING REDELIVERY",
                "OLDEST AWAITING",
                "DEAD",
                "TOTAL",
                "OLDEST PENDING",
                "EXPIRED LEASES",
                "ATTEMPTS:ROWS",
            ],
            &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
            cells,
        );
    }
    let _ = writeln!(out);
    table(
        out,
        &["OUTBOX", "PENDING", "SENT", "DEAD", "OLDEST PENDING"],
        &[1, 2, 3, 4],
        vec![vec![
            String::new(),
            r.outbox.counts.pending.to_string(),
            r.outbox.counts.sent.to_string(),
            r.outbox.counts.dead.to_string(),
            r.outbox
                .oldest_pending_age_ms
                .map_or("-".into(), render::age),
        ]],
    );
}

/// The sequence watermarks, when there are any: an operator reads
/// "missing 41-45" per stream.
fn print_sequences(out: &mut String, streams: &[postroom::StreamWatermark]) {
    if streams.is_empty() {
        return;
    }
    let _ = writeln!(out);
    let cells = streams
        .iter()
        .map(|w| {
            vec![
                esc(&w.consumer),
                esc(&w.stream),
                w.watermark.to_string(),
                w.highest.map_or("-".into(), |h| h.to_string()),
                w.listed.to_string(),
                w.unrecorded.to_string(),
                match w.missing_text() {
                    text if text.is_empty() => "-".into(),
                    text => text,
                },
            ]
        })
        .collect();
    table(
        out,
        &[
            "SEQUENCES",
            "STREAM",
            "WATERMARK",
            "HIGHEST",
            "LISTED",
            "UNRECORDED",
            "MISSING",
        ],
        &[2, 3, 4, 5],
        cells,
    );
}

fn print_inbox_detail(out: &mut String, d: &admin::InboxDetail) {
    let e = &d.entry;
    let fields: Vec<(&str, String)> = vec![
        ("id", e.id.to_string()),
        ("consumer", esc(&e.consumer)),
        ("source", esc(&e.source)),
        ("message id", esc(&e.message_id)),
        ("status", inbox_state(e)),
        ("attempts", e.attempts.to_string()),
        (
            "ordering key",
            e.ordering_key.as_deref().map_or("-".into(), esc),
        ),
        (
            "last error",
            e.last_error.as_deref().map_or("-".into(), esc_long),
        ),
        ("received at", time(e.received_at)),
        ("updated at", time(e.updated_at)),
        (
            "next attempt at",
            match (e.next_attempt_at, e.status) {
                _ if e.waiting_for_redelivery => {
                    "when its sender redelivers it (no worker retries it)".into()
                }
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
    render::key_values(out, &fields);
    render::headers(out, &d.headers);
    render::payload(out, "payload", d.payload.as_ref());
}

fn print_outbox_detail(out: &mut String, d: &admin::OutboxDetail) {
    let e = &d.entry;
    let held = match &d.held_back_by {
        Some(h) => format!(
            "seq {} of the same key, waiting out a backoff until {} after {} failed \
             attempt(s) (committed {}): {}",
            h.seq,
            opt_time(h.next_attempt_at),
            h.attempts,
            time(h.created_at),
            esc_long(h.last_error.as_deref().unwrap_or("-"))
        ),
        None => "-".into(),
    };
    let fields: Vec<(&str, String)> = vec![
        ("seq", e.seq.to_string()),
        ("message id", esc(&e.message_id)),
        ("topic", esc(&e.topic)),
        ("key", e.key.as_deref().map_or("-".into(), esc)),
        ("status", e.status.to_string()),
        ("attempts", e.attempts.to_string()),
        (
            "last error",
            e.last_error.as_deref().map_or("-".into(), esc_long),
        ),
        ("created at", time(e.created_at)),
        (
            "next attempt at",
            match (e.next_attempt_at, e.status) {
                (None, OutboxState::Pending) => "at once".into(),
                (at, _) => opt_time(at),
            },
        ),
        ("sent at", opt_time(e.sent_at)),
        (
            "caused by",
            e.caused_by.as_ref().map_or("-".into(), |[c, s, m]| {
                format!("consumer {}, source {}, message {}", esc(c), esc(s), esc(m))
            }),
        ),
        ("held back by", held),
        (
            "holding back",
            if d.holding_back == 0 {
                "-".into()
            } else {
                format!("{} later pending row(s) of its key", d.holding_back)
            },
        ),
    ];
    render::key_values(out, &fields);
    render::headers(out, &d.headers);
    render::payload(out, "payload", Some(&d.payload));
}

fn print_conflict(out: &mut String, d: &admin::ConflictDetail) {
    let e = &d.entry;
    render::key_values(
        out,
        &[
            ("conflict id", e.id.to_string()),
            ("consumer", esc(&e.consumer)),
            ("source", esc(&e.source)),
            ("message id", esc(&e.message_id)),
            ("deliveries", e.deliveries.to_string()),
            ("first seen", time(e.first_seen_at)),
            ("last seen", time(e.last_seen_at)),
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
    render::headers(out, &d.headers);
    render::payload(out, "quarantined payload", Some(&d.payload));
    if d.stored.is_some() {
        render::payload(out, "stored payload", d.stored_payload.as_ref());
    }
}

fn print_cleanup(out: &mut String, s: &admin::CleanupSummary, retention: Duration) {
    let verb = if s.dry_run { "would delete" } else { "deleted" };
    let _ = writeln!(
        out,
        "{}{verb} {} completed inbox row(s) and {} sent outbox row(s) finished before {} \
         (retention {})",
        if s.dry_run { "dry run: " } else { "" },
        s.inbox_deleted,
        s.outbox_deleted,
        time(s.cutoff_ms),
        render::age(i64::try_from(retention.as_millis()).unwrap_or(i64::MAX)),
    );
    if let (Some(n), Some(cutoff)) = (s.dead_deleted, s.dead_cutoff_ms) {
        let _ = writeln!(
            out,
            "{verb} {n} dead letter(s) dead before {}",
            time(cutoff)
        );
    }
    if let (Some(n), Some(cutoff)) = (s.conflicts_deleted, s.conflicts_cutoff_ms) {
        let _ = writeln!(
            out,
            "{verb} {n} conflict(s) last seen before {}",
            time(cutoff)
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

fn print_check(out: &mut String, r: &admin::CheckReport) {
    if r.integrity_ok {
        let _ = writeln!(out, "{}: ok", r.integrity_check);
    } else {
        let _ = writeln!(out, "{}: FAILED", r.integrity_check);
        for line in r.integrity_errors.iter().flat_map(|e| e.lines()) {
            let _ = writeln!(out, "  {}", esc(line));
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
        let cells = list
            .iter()
            .map(|f| {
                vec![
                    f.kind.to_string(),
                    f.table.to_owned(),
                    f.id.to_string(),
                    esc(&f.detail),
                ]
            })
            .collect();
        table(out, &["KIND", "TABLE", "ID", "DETAIL"], &[2], cells);
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn the_path_is_used_as_given() {
        let m = command().get_matches_from(["postroom", "x.db", "status", "--json"]);
        let cli = Cli::from_arg_matches(&m).unwrap();
        assert_eq!(cli.db, Path::new("x.db"));
        assert!(cli.json);
    }

    #[test]
    fn nested_usage_lines_name_the_database() {
        let mut cmd = command();
        cmd.build();
        let inbox = cmd.find_subcommand_mut("inbox").unwrap();
        let list = inbox.find_subcommand_mut("list").unwrap();
        let usage = list.render_usage().to_string();
        assert!(usage.contains("postroom <DB> inbox list"), "{usage}");
    }
}
