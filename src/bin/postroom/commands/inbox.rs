//! `postroom <DB> inbox list | show`: inbox rows, a page at a time, and
//! one in full.

use postroom::admin::{self, InboxEntry};

use super::{detail, list_page};
use crate::render::{self, clip, esc, time, Column};
use crate::{Ctx, Failed, InboxListArgs, EXIT_OK};

/// `inbox list`'s columns.
fn columns() -> [Column<InboxEntry>; 9] {
    [
        Column::number("ID", |r| r.id.to_string()),
        Column::text("CONSUMER", |r| esc(&r.consumer)),
        Column::text("SOURCE", |r| esc(&r.source)),
        Column::text("MESSAGE ID", |r| clip(&r.message_id, 40)),
        Column::text("STATUS", render::inbox_state),
        Column::number("ATTEMPTS", |r| r.attempts.to_string()),
        Column::text("RECEIVED", |r| time(r.received_at)),
        Column::number("PAYLOAD", |r| {
            r.payload_bytes.map_or("-".into(), |n| n.to_string())
        }),
        Column::text("LAST ERROR", |r| {
            clip(r.last_error.as_deref().unwrap_or(""), 60)
        }),
    ]
}

/// `inbox list`: a page of inbox rows as a table.
pub(crate) fn list(ctx: &mut Ctx<'_>, args: &InboxListArgs) -> Result<u8, Failed> {
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
    list_page(ctx, &rows, &columns(), &args.page, |r| r.id);
    Ok(EXIT_OK)
}

/// `inbox show ID`: one inbox row in full, payload and headers too.
pub(crate) fn show(ctx: &mut Ctx<'_>, id: i64) -> Result<u8, Failed> {
    let found = ctx.read("inbox show", |c| admin::inbox_show(c, id))?;
    detail(
        ctx,
        found,
        || format!("no inbox row with id {id}"),
        render::print_inbox_detail,
    )?;
    Ok(EXIT_OK)
}
