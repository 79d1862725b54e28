//! The `testkit_orders` fuzz target's body on stable, bounded: its corpus
//! (`corpus/testkit_orders/`, if any), then pseudo-random inputs until
//! `POSTROOM_FUZZ_SECS` (default 10) have passed, each a seed and a fault
//! schedule for the example's fixed orders handler (`Scenario::run_bytes`).
//! A violation panics with the testkit's report; the input is written to
//! `artifacts/testkit_orders/` for `cargo fuzz run testkit_orders <file>`.

use std::path::Path;
use std::time::{Duration, Instant};

use postroom::testkit::Rng;

// The buggy version is the example's other half, not fuzzed here.
#[allow(dead_code)]
#[path = "../../examples/testkit_orders/scenarios.rs"]
mod scenarios;

fn env(name: &str) -> Option<u64> {
    std::env::var(name).ok()?.parse().ok()
}

/// Runs one input; on a panic, saves it and says how to replay it.
fn run(input: &[u8], what: &str) {
    let result = std::panic::catch_unwind(|| scenarios::fixed().run_bytes(input));
    if let Err(panic) = result {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("artifacts/testkit_orders");
        let _ = std::fs::create_dir_all(&dir);
        let file = dir.join(format!("crash-{}", name_of(input)));
        let _ = std::fs::write(&file, input);
        eprintln!(
            "{what} failed; input saved as {} (cargo fuzz run testkit_orders {})",
            file.display(),
            file.display()
        );
        std::panic::resume_unwind(panic);
    }
}

/// A file name from the input's bytes (FNV-1a), stable across runs.
fn name_of(input: &[u8]) -> String {
    let hash = input.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("{hash:016x}")
}

#[test]
fn the_orders_scenario_survives_fuzzer_inputs() {
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/testkit_orders");
    let mut inputs = 0;
    if let Ok(entries) = std::fs::read_dir(&corpus) {
        let mut files: Vec<_> = entries.filter_map(|e| e.ok()).map(|e| e.path()).collect();
        files.sort();
        for file in files {
            let input = std::fs::read(&file).expect("corpus file");
            run(&input, &format!("corpus input {}", file.display()));
            inputs += 1;
        }
    }
    let secs = env("POSTROOM_FUZZ_SECS").unwrap_or(10);
    let seed = env("POSTROOM_FUZZ_SEED").unwrap_or(0x7E57_0DE5);
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut rng = Rng::new(seed);
    let mut generated = 0u64;
    let mut slowest = Duration::ZERO;
    // At least one input, however short the budget.
    while generated == 0 || Instant::now() < deadline {
        // A seed and up to 8 faults (3 bytes each).
        let len = 8 + 3 * rng.below(9) as usize;
        let input: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
        let started = Instant::now();
        run(
            &input,
            &format!("POSTROOM_FUZZ_SEED={seed}: generated input {generated}"),
        );
        slowest = slowest.max(started.elapsed());
        generated += 1;
    }
    eprintln!(
        "testkit_orders: {inputs} corpus inputs and {generated} generated in {secs} s \
         (slowest {slowest:.2?}), no violation"
    );
}
