//! The fuzz target's body, shared by the libFuzzer target
//! (`fuzz_targets/model.rs`, nightly, `cargo fuzz run model`) and the
//! stable bounded run (`tests/model.rs`), so both exercise the very same
//! function.

use std::sync::Once;

/// Runs the operation sequence `data` encodes (see `postroom::sim`) against
/// a real database in a fresh temporary directory, checking it against the
/// reference model after every step; panics on any divergence.
pub fn model(data: &[u8]) {
    let dir = tempfile::tempdir().expect("temp dir");
    if let Err(e) = postroom::sim::run_bytes(dir.path(), data) {
        panic!("{e}");
    }
}

/// The simulated handler panics on purpose (the engine catches it); quiet
/// those panics, and pass every other one to the hook installed before
/// (libFuzzer's aborts, so that a real panic is a finding even where the
/// engine would catch it).
pub fn quiet_sim_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let fatal = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !info.to_string().contains("sim panic") {
                fatal(info);
            }
        }));
    });
}
