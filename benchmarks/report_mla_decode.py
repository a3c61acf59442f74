"""Render benchmarks/mla_decode.py's JSON as a markdown table of ratios and a PNG plot; several
files (runs of different head counts, say) go into one table and one figure, each panel from the
file that holds its shapes.

    python benchmarks/report_mla_decode.py results/mla_decode-2026-11-30.json \
        --md results/mla_decode-2026-11-30-table.md --png results/mla_decode-2026-11-30.png
"""

import argparse
import json
from collections import defaultdict

PROVIDERS = ("latentspeed", "latentspeed-triton", "FLASHMLA", "FLASH_ATTN_MLA", "FLASHINFER_MLA", "TRITON_MLA")
COLORS = dict(zip(PROVIDERS, ("tab:blue", "tab:cyan", "tab:orange", "tab:green", "tab:purple", "tab:red")))
SPEED_UPS = ("FLASHMLA", "FLASHINFER_MLA", "TRITON_MLA")


def table(rows) -> str:
    shapes = defaultdict(dict)
    for r in rows:
        shapes[(r["cache"], r["heads"], r["q_len"], r["ctx"])][r["provider"]] = r
    lines = [
        "| cache | H | S_q | ctx | " + " | ".join(f"{p} µs" for p in PROVIDERS)
        + " | ours TB/s | ours % of copy | ours TFLOP/s | " + " | ".join(f"ours / {p}" for p in SPEED_UPS) + " |",
        "|" + "---|" * (4 + len(PROVIDERS) + 3 + len(SPEED_UPS)),
    ]
    for (cache, heads, q_len, ctx), by in shapes.items():
        ours = by["latentspeed"]
        times = " | ".join(f"{by[p]['us']:.0f}" if p in by else "—" for p in PROVIDERS)

        def speed(p):
            return f"{by[p]['us'] / ours['us']:.2f}×" if p in by else "—"

        copy = ours.get("copy_tb_s")
        of_copy = f"{100 * ours['tb_s'] / copy:.0f} %" if copy else "—"
        lines.append(
            f"| {cache} | {heads} | {q_len} | {ctx} | {times} | {ours['tb_s']:.2f} | {of_copy} "
            f"| {ours['tflop_s']:.0f} | " + " | ".join(speed(p) for p in SPEED_UPS) + " |"
        )
    return "\n".join(lines) + "\n\nRatios are speed-ups (their time / ours): above 1× ours is faster.\n"


def plot(rows, path: str, cards: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["cache"], r["heads"], r["q_len"]) for r in rows})
    cols = min(4, len(panels))
    rows_of_panels = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows_of_panels, cols, figsize=(4.5 * cols, 3.7 * rows_of_panels),
                             squeeze=False)
    for ax, (cache, heads, q_len) in zip(axes.flat, panels):
        for provider in PROVIDERS:
            pts = sorted((r["ctx"], r["us"]) for r in rows if (r["cache"], r["heads"], r["q_len"], r["provider"]) == (cache, heads, q_len, provider))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=provider, color=COLORS[provider])
        ax.set_title(f"{cache} cache, H={heads}, S_q={q_len}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(f"µs (batch {rows[0]['batch']})")
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    axes.flat[0].legend()
    fig.suptitle(f"MLA decode kernel time on one {cards} (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("json", nargs="+")
    parser.add_argument("--md", required=True)
    parser.add_argument("--png", required=True)
    args = parser.parse_args()
    runs = [json.load(open(path)) for path in args.json]
    rows = [dict(row, copy_tb_s=run.get("copy_tb_s")) for run in runs for row in run["rows"]]
    cards = " / ".join(sorted({run.get("card", "unnamed card") for run in runs}))
    copies = ", ".join(f"{run['copy_tb_s']:.2f}" for run in runs if run.get("copy_tb_s"))
    copy_line = f" Device-to-device copy (read + write) measured in the run: {copies} TB/s." if copies else ""
    with open(args.md, "w") as f:
        f.write(f"Card: {cards}.{copy_line}\n\n" + table(rows))
    plot(rows, args.png, cards)


if __name__ == "__main__":
    main()
