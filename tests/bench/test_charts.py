"""bench/charts.py, the chart helper every benchmark shares: it writes real PNG files, draws
missing values as gaps, and refuses series that do not match their groups."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from charts import bar_chart, timeline_chart  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def test_bar_chart_writes_a_png_with_gaps_and_limits(tmp_path: Path) -> None:
    out = bar_chart(tmp_path / "sub" / "save.png", "Save", ["1g", "4g"],
                    {"ckptstore": [1.9, None], "DCP": [1.2, 1.1]}, unit="GB/s",
                    limits={"disk": 2.2, "unknown": None}, note="shared machine")
    data = out.read_bytes()
    assert data.startswith(PNG) and len(data) > 5000


def test_bar_chart_refuses_mismatched_series(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="2 values for 3 groups"):
        bar_chart(tmp_path / "x.png", "x", ["a", "b", "c"], {"s": [1.0, 2.0]}, unit="u")
    assert not (tmp_path / "x.png").exists()


def test_timeline_chart(tmp_path: Path) -> None:
    out = timeline_chart(tmp_path / "t.png", "Recovery", [("kill", 1.0), ("training", 7.5)],
                         spans=[("restart", 1.0, 3.0), ("restore", 3.0, 7.5)])
    assert out.read_bytes().startswith(PNG)
