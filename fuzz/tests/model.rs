//! The fuzz target's body on stable, bounded: every input of the corpus
//! (`corpus/model/`, kept in the repository), then pseudo-random inputs
//! until `POSTROOM_FUZZ_SECS` (default 10) have passed. A divergence from
//! the model panics and names the seed and input length to replay with
//! `POSTROOM_FUZZ_SEED`; the failing input is also written to
//! `artifacts/model/` for `cargo fuzz run model <file>`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

// The project's one seeded generator (SplitMix64, as before: the same
// seeds give the same inputs).
use postroom::testkit::Rng;

fn env(name: &str) -> Option<u64> {
    std::env::var(name).ok()?.parse().ok()
}

/// Runs one input; on a panic, saves it and says how to replay it.
fn run(input: &[u8], what: &str) {
    let result = std::panic::catch_unwind(|| postroom_fuzz::model(input));
    if let Err(panic) = result {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("artifacts/model");
        let _ = std::fs::create_dir_all(&dir);
        let file = dir.join(format!("crash-{}", name_of(input)));
        let _ = std::fs::write(&file, input);
        eprintln!("{what} failed; input saved as {}", file.display());
        std::panic::resume_unwind(panic);
    }
}

/// A name for an input (not cryptographic: FNV-1a).
fn name_of(input: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in input {
        h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

#[test]
fn the_corpus_and_random_inputs_match_the_model() {
    postroom_fuzz::quiet_sim_panics();
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/model");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&corpus)
        .expect("corpus/model is kept in the repository")
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "empty corpus");
    for file in &files {
        run(&std::fs::read(file).unwrap(), &file.display().to_string());
    }
    let budget = Duration::from_secs(env("POSTROOM_FUZZ_SECS").unwrap_or(10));
    let seed = env("POSTROOM_FUZZ_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
    });
    eprintln!(
        "corpus: {} inputs; random inputs from POSTROOM_FUZZ_SEED={seed}",
        files.len()
    );
    let mut rng = Rng::new(seed);
    let started = Instant::now();
    let mut runs = 0u64;
    while started.elapsed() < budget {
        // Lengths up to 1,200 bytes: up to the 400 operations a run takes.
        let len = (rng.next_u64() % 1_200) as usize;
        let input: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
        run(
            &input,
            &format!("random input {runs} (POSTROOM_FUZZ_SEED={seed}, {len} bytes)"),
        );
        runs += 1;
    }
    eprintln!("{runs} random inputs in {:.0?}", started.elapsed());
}
