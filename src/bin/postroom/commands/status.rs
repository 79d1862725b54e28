//! `postroom <DB> status`: counts per consumer and status, backlog ages,
//! attempts, the outbox, conflicts, sequences and file sizes, and a slow
//! handler if a running engine records one.

use postroom::admin;

use crate::render;
use crate::{Ctx, Failed, EXIT_OK};

/// `status`: the report for people, or as JSON.
pub(crate) fn run(ctx: &mut Ctx<'_>) -> Result<u8, Failed> {
    let cli = ctx.cli;
    let report = ctx.read("status", |c| admin::status(c, &cli.db))?;
    if cli.json {
        ctx.json(&report);
    } else {
        render::print_slow_handler(&mut ctx.out, &cli.db, report.now_ms);
        render::print_status(&mut ctx.out, &report);
        render::print_sequences(&mut ctx.out, &report.sequences);
    }
    Ok(EXIT_OK)
}
