//! Model-based test: seeded sequences of deliver / receive / duplicate /
//! conflicting payload / handler fail, reject, panic, crash / crash and
//! re-open / clock / reap / relay / cleanup / a drain split around other
//! operations, each step checked against a reference model
//! (`postroom::sim`, internal). Needs `--features _sim`.
//!
//! `POSTROOM_MODEL_SEQUENCES` (default 2000) and `POSTROOM_MODEL_LEN`
//! (default 40) size the run; `POSTROOM_SEED` replays one sequence.

mod common;

use common::in_parallel;
use postroom::sim::{self, Op, Plan};

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

#[test]
fn seeded_sequences_match_the_model() {
    // The simulated handler panics on purpose; keep those quiet.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if !info.to_string().contains("sim panic") {
            default_hook(info);
        }
    }));
    let len = env("POSTROOM_MODEL_LEN", 40) as usize;
    let seeds: Vec<u64> = match std::env::var("POSTROOM_SEED") {
        Ok(seed) => vec![seed.parse().expect("POSTROOM_SEED is a number")],
        Err(_) => {
            let base = env("POSTROOM_MODEL_BASE", 0x5EED);
            (0..env("POSTROOM_MODEL_SEQUENCES", 2000))
                .map(|i| base + i)
                .collect()
        }
    };
    // The seeds are independent (a directory each, no shared state): run
    // on as many threads as there are CPUs, at most 4, each taking the
    // next seed; the first failure stops the others.
    let runs = in_parallel(&seeds, "POSTROOM_MODEL_JOBS", |&seed| {
        let dir = tempfile::tempdir().unwrap();
        sim::run_seed(dir.path(), seed, len)
            .map(Some)
            .map_err(|e| format!("POSTROOM_SEED={seed} POSTROOM_MODEL_LEN={len}: {e}"))
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let (mut ops, mut processed, mut crashes, mut conflicts, mut dead, mut stale) =
        (0, 0, 0, 0, 0, 0);
    let (mut rolled_back, mut by_sequence, mut resets) = (0, 0, 0);
    for stats in runs {
        ops += stats.ops;
        processed += stats.processed;
        crashes += stats.crashes;
        conflicts += stats.conflicts;
        dead += stats.dead;
        stale += stats.live_at_apply;
        rolled_back += stats.rolled_back;
        by_sequence += stats.by_sequence;
        resets += stats.resets;
    }
    eprintln!(
        "model: {} sequences, {ops} operations; {processed} processed, {crashes} crashes, \
         {conflicts} conflicts, {dead} dead letters, {rolled_back} batches rolled back by a \
         handler, {stale} retired keys delivered anew between a drain's read and its deletions, \
         {by_sequence} answered by a sequence watermark, {resets} sequence resets; every step \
         matched the model",
        seeds.len()
    );
    assert!(
        processed > 0
            && crashes > 0
            && conflicts > 0
            && dead > 0
            && rolled_back > 0
            && by_sequence > 0
            && resets > 0,
        "the generator covers every path"
    );
}

/// Inline delivery of message `id`, payload `variant`, that succeeds.
fn deliver(id: u8, variant: u8) -> Op {
    Op::Deliver {
        consumer: 0,
        id,
        variant,
        plan: Plan::Ok,
    }
}

/// Retention with a zero horizon, past every row processed before: a pass
/// that deletes its key entries (`keys`), or one cut short after the rows
/// (their keys retired, the entries kept).
fn cleanup(keys: bool) -> Op {
    Op::Cleanup {
        retention_ms: 0,
        keys,
    }
}

/// Runs a fixed sequence, every step checked against the model.
fn run_fixed(ops: &[Op]) -> sim::RunStats {
    let dir = tempfile::tempdir().unwrap();
    sim::run(dir.path(), ops).unwrap_or_else(|e| panic!("{e}"))
}

/// A drain reads a retired key; the key is delivered again with another
/// payload (a live row) before the drain's deletions land: the entry now
/// belongs to the live row and must stay. Fails if the deletion does not
/// check for an inbox row at the entry's `inbox_id`
/// (`a_retired_entry_whose_row_id_another_key_took_is_deleted` in
/// tests/retention.rs covers an id another key took).
///
/// Retention keeps the newest row: each sequence below delivers another
/// message (8, 9) after the ones it retires.
#[test]
fn a_key_delivered_anew_after_a_drains_read_keeps_its_entry() {
    let stats = run_fixed(&[
        deliver(1, 0),
        deliver(9, 0),
        Op::Advance { ms: 10 },
        cleanup(false),
        Op::ReadRetired,
        // Another payload under a retired key is a new message.
        deliver(1, 1),
        Op::ApplyRetired,
        // Its row is still there, and the same payload is a duplicate.
        deliver(1, 1),
    ]);
    assert_eq!(stats.processed, 3, "1, 9, and 1 anew ran");
    assert_eq!(stats.live_at_apply, 1, "the race happened");
}

/// A drain reads a note its key has outlived (the key was delivered anew);
/// before the deletions land, the key retires again. Its entry is retired
/// now, so the deletion takes it, and the note the second retirement wrote
/// (after the read) stays for the next drain.
#[test]
fn a_stale_note_read_before_its_key_retires_again_deletes_the_entry() {
    let stats = run_fixed(&[
        deliver(1, 0),
        deliver(9, 0),
        Op::Advance { ms: 10 },
        cleanup(false),
        // Delivered anew: its first note is stale from here on.
        deliver(1, 1),
        deliver(8, 0),
        Op::ReadRetired,
        Op::Advance { ms: 10 },
        cleanup(false),
        Op::ApplyRetired,
        // The entry is gone: the same payload is new again.
        deliver(1, 1),
        Op::Advance { ms: 10 },
        cleanup(true),
    ]);
    assert_eq!(stats.processed, 5, "1, 9, 1 anew, 8, and 1 anew again");
}

/// A drain reads the retired keys; another key is retired after the read.
/// The drain then clears only the notes it read: the later note (and the
/// entry it names) waits for the next drain. Fails if the clear is not
/// bounded by the read's last `seq`.
#[test]
fn a_drain_clears_only_the_notes_it_read() {
    let stats = run_fixed(&[
        deliver(1, 0),
        deliver(9, 0),
        Op::Advance { ms: 10 },
        cleanup(false),
        Op::ReadRetired,
        deliver(2, 0),
        deliver(8, 0),
        Op::Advance { ms: 10 },
        cleanup(false),
        Op::ApplyRetired,
        // The first key's entry is gone: new again. The second is still
        // retired: a duplicate.
        deliver(1, 0),
        deliver(2, 0),
        Op::Advance { ms: 10 },
        cleanup(true),
    ]);
    assert_eq!(stats.processed, 5, "1, 9, 2, 8, then 1 again as new");
}

/// Sequenced messages (ids 3 to 5 are sequences 1 to 3): 3 before 2, then
/// retention deletes both rows and their keys; 2 and 3 come back and are
/// answered by the watermark (listed above it), a redelivery of 3 with
/// another payload is a conflict, and 1 (the gap) is new and closes it. Every step checks
/// the watermark and its listed sequences against the model.
#[test]
fn sequenced_messages_after_retention_match_the_model() {
    let stats = run_fixed(&[
        deliver(5, 0),
        deliver(4, 0),
        deliver(9, 0),
        Op::Advance { ms: 10 },
        cleanup(true),
        deliver(4, 0),
        deliver(5, 0),
        deliver(5, 1),
        deliver(3, 0),
        Op::Receive {
            consumer: 0,
            msgs: vec![(4, 0), (5, 0)],
        },
    ]);
    assert_eq!(stats.processed, 4, "5, 4, 9 and then 3 ran: {stats:?}");
    assert_eq!(stats.by_sequence, 4);
    assert_eq!(stats.conflicts, 1);
}

/// A reset starts a new epoch: the old numbers no longer answer, and the
/// old epoch's rows (5's, retained) keep answering by key without
/// settling the new epoch's numbers.
#[test]
fn a_sequence_reset_starts_a_new_epoch_in_the_model() {
    let stats = run_fixed(&[
        deliver(3, 0),
        deliver(4, 0),
        deliver(9, 0),
        Op::Advance { ms: 10 },
        cleanup(true),
        deliver(5, 0),
        deliver(3, 0),
        Op::ResetSequence { consumer: 0 },
        // Sequence 1 is new again; 5's row (sequence 3) answers by key.
        deliver(3, 0),
        deliver(5, 0),
        deliver(4, 0),
    ]);
    assert_eq!(stats.by_sequence, 1, "only 3, before the reset: {stats:?}");
    assert_eq!(stats.resets, 1);
    assert_eq!(
        stats.processed, 6,
        "3, 4, 9, 5, then 3 and 4 anew: {stats:?}"
    );
}
