"""PNG figures for evaluation summaries and (E, K) sweeps.

Every writer saves atomically (selfspec.utils.io), so a reader (or a crashed run) never sees a half-written
image. Missing values (None) are skipped in bar charts and shown as
grey, "-" cells in heatmaps.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import matplotlib

# Headless by construction: evaluation runs on cluster nodes without a display. This must happen before pyplot
# is imported anywhere in the process, hence here rather than inside the functions.
matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import TwoSlopeNorm  # noqa: E402

from selfspec.errors import check  # noqa: E402
from selfspec.evaluation.report import aggregate_sweep, sweep_grid  # noqa: E402
from selfspec.utils.io import atomic_write, atomic_write_text  # noqa: E402

__all__ = ["plot_acceptance_by_position", "plot_speedup_by_category", "plot_heatmap", "write_sweep_report"]


def _save_figure(fig: Any, path: str | os.PathLike) -> Path:
    def write(f) -> None:
        # Written to a temp file object, so the format is given explicitly rather than inferred from a suffix.
        fig.savefig(f, format="png", dpi=120, bbox_inches="tight")

    try:
        return atomic_write(path, write)
    finally:
        plt.close(fig)  # figures are otherwise kept alive by pyplot and leak across many sweep jobs


def _missing(x: Any) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def _check_summary(summary: Any) -> None:
    check(isinstance(summary, dict) and isinstance(summary.get("methods"), dict),
          "summary must be the dict returned by summarize_methods (with a 'methods' dict)")


def _empty_note(ax: Any, text: str) -> None:
    # An empty axis with an explanation is more useful in a report than a missing file or an exception.
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_xticks([])
    ax.set_yticks([])


def conditional_rates(shares: list) -> list:
    """Share of drafts at position i that were accepted (accepted_i / drafted_i: the draft and every one before it
    right) -> the rate at i given the drafts before it were right (share_i / share_{i-1}); None where undefined."""
    out, prev = [], 1.0
    for r in shares:
        out.append(None if _missing(r) or _missing(prev) or prev <= 0 else min(1.0, r / prev))
        prev = r
    return out


def plot_acceptance_by_position(summary: dict, path: str | os.PathLike) -> Path:
    """Two panels of grouped bars, one bar per method that drafted, at draft positions 1..K: left, the share of
    drafts accepted there (accepted_i / drafted_i, which needs every earlier draft of the round right too);
    right, the conditional rate (that share over the previous position's)."""
    _check_summary(summary)
    series = {name: m.get("accept_rate_per_position") or [] for name, m in summary["methods"].items()}
    series = {n: v for n, v in series.items() if any(not _missing(x) for x in v)}
    k_max = max((len(v) for v in series.values()), default=0)

    fig, axes = plt.subplots(1, 2, figsize=(2 * max(5.0, 0.8 * k_max + 2.5), 4.0))
    panels = (("share accepted (accepted / drafted)", lambda v: v),
              ("conditional (given earlier drafts right)", conditional_rates))
    for ax, (label, transform) in zip(axes, panels):
        if not series:
            _empty_note(ax, "no method drafted any token")
            continue
        positions = np.arange(1, k_max + 1)
        width = 0.8 / len(series)
        for i, (name, rates) in enumerate(series.items()):
            rates = transform(list(rates))
            xs = [p + (i - (len(series) - 1) / 2) * width for p, r in zip(positions, rates) if not _missing(r)]
            ys = [r for r in rates if not _missing(r)]
            ax.bar(xs, ys, width=width, label=name)
        ax.set_xticks(positions)
        ax.set_xlim(0.5, k_max + 0.5)
        ax.set_ylim(0.0, 1.05)
        ax.set_xlabel("draft position")
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle("Acceptance by draft position")
    return _save_figure(fig, path)


def plot_speedup_by_category(summary: dict, path: str | os.PathLike) -> Path:
    """Grouped bars: speedup over the reference per prompt category, one bar per method, a line at 1.0."""
    _check_summary(summary)
    per_category: dict[str, dict[str, dict]] = summary.get("per_category") or {}
    categories = sorted(per_category)
    # The reference is 1.0 everywhere by definition; the horizontal line stands for it.
    reference = summary.get("reference")
    names = [n for n in summary["methods"] if n != reference
             and any(not _missing((per_category[c].get(n) or {}).get("speedup")) for c in categories)]

    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(categories) * max(1, len(names)) ** 0.5 + 3.0), 4.0))
    if not names:
        _empty_note(ax, "no speedup to plot (reference absent or only the reference ran)")
    else:
        xs = np.arange(len(categories))
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            vals = [(per_category[c].get(name) or {}).get("speedup") for c in categories]
            bx = [x + (i - (len(names) - 1) / 2) * width for x, v in zip(xs, vals) if not _missing(v)]
            ax.bar(bx, [v for v in vals if not _missing(v)], width=width, label=name)
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1.0,
                   label=f"{reference} (1.0)" if reference else "1.0")
        ax.set_xticks(xs)
        ax.set_xticklabels(categories, rotation=30 if len(categories) > 4 else 0, ha="right"
                           if len(categories) > 4 else "center")
        ax.set_ylabel("speedup")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize="small")
    ax.set_title("Speedup by category")
    return _save_figure(fig, path)


def plot_heatmap(rows: list[dict], value_key: str, path: str | os.PathLike, title: str | None = None) -> Path:
    """Heatmap of `value_key` over exit layer E (y) x draft length K (x), each cell labelled with its value.

    For value_key == "speedup", cells whose row carries a predicted_speedup read "measured\\n(pred)". Where
    several rows share an (E, K), the best-speedup one is shown (as in `report.sweep_grid`).
    """
    grid = sweep_grid(rows)
    check(value_key in grid and value_key not in ("exit_layers", "draft_lens", "head"),
          f"value_key must be one of speedup, predicted_speedup, tau, accept_rate; got {value_key!r}")
    es, ks = grid["exit_layers"], grid["draft_lens"]
    values = np.array([[np.nan if _missing(v) else float(v) for v in row] for row in grid[value_key]], dtype=float)
    data = np.ma.masked_invalid(values)

    fig, ax = plt.subplots(figsize=(max(4.5, 0.9 * len(ks) + 2.5), max(3.5, 0.6 * len(es) + 2.0)))
    cmap = plt.get_cmap("RdYlGn" if "speedup" in value_key else "viridis").with_extremes(bad="lightgrey")
    norm = None
    finite = values[np.isfinite(values)]
    if "speedup" in value_key and finite.size and finite.min() < 1.0 < finite.max():
        # Centre the diverging map on 1.0 so red reads "slower than baseline" and green "faster".
        norm = TwoSlopeNorm(vcenter=1.0, vmin=float(finite.min()), vmax=float(finite.max()))
    im = ax.imshow(data, cmap=cmap, norm=norm, origin="lower", aspect="auto")
    fig.colorbar(im, ax=ax, label=value_key)

    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    for i in range(len(es)):
        for j in range(len(ks)):
            v = values[i, j]
            if not np.isfinite(v):
                ax.text(j, i, "-", ha="center", va="center", color="black")
                continue
            text = f"{v:.2f}"
            pred = grid["predicted_speedup"][i][j]
            if value_key == "speedup" and not _missing(pred):
                text += f"\n({pred:.2f})"
            # Light text on the dark middle of the map would vanish; pick by the cell's colour luminance.
            rgba = im.cmap(im.norm(v)) if hi > lo else im.cmap(0.5)
            luminance = 0.299 * rgba[0] + 0.587 * rgba[1] + 0.114 * rgba[2]
            ax.text(j, i, text, ha="center", va="center", fontsize=8,
                    color="black" if luminance > 0.5 else "white")

    ax.set_xticks(range(len(ks)))
    ax.set_xticklabels([str(k) for k in ks])
    ax.set_yticks(range(len(es)))
    ax.set_yticklabels([str(e) for e in es])
    ax.set_xlabel("draft length K")
    ax.set_ylabel("exit layer E")
    has_pred = value_key == "speedup" and any(not _missing(p) for row in grid["predicted_speedup"] for p in row)
    default_title = {"speedup": "Measured speedup", "tau": "Tokens per verify step (tau)"}.get(value_key, value_key)
    default_title += " (predicted in parentheses)" if has_pred else ""
    ax.set_title(title or default_title)
    return _save_figure(fig, path)


def write_sweep_report(sweep_dir: str | os.PathLike, rows: list[dict], more_markdown: str = "") -> dict[str, Path]:
    """Write sweep.md (the table, then `more_markdown`), heatmap_speedup.png and heatmap_tau.png into sweep_dir;
    returns {name: path}."""
    sweep_dir = Path(sweep_dir)
    markdown, _grid = aggregate_sweep(rows)  # validates rows before anything is written

    out = {
        "sweep.md": atomic_write_text(sweep_dir / "sweep.md", markdown + more_markdown),
        "heatmap_speedup.png": plot_heatmap(rows, "speedup", sweep_dir / "heatmap_speedup.png"),
        "heatmap_tau.png": plot_heatmap(rows, "tau", sweep_dir / "heatmap_tau.png"),
    }
    precisions = sorted({r.get("draft_precision") or "full" for r in rows})
    if len(precisions) > 1:  # an E x K x precision sweep: one E x K map per precision beside the best-of map
        for p in precisions:
            mine = [r for r in rows if (r.get("draft_precision") or "full") == p]
            for key in ("speedup", "tau"):
                name = f"heatmap_{key}_{p}.png"
                title = {"speedup": "Measured speedup", "tau": "tau"}[key] + f", draft precision {p}"
                out[name] = plot_heatmap(mine, key, sweep_dir / name, title=title)
    return out
