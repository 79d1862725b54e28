#!/usr/bin/env bash
# Makes a wine prefix that runs Rust programs built for x86_64-pc-windows-gnu,
# and prints the runner to give cargo (CARGO_TARGET_..._RUNNER).
#
# Debian's wine 8.0 has no bcryptprimitives.dll `ProcessPrng`, which Rust's
# std imports, so without it every Rust program fails to start (status
# c0000135). bcryptprimitives.c is a shim of that one function over
# `RtlGenRandom`, built with mingw into the prefix's system32.
# Usage: source .ci/wine/setup.sh   (sets WINEPREFIX, WINEDEBUG, WINE)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export WINEPREFIX="${WINEPREFIX:-${TMPDIR:-/tmp}/postroom-wine}"
export WINEDEBUG="${WINEDEBUG:--all}"
# A headless first boot would otherwise try to install Mono and Gecko.
export WINEDLLOVERRIDES="${WINEDLLOVERRIDES:-mscoree,mshtml=}"
WINE="$(command -v wine64 || true)"
[ -n "$WINE" ] || WINE=/usr/lib/wine/wine64
export WINE
if [ ! -f "$WINEPREFIX/drive_c/windows/system32/bcryptprimitives.dll" ]; then
  "$WINE" wineboot -i >/dev/null 2>&1 || true
  "$(dirname "$WINE")/wineserver" -w 2>/dev/null || true
  [ -d "$WINEPREFIX/drive_c/windows/system32" ] \
    || { echo "wineboot made no prefix at $WINEPREFIX"; exit 1; }
  x86_64-w64-mingw32-gcc -shared -O2 -o "$WINEPREFIX/drive_c/windows/system32/bcryptprimitives.dll" \
    "$here/bcryptprimitives.c" "$here/bcryptprimitives.def" -ladvapi32
fi
export CARGO_TARGET_X86_64_PC_WINDOWS_GNU_RUNNER="$WINE"
