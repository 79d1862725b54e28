//! `postroom <DB> top`: status refreshed in place, with rates; `--json`
//! prints one frame per refresh.

use std::fmt::Write as _;
use std::io::{self, IsTerminal};
use std::time::{Duration, Instant};

use postroom::admin;
use serde::Serialize;

use crate::render::{self, time};
use crate::{Ctx, Failed};

/// One frame of `top --json`.
#[derive(Serialize)]
struct Frame<'a> {
    status: &'a admin::StatusReport,
    /// Per second since the previous frame; absent in the first.
    rates: Option<Rates>,
    engine_running: Option<bool>,
}

#[derive(Serialize, Clone, Copy)]
struct Rates {
    completed_per_sec: f64,
    dead_per_sec: f64,
    received_per_sec: f64,
    sent_per_sec: f64,
}

/// Totals the rates are differences of.
#[derive(Clone, Copy)]
struct Totals {
    at: Instant,
    completed: u64,
    dead: u64,
    received: u64,
    sent: u64,
}

impl Totals {
    fn of(r: &admin::StatusReport) -> Totals {
        let sum = |f: fn(&admin::ConsumerStatus) -> u64| r.consumers.iter().map(f).sum();
        Totals {
            at: Instant::now(),
            completed: sum(|c| c.counts.completed),
            dead: sum(|c| c.counts.dead),
            received: sum(|c| c.total),
            sent: r.outbox.counts.sent,
        }
    }

    /// Rates from `earlier` to `self`. Retention deleting rows can make a
    /// total shrink: that interval counts as 0, not negative.
    fn rates_since(&self, earlier: &Totals) -> Rates {
        let secs = self.at.duration_since(earlier.at).as_secs_f64().max(1e-3);
        let rate = |now: u64, then: u64| now.saturating_sub(then) as f64 / secs;
        Rates {
            completed_per_sec: rate(self.completed, earlier.completed),
            dead_per_sec: rate(self.dead, earlier.dead),
            received_per_sec: rate(self.received, earlier.received),
            sent_per_sec: rate(self.sent, earlier.sent),
        }
    }
}

/// The shortest refresh `top` makes: each one reads the whole inbox.
const TOP_MIN_INTERVAL: Duration = Duration::from_millis(100);

/// `top`: a frame per interval, in place on a terminal, until interrupted
/// or `--iterations` frames.
pub(crate) fn run(
    ctx: &mut Ctx<'_>,
    interval: Duration,
    iterations: Option<u64>,
) -> Result<(), Failed> {
    let interval = interval.max(TOP_MIN_INTERVAL);
    let tty = io::stdout().is_terminal() && !ctx.cli.json;
    if tty {
        // Asked for its side effect: in a Windows console it turns on VT
        // processing, which the redraw's escapes need; elsewhere it reads
        // the environment only.
        let _ = console::Term::stdout().features().colors_supported();
    }
    let mut previous: Option<Totals> = None;
    let mut frame = 0u64;
    loop {
        // A fresh connection per frame: an engine that opened meanwhile is
        // read through its WAL.
        let (report, view) = admin::read(&ctx.cli.db, ctx.cli.busy_timeout, |c, _| {
            admin::status(c, &ctx.cli.db)
        })?;
        let totals = Totals::of(&report);
        let rates = previous.map(|p| totals.rates_since(&p));
        previous = Some(totals);
        if ctx.cli.json {
            let line = serde_json::to_string(&Frame {
                status: &report,
                rates,
                engine_running: view.engine_running,
            })
            .unwrap_or_default();
            let _ = writeln!(ctx.out, "{line}");
        } else {
            if tty {
                // Home and clear: the frame is redrawn in place.
                ctx.out.push_str("\x1b[H\x1b[2J");
            } else if frame > 0 {
                ctx.out.push('\n');
            }
            let _ = writeln!(
                ctx.out,
                "postroom top — {} — every {} — engine {}",
                time(report.now_ms),
                render::span(interval),
                match view.engine_running {
                    Some(true) => "running",
                    Some(false) => "not running",
                    None => "unknown",
                }
            );
            match rates {
                Some(r) => {
                    let _ = writeln!(
                        ctx.out,
                        "rates/s    received {:.1}  completed {:.1}  dead {:.1}  sent {:.1}",
                        r.received_per_sec, r.completed_per_sec, r.dead_per_sec, r.sent_per_sec
                    );
                }
                None => {
                    let _ = writeln!(ctx.out, "rates/s    (after the next refresh)");
                }
            }
            let _ = writeln!(
                ctx.out,
                "relay lag  {}",
                report
                    .outbox
                    .oldest_pending_age_ms
                    .map_or("none (nothing pending)".into(), render::age)
            );
            render::print_slow_handler(&mut ctx.out, &ctx.cli.db, report.now_ms);
            render::print_status(&mut ctx.out, &report);
            render::print_sequences(&mut ctx.out, &report.sequences);
            for note in view.notices() {
                let _ = writeln!(ctx.out, "note: {note}");
            }
        }
        if !ctx.flush()? {
            // The reader went away (`| head`): done.
            return Ok(());
        }
        frame += 1;
        if iterations.is_some_and(|n| frame >= n) {
            return Ok(());
        }
        std::thread::sleep(interval);
    }
}
