//! `postroom <DB> conflicts list | show | discard`: quarantined deliveries
//! (same id, different payload).

use std::fmt::Write as _;

use postroom::admin::{self, ConflictEntry};

use super::{detail, mutation, next_page};
use crate::render::{self, clip, esc, listing, time, Column};
use crate::{not_found, Ctx, Failed, PageArgs, EXIT_OK};

/// `conflicts list`'s columns.
fn columns() -> [Column<ConflictEntry>; 8] {
    [
        Column::number("ID", |r| r.id.to_string()),
        Column::text("CONSUMER", |r| esc(&r.consumer)),
        Column::text("SOURCE", |r| esc(&r.source)),
        Column::text("MESSAGE ID", |r| clip(&r.message_id, 40)),
        Column::number("DELIVERIES", |r| r.deliveries.to_string()),
        Column::number("PAYLOAD", |r| r.payload_bytes.to_string()),
        Column::text("FIRST SEEN", |r| time(r.first_seen_at)),
        Column::text("LAST SEEN", |r| time(r.last_seen_at)),
    ]
}

/// `conflicts list`: a page of quarantined deliveries.
pub(crate) fn list(ctx: &mut Ctx<'_>, page: &PageArgs) -> Result<u8, Failed> {
    let cli = ctx.cli;
    let rows = ctx.read("conflicts list", |c| admin::conflicts_list(c, page.page()))?;
    if cli.json {
        ctx.json(&rows);
    } else {
        listing(&mut ctx.out, &columns(), &rows);
        let _ = writeln!(ctx.out, "{} conflict(s)", rows.len());
        next_page(&mut ctx.out, rows.len(), page, rows.last().map(|r| r.id));
    }
    Ok(EXIT_OK)
}

/// `conflicts show ID`: one conflict beside the stored message.
pub(crate) fn show(ctx: &mut Ctx<'_>, id: i64) -> Result<u8, Failed> {
    let found = ctx.read("conflicts show", |c| admin::conflicts_show(c, id))?;
    detail(
        ctx,
        found,
        || format!("no conflict with id {id}"),
        render::print_conflict,
    )?;
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
