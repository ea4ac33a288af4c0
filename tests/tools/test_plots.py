"""`replay --plot`: a PNG with the headline panels (pool use over time per connector with stall marks, TTFT
distribution, tokens loaded vs recomputed), legends outside the data."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install matplotlib)")

from offload_bench.replay import plots  # noqa: E402

NAMES = ["offload", "offload-vllm-reservation", "vllm-offloading", "vllm-offloading-patched", "none"]


def _fake(with_ttfts: bool) -> NS:
    runs = []
    for k, name in enumerate(NAMES):
        stall = 79.5 if name in ("offload-vllm-reservation", "vllm-offloading") else None
        t = [i * 0.1 for i in range(int((stall or 156.0) / 0.1))]
        used = [0.5 + 0.4 * math.sin(x / 3) for x in t]
        result = NS(connector=name, stalled=stall is not None, first_stall_step=2536 if stall else None,
                    ttft_p50_s=0.4 + 0.1 * k, ttft_p95_s=1.1 + 0.2 * k, tokens_loaded_from_cpu=[298_112, 214_048,
                    212_000, 296_064, 0][k], tokens_recomputed=[1232, 1216, 3264, 3280, 278_448][k])
        series = {"t": t, "used": used, "running": [1] * len(t), "waiting": [0] * len(t)}
        if with_ttfts:
            series["ttft"] = [0.2 + 0.01 * i for i in range(100)]  # identical for every connector: must not hide
        runs.append(NS(result=result, series=series, stall_time=stall))
    return NS(runs=runs, workload="gemma4-31b-returning", requests=104,
              config=NS(model="gemma-4-31b", num_gpu_blocks=2188, cpu_bytes=40 * 2**30),
              phase_marks=[(0.0, "steady"), (79.0, "burst-k2"), (104.0, "burst-k3")])


def _inside(inner, outer) -> bool:
    return inner.x0 < outer.x1 and inner.x1 > outer.x0 and inner.y0 < outer.y1 and inner.y1 > outer.y0


@pytest.mark.parametrize("with_ttfts", [False, True])
def test_plot_has_the_headline_panels(tmp_path: Path, with_ttfts: bool) -> None:
    import matplotlib.pyplot as plt

    out = _fake(with_ttfts)
    fig = plots.build_figure(out)
    try:
        axes = fig.axes
        strips = [ax for ax in axes if ax.get_ylabel() in NAMES]
        assert [ax.get_ylabel() for ax in strips] == NAMES  # pool use over time, one strip per connector
        assert strips[-1].get_xlabel() == "simulated time (s)"
        assert strips[0].get_title(loc="left").startswith(plots.POOL_LABEL)
        ttft = [ax for ax in axes if ax.get_xlabel() == plots.TTFT_LABEL]
        tokens = [ax for ax in axes if ax.get_xlabel() == plots.TOKENS_LABEL]
        assert len(ttft) == len(tokens) == 1
        assert ("CDF" in ttft[0].get_title(loc="left")) == with_ttfts
        assert len(tokens[0].patches) == 2 * len(NAMES)  # loaded and recomputed bars per connector
        # Stall marks only on the stalled runs' strips: the dashed line and the ✕ (in the stall colour).
        for ax in strips:
            stalled = ax.get_ylabel() in ("offload-vllm-reservation", "vllm-offloading")
            marks = [ln for ln in ax.get_lines() if ln.get_color() == plots.STALL_COLOR]
            assert (len(marks) == 2) == stalled and (not stalled) == (not marks), ax.get_ylabel()
        # Legends: one, on the figure, clear of every panel.
        assert not any(ax.get_legend() for ax in axes)
        assert len(fig.legends) == 1
        fig.canvas.draw()
        box = fig.legends[0].get_window_extent()
        assert not any(_inside(box, ax.get_window_extent()) for ax in axes)
        labels = [t.get_text() for t in fig.legends[0].get_texts()]
        assert any(s.startswith("vllm-offloading (stalled at step 2,536") for s in labels)
        if with_ttfts:  # coinciding CDFs: drawn thinner one on top of the other, all visible
            widths = [ln.get_linewidth() for ln in ttft[0].get_lines()]
            assert len(widths) == len(NAMES) and widths == sorted(widths, reverse=True) and len(set(widths)) > 1
    finally:
        plt.close(fig)
    png = plots.plot(out, tmp_path / "sub" / "replay.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_of_a_real_replay(tmp_path: Path) -> None:
    from offload_bench.replay.runner import ReplayConfig, run_replay
    from offload_bench.replay.timemodel import time_model_for
    from offload_bench.replay.workloads import resolve_trace

    cfg = ReplayConfig(model="gpt-oss-20b", connectors=("offload", "none"), num_gpu_blocks=2304, cpu_bytes=2**31,
                       max_num_batched_tokens=1024, max_model_len=32768, max_num_seqs=64, limit=8,
                       time_model=time_model_for("gpt-oss-20b"))
    out = run_replay(resolve_trace("agent-tool-prefix", 0), cfg)
    png = plots.plot(out, tmp_path / "real.png")
    assert png.stat().st_size > 10_000
