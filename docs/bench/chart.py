#!/usr/bin/env python3
"""Draws docs/BENCHMARKS.md's chart from `bench --json` output, as SVG.

    python3 docs/bench/chart.py ROWS.json OUT.svg "TITLE"

Standard library only. For each engine row that the harness compares with a
floor (its `vs`, the same loop hand-written on postroom's schema, and its
`seeds_vs`, the articles' three statements on their own minimal schema),
three bars of messages per second side by side, on a log scale: one panel
for an empty database, one per prefilled size found (`@1M`, `@5M`). Paced
rows (relay latency) measure latency, not throughput, and are left out.
"""
import json
import math
import sys
from xml.sax.saxutils import escape

ENGINE, FLOOR, SEEDS = "#2b6cb0", "#a0aec0", "#dd6b20"
ROW_H, BAR_H, LABEL_W, PLOT_W, PAD = 40, 10, 250, 560, 20


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    rows = json.load(open(sys.argv[1]))
    by_name = {r["scenario"]: r for r in rows}
    panels = {}
    for r in rows:
        if r["kind"] != "engine" or r["paced"] or not (r["vs"] or r["seeds_vs"]):
            continue
        bars = [("postroom", r["msgs_per_s"], ENGINE)]
        for field, colour in (("vs", FLOOR), ("seeds_vs", SEEDS)):
            # Only floors: a row may be compared with another engine row.
            floor = by_name.get(r[field]) if r[field] else None
            if floor and floor["kind"] != "floor":
                floor = None
            bars.append((r[field], floor["msgs_per_s"] if floor else None, colour))
        if all(value is None for _, value, _ in bars[1:]):
            continue
        panels.setdefault(r["prefilled_rows"], []).append((r["scenario"], bars))

    values = [v for p in panels.values() for _, bars in p for _, v, _ in bars if v]
    lo = 10 ** math.floor(math.log10(min(values)))
    hi = 10 ** math.ceil(math.log10(max(values)))

    def x(v):
        return LABEL_W + PLOT_W * (math.log10(v) - math.log10(lo)) / (
            math.log10(hi) - math.log10(lo))

    out, y = [], 70
    for prefilled in sorted(panels):
        title = "empty database" if prefilled == 0 else f"{prefilled:,} rows already stored"
        out.append(f'<text x="{PAD}" y="{y}" font-weight="bold">{escape(title)}</text>')
        y += 10
        top = y
        grid_at = len(out)
        for scenario, bars in panels[prefilled]:
            out.append(f'<text x="{LABEL_W - 8}" y="{y + 19}" text-anchor="end">'
                       f'{escape(scenario)}</text>')
            for i, (name, value, colour) in enumerate(bars):
                if value is None:
                    continue
                by = y + 4 + i * (BAR_H + 1)
                out.append(f'<rect x="{LABEL_W}" y="{by}" width="{x(value) - LABEL_W:.1f}" '
                           f'height="{BAR_H}" fill="{colour}"><title>{escape(name)}: '
                           f'{value:,.0f} msgs/s</title></rect>')
                out.append(f'<text x="{x(value) + 4:.1f}" y="{by + 9}" font-size="10">'
                           f'{value:,.0f}</text>')
            y += ROW_H
        grid, decade = [], lo
        while decade <= hi:
            gx = x(decade)
            grid.append(f'<line x1="{gx:.1f}" y1="{top}" x2="{gx:.1f}" y2="{y}" '
                        f'stroke="#e2e8f0"/>')
            grid.append(f'<text x="{gx:.1f}" y="{y + 12}" font-size="10" '
                        f'text-anchor="middle">{decade:,}</text>')
            decade *= 10
        out[grid_at:grid_at] = grid  # under the bars
        y += 40

    legend = [("postroom", ENGINE, 0),
              ("engine floor: the same work hand-written on postroom's schema", FLOOR, 90),
              ("seeds floor: the three statements on a minimal schema", SEEDS, 470)]
    head = [f'<text x="{PAD}" y="24" font-size="15" font-weight="bold">'
            f'{escape(sys.argv[3])}</text>']
    for name, colour, dx in legend:
        head.append(f'<rect x="{PAD + dx}" y="36" width="10" height="10" fill="{colour}"/>')
        head.append(f'<text x="{PAD + dx + 14}" y="45" font-size="11">{escape(name)}</text>')
    width = LABEL_W + PLOT_W + 90
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y}" '
           f'font-family="sans-serif" font-size="12">\n'
           f'<rect width="100%" height="100%" fill="white"/>\n'
           + "\n".join(head + out)
           + f'\n<text x="{PAD}" y="{y - 12}" font-size="10">messages per second, log scale; '
             f'higher is better</text>\n</svg>\n')
    open(sys.argv[2], "w").write(svg)


if __name__ == "__main__":
    main()
