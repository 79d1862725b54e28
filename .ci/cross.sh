#!/usr/bin/env bash
# The targets postroom is for, beyond the CI machine's own (issue 37):
# builds the library and the CLI for aarch64 and armv7 Linux (glibc) and
# x86_64 musl (every feature and the examples for armv7), then runs a stated part of the suite on armv7
# under qemu-user (docs/TESTING.md, "On ARM and musl": what runs, what does
# not and why, and its time budget).
#
# Linkers and C compilers (SQLite is C) come from environment variables set
# here, not from a committed .cargo/config.toml, which would apply to every
# user's build of this repository. Run from .ci/run; by hand:
#   bash .ci/cross.sh            # everything
#   bash .ci/cross.sh build      # the three builds only
#   bash .ci/cross.sh test [cargo test args after --]  # the armv7 suite only
# Missing tools are installed when this runs as root with apt-get (CI); a
# step that cannot be had fails the run, naming it.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never

TARGETS=(aarch64-unknown-linux-gnu armv7-unknown-linux-gnueabihf x86_64-unknown-linux-musl)
ARMV7=armv7-unknown-linux-gnueabihf
what="${1:-all}"
[ $# -gt 0 ] && shift

step() { printf '\n== cross: %s (%ss)\n' "$*" "$SECONDS"; }
die() {
  printf '\ncross: FAILED: %s\n' "$*" >&2
  exit 1
}

# --- tools -----------------------------------------------------------------

# command -> the Debian package that provides it
declare -A PACKAGE=(
  [aarch64-linux-gnu-gcc]=gcc-aarch64-linux-gnu
  [arm-linux-gnueabihf-gcc]=gcc-arm-linux-gnueabihf
  [musl-gcc]=musl-tools
  [qemu-arm-static]=qemu-user-static
)
missing_tools() {
  local c
  for c in "${!PACKAGE[@]}"; do
    if [ "$c" = qemu-arm-static ]; then
      # Debian's qemu-user names it qemu-arm; either will do.
      command -v qemu-arm-static >/dev/null 2>&1 || command -v qemu-arm >/dev/null 2>&1 \
        || echo "$c"
    else
      command -v "$c" >/dev/null 2>&1 || echo "$c"
    fi
  done
}

step "tools: cross compilers, musl-gcc, qemu-user"
missing="$(missing_tools)"
if [ -n "$missing" ]; then
  packages=()
  for c in $missing; do packages+=("${PACKAGE[$c]}"); done
  echo "missing: $missing"
  if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
    die "install ${packages[*]} (apt-get, as root): this machine has no ${missing//$'\n'/, }"
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || echo "(apt-get update failed; trying the install anyway)"
  # The libc6-dev-*-cross packages come with the compilers; named so that a
  # partial install cannot leave a compiler without its C library.
  apt-get install -y -qq --no-install-recommends "${packages[@]}" \
    libc6-dev-arm64-cross libc6-dev-armhf-cross </dev/null \
    || die "apt-get install ${packages[*]}"
  missing="$(missing_tools)"
  [ -z "$missing" ] || die "still missing after apt-get install: ${missing//$'\n'/, }"
fi
QEMU_ARM="$(command -v qemu-arm-static || command -v qemu-arm)"
for c in aarch64-linux-gnu-gcc arm-linux-gnueabihf-gcc musl-gcc; do
  echo "$c: $(command -v "$c")"
done
echo "qemu: $QEMU_ARM ($("$QEMU_ARM" --version | head -1))"

step "tools: rustup targets"
installed="$(rustup target list --installed 2>/dev/null)" \
  || die "rustup is needed to add the targets ${TARGETS[*]}"
for t in "${TARGETS[@]}"; do
  if ! grep -qx "$t" <<<"$installed"; then
    rustup target add "$t" || die "rustup target add $t"
  fi
done

# --- environment -----------------------------------------------------------

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
export CARGO_TARGET_ARMV7_UNKNOWN_LINUX_GNUEABIHF_LINKER=arm-linux-gnueabihf-gcc
export CC_armv7_unknown_linux_gnueabihf=arm-linux-gnueabihf-gcc
# Rust links musl programs with its own self-contained musl; SQLite's C is
# compiled against musl's headers by musl-gcc.
export CC_x86_64_unknown_linux_musl=musl-gcc
# The armv7 programs are dynamically linked against Debian's armhf glibc:
# qemu finds its loader and libraries under this prefix.
export QEMU_LD_PREFIX=/usr/arm-linux-gnueabihf
export CARGO_TARGET_ARMV7_UNKNOWN_LINUX_GNUEABIHF_RUNNER="$QEMU_ARM"
# Children the tests spawn (crash children, the CLI) go through it too:
# tests/common/mod.rs, target_command.
export POSTROOM_TEST_RUNNER="$QEMU_ARM"
# The emulated build: opt-level 1 with debug assertions and overflow
# checks kept (what would catch a 32-bit overflow); see docs/TESTING.md for
# the measured difference. Its own target directory, so the host's debug
# build (same profile name) is not rebuilt.
CROSS_DIR=target/cross

build() {
  local t
  local t what
  for t in "${TARGETS[@]}"; do
    # Every feature and the examples only where the suite runs (armv7):
    # the examples build the dev-dependencies (tokio, rumqttd), which its
    # tests build anyway, and the bridges (tokio, async-nats with ring,
    # rumqttc) are Rust and ring's own portable code. Elsewhere the library
    # with the CLI and the testkit: SQLite's C and the engine built for the
    # target, without minutes of bridge dependencies the armv7 build shows.
    # Not the bridge demos (crates/postroom-demos) either: they run on the
    # CI machine.
    if [ "$t" = "$ARMV7" ]; then
      what=(--all-features --lib --bins --examples)
    else
      what=(--features cli,testkit --lib --bins)
    fi
    step "build $t: ${what[*]}"
    CARGO_TARGET_DIR="$CROSS_DIR" CARGO_PROFILE_DEV_OPT_LEVEL=1 \
      cargo build --locked --target "$t" "${what[@]}" \
      || die "cargo build --target $t"
  done
}

test_armv7() {
  # Past 2038: the time-dependent tests' manual clocks start in 2040.
  export POSTROOM_TEST_START_MS=2208988800000
  # The random tests, smaller under emulation (10-20x slower than native).
  export POSTROOM_MODEL_SEQUENCES="${POSTROOM_MODEL_SEQUENCES:-300}"
  step "armv7 under qemu: unit tests, inline, queued, relay, retention, watermarks, model, targets"
  # The 100,000-sequence watermark test settles 94,000 rows: minutes under
  # emulation, and nothing in it depends on the target.
  local args=("$@")
  [ ${#args[@]} -eq 0 ] && args=(-- --skip one_stuck_change_among_100000)
  CARGO_TARGET_DIR="$CROSS_DIR" CARGO_PROFILE_DEV_OPT_LEVEL=1 \
    cargo test --locked --target "$ARMV7" --all-features \
    --lib --test inline --test queued --test relay --test retention --test watermarks \
    --test model --test targets "${args[@]}" \
    || die "the armv7 suite under qemu (cargo test --target $ARMV7)"
  # The crash tests whose kills are not timed: a handler that aborts, a
  # kill between a handler's write and its commit, a queued poison crash
  # loop. Their children are this test binary run again, through qemu.
  # The random-kill tests are not run: they kill within milliseconds of
  # the spawn, before an emulated child has opened the database.
  step "armv7 under qemu: the crash tests with children killed at a chosen point"
  CARGO_TARGET_DIR="$CROSS_DIR" CARGO_PROFILE_DEV_OPT_LEVEL=1 \
    cargo test --locked --target "$ARMV7" --all-features --test crash -- \
    a_handler_that_aborts_the_process sigkill_between_the_handlers_write_and_commit \
    a_queued_poison_crash_loop \
    || die "the crash tests under qemu (cargo test --target $ARMV7 --test crash)"
  # A payload at the 256 MiB cap where usize is 32 bits: alone (1.8 GB).
  step "armv7 under qemu: a payload at the size cap (tests/targets.rs, ignored elsewhere)"
  CARGO_TARGET_DIR="$CROSS_DIR" CARGO_PROFILE_DEV_OPT_LEVEL=1 \
    cargo test --locked --target "$ARMV7" --all-features --test targets -- --ignored \
    || die "the size-cap test under qemu (cargo test --target $ARMV7 --test targets -- --ignored)"
}

case "$what" in
  all) build; test_armv7 "$@" ;;
  build) build ;;
  test) test_armv7 "$@" ;;
  *) die "usage: .ci/cross.sh [all|build|test] [cargo test args]" ;;
esac
step "done"
