//! The testkit's fuzz recipe (docs/TESTING-YOUR-HANDLERS.md, "Fuzzing your
//! handlers"), as a user's crate would have it: the fuzzer's bytes choose a
//! seed and a fault schedule (`Scenario::run_bytes`) for the example's
//! fixed orders handler (it marks the order paid and publishes the
//! shipping and email requests in one transaction, through a sink that
//! answers `Sent` only on its destination's acknowledgement). The
//! scenario is the example's own file, included with `#[path]` (a fuzz
//! crate cannot import an example or a `tests/` file). A violation panics:
//! a finding.
//!
//! `RUSTC_BOOTSTRAP=1 cargo fuzz run testkit_orders --sanitizer none -- -max_total_time=60`
//! (or `cargo +nightly fuzz run testkit_orders`), from fuzz/.
#![no_main]

// The buggy version is the example's other half, not fuzzed here.
#[allow(dead_code)]
#[path = "../../examples/testkit_orders/scenarios.rs"]
mod scenarios;

libfuzzer_sys::fuzz_target!(|data: &[u8]| scenarios::fixed().run_bytes(data));
