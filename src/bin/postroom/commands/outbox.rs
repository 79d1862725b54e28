//! `postroom <DB> outbox list | show`: outbox rows, a page at a time, and
//! one in full with what holds it back.

use postroom::admin::{self, OutboxEntry};

use super::{detail, list_page};
use crate::render::{self, clip, esc, opt_time, time, Column};
use crate::{Ctx, Failed, OutboxListArgs, EXIT_OK};

/// `outbox list`'s columns.
fn columns() -> [Column<OutboxEntry>; 10] {
    [
        Column::number("SEQ", |r| r.seq.to_string()),
        Column::text("TOPIC", |r| esc(&r.topic)),
        Column::text("KEY", |r| clip(r.key.as_deref().unwrap_or("-"), 24)),
        Column::text("MESSAGE ID", |r| clip(&r.message_id, 32)),
        Column::text("STATUS", |r| r.status.to_string()),
        Column::number("ATTEMPTS", |r| r.attempts.to_string()),
        Column::text("CREATED", |r| time(r.created_at)),
        Column::text("NEXT TRY / SENT", |r| {
            opt_time(r.next_attempt_at.or(r.sent_at))
        }),
        Column::number("PAYLOAD", |r| r.payload_bytes.to_string()),
        Column::text("LAST ERROR", |r| {
            clip(r.last_error.as_deref().unwrap_or(""), 50)
        }),
    ]
}

/// `outbox list`: a page of outbox rows as a table.
pub(crate) fn list(ctx: &mut Ctx<'_>, args: &OutboxListArgs) -> Result<u8, Failed> {
    let filter = admin::OutboxFilter {
        status: args.status,
        topic: args.topic.clone(),
        key: args.key.clone(),
        since_ms: args.since,
        until_ms: args.until,
        page: args.page.page(),
    };
    let rows = ctx.read("outbox list", |c| admin::outbox_list(c, &filter))?;
    list_page(ctx, &rows, &columns(), &args.page, |r| r.seq);
    Ok(EXIT_OK)
}

/// `outbox show SEQ`: one outbox row in full, with what holds it back.
pub(crate) fn show(ctx: &mut Ctx<'_>, seq: i64) -> Result<u8, Failed> {
    let found = ctx.read("outbox show", |c| admin::outbox_show(c, seq))?;
    detail(
        ctx,
        found,
        || format!("no outbox row with seq {seq}"),
        render::print_outbox_detail,
    )?;
    Ok(EXIT_OK)
}
