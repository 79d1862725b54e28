#!/usr/bin/env bash
# Windows and macOS, from this Linux machine:
# * x86_64-pc-windows-gnu (mingw): the library, the CLI and the examples
#   built and linted; the suite's platform-relevant part run under wine
#   (unit, inline, queued, relay, retention, watermarks, lock, identity,
#   platform, CLI, and the crash tests, which kill real child processes
#   with TerminateProcess: POSTROOM_CRASH_KILLS of them in the main loop);
#   the README program and an app that depends on postroom by path, run.
# * x86_64-pc-windows-msvc: `cargo check` of the library and the CLI. Not
#   checked: C code (SQLite, blake3's SIMD) compiled with MSVC, and linking,
#   which need the MSVC toolchain; SQLite comes from a system library there
#   (--no-default-features) and blake3 in pure Rust.
# * aarch64-apple-darwin, x86_64-apple-darwin: `cargo check` of the library
#   and the CLI, C code likewise not compiled (no Apple SDK here).
# Installs what it needs (Debian: wine64, gcc-mingw-w64-x86-64-posix).
set -euo pipefail
cd "$(dirname "$0")/.."
step() { printf '\n== %s (%ss)\n' "$*" "$SECONDS"; }

step "windows and apple: toolchains"
rustup target add x86_64-pc-windows-gnu x86_64-pc-windows-msvc \
  aarch64-apple-darwin x86_64-apple-darwin
if { ! command -v x86_64-w64-mingw32-gcc >/dev/null 2>&1 \
     || ! { command -v wine64 >/dev/null 2>&1 || [ -x /usr/lib/wine/wine64 ]; }; } \
  && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || echo "(apt-get update failed; trying the install anyway)"
  apt-get install -y -qq --no-install-recommends wine64 gcc-mingw-w64-x86-64-posix </dev/null
fi
command -v x86_64-w64-mingw32-gcc >/dev/null 2>&1 \
  || { echo "mingw is required (apt-get install gcc-mingw-w64-x86-64-posix)"; exit 1; }

win=(--locked --target x86_64-pc-windows-gnu)
# The test files that run on Windows; the others use unix-only facts
# (signals, modes, /proc, the sqlite3 shell, brokers started as processes).
tests=(--test inline --test queued --test relay --test retention --test watermarks
  --test lock --test identity --test platform --test cli --test crash)
step "windows (gnu): clippy of the library, the CLI, the examples and those tests"
cargo clippy "${win[@]}" --all-features --lib -- -D warnings
cargo clippy "${win[@]}" --features cli,testkit --lib --bins --examples "${tests[@]}" \
  -- -D warnings

step "windows (gnu): the CLI and the examples"
cargo build "${win[@]}" --features cli --bins --examples

step "windows (gnu): the suite under wine"
# shellcheck source=wine/setup.sh
source .ci/wine/setup.sh
export POSTROOM_UNDER_WINE=1
POSTROOM_CRASH_KILLS="${POSTROOM_WINE_KILLS:-500}" \
  cargo test "${win[@]}" --features cli --lib "${tests[@]}"

step "windows (gnu): the README program, and an app that depends on postroom by path"
# Wine reuses small process ids, and both programs name their directory
# after theirs: a run that failed before would leave one behind.
rm -rf "$WINEPREFIX"/drive_c/users/*/Temp/postroom-*
cargo run "${win[@]}" --example readme
CARGO_TARGET_DIR=target/compat cargo run --locked --target x86_64-pc-windows-gnu \
  --manifest-path tests/compat/Cargo.toml

# blake3's build compiles C for SIMD unless told it is pure Rust;
# CARGO_FEATURE_PURE is what its `pure` feature sets for its build script.
step "windows (msvc), macOS (arm64, x86_64): cargo check"
for target in x86_64-pc-windows-msvc aarch64-apple-darwin x86_64-apple-darwin; do
  CARGO_FEATURE_PURE=1 cargo check --locked --target "$target" --no-default-features \
    --features cli,testkit,mqtt --lib --bins
done
