"""Results to files: ``results.json`` (everything), ``results.md`` (the table), ``results.png``."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Optional

from benchmarks.harness import Comparison, Results

_HEADER = (
    "| case | at | ddpstate | baseline | ddpstate s | baseline s | ratio | target "
    "| pass | peak RSS MiB |\n|---|---|---|---|---|---|---|---|---|---|"
)


def _at(axis: str, x: float) -> str:
    return f"{x:g} MiB" if axis == "size_mib" else f"{int(x):,} tensors"


def _num(value: Optional[float], fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def _verdict(c: Comparison) -> str:
    if c.passed is None:
        return ""
    return "yes" if c.passed else "**NO**"


def _target(c: Comparison) -> str:
    parts = []
    if c.target is not None:
        parts.append(f"≤ {c.target:g}x")
    if c.rss_target_mib is not None:
        parts.append(f"RSS ≤ {c.rss_target_mib:.0f} MiB")
    return ", ".join(parts)


def markdown(results: Results) -> str:
    """The results table: one row per (case, size or tensor count, baseline)."""
    lines = [_HEADER]
    for c in results.comparisons:
        lines.append(
            f"| {c.case} | {_at(c.axis, c.x)} | {c.ours} | {c.baseline} | {c.ours_s:.3f} "
            f"| {c.baseline_s:.3f} | {c.ratio:.2f} | {_target(c)} | {_verdict(c)} "
            f"| {_num(c.peak_rss_mib, '.0f')} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: Results, path: Path) -> None:
    """Time against checkpoint size and against tensor count, log-log, one subplot per case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # (case, axis) -> impl -> {x: seconds}; an implementation's points come from
    # every comparison it appears in, so each baseline is drawn once per case.
    series: dict[tuple[str, str], dict[str, dict[float, float]]] = defaultdict(
        lambda: defaultdict(dict)
    )
    for c in results.comparisons:
        series[(c.case, c.axis)][c.ours][c.x] = c.ours_s
        series[(c.case, c.axis)][c.baseline][c.x] = c.baseline_s
    panels = [key for key in series if len({x for s in series[key].values() for x in s}) > 1]
    if not panels:
        panels = list(series)
    cols = 4
    rows = max(1, (len(panels) + cols - 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for ax, key in zip(axes.flat, panels, strict=False):
        case, axis = key
        for impl, points in series[key].items():
            xs = sorted(points)
            style = "-o" if impl.startswith(("ddpstate", "async", "sync")) else "--s"
            ax.plot(xs, [points[x] for x in xs], style, label=impl, markersize=4)
        ax.set_xscale("log")
        ax.set_yscale("log")
        by = "by size" if axis == "size_mib" else "by tensor count"
        ax.set_title(f"{case} ({by})", fontsize=9)
        ax.set_xlabel("checkpoint MiB" if axis == "size_mib" else "tensors (fixed total size)")
        ax.set_ylabel("seconds (median)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write(results: Results, out: Path, with_plot: bool = True) -> dict[str, Path]:
    """Write the three files into ``out``; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "results.md"}
    paths["json"].write_text(json.dumps(results.to_json(), indent=2))
    meta = results.meta
    header = [f"# ddpstate benchmarks\n\n`{meta.get('command', '')}`\n"]
    header += [f"- {k}: {v}" for k, v in meta.items() if k != "command"]
    header += [f"- note: {n}" for n in results.notes]
    paths["md"].write_text("\n".join(header) + "\n\n" + markdown(results))
    if with_plot:
        paths["png"] = out / "results.png"
        plot(results, paths["png"])
    return paths
