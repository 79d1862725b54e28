//! `postroom <DB> inbox list | show | find | retry | cancel`: inbox rows,
//! a page at a time, one in full, those of a message id; a failed row
//! retried now, a pending or failed one given up on.

use postroom::admin::{self, InboxEntry};

use std::fmt::Write as _;

use super::{detail, list_page, mutation};
use crate::render::{self, clip, esc, listing, time, Column};
use crate::{not_found, Ctx, Failed, InboxListArgs, EXIT_OK};

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

/// `inbox find MESSAGE_ID`: the rows of a message id, as `inbox list`
/// shows them; exit 5 when there is none.
pub(crate) fn find(
    ctx: &mut Ctx<'_>,
    message_id: &str,
    consumer: Option<&str>,
    source: Option<&str>,
) -> Result<u8, Failed> {
    let rows = ctx.read("inbox find", |c| {
        admin::inbox_find(c, consumer, source, message_id)
    })?;
    if rows.is_empty() {
        return Err(not_found(format!(
            "no inbox row of message id {} (never received, or deleted by retention)",
            esc(message_id)
        )));
    }
    if ctx.cli.json {
        ctx.json(&rows);
    } else {
        listing(&mut ctx.out, &columns(), &rows);
        let _ = writeln!(ctx.out, "{} row(s)", rows.len());
    }
    Ok(EXIT_OK)
}

/// `inbox retry ID`: a failed row due now.
pub(crate) fn retry(ctx: &mut Ctx<'_>, id: i64) -> Result<u8, Failed> {
    let (conn, progress) = ctx.write("inbox retry")?;
    let done = admin::inbox_retry_now(&conn, id, admin::now_ms())?;
    progress.finish();
    if !done {
        return Err(not_found(format!(
            "no failed inbox row with id {id} (only a failed row is retried; see `inbox show {id}`)"
        )));
    }
    let what = format!(
        "inbox row {id} is due now: a running engine's workers retry it at once (if none runs, \
         at its next start)"
    );
    mutation(ctx, "retry", "inbox", id, &what);
    Ok(EXIT_OK)
}

/// `inbox cancel ID --reason TEXT`: a pending or failed row dead-lettered.
pub(crate) fn cancel(ctx: &mut Ctx<'_>, id: i64, reason: &str) -> Result<u8, Failed> {
    let (conn, progress) = ctx.write("inbox cancel")?;
    let done = admin::inbox_cancel(&conn, id, reason, admin::now_ms())?;
    progress.finish();
    if !done {
        return Err(not_found(format!(
            "no pending or failed inbox row with id {id} (one being processed or finished is not \
             cancelled; see `inbox show {id}`)"
        )));
    }
    let what = format!(
        "inbox row {id} cancelled: a dead letter now, its payload kept (`dead redrive {id}` brings \
         it back)"
    );
    mutation(ctx, "cancel", "inbox", id, &what);
    Ok(EXIT_OK)
}
