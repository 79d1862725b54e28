//! One file per command (as cargo's `src/bin/cargo/commands/`): clap
//! parses in `main.rs`, which dispatches here; each command reads or
//! writes through `postroom::admin` and renders through `render.rs`.
//! Invariant: output goes into `ctx.out`, written once the command is
//! done, so a failing command prints nothing partial.

pub(crate) mod check;
pub(crate) mod cleanup;
pub(crate) mod conflicts;
pub(crate) mod dead;
pub(crate) mod inbox;
pub(crate) mod metrics;
pub(crate) mod outbox;
pub(crate) mod status;
pub(crate) mod top;

use std::fmt::Write as _;
use std::io::{self, IsTerminal, Write as _};

use serde::Serialize;

use crate::render::{listing, Column};
use crate::{not_found, usage, Ctx, Failed, PageArgs, EXIT_ERROR};

/// What a one-row mutation did, for `--json`.
#[derive(Serialize)]
pub(crate) struct Mutation<'a> {
    action: &'a str,
    table: &'a str,
    id: i64,
    done: bool,
    message: &'a str,
}

pub(crate) fn mutation(ctx: &mut Ctx<'_>, action: &str, table: &str, id: i64, message: &str) {
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

/// A listing's footer: the rows shown, and the next page when it was full.
pub(crate) fn page_footer(out: &mut String, shown: usize, page: &PageArgs, last: Option<i64>) {
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
pub(crate) fn next_page(out: &mut String, shown: usize, page: &PageArgs, last: Option<i64>) {
    if let Some(last) = last.filter(|_| shown == page.limit) {
        let _ = writeln!(out, "next page: --after {last}");
    }
}

/// A page of a listing: the rows as JSON with `--json`, else as a table of
/// `columns` with the page footer (`cursor`: a row's `--after` value).
pub(crate) fn list_page<R: Serialize>(
    ctx: &mut Ctx<'_>,
    rows: &[R],
    columns: &[Column<R>],
    page: &PageArgs,
    cursor: fn(&R) -> i64,
) {
    if ctx.cli.json {
        ctx.json(&rows);
    } else {
        listing(&mut ctx.out, columns, rows);
        page_footer(&mut ctx.out, rows.len(), page, rows.last().map(cursor));
    }
}

/// One row in full (`show`): as JSON with `--json`, else through `print`;
/// `missing` (exit 4) when there is no such row.
pub(crate) fn detail<D: Serialize>(
    ctx: &mut Ctx<'_>,
    found: Option<D>,
    missing: impl FnOnce() -> String,
    print: fn(&mut String, &D),
) -> Result<(), Failed> {
    let Some(d) = found else {
        return Err(not_found(missing()));
    };
    if ctx.cli.json {
        ctx.json(&d);
    } else {
        print(&mut ctx.out, &d);
    }
    Ok(())
}

/// The one rule for what deletes or rewrites rows in bulk: asks on the
/// terminal unless `--yes` was given; refuses (usage error, exit 2) when
/// stdin is not a terminal to ask on.
pub(crate) fn confirm(question: &str) -> Result<(), Failed> {
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
