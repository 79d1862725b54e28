//! `postroom <DB> dead list | redrive | discard`: dead letters of the
//! inbox or the outbox, one by one or in bulk.

use std::fmt::Write as _;

use postroom::admin::{self, DeadLetterAction as Act, Page};
use rusqlite::Connection;
use serde::Serialize;

use super::{confirm, mutation, next_page};
use crate::render::{clip, esc, table, time};
use crate::{not_found, usage, Ctx, Failed, PageArgs, EXIT_OK};
use crate::{DeadAction, DeadSelect};

/// `dead list`: dead letters in full, a page at a time.
pub(crate) fn list(ctx: &mut Ctx<'_>, select: &DeadSelect, page: &PageArgs) -> Result<u8, Failed> {
    let cli = ctx.cli;
    let filter = select.filter();
    let rows = ctx.read("dead list", |c| dead_rows(c, &filter, page.page()))?;
    print_dead(ctx, &rows, select.outbox);
    if !cli.json {
        let last = rows.last().map(|r| match r {
            DeadRow::Inbox(d) => d.entry.id,
            DeadRow::Outbox(d) => d.entry.seq,
        });
        next_page(&mut ctx.out, rows.len(), page, last);
    }
    Ok(EXIT_OK)
}

/// A dead letter as `dead list` shows it: the row in full.
#[derive(Serialize)]
#[serde(untagged)]
enum DeadRow {
    Inbox(admin::InboxDetail),
    Outbox(admin::OutboxDetail),
}

fn dead_rows(
    conn: &Connection,
    filter: &admin::DeadFilter,
    page: Page,
) -> postroom::Result<Vec<DeadRow>> {
    let mut rows = Vec::new();
    for id in admin::dead_select(conn, filter, page)? {
        let row = if filter.outbox {
            admin::outbox_show(conn, id)?.map(DeadRow::Outbox)
        } else {
            admin::inbox_show(conn, id)?.map(DeadRow::Inbox)
        };
        rows.extend(row);
    }
    Ok(rows)
}

fn print_dead(ctx: &mut Ctx<'_>, rows: &[DeadRow], outbox: bool) {
    if ctx.cli.json {
        ctx.json(&rows);
        return;
    }
    let cells = rows
        .iter()
        .map(|row| match row {
            DeadRow::Inbox(d) => vec![
                d.entry.id.to_string(),
                esc(&d.entry.consumer),
                esc(&d.entry.source),
                clip(&d.entry.message_id, 40),
                d.entry.attempts.to_string(),
                time(d.entry.updated_at),
                d.entry.payload_bytes.unwrap_or(0).to_string(),
                clip(d.entry.last_error.as_deref().unwrap_or(""), 60),
            ],
            DeadRow::Outbox(d) => vec![
                d.entry.seq.to_string(),
                esc(&d.entry.topic),
                clip(d.entry.key.as_deref().unwrap_or("-"), 24),
                clip(&d.entry.message_id, 40),
                d.entry.attempts.to_string(),
                time(d.entry.created_at),
                d.entry.payload_bytes.to_string(),
                clip(d.entry.last_error.as_deref().unwrap_or(""), 60),
            ],
        })
        .collect();
    let headers = if outbox {
        [
            "SEQ",
            "TOPIC",
            "KEY",
            "MESSAGE ID",
            "ATTEMPTS",
            "CREATED",
            "PAYLOAD",
            "LAST ERROR",
        ]
    } else {
        [
            "ID",
            "CONSUMER",
            "SOURCE",
            "MESSAGE ID",
            "ATTEMPTS",
            "DIED",
            "PAYLOAD",
            "LAST ERROR",
        ]
    };
    table(&mut ctx.out, &headers, &[0, 4, 6], cells);
    let _ = writeln!(ctx.out, "{} dead letter(s)", rows.len());
}

/// Dead letters a bulk dry run shows in full.
const PREVIEW_ROWS: usize = 20;

/// What a bulk redrive or discard did, or would do.
#[derive(Serialize)]
struct BulkReport<'a> {
    action: &'a str,
    table: &'a str,
    dry_run: bool,
    matched: usize,
    ids: &'a [i64],
    done: u64,
    skipped: u64,
}

/// `dead redrive` / `dead discard`: one dead letter by id, or in bulk by
/// filter (`--dry-run` shows what it would do; `--yes` or a terminal
/// confirms).
pub(crate) fn act(ctx: &mut Ctx<'_>, action: &DeadAction, act: Act) -> Result<(), Failed> {
    let sel = &action.select;
    if let Some(id) = action.id {
        if action.dry_run {
            return Err(usage(
                "--dry-run is for bulk actions; `dead list` shows one dead letter".into(),
            ));
        }
        return dead_one(ctx, sel.outbox, id, act);
    }
    if !action.all && !sel.narrowed() {
        return Err(usage(format!(
            "name a dead letter by ID, or select several with --consumer, --error, --since, \
             --until or --all (try `postroom <DB> dead {} --all --dry-run`)",
            act.as_str()
        )));
    }
    let filter = sel.filter();
    let verb = act.as_str();
    // Ids only (a bulk action may cover many rows, each with a payload of up
    // to a MiB); the dry run shows the first few in full.
    let (ids, preview) = ctx.read("selecting dead letters", |c| {
        let ids = admin::dead_select(c, &filter, Page::all())?;
        let preview = if action.dry_run && !ctx.cli.json {
            dead_rows(
                c,
                &filter,
                // Newest first, as `dead list` shows them.
                Page {
                    limit: PREVIEW_ROWS,
                    oldest_first: false,
                    after: None,
                },
            )?
        } else {
            Vec::new()
        };
        Ok((ids, preview))
    })?;
    let mut report = BulkReport {
        action: verb,
        table: sel.table(),
        dry_run: action.dry_run,
        matched: ids.len(),
        ids: &ids,
        done: 0,
        skipped: 0,
    };
    if action.dry_run || ids.is_empty() {
        if ctx.cli.json {
            ctx.json(&report);
        } else if action.dry_run {
            print_dead(ctx, &preview, sel.outbox);
            if ids.len() > preview.len() {
                let _ = writeln!(
                    ctx.out,
                    "… the newest {} shown (`dead list` pages through them all)",
                    preview.len()
                );
            }
            let _ = writeln!(
                ctx.out,
                "dry run: would {verb} {} {} dead letter(s); run again without --dry-run to do it",
                ids.len(),
                sel.table()
            );
        } else {
            let _ = writeln!(
                ctx.out,
                "no {} dead letter matches: nothing to {verb}",
                sel.table()
            );
        }
        return Ok(());
    }
    if !action.yes {
        confirm(&format!(
            "{verb} {} {} dead letter(s)?",
            ids.len(),
            sel.table()
        ))?;
    }
    let (conn, progress) = ctx.write(&format!("{verb}: 0 of {}", ids.len()))?;
    let total = ids.len();
    let mut on_batch = |n: u64| progress.message(&format!("{verb}: {n} of {total}"));
    let s =
        admin::act_on_dead_letters(&conn, act, sel.outbox, &ids, admin::now_ms(), &mut on_batch)?;
    progress.finish();
    report.done = s.done;
    report.skipped = s.skipped;
    if ctx.cli.json {
        ctx.json(&report);
    } else {
        let _ = writeln!(
            ctx.out,
            "{verb}: {} {} dead letter(s) done, {} skipped (no longer dead), {} transaction(s)",
            s.done,
            sel.table(),
            s.skipped,
            s.transactions
        );
    }
    Ok(())
}

fn dead_one(ctx: &mut Ctx<'_>, outbox: bool, id: i64, act: Act) -> Result<(), Failed> {
    let (conn, progress) = ctx.write(act.as_str())?;
    let s = admin::act_on_dead_letters(&conn, act, outbox, &[id], admin::now_ms(), &mut |_| {})?;
    progress.finish();
    if s.done == 0 {
        return Err(not_a_dead_letter(&conn, outbox, id));
    }
    let what = match (act, outbox) {
        (Act::Redrive, true) => format!(
            "outbox row {id} redriven: pending again, attempts reset; a running engine's relay \
             sends it at once (it watches for other processes' commits), else at its next start"
        ),
        (Act::Redrive, false) => format!(
            "inbox row {id} redriven: pending again, attempts reset; a running engine's workers \
             process it at once (it watches for other processes' commits), else at its next start"
        ),
        (Act::Discard, true) => format!(
            "outbox row {id} discarded: marked sent without being sent, retention deletes it"
        ),
        (Act::Discard, false) => format!(
            "inbox row {id} discarded: completed without effects, a redelivery is a duplicate"
        ),
    };
    let table = if outbox { "outbox" } else { "inbox" };
    mutation(ctx, act.as_str(), table, id, &what);
    Ok(())
}

/// Why a redrive or discard found nothing to do: the row is missing, or in
/// another status.
fn not_a_dead_letter(conn: &Connection, outbox: bool, id: i64) -> Failed {
    let key = if outbox { "seq" } else { "id" };
    let status = if outbox {
        admin::outbox_show(conn, id).map(|row| row.map(|r| r.entry.status.to_string()))
    } else {
        admin::inbox_show(conn, id).map(|row| row.map(|r| r.entry.status.to_string()))
    };
    let status = match status {
        Ok(status) => status,
        Err(e) => return Failed::from(e),
    };
    let what = if outbox { "outbox row" } else { "inbox row" };
    not_found(match status {
        Some(status) => format!("{what} {id} is not a dead letter (it is {status})"),
        None => format!("no {what} with {key} {id}"),
    })
}
