"""loadgen's latency CDFs: each axis in the unit its values read best in, tick labels apart."""
from __future__ import annotations

import pytest

from loadgen.plots import cdf_figure, time_unit


@pytest.mark.parametrize("top_ms, unit", [(0.0, "ms"), (350.0, "ms"), (1999.0, "ms"), (2000.0, "s"),
                                          (95_000.0, "s"), (120_000.0, "min"), (3_600_000.0, "min")])
def test_time_unit_follows_the_largest_value(top_ms, unit):
    assert time_unit([1.0, top_ms])[0] == unit
    assert time_unit([])[0] == "ms"


def test_cdf_axes_pick_their_units_and_ticks_do_not_overlap():
    runs = {"a": {"TTFT": [12.0, 40.0, 180.0], "TPOT": [800.0, 1500.0, 30_000.0],
                  "E2E": [50_000.0, 100_000.0, 150_000.0, 900_000.0]},
            "b": {"TTFT": [15.0, 90.0], "TPOT": [900.0], "E2E": [60_000.0, 130_000.0]}}
    fig = cdf_figure(runs)
    axes = fig.axes
    assert [ax.get_xlabel() for ax in axes] == ["TTFT (ms)", "TPOT (s)", "E2E (min)"]
    assert axes[2].get_xlim()[1] < 20  # 900,000 ms is 15 min, plotted in minutes
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in axes:
        lo, hi = ax.get_xlim()
        labels = [t for t, x in zip(ax.get_xticklabels(), ax.get_xticks()) if lo <= x <= hi and t.get_text()]
        assert 2 <= len(labels) <= 7, ax.get_xlabel()
        boxes = [t.get_window_extent(renderer) for t in labels]
        assert all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:])), [t.get_text() for t in labels]
    import matplotlib.pyplot as plt

    plt.close(fig)
