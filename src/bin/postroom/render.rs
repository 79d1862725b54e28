//! What people read: tables, escaped text, RFC 3339 times, durations.
//! JSON output never goes through here: it carries the stored values
//! exactly.

use std::fmt::Write as _;
use std::time::Duration;

use comfy_table::{CellAlignment, ContentArrangement, Table};
use postroom::admin::{self, OutboxState, Payload};
use postroom::Status;

/// `s` safe to print on a terminal, on one line: control characters
/// (escape sequences, carriage returns, newlines), bidirectional overrides
/// and invisible format characters are shown as `\u{…}` escapes, so a
/// message id or error text can neither drive the terminal nor forge lines.
pub fn esc(s: &str) -> String {
    escape(s, false)
}

/// As [`esc`] for a block of text (a payload): newlines and tabs are kept.
pub fn esc_block(s: &str) -> String {
    escape(s, true)
}

fn escape(s: &str, block: bool) -> String {
    if !s.chars().any(|c| unsafe_char(c, block)) {
        return s.to_owned();
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if unsafe_char(c, block) {
            let _ = write!(out, "{}", c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    out
}

fn unsafe_char(c: char, block: bool) -> bool {
    if block && (c == '\n' || c == '\t') {
        return false;
    }
    c.is_control()
        // Zero-width and directional marks, bidi embeddings, overrides and
        // isolates, word joiners and invisible operators, the BOM, and the
        // line and paragraph separators: text that reorders or hides what
        // is around it.
        || admin::invisible(c)
}

/// Most of a long field that a show view prints whole (an error text,
/// which user code writes): [`esc`]`(s)`, cut past [`LONG_FIELD_CHARS`]
/// characters with a `… truncated` note, so one field cannot flood the
/// terminal. `--json` carries it whole.
pub fn esc_long(s: &str) -> String {
    if s.chars().count() <= LONG_FIELD_CHARS {
        return esc(s);
    }
    let head: String = s.chars().take(LONG_FIELD_CHARS).collect();
    format!(
        "{}… truncated ({} bytes in all; --json gives it whole)",
        esc(&head),
        s.len()
    )
}

/// How many characters of a long field [`esc_long`] shows.
pub const LONG_FIELD_CHARS: usize = 4096;

/// At most `max` characters of [`esc`]`(s)`, with `…` when cut.
pub fn clip(s: &str, max: usize) -> String {
    let clean = esc(s);
    if clean.chars().count() <= max {
        clean
    } else {
        let mut cut: String = clean.chars().take(max.saturating_sub(1)).collect();
        cut.push('…');
        cut
    }
}

/// A borderless table, two spaces between columns, widths by display
/// width (CJK and emoji take two columns); `right` lists the numeric
/// columns. Cells must already be escaped.
pub fn table(out: &mut String, headers: &[&str], right: &[usize], rows: Vec<Vec<String>>) {
    let mut t = Table::new();
    t.load_style(comfy_table::presets::NOTHING)
        .set_content_arrangement(ContentArrangement::Disabled)
        .set_header(headers.to_vec());
    for row in rows {
        t.add_row(row);
    }
    let last = headers.len().saturating_sub(1);
    for (i, column) in t.column_iter_mut().enumerate() {
        column.set_padding((0, if i == last { 0 } else { 2 }));
        if right.contains(&i) {
            column.set_cell_alignment(CellAlignment::Right);
        }
    }
    for line in t.lines() {
        out.push_str(line.trim_end());
        out.push('\n');
    }
}

/// One column of a listing: its header, whether it is a number
/// (right-aligned), and its cell, already escaped or clipped.
pub struct Column<R> {
    pub header: &'static str,
    pub number: bool,
    pub cell: fn(&R) -> String,
}

impl<R> Column<R> {
    /// A text column.
    pub fn text(header: &'static str, cell: fn(&R) -> String) -> Self {
        Column {
            header,
            number: false,
            cell,
        }
    }

    /// A right-aligned number column.
    pub fn number(header: &'static str, cell: fn(&R) -> String) -> Self {
        Column {
            header,
            number: true,
            cell,
        }
    }
}

/// The one renderer of the listings (`inbox list`, `outbox list`,
/// `conflicts list`): `rows` as a [`table`] of `columns`.
pub fn listing<R>(out: &mut String, columns: &[Column<R>], rows: &[R]) {
    let headers: Vec<&str> = columns.iter().map(|c| c.header).collect();
    let right: Vec<usize> = (0..columns.len()).filter(|&i| columns[i].number).collect();
    let cells = rows
        .iter()
        .map(|r| columns.iter().map(|c| (c.cell)(r)).collect())
        .collect();
    table(out, &headers, &right, cells);
}

/// `key  value` lines, keys aligned. Values must already be escaped.
pub fn key_values(out: &mut String, fields: &[(&str, String)]) {
    let width = fields.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (k, v) in fields {
        let _ = writeln!(out, "{k:<width$}  {v}");
    }
}

/// Unix ms as RFC 3339 in UTC with milliseconds, so columns align:
/// `2026-11-25T10:00:00.120Z`.
pub fn time(ms: i64) -> String {
    match jiff::Timestamp::from_millisecond(ms) {
        Ok(t) => t.strftime("%Y-%m-%dT%H:%M:%S%.3fZ").to_string(),
        Err(_) => format!("{ms} (unix ms, out of range)"),
    }
}

/// [`time`], or `-`.
pub fn opt_time(ms: Option<i64>) -> String {
    ms.map_or("-".into(), time)
}

/// A duration in ms for people: `850ms`, `12s`, `3m 12s`, `5h 3m`, `2d 4h`
/// (the two largest units).
pub fn age(ms: i64) -> String {
    let ms = ms.max(0);
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let span = jiff::SignedDuration::from_secs(ms / 1000);
    let secs = span.as_secs();
    let (d, h, m, s) = (
        secs / 86_400,
        secs % 86_400 / 3600,
        secs % 3600 / 60,
        secs % 60,
    );
    match (d, h, m) {
        (0, 0, 0) => format!("{s}s"),
        (0, 0, _) => format!("{m}m {s}s"),
        (0, _, _) => format!("{h}h {m}m"),
        _ => format!("{d}d {h}h"),
    }
}

/// A duration as typed: `2s`, `1.5s`, `250ms`.
pub fn span(d: Duration) -> String {
    jiff::SignedDuration::try_from(d).map_or_else(|_| format!("{d:?}"), |s| format!("{s:#}"))
}

/// A byte count with binary units.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

/// A span as people type it: `7d`, `36h`, `1h 30m`, `90s`, or ISO 8601
/// (`P7D`); days are 24 hours. A bare number is refused: its unit would
/// be a guess.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let hint = "a duration such as 7d, 36h, 1h30m or 90s";
    if s.trim().chars().all(|c| c.is_ascii_digit()) {
        return Err(format!("{s:?} has no unit: give {hint}"));
    }
    let span: jiff::Span = s
        .trim()
        .parse()
        .map_err(|e| format!("{s:?} is not {hint} ({e})"))?;
    let ms = span
        .total((
            jiff::Unit::Millisecond,
            jiff::SpanRelativeTo::days_are_24_hours(),
        ))
        .map_err(|e| format!("{s:?}: {e}"))?;
    if ms < 0.0 {
        return Err(format!("{s:?} is negative"));
    }
    if ms > 100.0 * 365.0 * 86_400_000.0 {
        return Err(format!("{s:?} is more than 100 years"));
    }
    Ok(Duration::from_millis(ms as u64))
}

/// A point in time as unix ms: RFC 3339 (`2026-11-25T10:00:00Z`, seconds
/// optional), a date (`2026-11-25`, midnight UTC), or an age counted back
/// from now (`2h`, `7d`).
pub fn parse_time(s: &str) -> Result<i64, String> {
    let s = s.trim();
    if let Ok(t) = s.parse::<jiff::Timestamp>() {
        return Ok(t.as_millisecond());
    }
    // A date alone is midnight UTC; a date with a time but no offset is
    // refused (jiff would drop the time and read the date alone, and a
    // bulk action would then take more rows than asked for).
    if let Some(date) = s
        .get(..10)
        .and_then(|d| d.parse::<jiff::civil::Date>().ok())
    {
        if s.len() > 10 {
            return Err(format!(
                "{s:?} has no offset: add Z (UTC) or one such as +01:00"
            ));
        }
        return jiff::tz::TimeZone::UTC
            .to_timestamp(date.at(0, 0, 0, 0))
            .map(|t| t.as_millisecond())
            .map_err(|e| format!("{s:?}: {e}"));
    }
    match parse_duration(s.strip_suffix(" ago").unwrap_or(s)) {
        Ok(ago) => {
            Ok(admin::now_ms().saturating_sub(i64::try_from(ago.as_millis()).unwrap_or(i64::MAX)))
        }
        Err(_) => Err(format!(
            "{s:?} is not a time: give RFC 3339 (2026-11-25T10:00:00Z, or \
             2026-11-25T10:00Z), a date (2026-11-25, UTC) or an age (2h, 7d)"
        )),
    }
}

/// A payload for people: the kind, then pretty JSON, text or a hex dump,
/// escaped.
pub fn payload(out: &mut String, label: &str, p: Option<&Payload>) {
    let Some(p) = p else {
        let _ = writeln!(out, "{label}: not kept");
        return;
    };
    let kind = match p.encoding() {
        "json" => "JSON",
        "text" => "text",
        _ => "binary, hex dump",
    };
    let _ = writeln!(out, "{label} ({} bytes, {kind}):", p.as_bytes().len());
    let body = esc_block(&crate::pretty::pretty(p));
    out.push_str(&body);
    if !body.ends_with('\n') {
        out.push('\n');
    }
}

/// Headers, one per line, escaped.
pub fn headers(out: &mut String, headers: &postroom::Headers) {
    if headers.is_empty() {
        let _ = writeln!(out, "headers: none");
    } else {
        let _ = writeln!(out, "headers:");
        for (k, v) in headers {
            let _ = writeln!(out, "  {}: {}", esc(k), esc(v));
        }
    }
}

// What each command shows for people.

/// The handler holding a running engine's writer past its `slow_handler`
/// threshold, if one does: every write of that engine waits for it.
pub fn print_slow_handler(out: &mut String, db: &std::path::Path, now_ms: i64) {
    if let Some(slow) = admin::slow_handler(db) {
        let _ = writeln!(
            out,
            "SLOW HANDLER running for {}: {}/{} (every write of the engine waits for it)",
            age(now_ms.saturating_sub(slow.since_ms)),
            esc(&slow.consumer),
            esc(&slow.message_id)
        );
    }
}

/// An inbox row's state for people: its status, and for a failed row that
/// no worker retries, that it waits for its sender's redelivery.
pub fn inbox_state(e: &admin::InboxEntry) -> String {
    if e.waiting_for_redelivery {
        format!("{} (waiting for redelivery)", e.status)
    } else {
        e.status.to_string()
    }
}

pub fn print_status(out: &mut String, r: &admin::StatusReport) {
    let _ = writeln!(out, "database   {}", esc(&r.path));
    let _ = writeln!(out, "schema     {}", r.schema_version);
    let _ = writeln!(
        out,
        "size       {} database, {} WAL",
        bytes(r.db_bytes),
        bytes(r.wal_bytes)
    );
    let _ = writeln!(out, "conflicts  {}", r.conflicts);
    let _ = writeln!(out);
    if r.consumers.is_empty() {
        let _ = writeln!(out, "inbox: empty");
    } else {
        // One line of counts per consumer, within 80 columns for short
        // names; what needs words (redeliveries awaited, expired leases,
        // retries) follows as sentences, only where there is any.
        let cells = r
            .consumers
            .iter()
            .map(|c| {
                vec![
                    esc(&c.consumer),
                    c.counts.pending.to_string(),
                    c.counts.processing.to_string(),
                    c.counts.failed.to_string(),
                    c.counts.dead.to_string(),
                    c.counts.completed.to_string(),
                    c.total.to_string(),
                    c.oldest_pending_age_ms.map_or("-".into(), age),
                ]
            })
            .collect();
        table(
            out,
            &[
                "CONSUMER",
                "PENDING",
                "PROCESSING",
                "FAILED",
                "DEAD",
                "COMPLETED",
                "TOTAL",
                "OLDEST PENDING",
            ],
            &[1, 2, 3, 4, 5, 6, 7],
            cells,
        );
        for c in &r.consumers {
            let name = esc(&c.consumer);
            if c.counts.waiting_for_redelivery > 0 {
                let _ = writeln!(
                    out,
                    "{name}: {} failed awaiting their sender's redelivery (inline), oldest {}",
                    c.counts.waiting_for_redelivery,
                    c.oldest_waiting_for_redelivery_age_ms
                        .map_or("-".into(), age)
                );
            }
            if c.expired_leases > 0 {
                let _ = writeln!(
                    out,
                    "{name}: {} processing past their lease (the reaper retries them)",
                    c.expired_leases
                );
            }
            if c.attempts.iter().any(|b| b.attempts > 1) {
                let buckets: Vec<String> = c
                    .attempts
                    .iter()
                    .map(|b| {
                        format!(
                            "{} row{} with {}",
                            b.rows,
                            if b.rows == 1 { "" } else { "s" },
                            b.attempts
                        )
                    })
                    .collect();
                let _ = writeln!(out, "{name}: attempts made: {}", buckets.join(", "));
            }
        }
        // Strict order: what dead letters hold (nothing of their keys runs).
        for c in r.consumers.iter().filter(|c| c.strict_order) {
            let _ = match c.oldest_held_age_ms {
                Some(oldest) if c.held_keys > 0 => writeln!(
                    out,
                    "strict order {}: {} key{} held by dead letters, oldest {}; redrive or \
                     discard them to release",
                    esc(&c.consumer),
                    c.held_keys,
                    if c.held_keys == 1 { "" } else { "s" },
                    age(oldest)
                ),
                _ => writeln!(out, "strict order {}: no key held", esc(&c.consumer)),
            };
        }
    }
    let _ = writeln!(out);
    table(
        out,
        &["OUTBOX", "PENDING", "SENT", "DEAD", "OLDEST PENDING"],
        &[1, 2, 3, 4],
        vec![vec![
            String::new(),
            r.outbox.counts.pending.to_string(),
            r.outbox.counts.sent.to_string(),
            r.outbox.counts.dead.to_string(),
            r.outbox.oldest_pending_age_ms.map_or("-".into(), age),
        ]],
    );
}

/// The sequence watermarks, when there are any: an operator reads
/// "missing 41-45" per stream.
pub fn print_sequences(out: &mut String, streams: &[postroom::StreamWatermark]) {
    if streams.is_empty() {
        return;
    }
    let _ = writeln!(out);
    let cells = streams
        .iter()
        .map(|w| {
            vec![
                esc(&w.consumer),
                esc(&w.stream),
                w.watermark.to_string(),
                w.highest.map_or("-".into(), |h| h.to_string()),
                w.listed.to_string(),
                w.unrecorded.to_string(),
                match w.missing_text() {
                    text if text.is_empty() => "-".into(),
                    text => text,
                },
            ]
        })
        .collect();
    table(
        out,
        &[
            "SEQUENCES",
            "STREAM",
            "WATERMARK",
            "HIGHEST",
            "LISTED",
            "UNRECORDED",
            "MISSING",
        ],
        &[2, 3, 4, 5],
        cells,
    );
}

pub fn print_inbox_detail(out: &mut String, d: &admin::InboxDetail) {
    let e = &d.entry;
    let fields: Vec<(&str, String)> = vec![
        ("id", e.id.to_string()),
        ("consumer", esc(&e.consumer)),
        ("source", esc(&e.source)),
        ("message id", esc(&e.message_id)),
        ("status", inbox_state(e)),
        ("attempts", e.attempts.to_string()),
        (
            "ordering key",
            e.ordering_key.as_deref().map_or("-".into(), esc),
        ),
        (
            "last error",
            e.last_error.as_deref().map_or("-".into(), esc_long),
        ),
        ("received at", time(e.received_at)),
        ("updated at", time(e.updated_at)),
        (
            "next attempt at",
            match (e.next_attempt_at, e.status) {
                _ if e.waiting_for_redelivery => {
                    "when its sender redelivers it (no worker retries it)".into()
                }
                (None, Status::Pending | Status::Failed) => "at once".into(),
                (at, _) => opt_time(at),
            },
        ),
        ("processed at", opt_time(e.processed_at)),
        ("lease until", opt_time(d.lease_until)),
        (
            "lease token",
            d.lease_token.map_or("-".into(), |t| t.to_string()),
        ),
        (
            "payload digest",
            format!(
                "{}{}",
                d.payload_hash,
                match d.payload_hash_ok {
                    Some(true) => " (matches the payload)",
                    Some(false) => " (DOES NOT MATCH the stored payload)",
                    None => "",
                }
            ),
        ),
        (
            "outbox rows",
            if d.caused_outbox.is_empty() {
                "-".into()
            } else {
                d.caused_outbox
                    .iter()
                    .map(|s| s.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            },
        ),
    ];
    key_values(out, &fields);
    headers(out, &d.headers);
    payload(out, "payload", d.payload.as_ref());
}

pub fn print_outbox_detail(out: &mut String, d: &admin::OutboxDetail) {
    let e = &d.entry;
    let held = match &d.held_back_by {
        Some(h) => format!(
            "seq {} of the same key, waiting out a backoff until {} after {} failed \
             attempt(s) (committed {}): {}",
            h.seq,
            opt_time(h.next_attempt_at),
            h.attempts,
            time(h.created_at),
            esc_long(h.last_error.as_deref().unwrap_or("-"))
        ),
        None => "-".into(),
    };
    let fields: Vec<(&str, String)> = vec![
        ("seq", e.seq.to_string()),
        ("message id", esc(&e.message_id)),
        ("topic", esc(&e.topic)),
        ("key", e.key.as_deref().map_or("-".into(), esc)),
        ("status", e.status.to_string()),
        ("attempts", e.attempts.to_string()),
        (
            "last error",
            e.last_error.as_deref().map_or("-".into(), esc_long),
        ),
        ("created at", time(e.created_at)),
        (
            "next attempt at",
            match (e.next_attempt_at, e.status) {
                (None, OutboxState::Pending) => "at once".into(),
                (at, _) => opt_time(at),
            },
        ),
        ("sent at", opt_time(e.sent_at)),
        (
            "caused by",
            e.caused_by.as_ref().map_or("-".into(), |[c, s, m]| {
                format!("consumer {}, source {}, message {}", esc(c), esc(s), esc(m))
            }),
        ),
        ("held back by", held),
        (
            "holding back",
            if d.holding_back == 0 {
                "-".into()
            } else {
                format!("{} later pending row(s) of its key", d.holding_back)
            },
        ),
    ];
    key_values(out, &fields);
    headers(out, &d.headers);
    payload(out, "payload", Some(&d.payload));
}

pub fn print_conflict(out: &mut String, d: &admin::ConflictDetail) {
    let e = &d.entry;
    key_values(
        out,
        &[
            ("conflict id", e.id.to_string()),
            ("consumer", esc(&e.consumer)),
            ("source", esc(&e.source)),
            ("message id", esc(&e.message_id)),
            ("deliveries", e.deliveries.to_string()),
            ("first seen", time(e.first_seen_at)),
            ("last seen", time(e.last_seen_at)),
            ("stored digest", e.stored_hash.clone()),
            ("new digest", e.payload_hash.clone()),
            (
                "stored row",
                match &d.stored {
                    Some(s) => format!("inbox row {} ({})", s.id, s.status),
                    None => "deleted by retention".into(),
                },
            ),
        ],
    );
    headers(out, &d.headers);
    payload(out, "quarantined payload", Some(&d.payload));
    if d.stored.is_some() {
        payload(out, "stored payload", d.stored_payload.as_ref());
    }
}

pub fn print_cleanup(out: &mut String, s: &admin::CleanupSummary, retention: Duration) {
    let verb = if s.dry_run { "would delete" } else { "deleted" };
    let _ = writeln!(
        out,
        "{}{verb} {} completed inbox row(s) and {} sent outbox row(s) finished before {} \
         (retention {})",
        if s.dry_run { "dry run: " } else { "" },
        s.inbox_deleted,
        s.outbox_deleted,
        time(s.cutoff_ms),
        age(i64::try_from(retention.as_millis()).unwrap_or(i64::MAX)),
    );
    if let (Some(n), Some(cutoff)) = (s.dead_deleted, s.dead_cutoff_ms) {
        let _ = writeln!(
            out,
            "{verb} {n} dead letter(s) dead before {}",
            time(cutoff)
        );
    }
    if let (Some(n), Some(cutoff)) = (s.conflicts_deleted, s.conflicts_cutoff_ms) {
        let _ = writeln!(
            out,
            "{verb} {n} conflict(s) last seen before {}",
            time(cutoff)
        );
    }
    let _ = writeln!(
        out,
        "(the newest row of the inbox and of the outbox stays, whatever its age: row ids are never \
         given out twice)"
    );
    if !s.dry_run {
        let _ = writeln!(
            out,
            "{} inbox key entr{} deleted after the rows, {} transaction(s)",
            s.keys_deleted,
            if s.keys_deleted == 1 { "y" } else { "ies" },
            s.transactions
        );
    }
}

pub fn print_check(out: &mut String, r: &admin::CheckReport) {
    if r.integrity_ok {
        let _ = writeln!(out, "{}: ok", r.integrity_check);
    } else {
        let _ = writeln!(out, "{}: FAILED", r.integrity_check);
        for line in r.integrity_errors.iter().flat_map(|e| e.lines()) {
            let _ = writeln!(out, "  {}", esc(line));
        }
        let _ = writeln!(out, "postroom invariants not checked: the file is damaged");
        return;
    }
    let _ = writeln!(
        out,
        "checked {} inbox row(s), {} outbox row(s), {} payload digest(s)",
        r.inbox_rows, r.outbox_rows, r.payloads_hashed
    );
    for (title, list, total) in [
        ("violations", &r.violations, r.violations_total),
        ("warnings", &r.warnings, r.warnings_total),
    ] {
        if total == 0 {
            continue;
        }
        let _ = writeln!(out, "\n{title} ({total}):");
        let cells = list
            .iter()
            .map(|f| {
                vec![
                    f.kind.to_string(),
                    f.table.to_owned(),
                    f.id.to_string(),
                    esc(&f.detail),
                ]
            })
            .collect();
        table(out, &["KIND", "TABLE", "ID", "DETAIL"], &[2], cells);
        if (list.len() as u64) < total {
            let _ = writeln!(out, "… and {} more", total - list.len() as u64);
        }
    }
    let _ = writeln!(
        out,
        "\n{}",
        if r.is_ok() {
            format!("check: OK ({} warning(s))", r.warnings_total)
        } else {
            format!("check: {} VIOLATION(S)", r.violations_total)
        }
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_and_bidi_characters_are_escaped_and_text_is_not() {
        assert_eq!(esc("plain id"), "plain id");
        assert_eq!(esc("a\x1b[2Jb"), "a\\u{1b}[2Jb");
        assert_eq!(esc("x\r\nforged"), "x\\u{d}\\u{a}forged");
        assert_eq!(esc("abc\u{202e}cba"), "abc\\u{202e}cba");
        assert_eq!(esc("a\u{e0041}\u{ad}b"), "a\\u{e0041}\\u{ad}b");
        assert_eq!(esc_block("line 1\nline\t2\x07"), "line 1\nline\t2\\u{7}");
        assert_eq!(esc("日本語 ✓"), "日本語 ✓");
        assert_eq!(clip("abcdef", 4), "abc…");
        let long = "e\n".repeat(LONG_FIELD_CHARS);
        let shown = esc_long(&long);
        assert!(shown.len() < 4 * LONG_FIELD_CHARS, "{}", shown.len());
        assert!(shown.ends_with("… truncated (8192 bytes in all; --json gives it whole)"));
        assert!(!shown.contains('\n'));
    }

    #[test]
    fn times_are_rfc3339_and_ages_short() {
        assert_eq!(time(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(time(120), "1970-01-01T00:00:00.120Z");
        assert_eq!(time(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(age(850), "850ms");
        assert_eq!(age(192_000), "3m 12s");
        assert_eq!(age(2 * 86_400_000 + 4 * 3_600_000), "2d 4h");
    }

    #[test]
    fn durations_and_times_parse_as_people_write_them() {
        assert_eq!(parse_duration("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("P2D"), Ok(Duration::from_secs(2 * 86_400)));
        assert!(parse_duration("604800").unwrap_err().contains("no unit"));
        assert!(parse_duration("soon").is_err());
        assert_eq!(parse_time("2026-11-25T10:00:00Z"), Ok(1_795_600_800_000));
        assert_eq!(parse_time("2026-11-25T10:00Z"), Ok(1_795_600_800_000));
        assert_eq!(parse_time("2026-11-25"), Ok(1_795_564_800_000));
        let two_hours_ago = parse_time("2h").unwrap();
        let expected = admin::now_ms() - 7_200_000;
        assert!((two_hours_ago - expected).abs() < 5_000);
        assert!(parse_time("yesterday-ish").is_err());
        assert!(parse_time("2026-11-25T23:59")
            .unwrap_err()
            .contains("no offset"));
        let week_ago = parse_time("7d ago").unwrap();
        assert!((week_ago - (admin::now_ms() - 7 * 86_400_000)).abs() < 5_000);
    }

    #[test]
    fn table_columns_are_aligned_by_display_width() {
        let mut out = String::new();
        table(
            &mut out,
            &["NAME", "N"],
            &[1],
            vec![
                vec!["日本".into(), "1".into()],
                vec!["abcd".into(), "22".into()],
            ],
        );
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines, ["NAME   N", "日本   1", "abcd  22"]);
    }
}
