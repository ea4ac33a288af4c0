"""PNG plots of a replay: GPU pool use and running/waiting requests over simulated time, one line per connector."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_COLORS = {"offload": "tab:green", "offload-vllm-reservation": "tab:orange", "vllm-offloading": "tab:red",
           "none": "tab:gray"}


def _thin(xs: list[float], ys: list[float], n: int = 4000) -> tuple[list[float], list[float]]:
    """Every k-th point, so a long run draws quickly; keeps the last point (where a stall is)."""
    if len(xs) <= n:
        return xs, ys
    k = len(xs) // n + 1
    return xs[::k] + xs[-1:], ys[::k] + ys[-1:]


def plot(out: Any, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    fig, (ax_pool, ax_run, ax_wait) = plt.subplots(3, 1, figsize=(11, 8.5), sharex=True)
    for run in out.runs:
        name = run.result.connector
        s = run.series
        color = _COLORS.get(name)
        label = name + (f" (stalled at step {run.result.first_stall_step:,})" if run.result.stalled else "")
        x, y = _thin(s["t"], [100 * u for u in s["used"]])
        ax_pool.plot(x, y, lw=0.9, color=color, label=label)
        x, y = _thin(s["t"], s["running"])
        ax_run.plot(x, y, lw=0.9, color=color)
        x, y = _thin(s["t"], s["waiting"])
        ax_wait.plot(x, y, lw=0.9, color=color)
        if run.stall_time is not None:
            for ax in (ax_pool, ax_run, ax_wait):
                ax.axvline(run.stall_time, color=color, ls="--", lw=1)
            ax_pool.plot([run.stall_time], [100 * s["used"][-1]], "x", color=color, ms=10, mew=2)
    for t, name in getattr(out, "phase_marks", []):
        for ax in (ax_pool, ax_run, ax_wait):
            ax.axvline(t, color="0.6", ls=":", lw=0.8)
        ax_pool.text(t, 101, name, fontsize=7, color="0.35", rotation=0, va="bottom", ha="left")
    ax_pool.set_ylabel("GPU pool used (%)")
    ax_pool.set_ylim(0, 112)
    from matplotlib.ticker import MaxNLocator

    for ax in (ax_run, ax_wait):
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_run.set_ylabel("running requests")
    ax_wait.set_ylabel("waiting requests")
    ax_wait.set_xlabel("simulated time (s)")
    cfg = out.config
    ax_pool.set_title(f"{out.workload} on {cfg.model}: {cfg.num_gpu_blocks:,} GPU blocks, "
                      f"{cfg.cpu_bytes / 2**30:.0f} GiB CPU tier (x, dashed: stall, that run stops; dotted: phases)",
                      fontsize=10)
    ax_pool.legend(loc="lower right", fontsize=8)
    for ax in (ax_pool, ax_run, ax_wait):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=90)
    plt.close(fig)
    return p
