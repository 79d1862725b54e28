"""Checks that Cargo.toml's rust-version is true.

Reads `cargo metadata --locked --format-version 1` on stdin. Fails (exit 1,
naming each offender) when this toolchain is older than the declared
rust-version, or when any locked dependency declares a higher one: cargo
would then refuse to build for a user on exactly our rust-version.
"""
import json
import subprocess
import sys


def version(text):
    parts = (text.split("-")[0].split(".") + ["0", "0"])[:3]
    return tuple(int(p) for p in parts)


meta = json.load(sys.stdin)
ours = next(p for p in meta["packages"] if p["name"] == "postroom")
declared = ours.get("rust_version")
if not declared:
    sys.exit("Cargo.toml declares no rust-version")
rustc = subprocess.run(["rustc", "--version"], capture_output=True, text=True, check=True)
toolchain = rustc.stdout.split()[1]
print("postroom rust-version %s, rustc %s" % (declared, toolchain))

problems = []
if version(toolchain) < version(declared):
    problems.append("this toolchain (%s) is older than rust-version %s" % (toolchain, declared))
for p in meta["packages"]:
    needs = p.get("rust_version")
    if needs and version(needs) > version(declared):
        problems.append("%s %s needs rust %s" % (p["name"], p["version"], needs))
if problems:
    sys.exit("rust-version %s is not true:\n  %s" % (declared, "\n  ".join(problems)))
print("every locked dependency builds on rust %s" % declared)
