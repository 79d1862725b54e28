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
//!   `inbox retry`, `inbox cancel`, `cleanup`) first run the integrity check the engine runs at open and
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
//! postroom <DB> inbox find MESSAGE_ID [--consumer C] [--source S]
//! postroom <DB> inbox retry ID
//! postroom <DB> inbox cancel ID --reason TEXT
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
//! postroom <DB> cleanup [--retention 7d] [--dead-retention D] [--conflict-retention D] [--dry-run] [--yes]
//! postroom <DB> check [--full]
//! postroom <DB> metrics
//! postroom --completions (bash | elvish | fish | powershell | zsh)
//! postroom --man
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
//! | 2 | usage error (bad arguments; a bulk action, or a cleanup that deletes dead letters or conflicts, without `--yes` and no terminal to confirm on) |
//! | 3 | bad database: missing or unreadable path, symbolic link loop, not SQLite, not a postroom database, newer schema, damaged, read-only for a write command |
//! | 4 | `check` found broken postroom invariants |
//! | 5 | the row named by ID does not exist (for `dead redrive`/`dead discard`: is not a dead letter) |
#![forbid(unsafe_code)]

mod commands;
mod pretty;
mod render;

use std::ffi::OsString;
use std::io::{self, Write as _};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use postroom::admin::{self, DeadLetterAction as Act, OutboxState, Page, ReadView};
use postroom::{Error, Status};
use rusqlite::{Connection, ErrorCode};
use serde::Serialize;
use serde_json::json;

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
  2  usage error (bad arguments; a bulk action, or a cleanup that deletes dead letters or
     conflicts, without --yes and no terminal to confirm on)
  3  bad database: missing path, symlink loop, not SQLite, not a postroom database, newer
     schema, damaged, or read-only for a write command
  4  check found broken postroom invariants
  5  the row named by ID does not exist (redrive/discard: is not a dead letter)

Shell completions: postroom --completions bash|elvish|fish|powershell|zsh; the man page:
postroom --man (both written to stdout).

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
        /// Delete dead letters or conflicts without asking (needed when
        /// stdin is not a terminal)
        #[arg(long)]
        yes: bool,
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
    /// The rows of a message id (as logs and brokers carry it), of every
    /// consumer and source unless narrowed
    Find {
        /// The message id
        message_id: String,
        /// Only this consumer
        #[arg(long)]
        consumer: Option<String>,
        /// Only this source
        #[arg(long)]
        source: Option<String>,
    },
    /// Retry a failed row now, not at its next attempt's time (the
    /// engine's workers take it; its attempts stay counted)
    Retry {
        /// Row id (from `inbox list` or `inbox find`)
        id: i64,
    },
    /// Give up on a pending or failed row: a dead letter with the reason
    /// (payload kept: `dead redrive` brings it back; under strict order it
    /// holds its key, as any dead letter does, until redriven or discarded)
    Cancel {
        /// Row id (from `inbox list` or `inbox find`)
        id: i64,
        /// Why, kept in its last error
        #[arg(long)]
        reason: String,
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

/// When the command was written before the database (`postroom status
/// app.db`): the first argument that is not an option names a command
/// and is no file here. Says the order.
fn database_first_hint(args: &[OsString]) -> Option<String> {
    let words: Vec<&str> = args
        .iter()
        .skip(1)
        .filter_map(|a| a.to_str())
        .filter(|a| !a.starts_with('-'))
        .collect();
    let first = *words.first()?;
    let cmd = command();
    let is_command = cmd.get_subcommands().any(|sc| sc.get_name() == first);
    if !is_command || std::path::Path::new(first).exists() {
        return None;
    }
    // The database: a word naming a file; else said as <DB>.
    let db = words
        .iter()
        .skip(1)
        .find(|w| std::path::Path::new(w).is_file())
        .copied()
        .unwrap_or("<DB>");
    Some(format!(
        "hint: the database comes first, then the command: postroom {db} {first} …"
    ))
}

/// `postroom --completions SHELL` and `postroom --man`: generated from
/// the parser's own definitions, before any database is named. `None`
/// when neither was asked.
fn generated(args: &[OsString]) -> Option<ExitCode> {
    let first = args.get(1)?.to_str()?;
    let mut cmd = Cli::command();
    // Into memory first: the generators panic on a failed write (a closed
    // pipe), and the output is what every other command's is: written
    // once, a closed pipe taken as the reader having had enough.
    let mut text = Vec::new();
    match first {
        "--completions" => {
            let shell = args.get(2).and_then(|s| s.to_str()).unwrap_or("");
            let Ok(shell) = shell.parse::<clap_complete::Shell>() else {
                eprintln!(
                    "error: --completions needs a shell: bash, elvish, fish, powershell or zsh"
                );
                return Some(ExitCode::from(EXIT_USAGE));
            };
            clap_complete::generate(shell, &mut cmd, "postroom", &mut text);
        }
        "--man" => {
            if let Err(e) = clap_mangen::Man::new(cmd).render(&mut text) {
                eprintln!("error: the man page: {e}");
                return Some(ExitCode::from(EXIT_ERROR));
            }
        }
        _ => return None,
    }
    let mut out = io::stdout().lock();
    Some(match out.write_all(&text).and_then(|()| out.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: writing the output: {e}");
            ExitCode::from(EXIT_ERROR)
        }
    })
}

fn main() -> ExitCode {
    let args: Vec<OsString> = std::env::args_os().collect();
    if let Some(code) = generated(&args) {
        return code;
    }
    let json = args.iter().any(|a| a == "--json");
    let cli = match command()
        .try_get_matches_from(&args)
        .and_then(|m| Cli::from_arg_matches(&m))
    {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                e.exit();
            }
            let message = e.render().to_string();
            let mut message = message.trim_end().trim_start_matches("error: ").to_owned();
            if let Some(hint) = database_first_hint(&args) {
                message.push_str("\n\n");
                message.push_str(&hint);
            }
            if !json {
                eprintln!("error: {message}");
                return ExitCode::from(EXIT_USAGE);
            }
            report(true, &usage(message));
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
        let mut conn = admin::open_with_timeout(
            &self.cli.db,
            admin::Access::ReadWrite,
            self.cli.busy_timeout,
        )?;
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

/// Dispatches the parsed command to its file under `commands/`.
fn run(ctx: &mut Ctx<'_>) -> Result<u8, Failed> {
    use commands::*;
    let cli = ctx.cli;
    match &cli.command {
        Command::Status => status::run(ctx),
        Command::Top {
            interval,
            iterations,
        } => top::run(ctx, *interval, *iterations).map(|()| EXIT_OK),
        Command::Metrics => metrics::run(ctx),
        Command::Inbox(InboxCommand::List(args)) => inbox::list(ctx, args),
        Command::Inbox(InboxCommand::Show { id }) => inbox::show(ctx, *id),
        Command::Inbox(InboxCommand::Find {
            message_id,
            consumer,
            source,
        }) => inbox::find(ctx, message_id, consumer.as_deref(), source.as_deref()),
        Command::Inbox(InboxCommand::Retry { id }) => inbox::retry(ctx, *id),
        Command::Inbox(InboxCommand::Cancel { id, reason }) => inbox::cancel(ctx, *id, reason),
        Command::Outbox(OutboxCommand::List(args)) => outbox::list(ctx, args),
        Command::Outbox(OutboxCommand::Show { seq }) => outbox::show(ctx, *seq),
        Command::Dead(DeadCommand::List { select, page }) => dead::list(ctx, select, page),
        Command::Dead(DeadCommand::Redrive(action)) => {
            dead::act(ctx, action, Act::Redrive).map(|()| EXIT_OK)
        }
        Command::Dead(DeadCommand::Discard(action)) => {
            dead::act(ctx, action, Act::Discard).map(|()| EXIT_OK)
        }
        Command::Conflicts(ConflictsCommand::List { page }) => conflicts::list(ctx, page),
        Command::Conflicts(ConflictsCommand::Show { id }) => conflicts::show(ctx, *id),
        Command::Conflicts(ConflictsCommand::Discard { id }) => conflicts::discard(ctx, *id),
        Command::Cleanup {
            retention,
            dead_retention,
            conflict_retention,
            dry_run,
            yes,
        } => cleanup::run(
            ctx,
            cleanup::CleanupArgs {
                retention: *retention,
                dead_retention: *dead_retention,
                conflict_retention: *conflict_retention,
                dry_run: *dry_run,
                yes: *yes,
            },
        ),
        Command::Check { full } => check::run(ctx, *full),
    }
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
