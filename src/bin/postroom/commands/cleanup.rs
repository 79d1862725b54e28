//! `postroom <DB> cleanup`: retention run from outside the engine, or
//! counted (`--dry-run`). Deleting dead letters or conflicts (their
//! payloads, for good) follows the rule of every bulk action: `--yes`, or
//! a yes on the terminal, after counting what would go.

use std::time::Duration;

use postroom::admin;

use super::confirm;
use crate::render;
use crate::{Ctx, Failed, EXIT_OK};

/// The command's arguments, as clap parsed them.
pub(crate) struct CleanupArgs {
    pub retention: Duration,
    pub dead_retention: Option<Duration>,
    pub conflict_retention: Option<Duration>,
    pub dry_run: bool,
    pub yes: bool,
}

/// `cleanup`: deletes (or with `--dry-run` counts) what retention expired.
pub(crate) fn run(ctx: &mut Ctx<'_>, args: CleanupArgs) -> Result<u8, Failed> {
    let cli = ctx.cli;
    let CleanupArgs {
        retention,
        dead_retention,
        conflict_retention,
        dry_run,
        yes,
    } = args;
    let policy = admin::Retention::new(retention)
        .dead(dead_retention)
        .conflicts(conflict_retention);
    // One time for the count and the delete: the same cutoffs, so what
    // the delete takes is what was counted (less what was redriven or
    // deleted meanwhile), never a row that expired after the question.
    let now = admin::now_ms();
    let count = |ctx: &mut Ctx<'_>| {
        ctx.read("cleanup: counting expired rows", |c| {
            admin::cleanup(c, now, policy, admin::CleanupMode::DryRun)
        })
    };
    let s = if dry_run {
        count(ctx)?
    } else {
        if !yes && (dead_retention.is_some() || conflict_retention.is_some()) {
            let would = count(ctx)?;
            let dead = would.dead_deleted.unwrap_or(0);
            let conflicts = would.conflicts_deleted.unwrap_or(0);
            if dead + conflicts > 0 {
                confirm(&format!(
                    "Delete {dead} dead letter(s) and {conflicts} conflict(s), payloads and all, \
                     for good?"
                ))?;
            }
        }
        let (conn, progress) = ctx.write("cleanup: deleting expired rows")?;
        let s = admin::cleanup(&conn, now, policy, admin::CleanupMode::Delete)?;
        progress.finish();
        s
    };
    if cli.json {
        ctx.json(&s);
    } else {
        render::print_cleanup(&mut ctx.out, &s, retention);
    }
    Ok(EXIT_OK)
}
