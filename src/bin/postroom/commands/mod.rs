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

use serde::Serialize;

use crate::{Ctx, PageArgs};

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
