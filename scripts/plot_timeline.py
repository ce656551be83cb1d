"""Renders a jaxps trace as a PNG summary of the chunk stage timings.

    python scripts/plot_timeline.py /tmp/trace/jaxps-rank0.trace.json out.png

Top: every span of the trace on its row (device callbacks, push_pulls, and
each server's queue / push / pull stages) over time. Bottom: total seconds
per stage and the share of communication hidden behind compute. Needs
matplotlib (``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import sys

from jaxps._src import timeline

COLORS = {
    "start": "tab:green",
    "done": "tab:red",
    "in_flight": "tab:gray",
    "queue": "tab:orange",
    "push": "tab:blue",
    "pull": "tab:purple",
}


def plot(events: list[dict], path: str) -> dict:
    """Draws the figure into `path`; returns the trace summary."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spans = [e for e in events if e.get("ph") == "X"]
    if not spans:
        raise ValueError("the trace has no spans")
    rows = sorted({e["tid"] for e in spans}, key=lambda r: (r != "device", r))
    t0 = min(e["ts"] for e in spans)
    fig, (top, bottom) = plt.subplots(
        2,
        1,
        figsize=(11, 2 + 0.5 * len(rows)),
        gridspec_kw={"height_ratios": [max(2, len(rows)), 2]},
    )
    for e in spans:
        y = rows.index(e["tid"])
        top.barh(
            y,
            e["dur"] / 1e3,
            left=(e["ts"] - t0) / 1e3,
            height=0.6,
            color=COLORS.get(e["name"], "black"),
            linewidth=0,
        )
    top.set_yticks(range(len(rows)), rows)
    top.invert_yaxis()
    top.set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    top.legend(handles, COLORS, ncol=6, loc="upper right", fontsize=8)
    summary = timeline.summarize(events)
    stages = ["start", "queue", "push", "pull"]
    bottom.bar(
        stages + ["waited", "in flight"],
        [summary[f"{s}_s"] for s in stages]
        + [summary["exposed_s"], summary["comm_s"]],
        color=[COLORS[s] for s in stages] + ["tab:red", "tab:gray"],
    )
    bottom.set_ylabel("seconds (total)")
    bottom.set_title(
        f"communication hidden behind compute: {summary['overlap']:.0%}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", help="a jaxps-rank<r>.trace.json file")
    p.add_argument("png", help="output image")
    args = p.parse_args(argv)
    summary = plot(timeline.load(args.trace), args.png)
    print(
        f"wrote {args.png}: {summary['comm_s']:.3f} s in flight, "
        f"{summary['exposed_s']:.3f} s waited, overlap "
        f"{summary['overlap']:.0%}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
