"""A PNG of one step per rank (matplotlib, Agg): for each rank a phase lane (forward, backward,
...), a compute lane (wgrad GEMMs of the async linear highlighted) and a communication lane
with one colour per kind of collective. Input: the `timeline` entries of overlap reports."""
from __future__ import annotations

from ..files import atomic_path

COLORS = {"forward": "#9ecae1", "backward": "#fdae6b", "weight": "#fd8d3c", "finalize_grads": "#c7e9c0", "optimizer": "#dadaeb",
          "compute": "#636363", "wgrad": "#e6550d", "all_gather": "#3182bd", "reduce_scatter": "#31a354",
          "all_reduce": "#de2d26", "send_recv": "#756bb1", "barrier": "#969696", "broadcast": "#bcbddc",
          "all_to_all": "#fd8d3c", "ring_kv": "#8c6bb1", "ring_dkv": "#54278f"}


def _bars(ax, intervals, y, height, color):
    ax.broken_barh([(a, b - a) for a, b in intervals], (y, height), facecolors=color, linewidth=0)


def plot_timelines(runs: dict[str, list[dict]], path: str) -> None:
    """runs: {title: [timeline of rank 0, rank 1, ...]} -> one panel per title, saved to `path`."""
    import matplotlib  # here, not at the top: matplotlib is optional and slow to import, needed for a plot only
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = sum(len(t) for t in runs.values())
    height = 0.6 + 0.5 * len(runs) + 1.1 * rows  # inches: legend, titles and axes, lanes
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, height), squeeze=False)
    used = set()
    for ax, (title, timelines) in zip(axes[:, 0], runs.items()):
        ticks, labels = [], []
        for r, tl in enumerate(timelines):
            base = (len(timelines) - 1 - r) * 4.0
            for phase, xs in tl["phases"].items():
                _bars(ax, xs, base + 2.6, 0.6, COLORS[phase])
                used.add(phase)
            _bars(ax, tl["compute"], base + 1.3, 1.0, COLORS["compute"])
            _bars(ax, tl["wgrad"], base + 1.3, 1.0, COLORS["wgrad"])
            for kind, xs in tl["comm"].items():
                _bars(ax, xs, base, 1.0, COLORS.get(kind, "black"))
                used.add(kind)
            ticks += [base + 0.5, base + 1.8, base + 2.9]
            labels += [f"rank {r} comm", f"rank {r} compute", f"rank {r} phase"]
        ax.set_yticks(ticks, labels, fontsize=8)
        ax.set_xlim(0, max(tl["step_ms"] for tl in timelines))
        ax.set_title(title, fontsize=10)
    axes[-1, 0].set_xlabel("ms since step start")
    used |= {"compute", "wgrad"}
    fig.legend(handles=[Patch(color=COLORS[k], label=k) for k in COLORS if k in used],
               loc="lower center", ncol=min(8, len(used)), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.6 / height, 1, 1))
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=80, format="png")
    plt.close(fig)
