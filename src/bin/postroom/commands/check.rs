//! `postroom <DB> check`: SQLite's integrity check and postroom's
//! invariants; exit 3 for a damaged file, 4 for broken invariants.

use postroom::admin;

use crate::render;
use crate::{Ctx, Failed, EXIT_BAD_DATABASE, EXIT_CHECK_FAILED, EXIT_OK};

/// `check`: the report; the exit code says what it found.
pub(crate) fn run(ctx: &mut Ctx<'_>, full: bool) -> Result<u8, Failed> {
    let cli = ctx.cli;
    let what = if full {
        "integrity_check"
    } else {
        "quick_check"
    };
    let depth = if full {
        admin::CheckDepth::Full
    } else {
        admin::CheckDepth::Quick
    };
    let report = ctx.read(what, |c| admin::check(c, depth))?;
    if cli.json {
        ctx.json(&report);
    } else {
        render::print_check(&mut ctx.out, &report);
    }
    if !report.integrity_ok {
        return Ok(EXIT_BAD_DATABASE);
    }
    if !report.is_ok() {
        return Ok(EXIT_CHECK_FAILED);
    }
    Ok(EXIT_OK)
}
