//! Benchmark harness: throughput, latency and memory of postroom's inline
//! `deliver`, queued `receive`/`receive_batch` and processing, the outbox
//! relay, retention and a large backlog, each engine row next to a
//! raw-rusqlite floor (or a baseline) measured in the same run, on the same
//! disk — and next to the *seeds floor*, the physical limit of the job.
//!
//! ```text
//! cargo run --release -p postroom-bench -- [--quick] [--json PATH] [--only TEXT]
//! ```
//!
//! `--quick` uses small message counts and 50,000-row prefills (about 45 s on
//! two cores, a minute when they are busy). The full run prefills 1,000,000
//! and 5,000,000 retained rows, 1,000,000 expired and 1,000,000 pending
//! ones, and takes about 18 minutes on a busy two-core machine (four of
//! them `stats()` scanning millions of rows between timed phases, two of
//! them retention deleting a million rows three times, five or six of them
//! the duplicate, queued and relay rows at 1M and 5M, most of that at 5M,
//! where each engine open's `quick_check` reads the file for 4 s), plus a
//! minute or two of prefills the first time; the prefilled files are
//! cached in `<target dir>/bench-cache/` (`$CARGO_TARGET_DIR` when the
//! binary runs, else the workspace's `target/`), so only the first run pays
//! for them. `--json PATH` also writes the rows as a JSON array. Progress
//! goes to stderr, the report to stdout.
//!
//! Every scenario runs in three passes, each on a new database: a warm-up,
//! then a timed phase that ends at a third of its message count or of its
//! time cap, whichever comes first (exceptions below: the drains, the
//! cleanup row, the backlog row). Each floor and the engine rows compared with it run next
//! to each other, in alternating order from pass to pass. `--only TEXT`
//! runs just the groups with a scenario whose name contains TEXT (ends
//! with it, when TEXT ends with `$`: `--only "1 caller FULL$"` leaves out
//! the `@1M` and `@5M` groups). The rows,
//! in run order:
//!
//! * `idle engine: wakeups/s, threads`: default settings (FULL, 2
//!   workers), the bench consumer, an effectful one (`bench-effects`, an
//!   external step that does nothing) and a counting sink; one message
//!   delivered and one received, both processed and sent, then 3 s to
//!   settle (the engine's own tail: for about 2 s after its last commits
//!   the checkpointer's watch sees them and wakes the sleepers once to read
//!   their timers again; a 1 s settle measured that tail, 10-17 wakeups/s)
//!   and a window of 5 s (3 s with `--quick`) split over the passes while
//!   nothing is due. It counts the threads that appeared with the
//!   open (a diff of /proc/self/task before it, so the harness's threads,
//!   which only sleep meanwhile, are left out) and sums their
//!   `voluntary_ctxt_switches` + `nonvoluntary_ctxt_switches` over the
//!   window: wakeups per second, in all and by thread name (the notes;
//!   names cut to 15 bytes by the kernel), the most threads of a pass, the
//!   VmRSS after the settle over VmRSS before the open (the largest), and
//!   the process's CPU (ms per second, 10 ms ticks) and `write_bytes` per
//!   second over the window. No messages: its msgs/s and per-message
//!   columns are blank.
//! * `deliver …` rows drive the engine (`Postroom::deliver` from 1 or 8
//!   threads; the handler runs one domain `UPDATE` and one `publish`).
//!   `deliver 1 caller NORMAL, unkeyed publish` is the one-caller NORMAL
//!   row with the handler publishing without an ordering key, as the seeds
//!   floor does (every other engine row's handler publishes with the
//!   message id as its key, which costs the key's index entry).
//!   `deliver 1 caller FULL, sequenced` is the one-caller row with each
//!   message carrying a sequence number (`Message::with_sequence_in`, in
//!   order, so the watermark moves up by one per message), compared with
//!   the same row without.
//!   `floor …` rows are a hand-written rusqlite loop doing the same SQL per
//!   message (inbox row with postroom_inbox's columns, the domain `UPDATE`,
//!   the outbox `INSERT`) on a separate file with postroom's own schema, with
//!   the same `synchronous` level, WAL, and the stated messages per
//!   transaction. Like any plain loop it leaves SQLite's automatic
//!   checkpoint inside its commits, where the engine checkpoints on a thread
//!   of its own; that favours the engine's msgs/s (most at NORMAL), not its
//!   p50.
//! * `seeds floor N/tx …` rows are the seeds floor: the articles' pattern and
//!   nothing else, on their own minimal schema — `INSERT INTO inbox
//!   (consumer, message_id, received_at) … ON CONFLICT DO NOTHING` on a rowid
//!   table keyed `(consumer, message_id)`; if inserted, `UPDATE accounts SET
//!   balance = balance + 1, version = version + 1` on one of 1,000 rows;
//!   `INSERT INTO outbox (topic, payload, created_at)` (256 bytes) with a
//!   partial index on unsent rows; 32-hex random ids, WAL, default cache,
//!   `prepare_cached`; at 1, 8 and 100 messages per transaction. It does not
//!   move when postroom's schema grows. Every handler in this harness does
//!   the same work (one account updated, one 256-byte message published), so
//!   the `seeds` column (an engine row's msgs/s over the seeds floor named in
//!   the goals: 1/tx for one caller, 8/tx for eight, 100/tx for the drains)
//!   compares like with like. Rows that can say so give the WAL frames
//!   (pages dirtied, once per commit) and B-tree entries added (net, from
//!   `dbstat`, fresh databases only) per message of the timed phase: the
//!   floors by a WAL hook on their connection (frames only on postroom's
//!   schema), the engine rows from `stats().wal_frames_written` (its
//!   writer's commits) on a fresh database, and at any size for `deliver
//!   …` and retention (the other `@1M` rows skip `stats()`); not the
//!   held-key and backlog rows.
//! * `receive 1 by 1 FULL`: one caller `receive`s one message per call, no
//!   processing (`workers(0)`). `… + processing`: the same with default
//!   settings, processing as it goes; msgs/s is the receiving caller's, the
//!   notes say how many were processed before it stopped; its pages, CPU
//!   and bytes per message run until all are processed.
//! * `duplicate storm` re-delivers messages that were all processed before;
//!   its floor is the dedupe `SELECT` on the unique key, one by one.
//! * `receive_batch 1000`: one caller storing batches of 1,000 with
//!   `receive_batch` into a consumer with `workers(0)`, so only intake is
//!   measured; its floor does the same `pending` inbox INSERTs (the
//!   engine's columns, `queued = 1`), one transaction per 1,000.
//! * `queued end to end, N workers`: the warm-up's messages received and
//!   processed first, then the whole count stored with one `receive_batch`;
//!   timed from its return until the domain counter (updated in the
//!   transaction that completes each message) shows every message done,
//!   polled every 2 ms and checked against `stats()` afterwards (polling
//!   `stats()` itself would scan the inbox on one of the two cores). Like
//!   the relay drain (and its floor) it runs until drained, not to the time
//!   cap (giving up after 5 minutes, with a note), so the counts are sized
//!   to take a few seconds a pass. Transactional consumers' rows are
//!   processed in batches of `process_batch` in one transaction each (N only
//!   sizes the effectful workers, idle here): the notes give commits per
//!   message. Compared with the seeds floor at 100/tx. Its pages, CPU and
//!   bytes per message cover the `receive_batch` call too (a queued
//!   message's whole cost), and the harness's polling.
//! * `relay drain`: N committed pending outbox rows (keyed, with causation
//!   headers, published by `room.transaction` in 10,000-row chunks with no
//!   sink), then the engine reopened with a `sink_fn` that counts and
//!   returns `Sent`; timed from the warm-up's count handed over until the
//!   sink has seen all N and none is left pending, checked against
//!   `stats().outbox.sent`. Default `relay_batch` (100). Its floor reads
//!   due rows through the relay's index (`postroom_outbox_ready`, no key
//!   held back: each row is its key's only one) and runs one mark-sent
//!   `UPDATE` per row, one transaction per 100, on the same kind of file.
//! * `relay latency`: one `deliver()` every 2 ms into an engine with a
//!   `ChannelSink`; each message is timed from `deliver()` being called to
//!   its outbox row coming out of the channel (the notes add the time from
//!   `deliver()` returning: the true commit-to-sink time lies between).
//!   Paced, so msgs/s is blank.
//! * `held key: …` rows (issue 32): each measure twice, on a database with
//!   no backlog and on one where 1,000,000 rows (50,000 with `--quick`) of
//!   one ordering key wait behind a head that retries in a day, written by
//!   SQL before the engine opens with default settings: `deliver 1 caller
//!   FULL` (the bench consumer's inbox holds the held key; the writer runs
//!   queued processing between its batches), `queued latency, another key`
//!   (`receive()` of a message with a key of its own until its handler
//!   committed, one at a time, polled every 100 µs) and `relay latency,
//!   another key` (the outbox holds the held key; as `relay latency`).
//!   Compared by p99: the held row within 2x of the one with none held.
//! * `… @1M` and `… @5M` rows: every FULL row above (deliver, 1 and 8
//!   callers; duplicate storm; receive_batch 1000; queued end to end, 2 and
//!   4 workers; relay drain; relay latency) and its floor again, with the
//!   same counts and caps, each pass on a new copy of a database already
//!   holding that many retained completed inbox rows with random
//!   UUIDv4-like ids (prefill row `i` is message `i` of a fixed seed, its
//!   payload's digest stored); the floors run on copies of the same file.
//!   The duplicate storm there re-delivers rows of the prefill, picked at
//!   random over all of them (its floor looks up the same ones), so the
//!   lookups land on cold pages all over the file, not on the newest; the
//!   other rows send fresh messages. The engine rows other than `deliver …`
//!   skip `stats()` there (15 s a call at 5M), so they have no group-commit
//!   notes, and the drains check their counts through a read-only
//!   connection instead.
//! * `retention 1M: …`: a copy of a database of 1,000,000 completed rows
//!   processed two to three days ago, opened with `retention` 1 hour (all
//!   expired), `reaper_interval` one day and no workers. `no cleanup`: one
//!   caller delivers, the baseline. `during cleanup`: `room.cleanup()` on
//!   another thread deletes them all while one caller delivers until it
//!   returns, however long that takes (no cap). Notes give rows deleted per
//!   second of `cleanup()`, all passes together, and for both rows how many
//!   deliveries took over 50 ms.
//! * `peak RSS, 1M pending backlog`: a copy of a database of 1,000,000
//!   received, still pending messages, opened with default settings (2
//!   workers, quick_check on) and left to process for 10 s per pass (2 s with
//!   `--quick`); msgs/s is what the workers completed in that time. Notes
//!   give the engine's own share of the peak: VmHWM minus VmRSS just
//!   before the open, the largest over the passes. That is a lower bound:
//!   the engine reuses heap the allocator kept from earlier scenarios; the
//!   `peak RSS` column, everything included, is the upper one.
//!
//! The columns:
//!
//! * `msgs/s`: messages finished in the timed phase over its wall time.
//! * `p50 p99 max`: latency of one `deliver()` call, of one message through
//!   the relay, of one `receive_batch()` call of 1,000 (and of one
//!   transaction of its floor), or of one message of a floor that commits
//!   each message (or looks each one up) on its own; blank for the other
//!   batching floors, where a message has no latency of its own, and for
//!   the drains and the backlog, which time the whole.
//! * `peak RSS`: VmHWM from /proc/self/status, which is process-wide and
//!   monotonic; it is reset (`/proc/self/clear_refs`) before each pass of a
//!   scenario (the backlog row: again just before the engine opens), so it
//!   is the peak during that pass (on top of whatever earlier scenarios left
//!   resident: the backlog row's notes say how much), and the lowest over
//!   the passes is shown. If the reset fails the header says so and the
//!   column is the run's peak so far; the largest scenarios run last either
//!   way. Includes the harness's own latency vectors (16 B per message).
//! * `CPU/msg`: the process's user + system time over the timed phase (all
//!   threads, those that ended included: the engine's and the harness's
//!   callers and polling; /proc/self/stat, 10 ms ticks) per message
//!   finished.
//! * `WAL/msg`: WAL bytes appended per message, WAL frames × (page size +
//!   24-byte frame header), where the row counts frames (the `pages` of
//!   the notes).
//! * `disk/msg`: `write_bytes` of /proc/self/io over the timed phase per
//!   message: what the kernel counts as sent to storage for this process,
//!   WAL appends and the checkpoints' copies back into the database alike.
//!   A 4 KiB page is counted when it becomes dirty: one rewritten before
//!   the kernel writes it back counts once (rewrites merge at NORMAL, where
//!   no fsync comes between), so it is near what reaches the device, not
//!   what SQLite wrote; checkpoints after the phase are not in it. The
//!   header says whether it counts here at all (a container's filesystem
//!   may leave it 0).
//! * `ΔRSS`: VmRSS after a pass minus before it, the largest over the passes.
//! * `ratio` / `vs`: this row's msgs/s over that of the floor (or, for the
//!   cleanup row, the baseline) named in `vs`.
//! * `notes`: the average group-commit size (jobs_committed /
//!   batches_committed from `stats()`) for engine rows, and per row what
//!   else it measured (WAL pages and B-tree entries per message, commits
//!   per message, rows deleted per second, relay latency from `deliver()`
//!   returning; the idle row's wakeups, threads, VmRSS, CPU and bytes
//!   written per second, and below the table its wakeups by thread). The
//!   `deliver …`, duplicate storm
//!   and retention rows give the CPU used in their timed phase, in cores
//!   (CPU seconds per wall second, out of `nproc`): the whole process
//!   (user + system, the harness's callers included) and the engine's
//!   writer thread alone. A writer near 1.0 is the serial limit; below it,
//!   the writer also waits: on its commits' fsyncs, or for callers' jobs.
//!
//! Below the notes, the goals of issue #6, judged on this run's figures:
//! ratios to the floors, absolute bounds (judged only at full size), and
//! each `… @5M` row against the same row on a fresh database (at least
//! 0.6x; the paced relay latency row by 1/p99), with how far its floor
//! moved between the two as a measure of the disk's drift.
//!
//! (`--prefill-child KIND N PATH` is internal: the prefill runs in a child
//! process so its 1 GiB page cache does not show up in this process's peak
//! RSS.)

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use postroom::{
    handler_fn, sink_fn, Builder, ChannelSink, Durability, EffectContext, EffectHandler, Failure,
    Handler, Message, OutboxMessage, Outcome, Outgoing, Postroom, Receipt, SendResult, Tx,
    CAUSATION_HEADER, CORRELATION_HEADER,
};
use rusqlite::{params, Connection, OptionalExtension};
use serde::Serialize;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Res<T> = Result<T, BoxError>;

const CONSUMER: &str = "bench";
const SOURCE: &str = "orders";
const OUT_TOPIC: &str = "shipping.requested";
/// The seeds' outgoing message: 256 bytes.
const OUT_PAYLOAD: &[u8] = &[b'x'; 256];
/// The seeds' domain write: one of `ACCOUNTS` rows, picked by message.
const DOMAIN_UPDATE: &str =
    "UPDATE accounts SET balance = balance + 1, version = version + 1 WHERE id = ?1";
const ACCOUNTS: u64 = 1_000;
const COUNTERS_DDL: &str = "CREATE TABLE IF NOT EXISTS accounts (
         id INTEGER PRIMARY KEY, balance INTEGER NOT NULL, version INTEGER NOT NULL);
     INSERT OR IGNORE INTO accounts (id, balance, version)
         WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 1000)
         SELECT i, 0, 0 FROM n;";

/// The account a message's handler updates (spread over all of them).
fn account_of(message_id: &str) -> i64 {
    let h = blake3::hash(message_id.as_bytes());
    let n = u64::from_le_bytes(h.as_bytes()[..8].try_into().expect("8 bytes"));
    i64::try_from(n % ACCOUNTS + 1).expect("small")
}

/// Messages per `receive_batch` call, and per transaction of its floor.
const RECEIVE_BATCH: usize = 1000;
/// The pause between two messages timed through the relay: far from
/// saturating it.
const RELAY_PACE: Duration = Duration::from_millis(2);
/// Rows published per transaction when filling an outbox before a drain.
const OUTBOX_FILL_TXN: u64 = 10_000;
/// The drains run until drained (that is what they time), not to the time
/// cap; past this they give up and say so.
const DRAIN_LIMIT: Duration = Duration::from_secs(300);
/// A delivery slower than this is a stall (the retention goal).
const STALL: Duration = Duration::from_millis(50);

// ---------------------------------------------------------------------------
// Plan: how much each mode runs.

struct Plan {
    quick: bool,
    /// Each scenario's count and time cap are split over this many passes,
    /// and each pass alternates which of a floor and its engine row runs
    /// first: fsync times on shared virtual disks drift by 2x over a minute,
    /// and interleaving keeps that drift out of the ratios.
    passes: u32,
    /// Untimed messages before each timed phase.
    warmup: u64,
    /// Upper bound on a scenario's timed phases, all passes together.
    cap: Duration,
    one_full: u64,
    one_normal: u64,
    many: u64,
    duplicates: u64,
    /// Messages stored with `receive_batch`, `RECEIVE_BATCH` per call.
    receive: u64,
    /// Messages received first, then drained by queued workers (sized to
    /// drain in a few seconds a pass: the drains ignore `cap`).
    queued: u64,
    /// Committed outbox rows drained by the relay (likewise).
    relay: u64,
    /// Messages timed one at a time through the relay.
    relay_latency: u64,
    /// Prefilled databases: completed rows for the scale rows.
    retained: Vec<u64>,
    /// Expired completed rows that `cleanup()` deletes while one caller
    /// delivers, and pending received rows for the memory scenario.
    expired: u64,
    backlog: u64,
    /// How long each pass of the memory scenario lets workers process the
    /// backlog.
    backlog_for: Duration,
    /// Rows of one ordering key held behind a head that retries in a day
    /// (the held-key rows).
    held: u64,
    /// The idle row: how long each pass lets the engine settle, and how
    /// long it is measured, all passes together.
    idle_settle: Duration,
    idle_for: Duration,
}

impl Plan {
    fn quick() -> Plan {
        Plan {
            quick: true,
            passes: 3,
            warmup: 300,
            cap: Duration::from_millis(1500),
            one_full: 3_000,
            one_normal: 10_000,
            many: 10_000,
            duplicates: 5_000,
            receive: 60_000,
            queued: 24_000,
            relay: 30_000,
            relay_latency: 150,
            retained: vec![50_000],
            expired: 50_000,
            backlog: 50_000,
            backlog_for: Duration::from_secs(2),
            held: 50_000,
            idle_settle: Duration::from_secs(3),
            idle_for: Duration::from_secs(3),
        }
    }

    fn full() -> Plan {
        Plan {
            quick: false,
            passes: 3,
            warmup: 2_000,
            cap: Duration::from_secs(10),
            one_full: 30_000,
            one_normal: 200_000,
            many: 200_000,
            duplicates: 100_000,
            receive: 1_500_000,
            queued: 150_000,
            relay: 150_000,
            relay_latency: 1_500,
            retained: vec![1_000_000, 5_000_000],
            expired: 1_000_000,
            backlog: 1_000_000,
            backlog_for: Duration::from_secs(10),
            held: 1_000_000,
            idle_settle: Duration::from_secs(3),
            idle_for: Duration::from_secs(5),
        }
    }
}

// ---------------------------------------------------------------------------
// Scenarios.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SyncMode {
    Full,
    Normal,
}

impl SyncMode {
    fn label(self) -> &'static str {
        match self {
            SyncMode::Full => "FULL",
            SyncMode::Normal => "NORMAL",
        }
    }

    fn engine(self) -> Durability {
        match self {
            SyncMode::Full => Durability::Full,
            SyncMode::Normal => Durability::Normal,
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Work {
    /// Engine: fresh messages from `callers` threads calling `deliver`;
    /// the handler publishes with an ordering key unless `keyed` is false.
    Deliver { callers: usize, keyed: bool },
    /// Engine: as `Deliver`, each message carrying a sequence number (in
    /// order, one stream per pass) so that the watermark advances with it.
    DeliverSequenced,
    /// Engine: every message was processed before; one caller re-delivers.
    DuplicateStorm,
    /// Floor: inbox insert + domain update + outbox insert, `batch` per
    /// transaction.
    FloorWrites { batch: usize },
    /// Floor: the dedupe lookup alone, one `SELECT` per message.
    FloorDedupe,
    /// The seeds floor: the articles' three statements on their own
    /// minimal schema, `batch` messages per transaction.
    SeedsFloor { batch: usize },
    /// Engine: one caller `receive`s one message per call, no workers.
    ReceiveOne,
    /// Engine: one caller `receive`s one message per call while the
    /// engine processes them (default settings).
    ReceiveProcess,
    /// Engine: one caller storing `batch` messages per `receive_batch`, with
    /// no workers, so only intake is measured.
    Receive { batch: usize },
    /// Floor: the `pending` inbox INSERT of a received message, `batch` per
    /// transaction.
    FloorReceive { batch: usize },
    /// Engine: `workers` queued workers draining messages received (in one
    /// `receive_batch`) just before the clock starts.
    QueuedDrain { workers: usize },
    /// Engine: a database holding committed pending outbox rows is opened
    /// with a counting sink; the relay drains them.
    RelayDrain,
    /// Floor: the relay's SQL by hand: the same due-rows `SELECT`, then one
    /// mark-sent `UPDATE` per row, one transaction per `batch`.
    FloorRelay { batch: usize },
    /// Engine: one `deliver` every `RELAY_PACE`, each timed until its
    /// outbox row reaches a `ChannelSink`.
    RelayLatency,
    /// Engine: one caller delivering on a database of expired completed
    /// rows, with or without `cleanup()` deleting them meanwhile.
    Retention { cleanup: bool },
    /// Engine: default settings opened on a pending backlog, processing it
    /// for `Plan::backlog_for`: what memory does the backlog cost?
    Backlog,
    /// Engine: default settings, a transactional and an effectful consumer
    /// and a sink, nothing due: its threads' context switches per second.
    Idle,
    /// Engine: default settings on a database where `held` rows of one
    /// ordering key wait behind a head that retries in a day (in the inbox
    /// of the bench consumer, or in the outbox for `HeldWhat::Relay`),
    /// measuring what another key's messages cost meanwhile.
    HeldKey { what: HeldWhat, held: u64 },
}

/// What a held-key row measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HeldWhat {
    /// One caller's `deliver()` p50/p99 (the writer runs queued processing
    /// between its batches).
    Deliver,
    /// One message of another key at a time: `receive()` until its handler
    /// committed (polled every 100 µs).
    Queued,
    /// One message at a time, `deliver()` until its outbox row reaches a
    /// `ChannelSink` (as `relay latency`).
    Relay,
}

impl HeldWhat {
    const ALL: [HeldWhat; 3] = [HeldWhat::Deliver, HeldWhat::Queued, HeldWhat::Relay];

    fn label(self) -> &'static str {
        match self {
            HeldWhat::Deliver => "deliver 1 caller FULL",
            HeldWhat::Queued => "queued latency, another key",
            HeldWhat::Relay => "relay latency, another key",
        }
    }
}

/// What a prefilled database holds besides postroom's empty tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Prefill {
    /// Completed rows processed over the day before the prefill, which the
    /// default 7-day retention keeps.
    Retained,
    /// Completed rows processed two to three days before the prefill: all
    /// past a one-hour retention.
    Expired,
    /// Received (`queued = 1`) rows still `pending`, with their payloads,
    /// and the `counters` table their handler updates.
    Pending,
}

impl Prefill {
    const ALL: [Prefill; 3] = [Prefill::Retained, Prefill::Expired, Prefill::Pending];

    /// Also the cache file's prefix.
    fn label(self) -> &'static str {
        match self {
            Prefill::Retained => "inbox",
            Prefill::Expired => "expired",
            Prefill::Pending => "pending",
        }
    }

    fn parse(label: &str) -> Option<Prefill> {
        Prefill::ALL.into_iter().find(|p| p.label() == label)
    }

    /// Part of the cache file's name: bump a kind's number when what its
    /// prefill writes changes, so old cache files are not used. Retained
    /// rows 2: the real digest of their payload (re-delivered as
    /// duplicates by the duplicate storm at scale), not a random one.
    fn format(self) -> u32 {
        match self {
            Prefill::Retained => 3,
            Prefill::Expired | Prefill::Pending => 2,
        }
    }
}

struct Scenario {
    name: String,
    work: Work,
    sync: SyncMode,
    /// The seeds floor this row is also compared with (see `seeds`).
    seeds: Option<String>,
    /// Rows of `prefill` the database starts with (0: an empty database).
    rows: u64,
    prefill: Prefill,
    /// Messages in the timed phase (fewer if the time cap is hit).
    count: u64,
    /// The row this one is compared with: a floor, or a baseline.
    vs: Option<String>,
}

impl Scenario {
    fn new(name: impl Into<String>, work: Work, count: u64) -> Scenario {
        Scenario {
            name: name.into(),
            work,
            sync: SyncMode::Full,
            rows: 0,
            prefill: Prefill::Retained,
            count,
            vs: None,
            seeds: None,
        }
    }

    fn seeds(mut self, floor: String) -> Scenario {
        self.seeds = Some(floor);
        self
    }

    fn on(mut self, prefill: Prefill, rows: u64) -> Scenario {
        self.prefill = prefill;
        self.rows = rows;
        self
    }

    fn vs(mut self, other: &str) -> Scenario {
        self.vs = Some(other.to_owned());
        self
    }
}

fn at(retained: u64) -> String {
    match retained {
        0 => String::new(),
        n if n % 1_000_000 == 0 => format!(" @{}M", n / 1_000_000),
        n if n % 1_000 == 0 => format!(" @{}k", n / 1_000),
        n => format!(" @{n}"),
    }
}

/// `1M`, `50k`: a row count in a scenario name.
fn size(n: u64) -> String {
    at(n).trim_start_matches(" @").to_owned()
}

fn deliver_name(callers: usize, sync: SyncMode, retained: u64) -> String {
    let who = if callers == 1 { "caller" } else { "callers" };
    format!("deliver {callers} {who} {}{}", sync.label(), at(retained))
}

fn floor_name(batch: usize, sync: SyncMode, retained: u64) -> String {
    let per = if batch == 1 {
        "1/txn".to_owned()
    } else {
        format!("batch {batch}")
    };
    format!("floor {per} {}{}", sync.label(), at(retained))
}

fn seeds_name(batch: usize, sync: SyncMode) -> String {
    format!("seeds floor {batch}/tx {}", sync.label())
}

const DELIVER_SEQUENCED: &str = "deliver 1 caller FULL, sequenced";
const DELIVER_UNKEYED: &str = "deliver 1 caller NORMAL, unkeyed publish";
const RECEIVE_ONE: &str = "receive 1 by 1 FULL";
const RECEIVE_PROCESS: &str = "receive 1 by 1 + processing FULL";
const DUPLICATE_STORM: &str = "duplicate storm (1 caller)";
const FLOOR_DEDUPE: &str = "floor dedupe SELECT";
const RECEIVE: &str = "receive_batch 1000 FULL";
const FLOOR_RECEIVE: &str = "floor receive batch 1000 FULL";
const RELAY_DRAIN: &str = "relay drain FULL";
const FLOOR_RELAY: &str = "floor relay batch 100 FULL";
const RELAY_LATENCY: &str = "relay latency FULL (1 msg / 2 ms)";
const IDLE: &str = "idle engine: wakeups/s, threads";
/// The idle row's effectful consumer.
const EFFECTS: &str = "bench-effects";

fn queued_name(workers: usize, retained: u64) -> String {
    format!("queued end to end, {workers} workers FULL{}", at(retained))
}

/// One of the named scenarios above, on a database of `retained` rows (the
/// name itself when 0).
fn named_at(name: &str, retained: u64) -> String {
    format!("{name}{}", at(retained))
}

fn retention_name(rows: u64, cleanup: bool) -> String {
    let what = if cleanup {
        "deliver during cleanup"
    } else {
        "deliver, no cleanup"
    };
    format!("retention {}: {what}", size(rows))
}

/// Every held-key row starts with this (`--only "held key"` runs them).
const HELD_KEY: &str = "held key";

fn held_name(what: HeldWhat, held: u64) -> String {
    let held = if held == 0 {
        "none held".to_owned()
    } else {
        format!("{} held", size(held))
    };
    format!("{HELD_KEY}: {}, {held}", what.label())
}

fn backlog_name(rows: u64) -> String {
    format!("peak RSS, {} pending backlog", size(rows))
}

/// A floor row and the engine row compared with it.
fn pair(
    callers: usize,
    floor_batch: usize,
    sync: SyncMode,
    retained: u64,
    count: u64,
) -> [Scenario; 2] {
    let floor = floor_name(floor_batch, sync, retained);
    [
        Scenario {
            name: floor.clone(),
            work: Work::FloorWrites { batch: floor_batch },
            sync,
            rows: retained,
            prefill: Prefill::Retained,
            count,
            vs: None,
            seeds: None,
        },
        Scenario {
            name: deliver_name(callers, sync, retained),
            work: Work::Deliver {
                callers,
                keyed: true,
            },
            sync,
            rows: retained,
            prefill: Prefill::Retained,
            count,
            vs: Some(floor),
            seeds: (retained == 0).then(|| seeds_name(callers.min(8), sync)),
        },
    ]
}

/// Every scenario, in groups whose members are compared with each other
/// and interleaved, in run order: the largest databases (and memory) last.
fn scenarios(plan: &Plan) -> Vec<Vec<Scenario>> {
    // (0) An idle engine: what it costs while nothing happens. First, so
    // no earlier scenario's threads or files are winding down.
    let mut groups = vec![vec![Scenario::new(IDLE, Work::Idle, 0)]];
    let seeds = |batch: usize, sync: SyncMode, count: u64| {
        let mut s = Scenario::new(seeds_name(batch, sync), Work::SeedsFloor { batch }, count);
        s.sync = sync;
        s
    };
    // (1) One caller: one commit per message on both sides; the seeds
    // floor at 1/tx; receiving one by one, alone and while processing.
    let mut one: Vec<Scenario> = pair(1, 1, SyncMode::Full, 0, plan.one_full).into();
    one.insert(0, seeds(1, SyncMode::Full, plan.one_full));
    let seeds_one = seeds_name(1, SyncMode::Full);
    one.push(
        Scenario::new(DELIVER_SEQUENCED, Work::DeliverSequenced, plan.one_full).vs(&deliver_name(
            1,
            SyncMode::Full,
            0,
        )),
    );
    one.push(Scenario::new(RECEIVE_ONE, Work::ReceiveOne, plan.one_full).seeds(seeds_one.clone()));
    one.push(Scenario::new(RECEIVE_PROCESS, Work::ReceiveProcess, plan.one_full).seeds(seeds_one));
    groups.push(one);
    let mut one: Vec<Scenario> = pair(1, 1, SyncMode::Normal, 0, plan.one_normal).into();
    one.insert(0, seeds(1, SyncMode::Normal, plan.one_normal));
    // The seeds floor publishes without a key: the same job, like for like.
    let mut unkeyed = Scenario::new(
        DELIVER_UNKEYED,
        Work::Deliver {
            callers: 1,
            keyed: false,
        },
        plan.one_normal,
    )
    .vs(&deliver_name(1, SyncMode::Normal, 0))
    .seeds(seeds_name(1, SyncMode::Normal));
    unkeyed.sync = SyncMode::Normal;
    one.push(unkeyed);
    groups.push(one);
    // (2) Eight callers sharing group commits, against a floor at 100/txn,
    // and for context the floor at the 8/txn that eight blocking callers
    // can reach at most.
    let mut eight: Vec<Scenario> = pair(8, 100, SyncMode::Full, 0, plan.many).into();
    eight.insert(
        0,
        Scenario::new(
            floor_name(8, SyncMode::Full, 0),
            Work::FloorWrites { batch: 8 },
            plan.many,
        ),
    );
    eight.insert(0, seeds(8, SyncMode::Full, plan.many));
    eight.insert(0, seeds(100, SyncMode::Full, plan.many));
    groups.push(eight);
    let mut eight: Vec<Scenario> = pair(8, 100, SyncMode::Normal, 0, plan.many).into();
    eight.insert(0, seeds(8, SyncMode::Normal, plan.many));
    eight.insert(0, seeds(100, SyncMode::Normal, plan.many));
    groups.push(eight);
    // (3) to (5): duplicates, queued mode and the relay.
    groups.extend(beyond_deliver(plan, 0));
    // (5b) A held key: each measure with no backlog, then with `held` rows
    // behind one head that retries in a day (issue 32).
    groups.push(
        HeldWhat::ALL
            .into_iter()
            .flat_map(|what| {
                let count = match what {
                    HeldWhat::Deliver => plan.one_full,
                    HeldWhat::Queued | HeldWhat::Relay => plan.relay_latency,
                };
                let base = held_name(what, 0);
                [
                    Scenario::new(&base, Work::HeldKey { what, held: 0 }, count),
                    Scenario::new(
                        held_name(what, plan.held),
                        Work::HeldKey {
                            what,
                            held: plan.held,
                        },
                        count,
                    )
                    .vs(&base),
                ]
            })
            .collect(),
    );
    // (6) Scale: the FULL rows above again, on copies of a database holding
    // retained rows; the floors run on copies of the same file.
    // After the first size, retention deleting a million expired rows while
    // one caller delivers (next to the same caller without cleanup), and the
    // memory of default settings on a million-message backlog.
    for (k, &n) in plan.retained.iter().enumerate() {
        groups.push(pair(1, 1, SyncMode::Full, n, plan.one_full).into());
        groups.push(pair(8, 100, SyncMode::Full, n, plan.many).into());
        groups.extend(beyond_deliver(plan, n));
        if k == 0 {
            let (rows, baseline) = (plan.expired, retention_name(plan.expired, false));
            groups.push(vec![
                Scenario::new(
                    baseline.clone(),
                    Work::Retention { cleanup: false },
                    plan.one_full,
                )
                .on(Prefill::Expired, rows),
                Scenario::new(
                    retention_name(rows, true),
                    Work::Retention { cleanup: true },
                    0,
                )
                .on(Prefill::Expired, rows)
                .vs(&baseline),
            ]);
            groups.push(vec![Scenario::new(
                backlog_name(plan.backlog),
                Work::Backlog,
                0,
            )
            .on(Prefill::Pending, plan.backlog)]);
        }
    }
    groups
}

/// The groups after inline delivery, on a fresh database (`retained` 0) or
/// on copies of one prefilled with `retained` retained rows: (3) the
/// duplicate storm, (4) queued mode (intake alone, then the workers'
/// drain), (5) the outbox relay (draining a backlog, and one message at a
/// time).
fn beyond_deliver(plan: &Plan, retained: u64) -> Vec<Vec<Scenario>> {
    let on = |s: Scenario| s.on(Prefill::Retained, retained);
    let name = |n: &str| named_at(n, retained);
    let (dedupe, receive, relay) = (name(FLOOR_DEDUPE), name(FLOOR_RECEIVE), name(FLOOR_RELAY));
    let batch = RECEIVE_BATCH;
    vec![
        vec![
            on(Scenario::new(&dedupe, Work::FloorDedupe, plan.duplicates)),
            on(Scenario::new(
                name(DUPLICATE_STORM),
                Work::DuplicateStorm,
                plan.duplicates,
            ))
            .vs(&dedupe),
        ],
        vec![
            on(Scenario::new(
                &receive,
                Work::FloorReceive { batch },
                plan.receive,
            )),
            on(Scenario::new(
                name(RECEIVE),
                Work::Receive { batch },
                plan.receive,
            ))
            .vs(&receive),
        ],
        [2, 4]
            .map(|workers| {
                let s = on(Scenario::new(
                    queued_name(workers, retained),
                    Work::QueuedDrain { workers },
                    plan.queued,
                ));
                if retained == 0 {
                    s.seeds(seeds_name(100, SyncMode::Full))
                } else {
                    s
                }
            })
            .into(),
        vec![
            on(Scenario::new(
                &relay,
                Work::FloorRelay { batch: 100 },
                plan.relay,
            )),
            on(Scenario::new(
                name(RELAY_DRAIN),
                Work::RelayDrain,
                plan.relay,
            ))
            .vs(&relay),
        ],
        vec![on(Scenario::new(
            name(RELAY_LATENCY),
            Work::RelayLatency,
            plan.relay_latency,
        ))],
    ]
}

// ---------------------------------------------------------------------------
// Message ids and payloads: deterministic, so floor and engine see the same
// kind of keys, and without a crate.

mod ids {
    const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

    /// SplitMix64's output function.
    pub fn mix(mut z: u64) -> u64 {
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// The `k`-th output of SplitMix64 seeded with `seed`, without walking
    /// the sequence: any thread can compute any message's id.
    pub fn nth(seed: u64, k: u64) -> u64 {
        mix(seed.wrapping_add(k.wrapping_add(1).wrapping_mul(GAMMA)))
    }

    /// A UUIDv4-shaped id: 122 random bits, version and variant set.
    pub fn uuid(seed: u64, i: u64) -> String {
        let hi = (nth(seed, 2 * i) & !0xF000) | 0x4000;
        let lo = (nth(seed, 2 * i + 1) & 0x3FFF_FFFF_FFFF_FFFF) | 0x8000_0000_0000_0000;
        format!(
            "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
            hi >> 32,
            (hi >> 16) & 0xFFFF,
            hi & 0xFFFF,
            lo >> 48,
            lo & 0xFFFF_FFFF_FFFF
        )
    }

    pub fn payload(i: u64) -> Vec<u8> {
        format!(r#"{{"order_id":{i},"amount_cents":4200}}"#).into_bytes()
    }

    pub fn hex(bytes: &[u8]) -> String {
        use std::fmt::Write;
        bytes.iter().fold(String::new(), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
    }

    pub fn seed_of(name: &str) -> u64 {
        let hash = blake3::hash(name.as_bytes());
        u64::from_le_bytes(hash.as_bytes()[..8].try_into().expect("8 bytes"))
    }
}

fn message(seed: u64, i: u64) -> Message {
    Message::new(SOURCE, ids::uuid(seed, i), ids::payload(i))
}

/// The `k`-th of a series of messages already in a database prefilled with
/// `retained` retained rows: row `i` of the prefill (made from message `i`
/// of `PREFILL_SEED`, its payload's digest stored), for `i` drawn at random
/// (by `seed`, with replacement) from all of them, so the lookups land on
/// pages all over the file rather than on the newest.
fn prefilled_message(seed: u64, retained: u64, k: u64) -> Message {
    message(PREFILL_SEED, ids::nth(seed, k) % retained)
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------
// Measurements.

/// What one timed phase produced.
#[derive(Default)]
struct Run {
    messages: u64,
    elapsed: Duration,
    latencies: Vec<Duration>,
    /// CPU the process, and the engine's writer thread, used in the phase
    /// (the rows that deliver: `deliver …`, duplicate storm, retention).
    cpu: Option<cpu::Used>,
    /// CPU and bytes written over the phase, every row (the per-message
    /// columns).
    cost: budget::Cost,
}

#[derive(Default)]
struct Measured {
    run: Run,
    /// Delta of (batches_committed, jobs_committed) over the timed phase.
    group: Option<(u64, u64)>,
    /// Relay latency measured the other way: from `deliver()` returning.
    after_return: Vec<Duration>,
    /// Rows `cleanup()` deleted, and how long it took.
    deleted: Option<(u64, Duration)>,
    /// VmHWM over the engine's life minus VmRSS just before it opened: what
    /// the engine itself added to the peak (the backlog row).
    rise_kib: Option<i64>,
    /// What the timed phase wrote: WAL frames (pages dirtied, per commit)
    /// and the net change of B-tree entries.
    footprint: Option<Footprint>,
    /// The database's page size, to turn WAL frames into bytes (each
    /// frame is a page and a 24-byte header).
    page_size: Option<u64>,
    /// The idle row's figures.
    idle: Option<Idle>,
    /// Facts worth printing below the table (open time, copy time, …).
    notes: Vec<String>,
}

/// An idle engine, measured: the threads it started and their context
/// switches over the measured window, all passes together.
#[derive(Default)]
struct Idle {
    seconds: f64,
    switches: u64,
    /// Threads the engine started (the most in a pass).
    threads: usize,
    /// By thread name: (threads of that name, their switches).
    by_name: std::collections::BTreeMap<String, (usize, u64)>,
    /// VmRSS after the settle minus VmRSS before the open (the largest).
    rss_kib: Option<i64>,
}

impl Idle {
    fn plus(mut self, other: Idle) -> Idle {
        self.seconds += other.seconds;
        self.switches += other.switches;
        self.threads = self.threads.max(other.threads);
        for (name, (n, sw)) in other.by_name {
            let e = self.by_name.entry(name).or_default();
            e.0 = e.0.max(n);
            e.1 += sw;
        }
        self.rss_kib = self.rss_kib.max(other.rss_kib);
        self
    }
}

/// WAL frames appended, and B-tree entries added (net, where the row
/// counts them: `dbstat` reads the whole file), over a phase.
#[derive(Debug, Clone, Copy, Default)]
struct Footprint {
    frames: u64,
    cells: Option<i64>,
}

impl Footprint {
    fn since(self, before: Footprint) -> Option<Footprint> {
        Some(Footprint {
            frames: self.frames.saturating_sub(before.frames),
            cells: self.cells.zip(before.cells).map(|(a, b)| a - b),
        })
    }

    fn plus(self, other: Footprint) -> Footprint {
        Footprint {
            frames: self.frames + other.frames,
            cells: self.cells.zip(other.cells).map(|(a, b)| a + b),
        }
    }
}

/// One line of the table, and one object of `--json`.
#[derive(Serialize)]
struct Row {
    scenario: String,
    kind: &'static str,
    durability: &'static str,
    callers: Option<usize>,
    workers: Option<usize>,
    msgs_per_txn: Option<usize>,
    /// Rows the database started with, and what they were.
    prefilled_rows: u64,
    prefill: Option<&'static str>,
    messages: u64,
    seconds: f64,
    msgs_per_s: f64,
    /// The messages were sent at a fixed pace: msgs/s is that pace, not a
    /// throughput (the table leaves it blank).
    paced: bool,
    /// Per `deliver()`, per `receive_batch()` call (or floor transaction),
    /// or per message through the relay: see the doc comment.
    p50_us: Option<f64>,
    p99_us: Option<f64>,
    max_us: Option<f64>,
    /// Relay latency rows: from `deliver()` returning to the sink.
    after_return_p50_us: Option<f64>,
    after_return_p99_us: Option<f64>,
    after_return_max_us: Option<f64>,
    /// Retention rows: what `cleanup()` deleted, all passes together, and
    /// the deliveries slower than `STALL`.
    deleted_rows: Option<u64>,
    deleted_per_s: Option<f64>,
    stalls: Option<u64>,
    /// The backlog row: the engine's own rise of VmHWM over VmRSS at open,
    /// the largest over the passes.
    engine_rise_kib: Option<i64>,
    peak_rss_kib: Option<u64>,
    rss_delta_kib: Option<i64>,
    vs: Option<String>,
    ratio: Option<f64>,
    /// The seeds floor this row is compared with too, and the ratio.
    seeds_vs: Option<String>,
    seeds_ratio: Option<f64>,
    /// Per message of the timed phase: WAL frames appended (pages dirtied,
    /// counted once per commit) and B-tree entries added, net.
    wal_frames_per_msg: Option<f64>,
    btree_entries_per_msg: Option<f64>,
    avg_group: Option<f64>,
    /// CPU used over the timed phase, in cores (CPU seconds per second):
    /// the whole process (the harness's callers included), and the
    /// engine's writer thread alone. Rows that deliver only.
    cpu_cores: Option<f64>,
    writer_cores: Option<f64>,
    batches_committed: Option<u64>,
    jobs_committed: Option<u64>,
    /// Commits per message, for queued rows (claims and completions).
    commits_per_msg: Option<f64>,
    /// Per message finished: the process's CPU (user + system, every
    /// thread) over the phase, in µs; WAL bytes appended (frames × (page
    /// size + 24)), where the row counts frames; and bytes the kernel
    /// counted as written to storage (/proc/self/io `write_bytes`).
    cpu_us_per_msg: Option<f64>,
    wal_bytes_per_msg: Option<f64>,
    disk_bytes_per_msg: Option<f64>,
    /// The idle row: context switches per second over the engine's
    /// threads, how many threads it started, its VmRSS over the process's
    /// before the open, the process's CPU (ms per second) and bytes written
    /// per second meanwhile, and the switches by thread name.
    idle_wakeups_per_s: Option<f64>,
    idle_threads: Option<usize>,
    idle_rss_kib: Option<i64>,
    idle_cpu_ms_per_s: Option<f64>,
    idle_disk_bytes_per_s: Option<f64>,
    idle_by_thread: Vec<IdleThread>,
    notes: Vec<String>,
}

/// The idle row's figures for the threads of one name.
#[derive(Serialize)]
struct IdleThread {
    name: String,
    threads: usize,
    wakeups_per_s: f64,
}

/// Nearest-rank percentile of sorted latencies.
fn percentile(sorted: &[Duration], p: f64) -> Option<Duration> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

mod mem {
    /// A `kB` field of /proc/self/status.
    pub fn status_kib(field: &str) -> Option<u64> {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        status
            .lines()
            .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    }

    /// Resets VmHWM to the current RSS (Linux >= 4.0), so each scenario
    /// gets its own peak rather than the run's.
    pub fn reset_peak() -> bool {
        std::fs::write("/proc/self/clear_refs", "5").is_ok()
    }
}

mod cpu {
    use std::time::Duration;

    /// /proc's clock ticks per second (`USER_HZ`, 100 on Linux whatever
    /// the kernel's own tick rate).
    const TICKS_PER_S: u64 = 100;
    /// The writer thread's name, as /proc shows it (15 bytes at most).
    const WRITER: &str = "postroom-writer";

    /// CPU time used so far.
    #[derive(Clone, Copy)]
    pub struct Used {
        /// The whole process, threads that ended included.
        pub process: Duration,
        /// The engine's writer thread (its scheduler run time); `None`
        /// when no such thread (or no schedstat) was found.
        pub writer: Option<Duration>,
    }

    impl Used {
        pub fn since(self, before: Used) -> Used {
            Used {
                process: self.process.saturating_sub(before.process),
                writer: self
                    .writer
                    .zip(before.writer)
                    .map(|(now, then)| now.saturating_sub(then)),
            }
        }

        pub fn plus(self, other: Used) -> Used {
            Used {
                process: self.process + other.process,
                writer: self.writer.zip(other.writer).map(|(a, b)| a + b),
            }
        }
    }

    /// User plus system time of the whole process, threads that ended
    /// included (/proc/self/stat, in `USER_HZ` ticks: 10 ms steps).
    pub fn process() -> Option<Duration> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        // Fields after the command name, which is in parentheses and may
        // hold spaces: utime and stime are the 12th and 13th.
        let fields: Vec<&str> = stat[stat.rfind(')')? + 2..].split(' ').collect();
        let ticks: u64 =
            fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
        Some(Duration::from_millis(ticks * 1000 / TICKS_PER_S))
    }

    /// User plus system time of the process (/proc/self/stat), and the run
    /// time of the writer thread (/proc/self/task/*/schedstat, in ns).
    /// `None` where /proc is missing or unreadable.
    pub fn now() -> Option<Used> {
        let process = process()?;
        let mut writer = None;
        for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
            let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
            if comm.trim_end() == WRITER {
                let schedstat =
                    std::fs::read_to_string(task.path().join("schedstat")).unwrap_or_default();
                if let Some(ns) = schedstat.split(' ').next().and_then(|n| n.parse().ok()) {
                    *writer.get_or_insert(Duration::ZERO) += Duration::from_nanos(ns);
                }
            }
        }
        Some(Used { process, writer })
    }
}

/// What a timed phase cost the process, for the per-message columns: CPU
/// (user + system over all its threads) and the bytes the kernel counted as
/// sent to storage (`write_bytes` of /proc/self/io: pages dirtied in the
/// page cache, WAL appends and checkpoints' copies into the database alike,
/// charged to the thread that dirtied them).
mod budget {
    use std::time::Duration;

    /// Usage so far (`now`), or over a phase (`since`).
    #[derive(Debug, Clone, Copy, Default)]
    pub struct Cost {
        pub cpu: Option<Duration>,
        pub written: Option<u64>,
    }

    pub fn now() -> Cost {
        Cost {
            cpu: super::cpu::process(),
            written: write_bytes(),
        }
    }

    impl Cost {
        /// Usage from `before` to now.
        pub fn since(before: Cost) -> Cost {
            let now = now();
            Cost {
                cpu: now.cpu.zip(before.cpu).map(|(a, b)| a.saturating_sub(b)),
                written: now
                    .written
                    .zip(before.written)
                    .map(|(a, b)| a.saturating_sub(b)),
            }
        }

        /// Two phases together (a missing figure counts as none: `Cost`
        /// starts empty, before the first pass).
        pub fn plus(self, other: Cost) -> Cost {
            fn add<T: std::ops::Add<Output = T>>(a: Option<T>, b: Option<T>) -> Option<T> {
                match (a, b) {
                    (Some(a), Some(b)) => Some(a + b),
                    (a, b) => a.or(b),
                }
            }
            Cost {
                cpu: add(self.cpu, other.cpu),
                written: add(self.written, other.written),
            }
        }
    }

    /// `write_bytes` of /proc/self/io; `None` where the file is missing or
    /// unreadable (a kernel without task I/O accounting).
    pub fn write_bytes() -> Option<u64> {
        let io = std::fs::read_to_string("/proc/self/io").ok()?;
        io.lines()
            .find_map(|l| l.strip_prefix("write_bytes:"))?
            .trim()
            .parse()
            .ok()
    }

    /// Whether `write_bytes` counts here: it moves for a 256 KiB write
    /// made durable in `dir` (a container's filesystem may hide it). The
    /// header says which.
    pub fn io_counts(dir: &std::path::Path) -> Result<(), String> {
        use std::io::Write;
        let before = write_bytes().ok_or("/proc/self/io is missing or unreadable")?;
        let path = dir.join(format!("bench-io-probe-{}", std::process::id()));
        let wrote = std::fs::File::create(&path).and_then(|mut f| {
            f.write_all(&[7u8; 256 * 1024])?;
            f.sync_all()
        });
        let _ = std::fs::remove_file(&path);
        wrote.map_err(|e| format!("the probe write failed: {e}"))?;
        match write_bytes() {
            Some(after) if after > before => Ok(()),
            _ => Err("write_bytes stays 0 here (a 256 KiB fsynced write did not move it)".into()),
        }
    }
}

/// The threads an engine started and how often they were switched out:
/// /proc/self/task/*/status (`voluntary_ctxt_switches` +
/// `nonvoluntary_ctxt_switches`) and `comm`, by thread id. Each switch
/// is a wakeup (a block and a resume, or a preemption).
mod tasks {
    use std::collections::BTreeMap;

    /// Thread id → (name, context switches so far).
    pub type Snapshot = BTreeMap<u64, (String, u64)>;

    pub fn snapshot() -> Snapshot {
        let mut out = Snapshot::new();
        let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
            return out;
        };
        for task in dir.flatten() {
            let Some(tid) = task.file_name().to_str().and_then(|t| t.parse().ok()) else {
                continue;
            };
            let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
            let switches = status
                .lines()
                .filter_map(|l| {
                    l.strip_prefix("voluntary_ctxt_switches:")
                        .or_else(|| l.strip_prefix("nonvoluntary_ctxt_switches:"))
                })
                .filter_map(|n| n.trim().parse::<u64>().ok())
                .sum();
            let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
            out.insert(tid, (comm.trim_end().to_owned(), switches));
        }
        out
    }
}

// ---------------------------------------------------------------------------
// The raw floor: what a careful hand-written rusqlite inbox would do, with
// cached statements and nothing else.

mod floor {
    use super::*;

    const INBOX_INSERT: &str = "INSERT INTO postroom_inbox (consumer, source, message_id, status,
             payload, payload_hash, headers, ordering_key, attempts, last_error, received_at,
             updated_at, next_attempt_at, processed_at)
         VALUES (?1, ?2, ?3, 'completed', NULL, ?4, NULL, NULL, 1, NULL, ?5, ?5, NULL, ?5)";
    // `named = 0`: the id is derived, as a handler's publish stores it
    // (schema 12; the column's default, 1, puts it in the index of named
    // ids).
    const OUTBOX_INSERT: &str = "INSERT INTO postroom_outbox (message_id, topic, key, payload,
             headers, status, attempts, created_at, next_attempt_at, cause_consumer,
             cause_source, cause_message_id, named)
         VALUES (?1, ?2, ?3, ?4, ?5, 'pending', 0, ?6, 0, ?7, ?8, ?9, 0)";
    // A received message, as the engine's `receive` stores it.
    const RECEIVE_INSERT: &str = "INSERT INTO postroom_inbox (consumer, source, message_id, status,
             payload, payload_hash, headers, ordering_key, attempts, received_at, updated_at,
             next_attempt_at, queued)
         VALUES (?1, ?2, ?3, 'pending', ?4, ?5, NULL, NULL, 0, ?6, ?6, NULL, 1)";
    // A relay's two statements at their least: due rows in commit order
    // through the index of rows that may go now (every row of the drain is
    // its key's only pending row, so no key needs holding back), and
    // marking one row sent. Until schema 10 this was the schema-5 relay's
    // query, holding keys back with a probe per row; from schema 8 on it
    // had no index of pending rows to read and scanned the table past
    // every row sent before, which made the floor itself slow down as it
    // drained.
    const RELAY_DUE: &str = "SELECT seq, message_id, topic, key, payload, headers, attempts,
             created_at, last_error
         FROM postroom_outbox INDEXED BY postroom_outbox_ready
         WHERE status = 'pending' AND head = 1 AND next_attempt_at <= ?1
         ORDER BY seq LIMIT ?2";
    const MARK_SENT: &str = "UPDATE postroom_outbox
         SET status = 'sent', sent_at = ?2, attempts = attempts + 1
         WHERE seq = ?1 AND status = 'pending'";
    // The engine's first look at a delivery: the key table alone answers a
    // duplicate of a completed message.
    const LOOKUP: &str = "SELECT inbox_id, digest, completed FROM postroom_inbox_keys
         WHERE consumer = ?1 AND source = ?2 AND message_id = ?3";

    /// Opens (creating with postroom's schema if needed) with the pragmas
    /// the engine's write connection uses.
    pub fn open(path: &Path, sync: SyncMode) -> Res<Connection> {
        let mut conn = Connection::open(path)?;
        conn.busy_timeout(Duration::from_secs(5))?;
        let mode: String =
            conn.pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(format!("journal_mode is {mode}, not WAL").into());
        }
        conn.pragma_update(None, "synchronous", sync.label())?;
        conn.pragma_update(None, "foreign_keys", true)?;
        conn.wal_hook(Some(seeds::note_frames))?;
        let has_schema: bool = conn.query_row(
            "SELECT count(*) > 0 FROM sqlite_master WHERE name = 'postroom_inbox'",
            [],
            |r| r.get(0),
        )?;
        if !has_schema {
            conn.execute_batch(&format!("BEGIN; {} COMMIT;", postroom::SCHEMA_SQL))?;
        }
        conn.execute_batch(COUNTERS_DDL)?;
        Ok(conn)
    }

    fn write_one(conn: &Connection, seed: u64, i: u64, now: i64) -> Res<()> {
        let id = ids::uuid(seed, i);
        let payload = ids::payload(i);
        let hash = blake3::hash(&payload);
        // The key table's primary key (filled by the schema's trigger)
        // refuses a known key: a duplicate, no effects.
        match conn.prepare_cached(INBOX_INSERT)?.execute(params![
            CONSUMER,
            SOURCE,
            id,
            hash.as_bytes().as_slice(),
            now
        ]) {
            Err(e) if e.sqlite_error_code() == Some(rusqlite::ErrorCode::ConstraintViolation) => {
                return Ok(())
            }
            other => other?,
        };
        conn.prepare_cached(DOMAIN_UPDATE)?
            .execute([account_of(&id)])?;
        // Same shape as the engine's row: a stable derived id, the
        // causation/correlation headers as JSON.
        let out_id = ids::hex(&blake3::hash(id.as_bytes()).as_bytes()[..16]);
        let headers = format!(r#"{{"causation-id":"{id}","correlation-id":"{id}"}}"#);
        conn.prepare_cached(OUTBOX_INSERT)?.execute(params![
            out_id,
            OUT_TOPIC,
            id,
            OUT_PAYLOAD,
            headers,
            now,
            CONSUMER,
            SOURCE,
            id
        ])?;
        Ok(())
    }

    /// Stores message `i` of `seed` as received: pending, with its payload.
    fn receive_one(conn: &Connection, seed: u64, i: u64, now: i64) -> Res<()> {
        let id = ids::uuid(seed, i);
        let payload = ids::payload(i);
        let hash = blake3::hash(&payload);
        let inserted = conn.prepare_cached(RECEIVE_INSERT)?.execute(params![
            CONSUMER,
            SOURCE,
            id,
            payload,
            hash.as_bytes().as_slice(),
            now
        ])?;
        if inserted != 1 {
            return Err(format!("message {i}: stored before").into());
        }
        Ok(())
    }

    /// The WAL frames this thread's floor commits appended since
    /// `seeds::frames()` read `before` (no B-tree count: the floors on
    /// postroom's schema are compared by speed).
    pub fn wal_since(before: u64) -> Option<Footprint> {
        Some(Footprint {
            frames: seeds::frames().saturating_sub(before),
            cells: None,
        })
    }

    /// Writes messages `0..count` of `seed`, `batch` per transaction.
    pub fn write_loop(
        conn: &Connection,
        batch: usize,
        seed: u64,
        count: u64,
        cap: Option<Duration>,
    ) -> Res<Run> {
        txn_loop(conn, batch, seed, count, cap, write_one, batch == 1)
    }

    /// Stores messages `0..count` of `seed` as received, `batch` per
    /// transaction, timing each transaction.
    pub fn receive_loop(
        conn: &Connection,
        batch: usize,
        seed: u64,
        count: u64,
        cap: Option<Duration>,
    ) -> Res<Run> {
        txn_loop(conn, batch, seed, count, cap, receive_one, true)
    }

    /// Runs `each` for messages `0..count` of `seed`, `batch` per
    /// transaction; with `timed`, records each transaction's latency.
    pub fn txn_loop(
        conn: &Connection,
        batch: usize,
        seed: u64,
        count: u64,
        cap: Option<Duration>,
        each: fn(&Connection, u64, u64, i64) -> Res<()>,
        timed: bool,
    ) -> Res<Run> {
        let spent = budget::now();
        let start = Instant::now();
        let mut latencies = Vec::new();
        let mut i = 0;
        while i < count && cap.is_none_or(|c| start.elapsed() < c) {
            let end = (i + batch as u64).min(count);
            let t = Instant::now();
            conn.prepare_cached("BEGIN IMMEDIATE")?.execute([])?;
            let now = now_ms();
            for j in i..end {
                each(conn, seed, j, now)?;
            }
            conn.prepare_cached("COMMIT")?.execute([])?;
            if timed {
                latencies.push(t.elapsed());
            }
            i = end;
        }
        Ok(Run {
            messages: i,
            elapsed: start.elapsed(),
            latencies,
            cpu: None,
            cost: budget::Cost::since(spent),
        })
    }

    /// Looks up messages `msg(0..count)`, each in its own implicit read
    /// transaction, checking each is a completed row with the same payload
    /// digest (what the engine decides `Duplicate` from).
    pub fn dedupe_loop(
        conn: &Connection,
        msg: impl Fn(u64) -> Message,
        count: u64,
        cap: Duration,
    ) -> Res<Run> {
        let spent = budget::now();
        let start = Instant::now();
        let mut latencies = Vec::with_capacity(usize::try_from(count).unwrap_or(0));
        let mut i = 0;
        while i < count && start.elapsed() < cap {
            let msg = msg(i);
            let t = Instant::now();
            let hash = blake3::hash(msg.payload());
            let row: Option<(i64, Vec<u8>, bool)> = conn
                .prepare_cached(LOOKUP)?
                .query_row(params![CONSUMER, msg.source(), msg.id()], |r| {
                    Ok((r.get(0)?, r.get(1)?, r.get(2)?))
                })
                .optional()?;
            latencies.push(t.elapsed());
            match row {
                Some((_, stored, true)) if stored == hash.as_bytes()[..16] => {}
                other => return Err(format!("message {i}: not a duplicate: {other:?}").into()),
            }
            i += 1;
        }
        Ok(Run {
            messages: i,
            elapsed: start.elapsed(),
            latencies,
            cpu: None,
            cost: budget::Cost::since(spent),
        })
    }

    /// One outbox row as a hand-written relay would hand it over.
    type RelayRow = (i64, String, String, Option<String>, Vec<u8>, Option<String>);

    /// Hands over (and marks sent) `count` committed outbox rows: read up to
    /// `batch` due rows, give them to a "sink" that decodes their headers
    /// and counts them, then mark each sent in one transaction.
    pub fn relay_loop(
        conn: &Connection,
        batch: usize,
        count: u64,
        cap: Option<Duration>,
    ) -> Res<Run> {
        let spent = budget::now();
        let start = Instant::now();
        let mut done = 0u64;
        let mut handed = 0usize;
        while done < count && cap.is_none_or(|c| start.elapsed() < c) {
            let want = i64::try_from((count - done).min(batch as u64))?;
            let now = now_ms();
            let rows: Vec<RelayRow> = conn
                .prepare_cached(RELAY_DUE)?
                .query_map(params![now, want], |r| {
                    Ok((
                        r.get(0)?,
                        r.get(1)?,
                        r.get(2)?,
                        r.get(3)?,
                        r.get(4)?,
                        r.get(5)?,
                    ))
                })?
                .collect::<Result<_, _>>()?;
            if rows.is_empty() {
                return Err(format!("the outbox ran dry after {done} rows").into());
            }
            for (_, id, topic, _, payload, headers) in &rows {
                let headers: std::collections::BTreeMap<String, String> = headers
                    .as_deref()
                    .map(serde_json::from_str)
                    .transpose()?
                    .unwrap_or_default();
                handed += id.len() + topic.len() + payload.len() + headers.len();
            }
            conn.prepare_cached("BEGIN IMMEDIATE")?.execute([])?;
            for row in &rows {
                conn.prepare_cached(MARK_SENT)?
                    .execute(params![row.0, now])?;
            }
            conn.prepare_cached("COMMIT")?.execute([])?;
            done += rows.len() as u64;
        }
        if handed == 0 && done > 0 {
            return Err("handed over nothing".into());
        }
        Ok(Run {
            messages: done,
            elapsed: start.elapsed(),
            latencies: Vec::new(),
            cpu: None,
            cost: budget::Cost::since(spent),
        })
    }
}

// ---------------------------------------------------------------------------
// The seeds floor: the articles' pattern and nothing else.

mod seeds {
    use super::*;

    /// A rowid inbox keyed by (consumer, message id), the domain table, and
    /// an outbox with a partial index on unsent rows.
    const DDL: &str = "CREATE TABLE IF NOT EXISTS inbox (
             consumer TEXT NOT NULL, message_id TEXT NOT NULL, received_at INTEGER NOT NULL,
             PRIMARY KEY (consumer, message_id));
         CREATE TABLE IF NOT EXISTS outbox (
             id INTEGER PRIMARY KEY, topic TEXT NOT NULL, payload BLOB NOT NULL,
             created_at INTEGER NOT NULL, sent_at INTEGER);
         CREATE INDEX IF NOT EXISTS outbox_unsent ON outbox (id) WHERE sent_at IS NULL;";

    /// Opens (creating if needed): WAL, `sync`, default cache.
    pub fn open(path: &Path, sync: SyncMode) -> Res<Connection> {
        let mut conn = Connection::open(path)?;
        conn.busy_timeout(Duration::from_secs(5))?;
        let mode: String =
            conn.pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(format!("journal_mode is {mode}, not WAL").into());
        }
        conn.pragma_update(None, "synchronous", sync.label())?;
        conn.execute_batch(DDL)?;
        conn.execute_batch(COUNTERS_DDL)?;
        conn.wal_hook(Some(note_frames))?;
        Ok(conn)
    }

    thread_local! {
        /// WAL frames appended by this thread's commits, and the WAL's
        /// size after the last one.
        static FRAMES: std::cell::Cell<(u64, i32)> = const { std::cell::Cell::new((0, 0)) };
    }

    /// WAL frames this thread's commits (with the hook below) appended so
    /// far, over every file.
    pub fn frames() -> u64 {
        FRAMES.with(|f| f.get().0)
    }

    /// Installed as the WAL hook of every connection the floors write
    /// with (the engine counts its own). A WAL hook replaces SQLite's
    /// automatic checkpoint, so this one also does what that did: a
    /// passive checkpoint inside the commit that brought the WAL to 1,000
    /// frames, errors ignored (`sqlite3WalDefaultHook`). Without it the
    /// floors never copied their WAL back while timed: their CPU and
    /// `disk/msg` left out the copy-back every real writer pays, and the
    /// engine's (whose checkpointer does it) did not.
    pub fn note_frames(wal: &mut rusqlite::hooks::Wal, pages: i32) -> rusqlite::Result<()> {
        FRAMES.with(|f| {
            let (sum, last) = f.get();
            let grown = if pages > last { pages - last } else { pages };
            f.set((sum + u64::try_from(grown).unwrap_or(0), pages));
        });
        if pages >= AUTOCHECKPOINT_FRAMES {
            let _ = wal.checkpoint();
        }
        Ok(())
    }

    /// SQLite's default `wal_autocheckpoint`.
    const AUTOCHECKPOINT_FRAMES: i32 = 1000;

    /// The articles' three statements for message `i` of `seed`.
    fn write_one(conn: &Connection, seed: u64, i: u64, now: i64) -> Res<()> {
        // 32 random hex digits.
        let id = ids::hex(&ids::nth(seed, 2 * i).to_le_bytes())
            + &ids::hex(&ids::nth(seed, 2 * i + 1).to_le_bytes());
        let inserted = conn
            .prepare_cached(
                "INSERT INTO inbox (consumer, message_id, received_at) VALUES (?1, ?2, ?3)
                 ON CONFLICT DO NOTHING",
            )?
            .execute(params![CONSUMER, id, now])?;
        if inserted == 1 {
            conn.prepare_cached(DOMAIN_UPDATE)?
                .execute([account_of(&id)])?;
            conn.prepare_cached(
                "INSERT INTO outbox (topic, payload, created_at) VALUES (?1, ?2, ?3)",
            )?
            .execute(params![OUT_TOPIC, OUT_PAYLOAD, now])?;
        }
        Ok(())
    }

    pub fn write_loop(
        conn: &Connection,
        batch: usize,
        seed: u64,
        count: u64,
        cap: Option<Duration>,
    ) -> Res<Run> {
        floor::txn_loop(conn, batch, seed, count, cap, write_one, batch == 1)
    }

    /// WAL frames this thread's commits appended so far, and the B-tree
    /// entries in `conn`'s database.
    pub fn footprint(conn: &Connection) -> Res<Footprint> {
        Ok(Footprint {
            frames: frames(),
            cells: Some(cells(conn)?),
        })
    }

    /// Every B-tree entry in the database: the cells of table leaves, and
    /// all cells of index B-trees (whose interior cells are entries too;
    /// WITHOUT ROWID tables are index B-trees).
    pub fn cells(conn: &Connection) -> Res<i64> {
        Ok(conn.query_row(
            "SELECT coalesce(sum(d.ncell), 0) FROM dbstat d
             LEFT JOIN sqlite_schema s ON s.name = d.name
             WHERE d.pagetype = 'leaf'
                OR (d.pagetype = 'internal'
                    AND (s.type = 'index' OR s.name IS NULL
                         OR s.sql LIKE '%WITHOUT ROWID%'))",
            [],
            |r| r.get(0),
        )?)
    }
}

// ---------------------------------------------------------------------------
// The engine side.

mod engine {
    use super::*;

    /// Every scenario's handler, inline or queued: one domain `UPDATE` and
    /// one `publish`.
    pub fn handler() -> impl Handler {
        handler_fn(|tx, msg| {
            tx.execute(DOMAIN_UPDATE, [account_of(msg.id())])?;
            tx.publish(Outgoing::new(OUT_TOPIC, OUT_PAYLOAD).with_key(msg.id()))?;
            Ok(())
        })
    }

    /// The `…, unkeyed publish` row's handler: the same work, the message
    /// published without an ordering key, as the seeds floor publishes it.
    pub fn unkeyed_handler() -> impl Handler {
        handler_fn(|tx, msg| {
            tx.execute(DOMAIN_UPDATE, [account_of(msg.id())])?;
            tx.publish(Outgoing::new(OUT_TOPIC, OUT_PAYLOAD))?;
            Ok(())
        })
    }

    /// Default settings but the durability, with the bench consumer.
    pub fn builder(sync: SyncMode) -> Builder {
        base(sync).consumer(CONSUMER, handler())
    }

    /// Default settings but the durability, no consumer.
    pub fn base(sync: SyncMode) -> Builder {
        Postroom::builder().durability(sync.engine())
    }

    pub fn open(path: &Path, sync: SyncMode) -> Res<(Postroom, Duration)> {
        open_with(builder(sync), path)
    }

    /// Opens, then creates the domain table; returns how long the open took.
    pub fn open_with(builder: Builder, path: &Path) -> Res<(Postroom, Duration)> {
        let t = Instant::now();
        let room = builder.open(path)?;
        let opened = t.elapsed();
        room.transaction(|tx| {
            tx.execute_batch(COUNTERS_DDL)?;
            Ok(())
        })?;
        Ok((room, opened))
    }

    /// A read-only connection beside the engine, to watch progress without
    /// `stats()`, which scans the inbox (seconds at a million rows, and a
    /// core's worth of CPU when polled every few ms).
    pub fn probe(path: &Path) -> Res<Connection> {
        let conn = Connection::open(path)?;
        conn.busy_timeout(Duration::from_secs(5))?;
        conn.pragma_update(None, "query_only", true)?;
        Ok(conn)
    }

    /// Messages whose handler committed so far: the domain counter, written
    /// in the same transaction that completes the message.
    pub fn processed(probe: &Connection) -> Res<u64> {
        let n: i64 = probe
            .prepare_cached("SELECT sum(version) FROM accounts")?
            .query_row([], |r| r.get(0))?;
        Ok(u64::try_from(n)?)
    }

    /// Outbox rows marked sent (the outbox alone: cheap beside a big inbox,
    /// unlike `stats()`).
    pub fn outbox_sent(probe: &Connection) -> Res<u64> {
        let n: i64 = probe
            .prepare_cached("SELECT count(*) FROM postroom_outbox WHERE status = 'sent'")?
            .query_row([], |r| r.get(0))?;
        Ok(u64::try_from(n)?)
    }

    /// Queued messages of the bench consumer still waiting for a worker
    /// (through the claim's partial index: cheap beside a big inbox).
    pub fn queued_due(probe: &Connection) -> Res<u64> {
        let n: i64 = probe
            .prepare_cached(
                "SELECT count(*) FROM postroom_inbox
                 WHERE consumer = ?1 AND queued = 1 AND status IN ('pending', 'failed')",
            )?
            .query_row([CONSUMER], |r| r.get(0))?;
        Ok(u64::try_from(n)?)
    }

    /// Pending outbox heads, through the relay's partial index (cheap once
    /// they are few): zero exactly when no row is pending, as the lowest
    /// pending row is always a head (schema 8).
    pub fn outbox_pending(probe: &Connection) -> Res<u64> {
        let n: i64 = probe
            .prepare_cached(
                "SELECT count(*) FROM postroom_outbox WHERE status = 'pending' AND head = 1",
            )?
            .query_row([], |r| r.get(0))?;
        Ok(u64::try_from(n)?)
    }

    /// Polls `done` every `every` until it is true; false if `cap` passed
    /// first.
    pub fn wait(every: Duration, cap: Duration, mut done: impl FnMut() -> Res<bool>) -> Res<bool> {
        let start = Instant::now();
        loop {
            if done()? {
                return Ok(true);
            }
            if start.elapsed() >= cap {
                return Ok(false);
            }
            thread::sleep(every);
        }
    }

    /// Stores messages `0..count` of `seed` with one caller, `batch` per
    /// `receive_batch` call, timing each call (building its messages
    /// included, as the floor's transactions include making theirs).
    pub fn receive_loop(
        room: &Postroom,
        batch: usize,
        seed: u64,
        count: u64,
        cap: Option<Duration>,
    ) -> Res<Run> {
        let spent = budget::now();
        let start = Instant::now();
        let mut latencies = Vec::new();
        let mut i = 0;
        while i < count && cap.is_none_or(|c| start.elapsed() < c) {
            let end = (i + batch as u64).min(count);
            let t = Instant::now();
            let msgs: Vec<Message> = (i..end).map(|j| message(seed, j)).collect();
            let receipts = room.receive_batch(CONSUMER, msgs)?;
            latencies.push(t.elapsed());
            if let Some(r) = receipts.iter().find(|r| **r != Receipt::Accepted) {
                return Err(format!("batch at {i}: expected Accepted, got {r:?}").into());
            }
            i = end;
        }
        Ok(Run {
            messages: i,
            elapsed: start.elapsed(),
            latencies,
            cpu: None,
            cost: budget::Cost::since(spent),
        })
    }

    /// Publishes `n` outbox rows (shaped like the handler's: keyed, with
    /// causation headers) from application transactions of
    /// `OUTBOX_FILL_TXN` rows, with no sink, and closes the engine.
    pub fn fill_outbox(path: &Path, sync: SyncMode, seed: u64, n: u64) -> Res<()> {
        let (room, _) = open_with(builder(sync).workers(0), path)?;
        let mut i = 0;
        while i < n {
            let end = (i + OUTBOX_FILL_TXN).min(n);
            room.transaction(move |tx| {
                for j in i..end {
                    let id = ids::uuid(seed, j);
                    tx.publish(
                        Outgoing::new(OUT_TOPIC, OUT_PAYLOAD)
                            .with_key(id.clone())
                            .with_header(CAUSATION_HEADER, id.clone())
                            .with_header(CORRELATION_HEADER, id),
                    )?;
                }
                Ok(())
            })?;
            i = end;
        }
        let mut notes = Vec::new();
        close(room, &mut notes)?;
        // Its dirty pages must not be written back during the timed phase.
        let _ = Command::new("sync").status();
        Ok(())
    }

    /// Writes `held` rows of key `doc-1` behind a head that retries in a
    /// day, by SQL on a file the engine created (its triggers keep their
    /// tables): pending inbox rows of the bench consumer behind a failed
    /// head, or (`outbox`) pending outbox rows behind one whose destination
    /// was unavailable. The held rows are never due during the run, so
    /// their payloads are empty.
    pub fn hold_key(path: &Path, outbox: bool, held: u64) -> Res<()> {
        let (room, _) = open_with(builder(SyncMode::Normal).workers(0), path)?;
        let mut notes = Vec::new();
        close(room, &mut notes)?;
        let mut conn = Connection::open(path)?;
        let tx = conn.transaction()?;
        let (now, later) = (now_ms(), now_ms() + 86_400_000);
        let digest = blake3::hash(b"held").as_bytes().to_vec();
        let held = i64::try_from(held)?;
        if outbox {
            tx.execute(
                "INSERT INTO postroom_outbox (message_id, topic, key, payload, status, attempts,
                     last_error, created_at, next_attempt_at)
                 VALUES ('doc-1/head', ?1, 'doc-1', x'', 'pending', 1, 'unavailable', ?2, ?3)",
                params![OUT_TOPIC, now, later],
            )?;
            tx.execute(
                "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1)
                 INSERT INTO postroom_outbox (message_id, topic, key, payload, status,
                     created_at, next_attempt_at)
                 SELECT 'doc-1/' || i, ?2, 'doc-1', x'', 'pending', ?3, 0 FROM n",
                params![held, OUT_TOPIC, now],
            )?;
        } else {
            tx.execute(
                "INSERT INTO postroom_inbox (consumer, source, message_id, status, payload,
                     payload_hash, ordering_key, attempts, last_error, received_at, updated_at,
                     next_attempt_at, queued)
                 VALUES (?1, 'editor', 'doc-1/head', 'failed', 'held', ?2, 'doc-1', 1,
                     'retry after a day', ?3, ?3, ?4, 1)",
                params![CONSUMER, digest, now, later],
            )?;
            tx.execute(
                "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1)
                 INSERT INTO postroom_inbox (consumer, source, message_id, status, payload,
                     payload_hash, ordering_key, received_at, updated_at, queued)
                 SELECT ?2, 'editor', 'doc-1/' || i, 'pending', x'', ?3, 'doc-1', ?4, ?4, 1
                 FROM n",
                params![held, CONSUMER, digest, now],
            )?;
        }
        tx.commit()?;
        drop(conn);
        let _ = Command::new("sync").status();
        Ok(())
    }

    /// Receives messages `0..count` of `seed`, each with an ordering key of
    /// its own, one at a time, each timed from `receive()` called until
    /// its handler committed (the domain counter, polled every 100 µs),
    /// `RELAY_PACE` apart.
    pub fn paced_queued(
        room: &Postroom,
        probe: &Connection,
        seed: u64,
        count: u64,
        cap: Option<Duration>,
    ) -> Res<Run> {
        let spent = budget::now();
        let start = Instant::now();
        let mut latencies = Vec::new();
        let mut i = 0;
        while i < count && cap.is_none_or(|c| start.elapsed() < c) {
            let msg = message(seed, i).with_ordering_key(format!("other-{seed:x}-{i}"));
            let base = processed(probe)?;
            let called = Instant::now();
            let receipt = room.receive(CONSUMER, msg)?;
            if receipt != Receipt::Accepted {
                return Err(format!("message {i}: {receipt:?}").into());
            }
            let step = Duration::from_micros(100);
            if !wait(step, Duration::from_secs(30), || {
                Ok(processed(probe)? > base)
            })? {
                return Err(format!("message {i} was not processed in 30 s").into());
            }
            latencies.push(called.elapsed());
            i += 1;
            thread::sleep(RELAY_PACE);
        }
        Ok(Run {
            messages: i,
            elapsed: start.elapsed(),
            latencies,
            cpu: None,
            cost: budget::Cost::since(spent),
        })
    }

    /// Delivers messages `0..count` of `seed` one at a time, `RELAY_PACE`
    /// apart, each timed until its outbox row comes out of `rx`: from
    /// `deliver()` called (the first vector) and from it returning.
    pub fn paced_relay(
        room: &Postroom,
        rx: &crossbeam_channel::Receiver<OutboxMessage>,
        seed: u64,
        count: u64,
        cap: Option<Duration>,
    ) -> Res<(Run, Vec<Duration>)> {
        let spent = budget::now();
        let start = Instant::now();
        let (mut after_call, mut after_return) = (Vec::new(), Vec::new());
        let mut i = 0;
        while i < count && cap.is_none_or(|c| start.elapsed() < c) {
            let msg = message(seed, i);
            let id = msg.id().to_owned();
            let called = Instant::now();
            let outcome = room.deliver(CONSUMER, msg)?;
            let returned = Instant::now();
            let out = rx.recv_timeout(Duration::from_secs(10))?;
            let arrived = Instant::now();
            if !matches!(outcome, Outcome::Processed { .. }) {
                return Err(format!("message {i}: {outcome:?}").into());
            }
            if out.headers.get(CAUSATION_HEADER) != Some(&id) {
                return Err(format!("message {i}: the sink got {:?}", out.headers).into());
            }
            after_call.push(arrived - called);
            after_return.push(arrived.saturating_duration_since(returned));
            i += 1;
            thread::sleep(RELAY_PACE);
        }
        let run = Run {
            messages: i,
            elapsed: start.elapsed(),
            latencies: after_call,
            cpu: None,
            cost: budget::Cost::since(spent),
        };
        Ok((run, after_return))
    }

    /// One caller delivering fresh messages of `seed` until `stop` is set.
    pub fn deliver_until(room: &Postroom, seed: u64, stop: &AtomicBool) -> Res<Run> {
        let spent = budget::now();
        let cpu_before = cpu::now();
        let start = Instant::now();
        let mut latencies = Vec::new();
        let mut i = 0;
        while !stop.load(Ordering::Acquire) {
            let msg = message(seed, i);
            let t = Instant::now();
            let outcome = room.deliver(CONSUMER, msg)?;
            latencies.push(t.elapsed());
            if !matches!(outcome, Outcome::Processed { .. }) {
                return Err(format!("message {i}: {outcome:?}").into());
            }
            i += 1;
        }
        let elapsed = start.elapsed();
        Ok(Run {
            messages: i,
            elapsed,
            latencies,
            cpu: cpu_before.zip(cpu::now()).map(|(a, b)| b.since(a)),
            cost: budget::Cost::since(spent),
        })
    }

    /// Sets the flag when dropped: a panicking thread still stops the
    /// caller waiting on it.
    pub struct SetOnDrop<'a>(pub &'a AtomicBool);

    impl Drop for SetOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
        }
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Expect {
        Processed,
        Duplicate,
    }

    /// Delivers messages `0..count` of `seed` from `callers` threads, each
    /// taking the next index, until done or past `cap`.
    pub fn drive(
        room: &Postroom,
        callers: usize,
        seed: u64,
        count: u64,
        cap: Option<Duration>,
        expect: Expect,
        progress: Option<&str>,
    ) -> Res<Run> {
        let msg = |i| message(seed, i);
        drive_with(room, callers, msg, count, cap, expect, progress)
    }

    /// Delivers `msg(0..count)` from `callers` threads, each taking the
    /// next index, until done or past `cap`.
    pub fn drive_with(
        room: &Postroom,
        callers: usize,
        msg: impl Fn(u64) -> Message + Sync,
        count: u64,
        cap: Option<Duration>,
        expect: Expect,
        progress: Option<&str>,
    ) -> Res<Run> {
        let next = AtomicU64::new(0);
        let spent = budget::now();
        let cpu_before = cpu::now();
        let start = Instant::now();
        let tenth = (count / 10).max(1);
        let per_caller = usize::try_from(count / callers as u64 + 1).unwrap_or(0);
        let caller = || -> Res<Vec<Duration>> {
            let mut latencies = Vec::with_capacity(per_caller);
            while cap.is_none_or(|c| start.elapsed() < c) {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= count {
                    break;
                }
                if let Some(label) = progress.filter(|_| i > 0 && i.is_multiple_of(tenth)) {
                    eprintln!("    {label}: {}%", i * 100 / count);
                }
                let msg = msg(i);
                let t = Instant::now();
                let outcome = room.deliver(CONSUMER, msg)?;
                latencies.push(t.elapsed());
                let ok = match expect {
                    Expect::Processed => matches!(outcome, Outcome::Processed { .. }),
                    Expect::Duplicate => outcome == Outcome::Duplicate,
                };
                if !ok {
                    return Err(format!("message {i}: expected {expect:?}, got {outcome:?}").into());
                }
            }
            Ok(latencies)
        };
        let per_thread = thread::scope(|s| {
            let handles: Vec<_> = (0..callers).map(|_| s.spawn(caller)).collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err("caller panicked".into())))
                .collect::<Vec<_>>()
        });
        let elapsed = start.elapsed();
        let cpu = cpu_before.zip(cpu::now()).map(|(a, b)| b.since(a));
        let cost = budget::Cost::since(spent);
        let mut latencies = Vec::new();
        for lat in per_thread {
            latencies.extend(lat?);
        }
        Ok(Run {
            messages: latencies.len() as u64,
            elapsed,
            latencies,
            cpu,
            cost,
        })
    }

    /// The engine's counters that a phase is measured by, from one
    /// `stats()`.
    #[derive(Debug, Clone, Copy)]
    pub struct Counters {
        /// (batches_committed, jobs_committed).
        pub group: (u64, u64),
        /// WAL frames its commits appended since it opened.
        pub frames: u64,
    }

    /// The counters, and how long `stats()` took: it scans the inbox,
    /// which matters at millions of rows.
    pub fn counters(room: &Postroom) -> Res<(Counters, Duration)> {
        let t = Instant::now();
        let stats = room.stats()?;
        let counters = Counters {
            group: (stats.batches_committed, stats.jobs_committed),
            frames: stats.wal_frames_written,
        };
        Ok((counters, t.elapsed()))
    }

    /// `counters`, except on a database prefilled with `retained` rows,
    /// where the engine rows other than `deliver …` skip `stats()` (15 s a
    /// call at 5M rows, twice a pass) and go without group-commit notes
    /// and WAL frames.
    pub fn counters_unless_scaled(room: &Postroom, retained: u64) -> Res<Option<Counters>> {
        if retained > 0 {
            return Ok(None);
        }
        Ok(Some(counters(room)?.0))
    }

    /// The group-commit counters over a phase, when both ends have them.
    pub fn group(before: Option<Counters>, after: Option<Counters>) -> Option<(u64, u64)> {
        before.zip(after).map(|(b, a)| delta(b.group, a.group))
    }

    /// The WAL frames appended over a phase (no B-tree count), when both
    /// ends have them.
    pub fn wal(before: Option<Counters>, after: Option<Counters>) -> Option<Footprint> {
        before.zip(after).map(|(b, a)| Footprint {
            frames: a.frames.saturating_sub(b.frames),
            cells: None,
        })
    }

    /// WAL frames the engine's commits appended since it opened.
    pub fn frames(room: &Postroom) -> Res<u64> {
        Ok(room.stats()?.wal_frames_written)
    }

    /// Notes how long the open took, on a prefilled database.
    pub fn note_open(retained: u64, opened: Duration, notes: &mut Vec<String>) {
        if retained > 0 {
            notes.push(format!(
                "open (with quick_check) took {:.1} s",
                opened.as_secs_f64()
            ));
        }
    }

    /// `after - before`, for pairs of counters.
    pub fn delta(before: (u64, u64), after: (u64, u64)) -> (u64, u64) {
        (after.0 - before.0, after.1 - before.1)
    }

    pub fn close(room: Postroom, notes: &mut Vec<String>) -> Res<()> {
        let t = Instant::now();
        let report = room.shutdown(Duration::from_secs(120))?;
        if !report.is_clean() {
            return Err(format!("unclean shutdown: {report:?}").into());
        }
        if t.elapsed() > Duration::from_millis(500) {
            notes.push(format!("shutdown took {:.1} s", t.elapsed().as_secs_f64()));
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// Prefilled databases: built once per N by a child process, cached, and
// copied for each scenario that uses one.

const PREFILL_SEED: u64 = 0x5EED_0F1D_B00C_0005;
const PREFILL_TXN_ROWS: u64 = 100_000;
/// Retained rows are spread over the day before the prefill. A cache file
/// older than this is rebuilt, so that the engine's retention (7 days by
/// default) never starts deleting its rows mid-run.
const PREFILL_MAX_AGE: Duration = Duration::from_secs(5 * 24 * 3600);

struct Cache {
    dir: PathBuf,
}

impl Cache {
    fn new() -> Cache {
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target"));
        Cache {
            dir: target.join("bench-cache"),
        }
    }

    fn file_for(&self, kind: Prefill, n: u64) -> PathBuf {
        // Keyed by schema as well, so a schema change rebuilds the files.
        let schema = ids::hex(&blake3::hash(postroom::SCHEMA_SQL.as_bytes()).as_bytes()[..6]);
        self.dir.join(format!(
            "{}-{n}-schema{schema}-p{}.db",
            kind.label(),
            kind.format()
        ))
    }

    /// The cached file for `n` rows of `kind`, built first if missing or
    /// stale.
    fn ensure(&self, kind: Prefill, n: u64, notes: &mut Vec<String>) -> Res<PathBuf> {
        let path = self.file_for(kind, n);
        let fresh = fs::metadata(&path)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age < PREFILL_MAX_AGE);
        if fresh {
            return Ok(path);
        }
        fs::create_dir_all(&self.dir)?;
        // Files for the same N from an older schema or format are a GiB
        // each and never used again.
        let prefix = format!("{}-{n}-", kind.label());
        for entry in fs::read_dir(&self.dir)?.flatten() {
            if entry.file_name().to_string_lossy().starts_with(&prefix) {
                fs::remove_file(entry.path())?;
            }
        }
        let partial = path.with_extension("partial");
        eprintln!(
            "    prefilling {} {} rows into {} (cached for later runs)",
            thousands(n),
            kind.label(),
            path.display()
        );
        let t = Instant::now();
        let status = Command::new(std::env::current_exe()?)
            .arg("--prefill-child")
            .arg(kind.label())
            .arg(n.to_string())
            .arg(&partial)
            .status()?;
        if !status.success() {
            return Err(format!("prefill child failed: {status}").into());
        }
        fs::rename(&partial, &path)?;
        notes.push(format!(
            "prefilled {} {} rows in {:.1} s",
            thousands(n),
            kind.label(),
            t.elapsed().as_secs_f64()
        ));
        Ok(path)
    }

    /// Copies the cached file into `dir` and flushes it, so the copy's dirty
    /// pages are not written back during (and slowing the fsyncs of) the
    /// timed phase.
    fn copy_to(&self, kind: Prefill, n: u64, dir: &Path, notes: &mut Vec<String>) -> Res<PathBuf> {
        let src = self.ensure(kind, n, notes)?;
        let dst = dir.join("bench.db");
        let t = Instant::now();
        let bytes = fs::copy(&src, &dst)?;
        fs::File::open(&dst)?.sync_all()?;
        notes.push(format!(
            "copied {:.0} MiB and synced in {:.1} s",
            bytes as f64 / 1048576.0,
            t.elapsed().as_secs_f64()
        ));
        Ok(dst)
    }
}

/// The child process: creates the schema through the engine, then inserts
/// `n` rows of `kind` straight into postroom_inbox in big transactions.
fn prefill_child(kind: Prefill, n: u64, path: &Path) -> Res<()> {
    for suffix in ["", "-wal", "-shm", "-postroom"] {
        let mut p = path.as_os_str().to_owned();
        p.push(suffix);
        let _ = fs::remove_file(PathBuf::from(p));
    }
    // The engine creates its own schema, so the file is what postroom makes.
    Postroom::builder()
        .open(path)?
        .shutdown(Duration::from_secs(30))?;
    let mut conn = Connection::open(path)?;
    // A cache file is rebuilt if anything goes wrong: no journal, no fsync,
    // and a cache big enough to hold the unique index while keys land at
    // random places in it.
    let _: String = conn.pragma_update_and_check(None, "journal_mode", "OFF", |r| r.get(0))?;
    conn.pragma_update(None, "synchronous", "OFF")?;
    conn.pragma_update(None, "cache_size", -1_048_576)?;
    let start = Instant::now();
    let day_ms = 24 * 3600 * 1000;
    let (end_ms, span_ms) = match kind {
        Prefill::Retained | Prefill::Pending => (now_ms(), day_ms),
        Prefill::Expired => (now_ms() - 2 * day_ms, day_ms),
    };
    if kind == Prefill::Pending {
        // The handler that processes the backlog updates it.
        conn.execute_batch(COUNTERS_DDL)?;
    }
    let mut done = 0;
    let mut reported = 0;
    while done < n {
        let tx = conn.transaction()?;
        {
            let mut completed = tx.prepare(
                "INSERT INTO postroom_inbox (consumer, source, message_id, status, payload,
                     payload_hash, attempts, received_at, updated_at, processed_at)
                 VALUES (?1, ?2, ?3, 'completed', NULL, ?4, 1, ?5, ?5, ?5)",
            )?;
            // As `receive` stores a message: payload kept (the claim checks
            // it against its digest), due at once, owned by the workers.
            let mut pending = tx.prepare(
                "INSERT INTO postroom_inbox (consumer, source, message_id, status, payload,
                     payload_hash, attempts, received_at, updated_at, next_attempt_at, queued)
                 VALUES (?1, ?2, ?3, 'pending', ?4, ?5, 0, ?6, ?6, NULL, 1)",
            )?;
            let mut hash = [0u8; 32];
            for i in done..(done + PREFILL_TXN_ROWS).min(n) {
                let t = end_ms - span_ms + (i as i64 * span_ms) / n as i64;
                let id = ids::uuid(PREFILL_SEED, i);
                if kind == Prefill::Pending {
                    let payload = ids::payload(i);
                    let digest = blake3::hash(&payload);
                    pending.execute(params![
                        CONSUMER,
                        SOURCE,
                        id,
                        payload,
                        digest.as_bytes().as_slice(),
                        t
                    ])?;
                    continue;
                }
                if kind == Prefill::Retained {
                    // Message `i` of `PREFILL_SEED` was processed: a
                    // re-delivery of it is a duplicate.
                    hash = *blake3::hash(&ids::payload(i)).as_bytes();
                } else {
                    for (k, chunk) in hash.chunks_mut(8).enumerate() {
                        chunk.copy_from_slice(
                            &ids::nth(!PREFILL_SEED, 4 * i + k as u64).to_le_bytes(),
                        );
                    }
                }
                completed.execute(params![CONSUMER, SOURCE, id, hash.as_slice(), t])?;
            }
        }
        tx.commit()?;
        done = (done + PREFILL_TXN_ROWS).min(n);
        let pct = done * 100 / n;
        if pct >= reported + 5 || done == n {
            reported = pct;
            eprintln!(
                "    prefill {} {} rows: {pct}% ({:.0} s)",
                thousands(n),
                kind.label(),
                start.elapsed().as_secs_f64()
            );
        }
    }
    let _: String = conn.pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0))?;
    conn.close().map_err(|(_, e)| e)?;
    let mut engine_file = path.as_os_str().to_owned();
    engine_file.push("-postroom");
    let _ = fs::remove_file(PathBuf::from(engine_file));
    fs::File::open(path)?.sync_all()?;
    Ok(())
}

// ---------------------------------------------------------------------------
// Running one scenario.

/// Runs one pass of `s`: `count` messages or `cap`, whichever ends first,
/// on a database of its own.
fn run(s: &Scenario, plan: &Plan, cache: &Cache, count: u64, cap: Duration) -> Res<Measured> {
    let dir = tempfile::tempdir()?;
    let mut m = Measured::default();
    let path = if s.rows > 0 {
        cache.copy_to(s.prefill, s.rows, dir.path(), &mut m.notes)?
    } else {
        dir.path().join("bench.db")
    };
    let seed = ids::seed_of(&s.name);
    let warm = seed ^ 0xFFFF;
    // The duplicates: on a fresh database the scenario's own messages,
    // delivered (or written) first; on a prefilled one, rows of the
    // prefill picked at random, a series of their own for the warm-up.
    let rows = s.rows;
    let dup_of = move |seed: u64| {
        move |k: u64| {
            if rows > 0 {
                prefilled_message(seed, rows, k)
            } else {
                message(seed, k)
            }
        }
    };
    let warm_dups = if rows > 0 { warm } else { seed };
    match s.work {
        Work::FloorWrites { batch } => {
            let conn = floor::open(&path, s.sync)?;
            floor::write_loop(&conn, batch, warm, plan.warmup, None)?;
            let frames = seeds::frames();
            m.run = floor::write_loop(&conn, batch, seed, count, Some(cap))?;
            m.footprint = floor::wal_since(frames);
        }
        Work::SeedsFloor { batch } => {
            let conn = seeds::open(&path, s.sync)?;
            seeds::write_loop(&conn, batch, warm, plan.warmup, None)?;
            let before = seeds::footprint(&conn)?;
            m.run = seeds::write_loop(&conn, batch, seed, count, Some(cap))?;
            m.footprint = seeds::footprint(&conn)?.since(before);
        }
        Work::ReceiveOne | Work::ReceiveProcess => {
            let processing = matches!(s.work, Work::ReceiveProcess);
            let workers = if processing { 2 } else { 0 };
            let builder = engine::builder(s.sync).workers(workers);
            let (room, opened) = engine::open_with(builder, &path)?;
            engine::note_open(rows, opened, &mut m.notes);
            let probe = engine::probe(&path)?;
            engine::receive_loop(&room, 1, warm, plan.warmup, None)?;
            let long = Duration::from_secs(300);
            let every = Duration::from_millis(2);
            if processing
                && !engine::wait(
                    every,
                    long,
                    || Ok(engine::processed(&probe)? >= plan.warmup),
                )?
            {
                return Err("the warm-up was not processed in 5 minutes".into());
            }
            let base = engine::processed(&probe)?;
            let before = engine::counters(&room)?.0;
            let cells = seeds::cells(&probe)?;
            let spent = budget::now();
            m.run = engine::receive_loop(&room, 1, seed, count, Some(cap))?;
            let after = engine::counters(&room)?.0;
            m.group = Some(engine::delta(before.group, after.group));
            if processing {
                let during = engine::processed(&probe)? - base;
                let t = Instant::now();
                let n = m.run.messages;
                if !engine::wait(every, long, || Ok(engine::processed(&probe)? - base >= n))? {
                    return Err("the received messages were not processed in 5 minutes".into());
                }
                m.notes.push(format!(
                    "{} of {} processed while receiving; the rest {} ms after",
                    thousands(during),
                    thousands(n),
                    t.elapsed().as_millis()
                ));
                // A message's cost: received and processed.
                m.run.cost = budget::Cost::since(spent);
            }
            let end = if processing {
                engine::counters(&room)?.0
            } else {
                after
            };
            m.footprint = Some(Footprint {
                frames: end.frames - before.frames,
                cells: Some(seeds::cells(&probe)? - cells),
            });
            engine::close(room, &mut m.notes)?;
        }
        Work::FloorDedupe => {
            let conn = floor::open(&path, s.sync)?;
            if rows == 0 {
                floor::write_loop(&conn, 1000, seed, count, None)?;
            }
            floor::dedupe_loop(&conn, dup_of(warm_dups), plan.warmup.min(count), cap)?;
            let frames = seeds::frames();
            m.run = floor::dedupe_loop(&conn, dup_of(seed), count, cap)?;
            m.footprint = floor::wal_since(frames);
        }
        Work::Deliver { callers, keyed } => {
            let builder = if keyed {
                engine::builder(s.sync)
            } else {
                engine::base(s.sync).consumer(CONSUMER, engine::unkeyed_handler())
            };
            let (room, opened) = engine::open_with(builder, &path)?;
            if s.rows > 0 {
                m.notes.push(format!(
                    "open (with quick_check) took {:.1} s",
                    opened.as_secs_f64()
                ));
            }
            let expect = engine::Expect::Processed;
            engine::drive(&room, callers, warm, plan.warmup, None, expect, None)?;
            let (before, scan) = engine::counters(&room)?;
            // dbstat reads the whole file: fresh databases only.
            let cells = (s.rows == 0)
                .then(|| seeds::cells(&engine::probe(&path)?))
                .transpose()?;
            m.run = engine::drive(&room, callers, seed, count, Some(cap), expect, None)?;
            let (after, _) = engine::counters(&room)?;
            m.group = Some(engine::delta(before.group, after.group));
            let cells_after = cells
                .map(|_| seeds::cells(&engine::probe(&path)?))
                .transpose()?;
            m.footprint = Some(Footprint {
                frames: after.frames - before.frames,
                cells: cells.zip(cells_after).map(|(b, a)| a - b),
            });
            if s.rows > 0 {
                m.notes
                    .push(format!("stats() took {} ms", scan.as_millis()));
            }
            engine::close(room, &mut m.notes)?;
        }
        Work::DeliverSequenced => {
            let (room, _) = engine::open(&path, s.sync)?;
            let expect = engine::Expect::Processed;
            // One stream per seed, numbered in delivery order from 1.
            let sequenced = |seed: u64| {
                move |i: u64| message(seed, i).with_sequence_in(format!("bench-{seed:x}"), i + 1)
            };
            engine::drive_with(&room, 1, sequenced(warm), plan.warmup, None, expect, None)?;
            let before = engine::counters(&room)?.0;
            let cells = seeds::cells(&engine::probe(&path)?)?;
            m.run = engine::drive_with(&room, 1, sequenced(seed), count, Some(cap), expect, None)?;
            let after = engine::counters(&room)?.0;
            m.group = Some(engine::delta(before.group, after.group));
            m.footprint = Some(Footprint {
                frames: after.frames - before.frames,
                cells: Some(seeds::cells(&engine::probe(&path)?)? - cells),
            });
            engine::close(room, &mut m.notes)?;
        }
        Work::DuplicateStorm => {
            let (room, opened) = engine::open(&path, s.sync)?;
            engine::note_open(rows, opened, &mut m.notes);
            if rows == 0 {
                let t = Instant::now();
                // First delivery of every message, fast through group commit.
                let first = engine::Expect::Processed;
                engine::drive(&room, 8, seed, count, None, first, Some("first delivery"))?;
                m.notes.push(format!(
                    "first delivery of {} messages (8 callers) took {:.1} s",
                    thousands(count),
                    t.elapsed().as_secs_f64()
                ));
            }
            let dup = engine::Expect::Duplicate;
            let warm_n = plan.warmup.min(count);
            engine::drive_with(&room, 1, dup_of(warm_dups), warm_n, None, dup, None)?;
            let before = engine::counters_unless_scaled(&room, rows)?;
            m.run = engine::drive_with(&room, 1, dup_of(seed), count, Some(cap), dup, None)?;
            let after = engine::counters_unless_scaled(&room, rows)?;
            m.group = engine::group(before, after);
            m.footprint = engine::wal(before, after);
            engine::close(room, &mut m.notes)?;
        }
        Work::FloorReceive { batch } => {
            let conn = floor::open(&path, s.sync)?;
            floor::receive_loop(&conn, batch, warm, plan.warmup, None)?;
            let frames = seeds::frames();
            m.run = floor::receive_loop(&conn, batch, seed, count, Some(cap))?;
            m.footprint = floor::wal_since(frames);
        }
        Work::Receive { batch } => {
            // No workers: what is measured is storing, not processing.
            let (room, opened) = engine::open_with(engine::builder(s.sync).workers(0), &path)?;
            engine::note_open(rows, opened, &mut m.notes);
            engine::receive_loop(&room, batch, warm, plan.warmup, None)?;
            let before = engine::counters_unless_scaled(&room, rows)?;
            m.run = engine::receive_loop(&room, batch, seed, count, Some(cap))?;
            let after = engine::counters_unless_scaled(&room, rows)?;
            m.group = engine::group(before, after);
            m.footprint = engine::wal(before, after);
            engine::close(room, &mut m.notes)?;
        }
        Work::QueuedDrain { workers } => {
            queued_drain(s, plan, &path, workers, count, DRAIN_LIMIT, &mut m)?
        }
        Work::FloorRelay { batch } => {
            engine::fill_outbox(&path, s.sync, seed, plan.warmup + count)?;
            let conn = floor::open(&path, s.sync)?;
            floor::relay_loop(&conn, batch, plan.warmup, None)?;
            let frames = seeds::frames();
            m.run = floor::relay_loop(&conn, batch, count, Some(DRAIN_LIMIT))?;
            m.footprint = floor::wal_since(frames);
        }
        Work::RelayDrain => relay_drain(s, plan, &path, count, DRAIN_LIMIT, &mut m)?,
        Work::RelayLatency => {
            let (tx, rx) = crossbeam_channel::unbounded();
            let builder = engine::builder(s.sync).sink(ChannelSink::new(tx));
            let (room, opened) = engine::open_with(builder, &path)?;
            engine::note_open(rows, opened, &mut m.notes);
            engine::paced_relay(&room, &rx, warm, plan.warmup.min(50), None)?;
            let before = engine::counters_unless_scaled(&room, rows)?;
            let (run, after_return) = engine::paced_relay(&room, &rx, seed, count, Some(cap))?;
            let after = engine::counters_unless_scaled(&room, rows)?;
            m.run = run;
            m.after_return = after_return;
            m.group = engine::group(before, after);
            m.footprint = engine::wal(before, after);
            engine::close(room, &mut m.notes)?;
        }
        Work::Retention { cleanup } => retention(s, plan, &path, cleanup, count, cap, &mut m)?,
        Work::Backlog => backlog(s, plan, &path, &mut m)?,
        Work::HeldKey { what, held } => held_key(s, plan, &path, what, held, count, cap, &mut m)?,
        Work::Idle => idle(plan, &path, &mut m)?,
    }
    if m.footprint.is_some() {
        m.page_size = Some(page_size(&path)?);
    }
    Ok(m)
}

/// The page size of the database at `path` (a WAL frame is a page and a
/// 24-byte header).
fn page_size(path: &Path) -> Res<u64> {
    let conn = Connection::open(path)?;
    let size: i64 = conn.query_row("PRAGMA page_size", [], |r| r.get(0))?;
    Ok(u64::try_from(size)?)
}

/// The held-key rows: `held` rows of key `doc-1` (the bench consumer's
/// inbox, or the outbox) written behind a head that retries in a day, then
/// the engine opened with default settings and timed as `what` says.
#[allow(clippy::too_many_arguments)]
fn held_key(
    s: &Scenario,
    plan: &Plan,
    path: &Path,
    what: HeldWhat,
    held: u64,
    count: u64,
    cap: Duration,
    m: &mut Measured,
) -> Res<()> {
    let seed = ids::seed_of(&s.name);
    let warm = seed ^ 0xFFFF;
    if held > 0 {
        let t = Instant::now();
        engine::hold_key(path, what == HeldWhat::Relay, held)?;
        m.notes.push(format!(
            "{} rows of one key written behind its held head in {:.1} s",
            thousands(held),
            t.elapsed().as_secs_f64()
        ));
    }
    let expect = engine::Expect::Processed;
    match what {
        HeldWhat::Deliver => {
            let (room, _) = engine::open(path, s.sync)?;
            engine::drive(&room, 1, warm, plan.warmup, None, expect, None)?;
            m.run = engine::drive(&room, 1, seed, count, Some(cap), expect, None)?;
            engine::close(room, &mut m.notes)?;
        }
        HeldWhat::Queued => {
            let (room, _) = engine::open(path, s.sync)?;
            let probe = engine::probe(path)?;
            engine::paced_queued(&room, &probe, warm, plan.warmup.min(50), None)?;
            m.run = engine::paced_queued(&room, &probe, seed, count, Some(cap))?;
            engine::close(room, &mut m.notes)?;
        }
        HeldWhat::Relay => {
            let (tx, rx) = crossbeam_channel::unbounded();
            let builder = engine::builder(s.sync).sink(ChannelSink::new(tx));
            let (room, _) = engine::open_with(builder, path)?;
            engine::paced_relay(&room, &rx, warm, plan.warmup.min(50), None)?;
            let (run, after_return) = engine::paced_relay(&room, &rx, seed, count, Some(cap))?;
            m.run = run;
            m.after_return = after_return;
            engine::close(room, &mut m.notes)?;
        }
    }
    Ok(())
}

/// Receives everything first, then times the workers from the moment the
/// batch is stored until the last message is completed.
fn queued_drain(
    s: &Scenario,
    plan: &Plan,
    path: &Path,
    workers: usize,
    count: u64,
    cap: Duration,
    m: &mut Measured,
) -> Res<()> {
    let seed = ids::seed_of(&s.name);
    let (room, opened) = engine::open_with(engine::builder(s.sync).workers(workers), path)?;
    engine::note_open(s.rows, opened, &mut m.notes);
    let probe = engine::probe(path)?;
    let every = Duration::from_millis(2);
    // Warm-up: received and processed before the timed phase.
    let warm_n = plan.warmup.min(count);
    engine::receive_loop(&room, RECEIVE_BATCH, seed ^ 0xFFFF, warm_n, None)?;
    let long = Duration::from_secs(300);
    if !engine::wait(every, long, || Ok(engine::processed(&probe)? >= warm_n))? {
        return Err("the warm-up was not processed in 5 minutes".into());
    }
    let base = engine::processed(&probe)?;
    let before = engine::counters_unless_scaled(&room, s.rows)?;
    let footprint = |room: &Postroom| -> Res<Option<Footprint>> {
        if s.rows > 0 {
            return Ok(None);
        }
        Ok(Some(Footprint {
            frames: engine::frames(room)?,
            cells: Some(seeds::cells(&probe)?),
        }))
    };
    let footprint_before = footprint(&room)?;
    // One transaction: no worker can complete anything before it commits,
    // and the workers are woken as it returns.
    let msgs: Vec<Message> = (0..count).map(|i| message(seed, i)).collect();
    // Like the footprint, the cost covers receiving and processing.
    let spent = budget::now();
    let receipts = room.receive_batch(CONSUMER, msgs)?;
    let start = Instant::now();
    if receipts.iter().any(|r| *r != Receipt::Accepted) {
        return Err("a fresh message was not accepted".into());
    }
    let drained = engine::wait(
        every,
        cap,
        || Ok(engine::processed(&probe)? - base >= count),
    )?;
    let elapsed = start.elapsed();
    let done = engine::processed(&probe)? - base;
    m.run = Run {
        messages: done,
        elapsed,
        latencies: Vec::new(),
        cpu: None,
        cost: budget::Cost::since(spent),
    };
    // Receiving and processing together: what a queued message costs.
    if let (Some(before), Some(after)) = (footprint_before, footprint(&room)?) {
        m.footprint = after.since(before);
    }
    if let Some(before) = before {
        let stats = room.stats()?;
        let after = (stats.batches_committed, stats.jobs_committed);
        // The receive_batch commit is not the workers'.
        let (batches, jobs) = engine::delta(before.group, after);
        m.group = Some((batches.saturating_sub(1), jobs.saturating_sub(1)));
        let completed = stats.inbox.get(CONSUMER).map_or(0, |c| c.completed);
        if drained && completed != warm_n + count {
            return Err(format!(
                "stats() shows {completed} completed, not {}",
                warm_n + count
            )
            .into());
        }
    } else if drained {
        // Without stats() (on a prefilled database): each message counted
        // once, and none left waiting.
        let (total, due) = (base + done, engine::queued_due(&probe)?);
        if total != warm_n + count || due != 0 {
            return Err(format!(
                "{total} processed (not {}), {due} still due",
                warm_n + count
            )
            .into());
        }
    }
    if !drained {
        m.notes.push(format!(
            "not drained: {} of {} done in {:.1} s",
            thousands(done),
            thousands(count),
            elapsed.as_secs_f64()
        ));
    }
    engine::close(room, &mut m.notes)
}

/// A database holding committed pending outbox rows, opened with a sink
/// that counts them: timed from the first `warmup` handed over until every
/// row is marked sent.
fn relay_drain(
    s: &Scenario,
    plan: &Plan,
    path: &Path,
    count: u64,
    cap: Duration,
    m: &mut Measured,
) -> Res<()> {
    let seed = ids::seed_of(&s.name);
    let total = plan.warmup + count;
    let t = Instant::now();
    engine::fill_outbox(path, s.sync, seed, total)?;
    m.notes.push(format!(
        "published {} outbox rows (no sink, {} per transaction) in {:.1} s",
        thousands(total),
        thousands(OUTBOX_FILL_TXN),
        t.elapsed().as_secs_f64()
    ));
    let sent = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&sent);
    let sink = sink_fn(move |_: &OutboxMessage| {
        counted.fetch_add(1, Ordering::Relaxed);
        SendResult::Sent
    });
    let (room, opened) = engine::open_with(engine::builder(s.sync).sink(sink), path)?;
    engine::note_open(s.rows, opened, &mut m.notes);
    let probe = engine::probe(path)?;
    let long = Duration::from_secs(300);
    let tick = Duration::from_millis(1);
    if !engine::wait(tick, long, || {
        Ok(sent.load(Ordering::Relaxed) >= plan.warmup)
    })? {
        return Err("the relay did not hand over the warm-up rows in 5 minutes".into());
    }
    let counted_before = engine::counters_unless_scaled(&room, s.rows)?;
    let spent = budget::now();
    let start = Instant::now();
    let from = sent.load(Ordering::Relaxed);
    // The sink's count first (no SQL while it runs), then the marking of
    // the last batch.
    let drained = engine::wait(tick, cap, || Ok(sent.load(Ordering::Relaxed) >= total))?
        && engine::wait(tick, cap, || Ok(engine::outbox_pending(&probe)? == 0))?;
    let elapsed = start.elapsed();
    let handed = sent.load(Ordering::Relaxed);
    m.run = Run {
        messages: handed.min(total) - from.min(total),
        elapsed,
        latencies: Vec::new(),
        cpu: None,
        cost: budget::Cost::since(spent),
    };
    m.footprint = engine::wal(
        counted_before,
        engine::counters_unless_scaled(&room, s.rows)?,
    );
    // stats() scans the inbox too: on a prefilled database, count the
    // outbox alone.
    let (marked, by) = if s.rows > 0 {
        (engine::outbox_sent(&probe)?, "the outbox shows")
    } else {
        (room.stats()?.outbox.sent, "stats() shows")
    };
    if drained && (marked != total || handed != total) {
        return Err(format!("{handed} handed over, {by} {marked} sent, of {total}").into());
    }
    if !drained {
        m.notes.push(format!(
            "not drained: {} of {} handed over in {:.1} s",
            thousands(handed - from),
            thousands(total - from),
            elapsed.as_secs_f64()
        ));
    }
    engine::close(room, &mut m.notes)
}

/// One caller delivering on a database of expired rows, retention one
/// hour (everything expired) and no reaper pass of its own: alone
/// (`count` messages or `cap`), or for as long as one `cleanup()` on
/// another thread takes to delete every expired row.
fn retention(
    s: &Scenario,
    plan: &Plan,
    path: &Path,
    cleanup: bool,
    count: u64,
    cap: Duration,
    m: &mut Measured,
) -> Res<()> {
    let seed = ids::seed_of(&s.name);
    let builder = engine::builder(s.sync)
        .workers(0)
        .retention(Duration::from_secs(3600))
        .reaper_interval(Duration::from_secs(24 * 3600));
    let (room, opened) = engine::open_with(builder, path)?;
    m.notes.push(format!(
        "open (with quick_check) took {:.1} s",
        opened.as_secs_f64()
    ));
    let expect = engine::Expect::Processed;
    engine::drive(&room, 1, seed ^ 0xFFFF, plan.warmup, None, expect, None)?;
    let (before, _) = engine::counters(&room)?;
    if cleanup {
        let stop = AtomicBool::new(false);
        let (cleaned, run) = thread::scope(|scope| {
            let cleaner = scope.spawn(|| {
                let _stop = engine::SetOnDrop(&stop);
                let t = Instant::now();
                room.cleanup().map(|r| (r, t.elapsed()))
            });
            let run = engine::deliver_until(&room, seed, &stop);
            let cleaned = cleaner.join().map_err(|_| "cleanup() panicked");
            (cleaned, run)
        });
        let (report, took) = cleaned??;
        let run = run?;
        if report.inbox_deleted != s.rows {
            return Err(format!(
                "cleanup deleted {} rows, not {}",
                report.inbox_deleted, s.rows
            )
            .into());
        }
        m.deleted = Some((report.inbox_deleted, took));
        m.run = run;
    } else {
        m.run = engine::drive(&room, 1, seed, count, Some(cap), expect, None)?;
    }
    // One `stats()` (it scans the inbox) for the group counters and, since
    // open (the warm-up included), what the checkpointer's paused passes
    // cost the callers, who cannot commit while one runs.
    let stats = room.stats()?;
    let after = (stats.batches_committed, stats.jobs_committed);
    m.group = Some(engine::delta(before.group, after));
    m.footprint = Some(Footprint {
        frames: stats.wal_frames_written.saturating_sub(before.frames),
        cells: None,
    });
    m.notes.push(format!(
        "{} paused checkpoint passes held writes {:.1} s in all, {:.1} ms at most",
        thousands(stats.wal_checkpoints),
        stats.wal_paused.as_secs_f64(),
        stats.wal_paused_max.as_secs_f64() * 1000.0
    ));
    engine::close(room, &mut m.notes)
}

/// The idle row's effectful consumer: an external step that does nothing,
/// then the same work as every handler.
struct Effect;

impl EffectHandler for Effect {
    type Output = ();

    fn effect(&self, _: &EffectContext<'_>, _: &Message) -> Result<(), Failure> {
        Ok(())
    }

    fn apply(&self, tx: &mut Tx<'_>, msg: &Message, _: ()) -> Result<(), Failure> {
        tx.execute(DOMAIN_UPDATE, [account_of(msg.id())])?;
        tx.publish(Outgoing::new(OUT_TOPIC, OUT_PAYLOAD).with_key(msg.id()))?;
        Ok(())
    }
}

/// An engine with default settings, the bench consumer, an effectful one
/// and a sink, after one message through each (delivered, received and
/// processed, published and sent), left to settle, then measured while
/// nothing is due: the threads that appeared with the open (the harness's
/// own are there before it, and only sleep meanwhile), their context
/// switches per second, and VmRSS over what it was before the open.
fn idle(plan: &Plan, path: &Path, m: &mut Measured) -> Res<()> {
    let before_open = tasks::snapshot();
    let resident = mem::status_kib("VmRSS");
    let sent = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&sent);
    let sink = sink_fn(move |_: &OutboxMessage| {
        counted.fetch_add(1, Ordering::Relaxed);
        SendResult::Sent
    });
    let builder = Postroom::builder()
        .consumer(CONSUMER, engine::handler())
        .effectful_consumer(EFFECTS, Effect)
        .sink(sink);
    let (room, _) = engine::open_with(builder, path)?;
    let seed = ids::seed_of(IDLE);
    let outcome = room.deliver(CONSUMER, message(seed, 0))?;
    if !matches!(outcome, Outcome::Processed { .. }) {
        return Err(format!("the idle engine's delivery: {outcome:?}").into());
    }
    let receipt = room.receive(EFFECTS, message(seed, 1))?;
    if receipt != Receipt::Accepted {
        return Err(format!("the idle engine's receive: {receipt:?}").into());
    }
    let probe = engine::probe(path)?;
    let (tick, long) = (Duration::from_millis(10), Duration::from_secs(60));
    if !engine::wait(tick, long, || {
        Ok(engine::processed(&probe)? >= 2 && sent.load(Ordering::Relaxed) >= 2)
    })? {
        return Err("the idle engine's two messages were not processed and sent in 60 s".into());
    }
    drop(probe);
    thread::sleep(plan.idle_settle);
    let rss = mem::status_kib("VmRSS")
        .zip(resident)
        .map(|(now, then)| now as i64 - then as i64);
    let window = plan.idle_for / plan.passes;
    let (from, spent, start) = (tasks::snapshot(), budget::now(), Instant::now());
    thread::sleep(window);
    let (to, cost, elapsed) = (
        tasks::snapshot(),
        budget::Cost::since(spent),
        start.elapsed(),
    );
    let mut idle = Idle {
        seconds: elapsed.as_secs_f64(),
        rss_kib: rss,
        ..Idle::default()
    };
    // The engine's threads alive over the whole window.
    for (tid, (name, then)) in from.iter().filter(|(t, _)| !before_open.contains_key(t)) {
        let Some((_, now)) = to.get(tid) else {
            continue;
        };
        let switches = now.saturating_sub(*then);
        idle.threads += 1;
        idle.switches += switches;
        let e = idle.by_name.entry(name.clone()).or_default();
        e.0 += 1;
        e.1 += switches;
    }
    let (came, went) = (
        to.keys().filter(|t| !from.contains_key(t)).count(),
        from.keys().filter(|t| !to.contains_key(t)).count(),
    );
    if came + went > 0 {
        m.notes.push(format!(
            "{came} threads started and {went} ended during the window (not counted)"
        ));
    }
    m.idle = Some(idle);
    m.run = Run {
        messages: 0,
        elapsed,
        latencies: Vec::new(),
        cpu: None,
        cost,
    };
    engine::close(room, &mut m.notes)
}

/// Default settings on a database with a pending backlog: the workers
/// process it for `Plan::backlog_for` while VmHWM records the peak.
fn backlog(s: &Scenario, plan: &Plan, path: &Path, m: &mut Measured) -> Res<()> {
    // The peak from here on: the engine's, on top of what is resident now.
    mem::reset_peak();
    let resident = mem::status_kib("VmRSS");
    let t = Instant::now();
    // Exactly an application's setup: default settings (2 workers).
    let room = Postroom::builder()
        .consumer(CONSUMER, engine::handler())
        .open(path)?;
    let opened = t.elapsed();
    let probe = engine::probe(path)?;
    let spent = budget::now();
    let start = Instant::now();
    let tick = Duration::from_millis(50);
    engine::wait(tick, plan.backlog_for, || {
        Ok(engine::processed(&probe)? >= s.rows)
    })?;
    let elapsed = start.elapsed();
    let done = engine::processed(&probe)?;
    m.run = Run {
        messages: done,
        elapsed,
        latencies: Vec::new(),
        cpu: None,
        cost: budget::Cost::since(spent),
    };
    m.rise_kib = mem::status_kib("VmHWM")
        .zip(resident)
        .map(|(peak, before)| peak as i64 - before as i64);
    m.notes.push(format!(
        "VmRSS {} before open (first pass); open (with quick_check) took {:.1} s; \
         processed {} of {} in {:.1} s",
        fmt_mib(resident),
        opened.as_secs_f64(),
        thousands(done),
        thousands(s.rows),
        elapsed.as_secs_f64()
    ));
    engine::close(room, &mut m.notes)
}

impl Measured {
    /// Adds another pass. Notes are kept from the first pass only: later
    /// passes repeat them with other numbers.
    fn absorb(&mut self, pass: Measured, first: bool) {
        self.run.messages += pass.run.messages;
        self.run.elapsed += pass.run.elapsed;
        self.run.latencies.extend(pass.run.latencies);
        self.run.cpu = match (self.run.cpu, pass.run.cpu) {
            (Some(a), Some(b)) => Some(a.plus(b)),
            (a, b) => a.or(b),
        };
        self.after_return.extend(pass.after_return);
        self.deleted = match (self.deleted, pass.deleted) {
            (Some(a), Some(b)) => Some((a.0 + b.0, a.1 + b.1)),
            (a, b) => a.or(b),
        };
        self.rise_kib = self.rise_kib.max(pass.rise_kib);
        self.group = match (self.group, pass.group) {
            (Some(a), Some(b)) => Some((a.0 + b.0, a.1 + b.1)),
            (a, b) => a.or(b),
        };
        self.footprint = match (self.footprint, pass.footprint) {
            (Some(a), Some(b)) => Some(a.plus(b)),
            (a, b) => a.or(b),
        };
        self.run.cost = self.run.cost.plus(pass.run.cost);
        self.page_size = self.page_size.or(pass.page_size);
        self.idle = match (self.idle.take(), pass.idle) {
            (Some(a), Some(b)) => Some(a.plus(b)),
            (a, b) => a.or(b),
        };
        if first {
            self.notes = pass.notes;
        }
    }
}

/// A scenario's results over the passes so far.
#[derive(Default)]
struct Tally {
    m: Measured,
    peak: Option<u64>,
    delta: Option<i64>,
    failed: Option<String>,
}

/// Median, 99th percentile and maximum of `latencies` (sorted here), in µs.
fn spread(latencies: &mut [Duration]) -> [Option<f64>; 3] {
    latencies.sort_unstable();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    [
        percentile(latencies, 50.0).map(us),
        percentile(latencies, 99.0).map(us),
        latencies.last().copied().map(us),
    ]
}

fn row_of(s: &Scenario, mut m: Measured, peak: Option<u64>, delta: Option<i64>) -> Row {
    let stalls = matches!(s.work, Work::Retention { .. })
        .then(|| m.run.latencies.iter().filter(|&&l| l > STALL).count() as u64);
    let [p50, p99, max] = spread(&mut m.run.latencies);
    let [r50, r99, rmax] = spread(&mut m.after_return);
    let secs = m.run.elapsed.as_secs_f64();
    let (kind, callers, workers, batch) = match s.work {
        Work::Deliver { callers, .. } => ("engine", Some(callers), None, None),
        Work::DuplicateStorm
        | Work::DeliverSequenced
        | Work::RelayLatency
        | Work::Retention { .. } => ("engine", Some(1), None, None),
        Work::FloorWrites { batch } | Work::FloorReceive { batch } | Work::FloorRelay { batch } => {
            ("floor", None, None, Some(batch))
        }
        Work::FloorDedupe => ("floor", None, None, None),
        Work::SeedsFloor { batch } => ("floor", None, None, Some(batch)),
        Work::ReceiveOne => ("engine", Some(1), Some(0), Some(1)),
        Work::ReceiveProcess => ("engine", Some(1), Some(2), Some(1)),
        Work::Receive { batch } => ("engine", Some(1), Some(0), Some(batch)),
        Work::QueuedDrain { workers } => ("engine", None, Some(workers), None),
        Work::RelayDrain => ("engine", None, None, None),
        Work::Backlog => ("engine", None, Some(2), None),
        Work::Idle => ("engine", None, Some(2), None),
        Work::HeldKey { .. } => ("engine", Some(1), Some(2), None),
    };
    let queued = matches!(s.work, Work::QueuedDrain { .. } | Work::Backlog);
    let per_msg = |x: f64| (m.run.messages > 0).then(|| x / m.run.messages as f64);
    let per_s = |x: f64| (secs > 0.0).then(|| x / secs);
    let idle = m.idle.take().filter(|i| i.seconds > 0.0);
    let mut idle_by_thread: Vec<IdleThread> = idle.as_ref().map_or_else(Vec::new, |i| {
        i.by_name
            .iter()
            .map(|(name, &(threads, switches))| IdleThread {
                name: name.clone(),
                threads,
                wakeups_per_s: switches as f64 / i.seconds,
            })
            .collect()
    });
    idle_by_thread.sort_by(|a, b| b.wakeups_per_s.total_cmp(&a.wakeups_per_s));
    if !idle_by_thread.is_empty() {
        let each = idle_by_thread
            .iter()
            .map(|t| {
                let n = if t.threads > 1 {
                    format!(" x{}", t.threads)
                } else {
                    String::new()
                };
                format!("{}{n} {:.1}", t.name, t.wakeups_per_s)
            })
            .collect::<Vec<_>>()
            .join(", ");
        m.notes.push(format!("wakeups/s by thread: {each}"));
    }
    Row {
        scenario: s.name.clone(),
        kind,
        durability: s.sync.label(),
        callers,
        workers,
        msgs_per_txn: batch,
        prefilled_rows: s.rows,
        prefill: (s.rows > 0).then(|| s.prefill.label()),
        messages: m.run.messages,
        seconds: secs,
        msgs_per_s: if secs > 0.0 {
            m.run.messages as f64 / secs
        } else {
            0.0
        },
        paced: matches!(
            s.work,
            Work::RelayLatency
                | Work::HeldKey {
                    what: HeldWhat::Queued | HeldWhat::Relay,
                    ..
                }
        ),
        p50_us: p50,
        p99_us: p99,
        max_us: max,
        after_return_p50_us: r50,
        after_return_p99_us: r99,
        after_return_max_us: rmax,
        deleted_rows: m.deleted.map(|d| d.0),
        deleted_per_s: m
            .deleted
            .filter(|d| !d.1.is_zero())
            .map(|(n, t)| n as f64 / t.as_secs_f64()),
        stalls,
        engine_rise_kib: m.rise_kib,
        peak_rss_kib: peak,
        rss_delta_kib: delta,
        vs: s.vs.clone(),
        ratio: None,
        seeds_vs: s.seeds.clone(),
        seeds_ratio: None,
        wal_frames_per_msg: m
            .footprint
            .filter(|_| m.run.messages > 0)
            .map(|f| f.frames as f64 / m.run.messages as f64),
        btree_entries_per_msg: m
            .footprint
            .and_then(|f| f.cells)
            .filter(|_| m.run.messages > 0)
            .map(|c| c as f64 / m.run.messages as f64),
        avg_group: m
            .group
            .filter(|&(b, _)| b > 0)
            .map(|(b, j)| j as f64 / b as f64),
        cpu_cores: m
            .run
            .cpu
            .filter(|_| secs > 0.0)
            .map(|c| c.process.as_secs_f64() / secs),
        writer_cores: m
            .run
            .cpu
            .filter(|_| secs > 0.0)
            .and_then(|c| c.writer)
            .map(|w| w.as_secs_f64() / secs),
        batches_committed: m.group.map(|g| g.0),
        jobs_committed: m.group.map(|g| g.1),
        commits_per_msg: m
            .group
            .filter(|_| queued && m.run.messages > 0)
            .map(|(b, _)| b as f64 / m.run.messages as f64),
        cpu_us_per_msg: m.run.cost.cpu.and_then(|c| per_msg(c.as_secs_f64() * 1e6)),
        wal_bytes_per_msg: m
            .footprint
            .zip(m.page_size)
            .and_then(|(f, page)| per_msg((f.frames * (page + 24)) as f64)),
        disk_bytes_per_msg: m.run.cost.written.and_then(|w| per_msg(w as f64)),
        idle_wakeups_per_s: idle.as_ref().map(|i| i.switches as f64 / i.seconds),
        idle_threads: idle.as_ref().map(|i| i.threads),
        idle_rss_kib: idle.as_ref().and_then(|i| i.rss_kib),
        idle_cpu_ms_per_s: idle
            .as_ref()
            .and(m.run.cost.cpu)
            .and_then(|c| per_s(c.as_secs_f64() * 1e3)),
        idle_disk_bytes_per_s: idle
            .as_ref()
            .and(m.run.cost.written)
            .and_then(|w| per_s(w as f64)),
        idle_by_thread,
        notes: m.notes,
    }
}

// ---------------------------------------------------------------------------
// Output.

fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn fmt_us(us: Option<f64>) -> String {
    match us {
        None => String::new(),
        Some(us) if us < 10.0 => format!("{us:.1}µs"),
        Some(us) if us < 1000.0 => format!("{us:.0}µs"),
        Some(us) if us < 100_000.0 => format!("{:.2}ms", us / 1000.0),
        Some(us) => format!("{:.0}ms", us / 1000.0),
    }
}

/// Bytes, per message or per second: `812 B`, `39.7 KiB`, `1.2 MiB`.
fn fmt_bytes(bytes: Option<f64>) -> String {
    match bytes {
        None => String::new(),
        Some(b) if b < 1024.0 => format!("{b:.0} B"),
        Some(b) if b < 1024.0 * 1024.0 => format!("{:.1} KiB", b / 1024.0),
        Some(b) => format!("{:.1} MiB", b / (1024.0 * 1024.0)),
    }
}

/// A blank cell's stand-in where a note needs one.
trait IfEmpty {
    fn if_empty(self, instead: &str) -> String;
}

impl IfEmpty for String {
    fn if_empty(self, instead: &str) -> String {
        if self.is_empty() {
            instead.to_owned()
        } else {
            self
        }
    }
}

fn fmt_mib(kib: Option<u64>) -> String {
    kib.map_or_else(String::new, |k| format!("{:.1} MiB", k as f64 / 1024.0))
}

fn fmt_delta(kib: Option<i64>) -> String {
    kib.map_or_else(String::new, |k| format!("{:+.1} MiB", k as f64 / 1024.0))
}

/// The notes column: group commits, and what else a row measured.
fn row_notes(r: &Row) -> String {
    let mut parts = Vec::new();
    if let (Some(w), Some(n)) = (r.idle_wakeups_per_s, r.idle_threads) {
        parts.push(format!(
            "{w:.1} wakeups/s over {n} threads; VmRSS {}; CPU {} ms/s; {} written/s",
            fmt_delta(r.idle_rss_kib),
            r.idle_cpu_ms_per_s
                .map_or_else(|| "?".to_owned(), |c| format!("{c:.1}")),
            fmt_bytes(r.idle_disk_bytes_per_s).if_empty("?")
        ));
    }
    match (r.wal_frames_per_msg, r.btree_entries_per_msg) {
        (Some(f), Some(c)) => parts.push(format!("{f:.2} pages, {c:+.2} B-tree entries per msg")),
        (Some(f), None) => parts.push(format!("{f:.2} pages per msg")),
        _ => {}
    }
    if let Some(g) = r.avg_group {
        let per = r
            .commits_per_msg
            .map_or_else(String::new, |c| format!(", {c:.2}/msg"));
        parts.push(format!(
            "group {g:.1} ({} commits{per})",
            thousands(r.batches_committed.unwrap_or(0))
        ));
    }
    if let Some(all) = r.cpu_cores {
        let writer = r
            .writer_cores
            .map_or_else(String::new, |w| format!(" (writer {w:.2})"));
        parts.push(format!("CPU {all:.2} cores{writer}"));
    }
    if let (Some(n), Some(rate)) = (r.deleted_rows, r.deleted_per_s) {
        parts.push(format!(
            "deleted {} rows, {} rows/s",
            thousands(n),
            thousands(rate.round() as u64)
        ));
    }
    if r.paced && r.after_return_p50_us.is_some() {
        parts.push(format!(
            "from deliver() returning: p50 {} p99 {} max {}",
            fmt_us(r.after_return_p50_us),
            fmt_us(r.after_return_p99_us),
            fmt_us(r.after_return_max_us)
        ));
    }
    if let Some(n) = r.stalls {
        parts.push(format!(
            "{} of {} deliveries > {} ms",
            thousands(n),
            thousands(r.messages),
            STALL.as_millis()
        ));
    }
    if r.prefill == Some(Prefill::Pending.label()) {
        parts.push(format!(
            "default settings ({} workers); engine's own peak {} over VmRSS at open",
            r.workers.unwrap_or(0),
            fmt_delta(r.engine_rise_kib)
        ));
    }
    parts.join("; ")
}

fn print_table(rows: &[Row]) {
    let head = [
        "scenario", "msgs/s", "p50", "p99", "max", "CPU/msg", "WAL/msg", "disk/msg", "peak RSS",
        "ΔRSS", "ratio", "vs", "seeds", "notes",
    ];
    let right = [
        false, true, true, true, true, true, true, true, true, true, true, false, true, false,
    ];
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.scenario.clone(),
                if r.paced || r.idle_wakeups_per_s.is_some() {
                    String::new()
                } else {
                    thousands(r.msgs_per_s.round() as u64)
                },
                fmt_us(r.p50_us),
                fmt_us(r.p99_us),
                fmt_us(r.max_us),
                fmt_us(r.cpu_us_per_msg),
                fmt_bytes(r.wal_bytes_per_msg),
                fmt_bytes(r.disk_bytes_per_msg),
                fmt_mib(r.peak_rss_kib),
                fmt_delta(r.rss_delta_kib),
                r.ratio.map_or_else(String::new, |x| format!("{x:.2}x")),
                r.vs.clone().unwrap_or_default(),
                r.seeds_ratio
                    .map_or_else(String::new, |x| format!("{x:.2}x")),
                row_notes(r),
            ]
        })
        .collect();
    let width = |i: usize| {
        cells
            .iter()
            .map(|c| c[i].chars().count())
            .chain([head[i].chars().count()])
            .max()
            .unwrap_or(0)
    };
    let widths: Vec<usize> = (0..head.len()).map(width).collect();
    let line = |cols: Vec<String>| {
        let mut out = String::new();
        for (i, c) in cols.iter().enumerate() {
            let pad = widths[i].saturating_sub(c.chars().count());
            if i > 0 {
                out.push_str("  ");
            }
            if right[i] {
                out.push_str(&" ".repeat(pad));
                out.push_str(c);
            } else {
                out.push_str(c);
                if i + 1 < cols.len() {
                    out.push_str(&" ".repeat(pad));
                }
            }
        }
        println!("{}", out.trim_end());
    };
    line(head.iter().map(|s| (*s).to_owned()).collect());
    line(widths.iter().map(|&w| "-".repeat(w)).collect());
    for c in cells {
        line(c);
    }
}

fn find<'a>(rows: &'a [Row], name: &str) -> Option<&'a Row> {
    rows.iter().find(|r| r.scenario == name)
}

fn print_goals(rows: &[Row], plan: &Plan) {
    println!("\ngoals (from this run)");
    let verdict = |x: Option<f64>, min: f64| match x {
        Some(x) if x >= min => format!("[met]     {x:.2}x"),
        Some(x) => format!("[not met] {x:.2}x"),
        None => "[no data]".to_owned(),
    };
    let ratio = |name: &str| find(rows, name).and_then(|r| r.ratio);
    let one = deliver_name(1, SyncMode::Full, 0);
    println!(
        "  {:<60} {}",
        "1 caller FULL >= 0.9x floor 1/txn FULL",
        verdict(ratio(&one), 0.9)
    );
    let eight = deliver_name(8, SyncMode::Full, 0);
    let group = find(rows, &eight)
        .and_then(|r| r.avg_group)
        .map_or_else(String::new, |g| format!(" (avg group {g:.1})"));
    let vs8 = match (
        find(rows, &eight),
        find(rows, &floor_name(8, SyncMode::Full, 0)),
    ) {
        (Some(e), Some(f)) if f.msgs_per_s > 0.0 => {
            format!("; vs floor batch 8: {:.2}x", e.msgs_per_s / f.msgs_per_s)
        }
        _ => String::new(),
    };
    println!(
        "  {:<60} {}{group}{vs8}",
        "8 callers FULL >= 0.8x floor batch 100 FULL",
        verdict(ratio(&eight), 0.8)
    );
    println!(
        "  {:<60} {}",
        "duplicate storm >= 0.8x floor dedupe SELECT",
        verdict(ratio(DUPLICATE_STORM), 0.8)
    );
    // Against the seeds floor (the articles' statements on their own
    // schema), in the same run.
    let over = |row: &str, floor: &str| {
        find(rows, row)
            .zip(find(rows, floor))
            .filter(|(_, f)| f.msgs_per_s > 0.0)
            .map(|(r, f)| r.msgs_per_s / f.msgs_per_s)
    };
    let (seeds1, seeds8, seeds100) = (
        seeds_name(1, SyncMode::Full),
        seeds_name(8, SyncMode::Full),
        seeds_name(100, SyncMode::Full),
    );
    let queued2 = queued_name(2, 0);
    let seeds_goals: [(&str, &str, &str, f64); 6] = [
        (
            "queued drain 2 workers FULL >= 0.5x seeds 100/tx",
            &queued2,
            &seeds100,
            0.5,
        ),
        (
            "queued drain 2 workers FULL >= 2.1x seeds 1/tx",
            &queued2,
            &seeds1,
            2.1,
        ),
        (
            "receive 1 by 1 FULL >= 1.0x seeds 1/tx",
            RECEIVE_ONE,
            &seeds1,
            1.0,
        ),
        (
            "receive 1 by 1 + processing FULL >= 1.0x seeds 1/tx",
            RECEIVE_PROCESS,
            &seeds1,
            1.0,
        ),
        ("1 caller FULL >= 0.9x seeds 1/tx", &one, &seeds1, 0.9),
        ("8 callers FULL >= 0.8x seeds 8/tx", &eight, &seeds8, 0.8),
    ];
    for (what, row, floor, min) in seeds_goals {
        println!("  {what:<60} {}", verdict(over(row, floor), min));
    }
    // At the largest size, each row against its fresh self. The relay
    // latency row is paced: its figure is 1/p99, so higher is better there
    // too.
    let figure = |r: &Row| {
        if r.paced {
            r.p99_us.filter(|&p| p > 0.0).map(|p| 1.0 / p)
        } else {
            Some(r.msgs_per_s).filter(|&x| x > 0.0)
        }
    };
    let biggest = plan.retained.iter().copied().max().unwrap_or(0);
    type Names = fn(u64) -> (String, Option<String>);
    let scaled: [(&str, Names); 8] = [
        ("1 caller FULL", |n| {
            let floor = floor_name(1, SyncMode::Full, n);
            (deliver_name(1, SyncMode::Full, n), Some(floor))
        }),
        ("8 callers FULL", |n| {
            let floor = floor_name(100, SyncMode::Full, n);
            (deliver_name(8, SyncMode::Full, n), Some(floor))
        }),
        ("duplicate storm", |n| {
            let floor = named_at(FLOOR_DEDUPE, n);
            (named_at(DUPLICATE_STORM, n), Some(floor))
        }),
        ("receive_batch 1000 FULL", |n| {
            let floor = named_at(FLOOR_RECEIVE, n);
            (named_at(RECEIVE, n), Some(floor))
        }),
        ("queued 2 workers FULL", |n| (queued_name(2, n), None)),
        ("queued 4 workers FULL", |n| (queued_name(4, n), None)),
        ("relay drain FULL", |n| {
            let floor = named_at(FLOOR_RELAY, n);
            (named_at(RELAY_DRAIN, n), Some(floor))
        }),
        ("relay latency FULL (1/p99)", |n| {
            (named_at(RELAY_LATENCY, n), None)
        }),
    ];
    for (what, names) in scaled {
        let ((fresh, fresh_floor), (big, big_floor)) = (names(0), names(biggest));
        let (fresh, big) = (find(rows, &fresh), find(rows, &big));
        let x = match (fresh.and_then(figure), big.and_then(figure)) {
            (Some(f), Some(s)) => Some(s / f),
            _ => None,
        };
        // Fresh and scaled rows run minutes apart; how far their floors moved
        // says how much of the difference is the disk, not the engine.
        let floors = fresh_floor
            .zip(big_floor)
            .and_then(|(f, s)| find(rows, &f).zip(find(rows, &s)));
        let detail = match (floors, fresh.zip(big)) {
            (Some((f, s)), _) if f.msgs_per_s > 0.0 => format!(
                " (its floor moved {:.2}x over the same span)",
                s.msgs_per_s / f.msgs_per_s
            ),
            (None, Some((f, s))) if f.paced => format!(
                " (p99 {}{}, {} fresh)",
                fmt_us(s.p99_us),
                at(biggest),
                fmt_us(f.p99_us)
            ),
            _ => String::new(),
        };
        let what = format!("{what} at 5M retained >= 0.6x fresh");
        if plan.quick {
            let x = x.map_or_else(|| "no data".to_owned(), |x| format!("{x:.2}x"));
            println!(
                "  {what:<60} [n/a]     --quick measures{}: {x}{detail}",
                at(biggest)
            );
        } else {
            println!("  {what:<60} {}{detail}", verdict(x, 0.6));
        }
    }
    println!(
        "  {:<60} {}",
        "receive_batch >= 0.9x raw floor at batch 1000",
        verdict(ratio(RECEIVE), 0.9)
    );
    // Absolute goals: met when the figure is at most the bound. The 1M
    // goals are judged only at 1M (`rows`); --quick shows its smaller
    // figure.
    let within = |x: Option<f64>, max: f64, rows: u64, show: &dyn Fn(f64) -> String| match x {
        None => "[no data]".to_owned(),
        Some(x) if rows > 0 && rows < 1_000_000 => {
            format!("[n/a]     --quick measures @{}: {}", size(rows), show(x))
        }
        Some(x) if x <= max => format!("[met]     {}", show(x)),
        Some(x) => format!("[not met] {}", show(x)),
    };
    let ms = |us: f64| fmt_us(Some(us));
    let relay = find(rows, RELAY_LATENCY);
    let from_return = relay.map_or_else(String::new, |r| {
        format!(
            " from deliver() called (its commit included); from deliver() returning: {}",
            fmt_us(r.after_return_p99_us)
        )
    });
    println!(
        "  {:<60} {}{from_return}",
        "relay p99 commit-to-sink <= 5 ms, not saturated",
        within(relay.and_then(|r| r.p99_us), 5_000.0, 0, &ms)
    );
    let during = find(rows, &retention_name(plan.expired, true));
    let alone = find(rows, &retention_name(plan.expired, false));
    let context = match (during, alone) {
        (Some(d), Some(a)) => format!(
            " max (p99 {}, {} of {} > 50 ms); without cleanup: max {}, p99 {}, {} of {} \
             > 50 ms (this disk's fsync alone has 100+ ms outliers)",
            fmt_us(d.p99_us),
            thousands(d.stalls.unwrap_or(0)),
            thousands(d.messages),
            fmt_us(a.max_us),
            fmt_us(a.p99_us),
            thousands(a.stalls.unwrap_or(0)),
            thousands(a.messages)
        ),
        _ => String::new(),
    };
    println!(
        "  {:<60} {}{context}",
        "no delivery stall > 50 ms while retention deletes 1M rows",
        within(during.and_then(|r| r.max_us), 50_000.0, plan.expired, &ms)
    );
    let backlog = find(rows, &backlog_name(plan.backlog));
    let peak = backlog.and_then(|r| r.peak_rss_kib).map(|k| k as f64);
    let mib = |kib: f64| format!("{:.1} MiB", kib / 1024.0);
    println!(
        "  {:<60} {}{}",
        "peak RSS <= 64 MiB, default settings, 1M pending backlog",
        within(peak, 65_536.0, plan.backlog, &mib),
        backlog.map_or_else(String::new, |r| format!(
            " process-wide, the harness's own resident memory included; the engine's own \
             rise over VmRSS at open: {}",
            fmt_delta(r.engine_rise_kib)
        ))
    );
}

fn header(args: &[String], plan: &Plan, peak_resets: bool, io: &Result<(), String>) {
    let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name")?.split_once(':'))
        .map_or("unknown", |(_, m)| m.trim())
        .to_owned();
    let nproc = thread::available_parallelism().map_or(0, |n| n.get());
    let mem = fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))?
                .split_whitespace()
                .next()?
                .parse::<u64>()
                .ok()
        })
        .map_or_else(String::new, |k| {
            format!(", {:.1} GiB RAM", k as f64 / 1048576.0)
        });
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let load = loadavg();
    println!(
        "postroom bench ({})",
        if plan.quick { "quick" } else { "full" }
    );
    println!(
        "command:  cargo run --release -p postroom-bench --{}",
        args.iter().map(|a| format!(" {a}")).collect::<String>()
    );
    println!("date:     {}", utc_now());
    println!(
        "machine:  nproc {nproc}, {model}{mem}, Linux {}",
        kernel.trim()
    );
    println!(
        "sqlite:   {} (bundled); temp dir {}",
        rusqlite::version(),
        std::env::temp_dir().display()
    );
    println!(
        "timing:   {} passes per scenario, each a warm-up of {} msgs, then up to a third of \
         the count or of {:.1} s",
        plan.passes,
        plan.warmup,
        plan.cap.as_secs_f64()
    );
    // The engine hands every message to its writer thread and back, so CPU
    // contention from other processes hurts it more than the one-thread
    // floor: ratios from a busy machine understate the engine.
    println!(
        "load:     {load} (1/5/15-min load average at start){}",
        if load
            .split_whitespace()
            .next()
            .and_then(|l| l.parse::<f64>().ok())
            > Some(0.5)
        {
            "; the machine is busy, expect noise"
        } else {
            ""
        }
    );
    println!(
        "memory:   peak RSS = VmHWM, process-wide and monotonic; {}",
        if peak_resets {
            "reset before each pass via /proc/self/clear_refs: the lowest pass peak is shown"
        } else {
            "could NOT be reset here, so it is the run's peak so far (see ΔRSS)"
        }
    );
    println!(
        "budget:   per msg finished: CPU/msg = the process's user+sys over the phase (every \
         thread, the harness's callers included; 10 ms ticks); WAL/msg = WAL frames x (page + 24 B); \
         disk/msg = /proc/self/io write_bytes ({})",
        match io {
            Ok(()) => "counts here".to_owned(),
            Err(why) => format!("NOT counted here: {why}; the column is blank or 0"),
        }
    );
    println!();
}

fn loadavg() -> String {
    fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (y, m, d) = civil_from_days((secs / 86_400) as i64);
    let s = secs % 86_400;
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        s / 3600,
        s % 3600 / 60,
        s % 60
    )
}

/// Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

// ---------------------------------------------------------------------------
// Main.

struct Options {
    quick: bool,
    json: Option<PathBuf>,
    only: Option<String>,
}

enum Mode {
    Bench(Options),
    PrefillChild(Prefill, u64, PathBuf),
}

const USAGE: &str =
    "usage: cargo run --release -p postroom-bench -- [--quick] [--json PATH] [--only TEXT]";

fn parse(args: &[String]) -> Result<Mode, String> {
    if args.first().map(String::as_str) == Some("--prefill-child") {
        return match args {
            [_, kind, n, path] => Ok(Mode::PrefillChild(
                Prefill::parse(kind).ok_or_else(|| format!("bad prefill kind {kind:?}"))?,
                n.parse().map_err(|_| format!("bad row count {n:?}"))?,
                PathBuf::from(path),
            )),
            _ => Err("--prefill-child KIND N PATH".into()),
        };
    }
    let mut opts = Options {
        quick: false,
        json: None,
        only: None,
    };
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--quick" => opts.quick = true,
            "--json" => {
                let path = it.next().ok_or("--json needs a path")?;
                opts.json = Some(PathBuf::from(path));
            }
            "--only" => {
                let text = it.next().ok_or("--only needs a text")?;
                opts.only = Some(text.clone());
            }
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(Mode::Bench(opts))
}

fn bench(opts: &Options, args: &[String]) -> Res<bool> {
    let plan = if opts.quick {
        Plan::quick()
    } else {
        Plan::full()
    };
    let peak_resets = mem::reset_peak();
    let io = budget::io_counts(&std::env::temp_dir());
    header(args, &plan, peak_resets, &io);
    let cache = Cache::new();
    let mut groups = scenarios(&plan);
    if let Some(only) = &opts.only {
        let matches = |name: &str| match only.strip_suffix('$') {
            Some(end) => name.ends_with(end),
            None => name.contains(only.as_str()),
        };
        groups.retain(|g| g.iter().any(|s| matches(&s.name)));
    }
    let total = groups.iter().map(Vec::len).sum::<usize>() * plan.passes as usize;
    let mut tallies: Vec<Vec<Tally>> = groups
        .iter()
        .map(|g| g.iter().map(|_| Tally::default()).collect())
        .collect();
    let started = Instant::now();
    let mut step = 0;
    for pass in 0..plan.passes {
        for (group, tally) in groups.iter().zip(&mut tallies) {
            let mut order: Vec<usize> = (0..group.len()).collect();
            if pass % 2 == 1 {
                order.reverse();
            }
            for k in order {
                let (s, t) = (&group[k], &mut tally[k]);
                step += 1;
                if t.failed.is_some() {
                    continue;
                }
                eprintln!(
                    "[{step:>2}/{total}] pass {}/{}: {} ({:.0} s so far)",
                    pass + 1,
                    plan.passes,
                    s.name,
                    started.elapsed().as_secs_f64()
                );
                // Writeback of unrelated dirty pages (the build that just
                // finished, the last scenario's files) would stall fsyncs.
                let _ = Command::new("sync").status();
                if peak_resets {
                    mem::reset_peak();
                }
                let rss_before = mem::status_kib("VmRSS");
                let count = s.count.div_ceil(u64::from(plan.passes));
                match run(s, &plan, &cache, count, plan.cap / plan.passes) {
                    Ok(m) => {
                        eprintln!(
                            "        {} msgs in {:.2} s",
                            thousands(m.run.messages),
                            m.run.elapsed.as_secs_f64()
                        );
                        let peak = mem::status_kib("VmHWM");
                        let delta = mem::status_kib("VmRSS")
                            .zip(rss_before)
                            .map(|(a, b)| a as i64 - b as i64);
                        // Memory freed by earlier scenarios stays resident
                        // (malloc keeps it), raising later passes' baseline:
                        // the lowest peak is the closest to this scenario's.
                        t.peak = match (t.peak, peak) {
                            (Some(a), Some(b)) => Some(a.min(b)),
                            (a, b) => a.or(b),
                        };
                        t.delta = t.delta.max(delta);
                        t.m.absorb(m, pass == 0);
                    }
                    Err(e) => {
                        eprintln!("        FAILED: {e}");
                        t.failed = Some(e.to_string());
                    }
                }
            }
        }
    }

    let mut rows: Vec<Row> = Vec::new();
    let mut failed = Vec::new();
    for (s, t) in groups.iter().flatten().zip(tallies.into_iter().flatten()) {
        if let Some(e) = t.failed {
            failed.push(format!("{}: {e}", s.name));
            continue;
        }
        rows.push(row_of(s, t.m, t.peak, t.delta));
    }
    // Floors may run in other groups, before or after their rows.
    let over = |rows: &[Row], r: &Row, vs: &Option<String>| {
        vs.as_deref()
            .and_then(|v| find(rows, v))
            .filter(|f| f.msgs_per_s > 0.0)
            .map(|f| r.msgs_per_s / f.msgs_per_s)
    };
    let ratios: Vec<(Option<f64>, Option<f64>)> = rows
        .iter()
        .map(|r| (over(&rows, r, &r.vs), over(&rows, r, &r.seeds_vs)))
        .collect();
    for (r, (ratio, seeds)) in rows.iter_mut().zip(ratios) {
        r.ratio = ratio;
        r.seeds_ratio = seeds;
    }

    print_table(&rows);
    let notes: Vec<String> = rows
        .iter()
        .flat_map(|r| r.notes.iter().map(move |n| format!("{}: {n}", r.scenario)))
        .collect();
    if !notes.is_empty() {
        println!("\nnotes");
        for n in notes {
            println!("  {n}");
        }
    }
    print_goals(&rows, &plan);
    for f in &failed {
        println!("FAILED {f}");
    }
    println!(
        "total {:.0} s; load average at the end: {}",
        started.elapsed().as_secs_f64(),
        loadavg()
    );
    if let Some(path) = &opts.json {
        let file = fs::File::create(path)?;
        serde_json::to_writer_pretty(std::io::BufWriter::new(file), &rows)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(failed.is_empty())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match parse(&args) {
        Ok(Mode::PrefillChild(kind, n, path)) => prefill_child(kind, n, &path).map(|()| true),
        Ok(Mode::Bench(opts)) => bench(&opts, &args),
        Err(why) => {
            if !why.is_empty() {
                eprintln!("{why}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("bench: {e}");
            ExitCode::FAILURE
        }
    }
}
