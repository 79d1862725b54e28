//! `postroom <DB> metrics`: the status numbers in the Prometheus text
//! format (`--json`: the status report).

use postroom::admin;

use crate::{Ctx, Failed, EXIT_OK};

/// `metrics`: the report as Prometheus text.
pub(crate) fn run(ctx: &mut Ctx<'_>) -> Result<u8, Failed> {
    let cli = ctx.cli;
    let report = ctx.read("metrics", |c| admin::status(c, &cli.db))?;
    if cli.json {
        ctx.json(&report);
    } else {
        ctx.out.push_str(&admin::prometheus(&report));
        ctx.out
            .push_str(&admin::sequences_prometheus(&report.sequences));
    }
    Ok(EXIT_OK)
}
