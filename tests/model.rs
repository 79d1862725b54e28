//! Model-based test: seeded sequences of deliver / receive / duplicate /
//! conflicting payload / handler fail, reject, panic, crash / crash and
//! re-open / clock / reap / relay / cleanup, each step checked against a
//! reference model (`postroom::sim`). Needs `--features sim`.
//!
//! `POSTROOM_MODEL_SEQUENCES` (default 2000) and `POSTROOM_MODEL_LEN`
//! (default 40) size the run; `POSTROOM_SEED` replays one sequence.

use postroom::sim;

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
    let (mut ops, mut processed, mut crashes, mut conflicts, mut dead) = (0, 0, 0, 0, 0);
    for &seed in &seeds {
        let dir = tempfile::tempdir().unwrap();
        match sim::run_seed(dir.path(), seed, len) {
            Ok(stats) => {
                ops += stats.ops;
                processed += stats.processed;
                crashes += stats.crashes;
                conflicts += stats.conflicts;
                dead += stats.dead;
            }
            Err(e) => panic!("POSTROOM_SEED={seed} POSTROOM_MODEL_LEN={len}: {e}"),
        }
    }
    eprintln!(
        "model: {} sequences, {ops} operations; {processed} processed, {crashes} crashes, \
         {conflicts} conflicts, {dead} dead letters; every step matched the model",
        seeds.len()
    );
    assert!(
        processed > 0 && crashes > 0 && conflicts > 0 && dead > 0,
        "the generator covers every path"
    );
}
