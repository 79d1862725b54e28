//! Model-based fuzz target: the fuzzer's bytes choose a sequence of
//! deliver / receive / work / crash / clock / reap / relay / cleanup
//! operations (see `postroom::sim`), which run against a real database and
//! are checked against the reference model after every step.
//!
//! Nightly: `cargo fuzz run model fuzz/corpus/model`. On stable the same
//! body runs from `tests/model.rs` (corpus plus pseudo-random inputs), which
//! is what `.ci/run` runs when no nightly toolchain and cargo-fuzz are at hand.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // libFuzzer's panic hook aborts on every panic, even a caught one; let
    // the simulated handler's deliberate panics through.
    postroom_fuzz::quiet_sim_panics();
    postroom_fuzz::model(data);
});
