//! `postroom <DB> conflicts list | show | discard`: quarantined deliveries
//! (same id, different payload).

use std::fmt::Write as _;

use postroom::admin;

use super::{mutation, next_page};
use crate::render::{self, clip, esc, table, time};
use crate::{not_found, Ctx, Failed, PageArgs, EXIT_OK};

/// `conflicts list`: a page of quarantined deliveries.
pub(crate) fn list(ctx: &mut Ctx<'_>, page: &PageArgs) -> Result<u8, Failed> {
    let cli = ctx.cli;
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
    Ok(EXIT_OK)
}

/// `conflicts show ID`: one conflict beside the stored message.
pub(crate) fn show(ctx: &mut Ctx<'_>, id: i64) -> Result<u8, Failed> {
    let cli = ctx.cli;
    let Some(d) = ctx.read("conflicts show", |c| admin::conflicts_show(c, id))? else {
        return Err(not_found(format!("no conflict with id {id}")));
    };
    if cli.json {
        ctx.json(&d);
    } else {
        render::print_conflict(&mut ctx.out, &d);
    }
    Ok(EXIT_OK)
}

/// `conflicts discard ID`: deletes it with its payload.
pub(crate) fn discard(ctx: &mut Ctx<'_>, id: i64) -> Result<u8, Failed> {
    let (conn, progress) = ctx.write("conflicts discard")?;
    let done = admin::conflicts_discard(&conn, id)?;
    progress.finish();
    if !done {
        return Err(not_found(format!("no conflict with id {id}")));
    }
    let what = format!("conflict {id} discarded: deleted with its payload");
    mutation(ctx, "discard", "conflicts", id, &what);
    Ok(EXIT_OK)
}
