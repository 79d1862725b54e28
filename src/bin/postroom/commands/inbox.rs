//! `postroom <DB> inbox list | show`: inbox rows, a page at a time, and
//! one in full.

use postroom::admin;

use crate::render::{self, clip, esc, table, time};
use crate::{not_found, Ctx, Failed, InboxListArgs, EXIT_OK};

use super::page_footer;

/// `inbox list`: a page of inbox rows as a table.
pub(crate) fn list(ctx: &mut Ctx<'_>, args: &InboxListArgs) -> Result<u8, Failed> {
    let cli = ctx.cli;
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
                    render::inbox_state(r),
                    r.attempts.to_string(),
                    time(r.received_at),
                    r.payload_bytes.map_or("-".into(), |n| n.to_string()),
                    clip(r.last_error.as_deref().unwrap_or(""), 60),
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
                "STATUS",
                "ATTEMPTS",
                "RECEIVED",
                "PAYLOAD",
                "LAST ERROR",
            ],
            &[0, 5, 7],
            cells,
        );
        page_footer(
            &mut ctx.out,
            rows.len(),
            &args.page,
            rows.last().map(|r| r.id),
        );
    }
    Ok(EXIT_OK)
}

/// `inbox show ID`: one inbox row in full, payload and headers too.
pub(crate) fn show(ctx: &mut Ctx<'_>, id: i64) -> Result<u8, Failed> {
    let cli = ctx.cli;
    let Some(d) = ctx.read("inbox show", |c| admin::inbox_show(c, id))? else {
        return Err(not_found(format!("no inbox row with id {id}")));
    };
    if cli.json {
        ctx.json(&d);
    } else {
        render::print_inbox_detail(&mut ctx.out, &d);
    }
    Ok(EXIT_OK)
}
