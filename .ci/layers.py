#!/usr/bin/env python3
"""The crate's module graph, drawn from its own `crate::` paths, checked
against the layers in docs/DESIGN.md: each module may use only modules of
its own layer or below, and no two modules may need each other (no cycle),
nor two files inside one layer's directory (`store/`, `runtime/`).

It also keeps SQL on the engine's tables inside `src/store/`: outside it
(the CLI in `src/bin/` included, in-file test modules not), no string
literal holding SQL (a statement keyword in capitals) may name a
`postroom_*` table from schema.sql, nor take its table from a format
argument (`FROM {table}`: a table chosen at run time). The few files
allowed to read the tables from outside are listed, each with its reason,
in SQL_ALLOWED.

Usage: python3 .ci/layers.py [--graph]   (exit 1 on a violation)
"""
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SRC = os.path.join(ROOT, "src")

# Lowest first. A module not listed is an error: every new file gets a floor.
LAYERS = [
    ("base", ["platform", "message", "error", "escape", "clock", "failpoint", "guard", "config", "telemetry"]),
    ("store", ["store"]),
    ("user code", ["handler", "sink"]),
    ("builder", ["builder"]),
    ("state machines", ["delivery", "recovery", "brakes"]),
    ("runtime", ["runtime"]),
    ("engine", ["engine"]),
    ("on top", ["admin", "sim", "sinks", "hop", "mqtt", "nats", "testkit"]),
]


# Files outside src/store/ that may hold SQL on the engine's tables, and why.
# An allowlist: a new file with such SQL fails until its SQL moves into
# store/ or it is listed here with a reason.
SQL_ALLOWED = {
    # The thread-free model harness and the application testkit check the
    # engine's rows from outside, as a reader would; they are test rigs
    # (issue 35 moves the model out of the library).
    "src/sim/machine.rs": "model harness: reads rows to check them against its model",
    "src/sim/ops.rs": "model harness: compares the rows with its model after each step",
    "src/testkit/run.rs": "testkit verdicts: read rows from outside, as a reader would",
    "src/testkit/process.rs": "testkit child process: reads what was sent",
}
SQL_KEYWORD = re.compile(  # case-sensitive: the crate writes SQL in capitals
    r"\b(SELECT|INSERT|UPDATE|DELETE|FROM|JOIN|INTO|TABLE|INDEX|TRIGGER|PRAGMA)\b"
)

RUNTIME_TABLE = re.compile(r"\b(FROM|JOIN|INTO|UPDATE|TABLE)\s+\{")


def string_literals(text):
    """Yields (line, content) for each string literal in Rust source, with
    comments skipped and char literals (`'"'`) not taken for strings."""
    i, n, line = 0, len(text), 1
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i)
            j = n if j < 0 else j + 2
            line += text.count("\n", i, j)
            i = j
        elif (
            c == "r"
            and re.match(r'r#*"', text[i:])
            and not re.match(r"[A-Za-z0-9_]", text[i - 1] if i else " ")
        ):
            m = re.match(r'r(#*)"', text[i:])
            close = '"' + m.group(1)
            start = i + len(m.group(0))
            j = text.find(close, start)
            j = n if j < 0 else j
            yield line, text[start:j]
            line += text.count("\n", i, j)
            i = j + len(close)
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            yield line, text[i + 1 : j]
            line += text.count("\n", i, j)
            i = j + 1
        elif c == "'":
            m = re.match(r"'(\\.[^']*|[^\\'])'", text[i:])
            i += len(m.group(0)) if m else 1
        else:
            i += 1


def engine_tables():
    schema = open(os.path.join(ROOT, "schema.sql"), encoding="utf-8").read()
    return set(re.findall(r"TABLE\s+(?:IF NOT EXISTS\s+)?(postroom_[a-z_]+)", schema))


def sql_outside_store():
    """Each string literal outside src/store/ that names an engine table."""
    tables = engine_tables()
    found = []
    for dirpath, _, files in os.walk(SRC):
        for f in sorted(files):
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
            if not f.endswith(".rs") or rel.startswith("src/store/") or rel in SQL_ALLOWED:
                continue
            text = open(path, encoding="utf-8").read()
            text = re.split(r"#\[cfg\(test\)\]\s*mod tests", text)[0]
            for line, lit in string_literals(text):
                if not SQL_KEYWORD.search(lit):
                    continue
                named = set(re.findall(r"\bpostroom_[a-z_]+\b", lit)) & tables
                if RUNTIME_TABLE.search(lit):
                    named.add("a table named at run time")
                if named:
                    found.append(
                        f"{rel}:{line}: SQL on {', '.join(sorted(named))} outside src/store/ "
                        "(move it into a store/ function, or list the file in SQL_ALLOWED with why)"
                    )
    return found


def module_of(path, depth=1):
    rel = os.path.relpath(path, SRC)
    parts = rel[:-3].split(os.sep)
    if parts[-1] in ("mod", "lib"):
        parts = parts[:-1]
    return "::".join(parts[:depth]) if parts else "lib"


def graph(depth=1):
    edges = {}
    for dirpath, _, files in os.walk(SRC):
        if os.path.relpath(dirpath, SRC).startswith("bin"):
            continue
        for f in files:
            if not f.endswith(".rs"):
                continue
            path = os.path.join(dirpath, f)
            mod = module_of(path, depth)
            if mod == "lib":
                continue
            text = open(path, encoding="utf-8").read()
            # Tests inside a module may reach anywhere.
            text = re.split(r"#\[cfg\(test\)\]\s*mod tests", text)[0]
            text = re.sub(r"//[^\n]*", "", text)
            path_re = r"crate::([a-z_][a-z0-9_]*(?:::[a-z_][a-z0-9_]*)*)"
            uses = {"::".join(u.split("::")[:depth]) for u in re.findall(path_re, text)}
            for block in re.findall(r"crate::\{([^}]*)\}", text):
                uses |= set(re.findall(r"(?:^|,)\s*([a-z_][a-z0-9_]*)", block))
            # `crate::store::inbox::Status` at depth 2 is `store::inbox`;
            # `crate::store::wal_path` is `store` itself.
            uses = {u if u in known(depth) else u.split("::")[0] for u in uses}
            edges.setdefault(mod, set()).update(u for u in uses if u != mod)
    return edges


def known(depth):
    mods = set()
    for dirpath, _, files in os.walk(SRC):
        for f in files:
            if f.endswith(".rs"):
                mods.add(module_of(os.path.join(dirpath, f), depth))
    return mods


def sccs(edges):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


# The one file allowed `unsafe` (lib.rs denies it everywhere else), and why.
UNSAFE_ALLOWED = {
    "src/guard.rs": "guard::raw: sqlite3_db_status and the finalizing of leaked user "
    "statements, which rusqlite does not wrap; the module doc says why each call is sound",
}


def unsafe_outside_allowlist():
    """Every `allow(unsafe_code)` outside UNSAFE_ALLOWED is a problem."""
    problems = []
    for dirpath, _, files in os.walk(SRC):
        for name in files:
            if not name.endswith(".rs"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
            with open(path, encoding="utf-8") as f:
                text = f.read()
            if "allow(unsafe_code)" in text and rel not in UNSAFE_ALLOWED:
                problems.append(f"{rel}: allows unsafe_code (only {', '.join(UNSAFE_ALLOWED)} may)")
    return problems


def main():
    edges = graph()
    layer_of = {m: i for i, (_, mods) in enumerate(LAYERS) for m in mods}
    problems = []
    for mod in sorted(edges):
        if mod not in layer_of:
            problems.append(f"{mod}: not in any layer (add it to .ci/layers.py and docs/DESIGN.md)")
    for mod, uses in sorted(edges.items()):
        for used in sorted(uses):
            if used not in edges:
                continue  # a re-export or an external path
            if mod in layer_of and used in layer_of and layer_of[used] > layer_of[mod]:
                problems.append(
                    f"{mod} ({LAYERS[layer_of[mod]][0]}) uses {used} "
                    f"({LAYERS[layer_of[used]][0]}), a layer above it"
                )
    for comp in sccs(edges):
        if len(comp) > 1:
            problems.append(f"import cycle of {len(comp)} modules: {', '.join(comp)}")
    # Inside a layer's directory too, no two files may need each other.
    for comp in sccs(graph(depth=2)):
        if len(comp) > 1:
            problems.append(f"files that use each other: {', '.join(comp)}")
    problems += sql_outside_store()
    problems += unsafe_outside_allowlist()
    if "--graph" in sys.argv:
        for mod, uses in sorted(edges.items()):
            print(f"{mod} -> {', '.join(sorted(u for u in uses if u in edges))}")
    for p in problems:
        print(p)
    print(f"{len(edges)} modules, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
