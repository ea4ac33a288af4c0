"""PNG plots of a replay: GPU pool use and running/waiting requests over simulated time, one line per connector."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_COLORS = {"offload": "tab:green", "offload-vllm-reservation": "tab:orange", "vllm-offloading": "tab:red",
           "vllm-offloading-patched": "tab:purple", "none": "tab:gray"}


def _thin(series: dict[str, list[float]], n: int = 6000) -> dict[str, list[float]]:
    """About n points, so long runs draw quickly. Points around a gap in time (the engine idle until the next
    arrival) and the last point (where a stall is) are always kept, or the lines would cut across gaps."""
    t = series["t"]
    if len(t) <= n:
        return series
    k = len(t) // n + 1
    gap = (t[-1] - t[0]) / n
    keep = [i for i in range(len(t))
            if i % k == 0 or i == len(t) - 1 or (i + 1 < len(t) and t[i + 1] - t[i] > gap)
            or (i > 0 and t[i] - t[i - 1] > gap)]
    return {name: [v[i] for i in keep] for name, v in series.items()}


def plot(out: Any, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    fig, (ax_pool, ax_run, ax_wait) = plt.subplots(3, 1, figsize=(11, 8.5), sharex=True)
    for run in out.runs:
        name = run.result.connector
        s = _thin(run.series)
        color = _COLORS.get(name)
        label = name + (f" (stalled at step {run.result.first_stall_step:,})" if run.result.stalled else "")
        ax_pool.plot(s["t"], [100 * u for u in s["used"]], lw=0.9, color=color, label=label)
        ax_run.plot(s["t"], s["running"], lw=0.9, color=color)
        ax_wait.plot(s["t"], s["waiting"], lw=0.9, color=color)
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
