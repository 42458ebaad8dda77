"""PNG charts of benchmark tables, shared by every benchmark in bench/ (the only module that
imports matplotlib: `pip install -e '.[bench]'`).

    from charts import bar_chart, timeline_chart
    bar_chart("docs/img/save.png", "Save, 1 GiB state", ["1g"],
              {"ckptstore": [1.9], "DCP": [1.2]}, unit="GB/s",
              limits={"disk write+fsync": 2.2})
    timeline_chart("docs/img/recovery.png", "Recovery", [("kill", 3.0), ("restored", 9.5)],
                   spans=[("restore", 4.0, 9.5)])

Each function writes one PNG (parent folders created) and returns its path. Missing values
(None) are drawn as gaps and labelled "n/a", never as zero. The Agg backend is used, so no
display is needed; figures are closed after saving."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise SystemExit("charts need matplotlib: pip install -e '.[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    _pyplot().close(fig)
    return out


def _finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)


def bar_chart(path: str | Path, title: str, groups: Sequence[str],
              series: Mapping[str, Sequence[float | None]], *, unit: str,
              limits: Mapping[str, float | None] | None = None,
              note: str = "") -> Path:
    """Grouped bars: one group per entry of `groups` (e.g. states), one bar per series (e.g.
    contestants) holding its value for each group. `limits` draws dashed lines across (e.g.
    the disk's measured limit); `note` goes under the chart (e.g. "shared 2-core machine")."""
    plt = _pyplot()
    names = list(series)
    wide = 0.9 * len(groups) * max(1, len(names)) + 2
    fig, ax = plt.subplots(figsize=(min(10.0, max(6.0, wide)), 4.2))
    width = 0.8 / max(1, len(names))
    top = 0.0
    for i, name in enumerate(names):
        values = list(series[name])
        if len(values) != len(groups):
            raise ValueError(f"series {name!r} has {len(values)} values for {len(groups)} groups")
        xs = [g + (i - (len(names) - 1) / 2) * width for g in range(len(groups))]
        heights = [v if _finite(v) else 0.0 for v in values]
        bars = ax.bar(xs, heights, width * 0.92, label=name)
        for bar, v in zip(bars, values):
            label = "n/a" if not _finite(v) else (f"{v:.2f}" if v < 10 else f"{v:.0f}")
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                        textcoords="offset points")
        top = max([top, *(v for v in values if _finite(v))])  # type: ignore[misc]
    for j, (label, value) in enumerate((limits or {}).items()):
        if _finite(value):
            ax.axhline(value, linestyle="--", linewidth=1, color=f"C{len(names) + j}",
                       label=f"{label} ({value:.2f} {unit})")
            top = max(top, float(value))  # type: ignore[arg-type]
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set_ylabel(unit)
    ax.set_ylim(0, top * 1.18 if top > 0 else 1)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, alpha=0.8)
    return _save(fig, path)


def timeline_chart(path: str | Path, title: str, events: Sequence[tuple[str, float]], *,
                   spans: Sequence[tuple[str, float, float]] = (), unit: str = "s",
                   note: str = "") -> Path:
    """A timeline: `spans` (label, start, end) as horizontal bars, one row each, and `events`
    (label, time) as vertical lines; e.g. kill -> detect -> restore -> training again."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.45 * max(1, len(spans))))
    for row, (label, start, end) in enumerate(spans):
        ax.barh(row, end - start, left=start, height=0.5, color=f"C{row}")
        ax.text(start, row, f" {label} ({end - start:.2f} {unit})", va="center", fontsize=8)
    for j, (label, t) in enumerate(events):
        ax.axvline(t, linestyle=":", color="black", linewidth=1)
        ax.annotate(label, (t, len(spans) - 0.4 if spans else 0.5), rotation=90, fontsize=7,
                    va="top", ha="right", xytext=(-2, -2 - 10 * (j % 2)),
                    textcoords="offset points")
    ax.set_yticks([])
    ax.set_xlabel(unit)
    ax.set_ylim(-0.6, max(1, len(spans)) - 0.2)
    ax.set_title(title)
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, alpha=0.8)
    return _save(fig, path)
