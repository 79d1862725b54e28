//! Counters and histograms through the [`metrics`] facade: whatever
//! recorder the application installed (Prometheus, StatsD, …) receives
//! them; without one each call costs a key built and dropped, nothing
//! more. The names and labels are listed in the crate docs ("Metrics").
//!
//! Every call here happens after the commit it reports on, so a batch
//! rolled back and run again is not counted twice.

use std::time::Duration;

use crate::message::{Outcome, Receipt};

/// `deliver` answers and queued results, by kind. `InFlight` is not
/// counted: the message was neither settled nor attempted.
pub(crate) fn outcome(consumer: &str, outcome: &Outcome) {
    let name = match outcome {
        Outcome::Processed { .. } => "postroom_delivered_total",
        Outcome::Duplicate | Outcome::DuplicateBySequence { .. } => "postroom_duplicates_total",
        Outcome::Conflict { .. } => "postroom_conflicts_total",
        Outcome::Failed { .. } => "postroom_failed_total",
        Outcome::Dead { .. } => "postroom_dead_total",
        Outcome::InFlight { .. } => return,
    };
    metrics::counter!(name, "consumer" => consumer.to_owned()).increment(1);
}

/// `receive` receipts: repeats and quarantined ids (an accepted message is
/// counted once processed).
pub(crate) fn receipt(consumer: &str, receipt: &Receipt) {
    let name = match receipt {
        Receipt::Duplicate | Receipt::DuplicateBySequence { .. } => "postroom_duplicates_total",
        Receipt::Conflict { .. } => "postroom_conflicts_total",
        Receipt::Accepted => return,
    };
    metrics::counter!(name, "consumer" => consumer.to_owned()).increment(1);
}

/// From `deliver` being called to its answer, durable.
pub(crate) fn deliver_latency(consumer: &str, took: Duration) {
    metrics::histogram!("postroom_deliver_seconds", "consumer" => consumer.to_owned())
        .record(took.as_secs_f64());
}

/// Jobs committed together in one group commit.
pub(crate) fn group_size(jobs: usize) {
    metrics::histogram!("postroom_group_size").record(jobs as f64);
}

/// An outbox message marked sent: how long after its commit.
pub(crate) fn relayed(lag_ms: i64) {
    metrics::counter!("postroom_outbox_sent_total").increment(1);
    metrics::histogram!("postroom_relay_lag_seconds").record(lag_ms.max(0) as f64 / 1000.0);
}

/// An outbox message dead (refused by the sink, or out of attempts).
pub(crate) fn outbox_dead() {
    metrics::counter!("postroom_outbox_dead_total").increment(1);
}

/// A copy-back of the writer's that a reader kept from completing (see
/// `WriterState::copy_back_inline`).
pub(crate) fn checkpoint_blocked() {
    metrics::counter!("postroom_checkpoint_blocked_total").increment(1);
}

/// A commit that left the WAL past its cap (a reader holds an old snapshot).
pub(crate) fn wal_over_cap() {
    metrics::counter!("postroom_wal_over_cap_total").increment(1);
}

/// A handler that held the writer past the `slow_handler` threshold.
pub(crate) fn slow_handler(consumer: &str) {
    metrics::counter!("postroom_slow_handlers_total", "consumer" => consumer.to_owned())
        .increment(1);
}

/// Rows waiting for a redelivery (failed, not queued: no worker retries
/// them) and the age of the oldest, per consumer: gauges, set by the live
/// gauges' refresh and whenever the inbox is counted
/// ([`Postroom::stats`](crate::Postroom::stats)).
pub(crate) fn waiting_for_redelivery(consumer: &str, rows: u64, oldest_age: Option<Duration>) {
    metrics::gauge!("postroom_waiting_for_redelivery", "consumer" => consumer.to_owned())
        .set(rows as f64);
    metrics::gauge!(
        "postroom_oldest_waiting_for_redelivery_seconds",
        "consumer" => consumer.to_owned()
    )
    .set(oldest_age.map_or(0.0, |age| age.as_secs_f64()));
}

/// One consumer's live counts, set after a change of the data (see
/// `runtime::gauges`).
pub(crate) fn consumer_counts(
    consumer: &str,
    backlog: u64,
    waiting_for_retry: u64,
    dead: u64,
    watermark_gaps: u64,
) {
    for (name, value) in [
        ("postroom_backlog", backlog),
        ("postroom_waiting_for_retry", waiting_for_retry),
        ("postroom_dead_letters", dead),
        ("postroom_watermark_gaps", watermark_gaps),
    ] {
        metrics::gauge!(name, "consumer" => consumer.to_owned()).set(value as f64);
    }
}

/// One consumer's oldest pending row's and oldest dead letter's ages; 0
/// when there is none.
pub(crate) fn consumer_ages(
    consumer: &str,
    oldest_pending: Option<Duration>,
    oldest_dead: Option<Duration>,
) {
    for (name, age) in [
        ("postroom_oldest_backlog_seconds", oldest_pending),
        ("postroom_oldest_dead_letter_seconds", oldest_dead),
    ] {
        metrics::gauge!(name, "consumer" => consumer.to_owned())
            .set(age.map_or(0.0, |age| age.as_secs_f64()));
    }
}

/// The size of the `-wal` file.
pub(crate) fn wal_bytes(bytes: u64) {
    metrics::gauge!("postroom_wal_bytes").set(bytes as f64);
}
