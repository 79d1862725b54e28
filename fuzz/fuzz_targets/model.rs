//! Model-based fuzz target: the fuzzer's bytes choose a sequence of
//! deliver / receive / work / crash / clock / reap / relay / cleanup
//! operations (see `postroom::sim`), which run against a real database and
//! are checked against the reference model after every step.
#![no_main]

use std::sync::Once;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // libFuzzer's panic hook aborts on every panic, even a caught one; the
    // simulated handler panics on purpose (the engine catches it), so let
    // exactly those through and keep every other panic fatal.
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let fatal = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !info.to_string().contains("sim panic") {
                fatal(info);
            }
        }));
    });
    let dir = tempfile::tempdir().expect("temp dir");
    if let Err(e) = postroom::sim::run_bytes(dir.path(), data) {
        panic!("{e}");
    }
});
