//! Model-based fuzz target: the fuzzer's bytes choose a sequence of
//! deliver / receive / work / crash / clock / reap / relay / cleanup
//! operations (see `postroom::sim`), which run against a real database and
//! are checked against the reference model after every step.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().expect("temp dir");
    if let Err(e) = postroom::sim::run_bytes(dir.path(), data) {
        panic!("{e}");
    }
});
