//! `postroom <DB> outbox list | show`: outbox rows, a page at a time, and
//! one in full with what holds it back.

use postroom::admin;

use super::page_footer;
use crate::render::{self, clip, esc, opt_time, table, time};
use crate::OutboxListArgs;
use crate::{not_found, Ctx, Failed, EXIT_OK};

/// `outbox list`: a page of outbox rows as a table.
pub(crate) fn list(ctx: &mut Ctx<'_>, args: &OutboxListArgs) -> Result<u8, Failed> {
    let cli = ctx.cli;
    let filter = admin::OutboxFilter {
        status: args.status,
        topic: args.topic.clone(),
        key: args.key.clone(),
        since_ms: args.since,
        until_ms: args.until,
        page: args.page.page(),
    };
    let rows = ctx.read("outbox list", |c| admin::outbox_list(c, &filter))?;
    if cli.json {
        ctx.json(&rows);
    } else {
        let cells = rows
            .iter()
            .map(|r| {
                vec![
                    r.seq.to_string(),
                    esc(&r.topic),
                    clip(r.key.as_deref().unwrap_or("-"), 24),
                    clip(&r.message_id, 32),
                    r.status.to_string(),
                    r.attempts.to_string(),
                    time(r.created_at),
                    opt_time(r.next_attempt_at.or(r.sent_at)),
                    r.payload_bytes.to_string(),
                    clip(r.last_error.as_deref().unwrap_or(""), 50),
                ]
            })
            .collect();
        table(
            &mut ctx.out,
            &[
                "SEQ",
                "TOPIC",
                "KEY",
                "MESSAGE ID",
                "STATUS",
                "ATTEMPTS",
                "CREATED",
                "NEXT TRY / SENT",
                "PAYLOAD",
                "LAST ERROR",
            ],
            &[0, 5, 8],
            cells,
        );
        page_footer(
            &mut ctx.out,
            rows.len(),
            &args.page,
            rows.last().map(|r| r.seq),
        );
    }
    Ok(EXIT_OK)
}

/// `outbox show SEQ`: one outbox row in full, with what holds it back.
pub(crate) fn show(ctx: &mut Ctx<'_>, seq: i64) -> Result<u8, Failed> {
    let cli = ctx.cli;
    let Some(d) = ctx.read("outbox show", |c| admin::outbox_show(c, seq))? else {
        return Err(not_found(format!("no outbox row with seq {seq}")));
    };
    if cli.json {
        ctx.json(&d);
    } else {
        render::print_outbox_detail(&mut ctx.out, &d);
    }
    Ok(EXIT_OK)
}
