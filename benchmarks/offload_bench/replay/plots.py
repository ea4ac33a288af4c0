"""PNG plot of a replay: the headline figures side by side, one colour per connector.

- GPU pool use over simulated time, one strip per connector (so no connector's line hides another's), with the
  workload's phases (dotted) and where a run stalled (red ✕ and dashed line; the run stops there, the rest of its
  strip is hatched).
- Time to first token per connector: its CDF where the run carries per-request TTFTs (`series["ttft"]`), else the
  p50-p95 range the result reports.
- Prompt tokens loaded from the CPU tier against tokens recomputed, per connector.

Legends and labels sit outside the data; where lines can coincide (CDFs), each connector is drawn thinner and
dashed differently on top of the one before, so identical curves show as one striped line, not one hidden line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_COLORS = {"offload": "tab:green", "offload-vllm-reservation": "tab:orange", "vllm-offloading": "tab:red",
           "vllm-offloading-patched": "tab:purple", "none": "tab:gray"}
_OTHER_COLORS = ["tab:blue", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"]
_DASHES = ["-", (0, (5, 2)), (0, (2, 2)), (0, (6, 2, 1, 2)), (0, (3, 1, 1, 1, 1, 1))]
STALL_COLOR = "crimson"

# Axis labels the test (and readers) find the panels by.
POOL_LABEL = "GPU pool used (%)"
TTFT_LABEL = "time to first token (s)"
TOKENS_LABEL = "prompt tokens"


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
    return {name: [v[i] for i in keep] for name, v in series.items() if len(v) == len(t)}


def _colors(names: list[str]) -> dict[str, str]:
    spare = iter(_OTHER_COLORS * 4)
    return {n: _COLORS.get(n) or next(spare) for n in names}


def _tokens(x: float, _pos: Any = None) -> str:
    for div, suf in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suf}"
    return f"{x:.0f}"


def _stall_note(run: Any) -> str:
    r = run.result
    if not r.stalled:
        return ""
    when = f", {run.stall_time:.1f} s" if run.stall_time is not None else ""
    return f"stalled at step {r.first_stall_step:,}{when}"


def build_figure(out: Any) -> Any:
    """The figure (matplotlib, Agg backend) for a `ReplayOutput`; `plot` saves it."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    runs = list(out.runs)
    names = [r.result.connector for r in runs]
    color = _colors(names)
    n = max(1, len(runs))
    fig = plt.figure(figsize=(12, 1.05 * n + 5.2))
    cdf = any(r.series.get("ttft") for r in runs)
    gs = fig.add_gridspec(2, 1, height_ratios=[1.05 * n, 3.4], hspace=0.24, left=0.17, right=0.97, bottom=0.1,
                          top=1 - 0.95 / (1.05 * n + 5.2))
    strips_gs = gs[0].subgridspec(n, 1, hspace=0.12)
    bottom_gs = gs[1].subgridspec(1, 2, wspace=0.25 if cdf else 0.06)

    # ---------------------------------------------------------------- pool use over time, one strip per run
    t_end = max([s["t"][-1] for s in (r.series for r in runs) if s.get("t")] + [1e-9])
    strips = []
    for i, run in enumerate(runs):
        ax = fig.add_subplot(strips_gs[i], sharex=strips[0] if strips else None)
        strips.append(ax)
        name = run.result.connector
        s = _thin(run.series) if run.series.get("t") else {"t": [], "used": []}
        used = [100 * u for u in s["used"]]
        ax.fill_between(s["t"], used, step="post", color=color[name], alpha=0.35, lw=0)
        ax.step(s["t"], used, where="post", color=color[name], lw=0.8)
        if run.stall_time is not None:
            ax.axvline(run.stall_time, color=STALL_COLOR, ls="--", lw=1.2)
            ax.plot([run.stall_time], [used[-1] if used else 0], "x", color=STALL_COLOR, ms=9, mew=2.2,
                    clip_on=False, zorder=5)
            ax.axvspan(run.stall_time, t_end, facecolor="none", edgecolor="0.75", hatch="///", lw=0)
            ax.text(run.stall_time + 0.01 * t_end, 52, f"✕ {_stall_note(run)}: the run stops here", fontsize=7.5,
                    color=STALL_COLOR, va="center", ha="left",
                    bbox=dict(facecolor="white", edgecolor="none", pad=1.5))  # on the hatch: no data there
        for t, _phase in getattr(out, "phase_marks", []):
            ax.axvline(t, color="0.55", ls=":", lw=0.8)
        ax.set_ylim(0, 105)
        ax.set_yticks([0, 50, 100])
        ax.tick_params(labelsize=7.5)
        ax.grid(alpha=0.25)
        ax.set_ylabel(name, rotation=0, ha="right", va="center", fontsize=8.5, color=color[name])
        if i < n - 1:
            ax.tick_params(labelbottom=False)
    if strips:
        top = strips[0]
        for t, phase in getattr(out, "phase_marks", []):  # above the first strip, outside the data
            top.text(t, 1.04, phase, transform=top.get_xaxis_transform(), fontsize=7, color="0.35",
                     ha="left", va="bottom", clip_on=False)
        strips[-1].set_xlabel("simulated time (s)", fontsize=8.5)
        strips[-1].set_xlim(0, t_end * 1.01)
        strips[0].set_title(POOL_LABEL + " over time, per connector", fontsize=9, loc="left", pad=14)

    # --------------------------------------------------------------------- tokens loaded vs recomputed
    ax_tok = fig.add_subplot(bottom_gs[0])
    h = 0.38
    for k, run in enumerate(runs):
        r, c = run.result, color[run.result.connector]
        ax_tok.barh(k - h / 2, r.tokens_loaded_from_cpu, height=h, color=c, edgecolor=c)
        ax_tok.barh(k + h / 2, r.tokens_recomputed, height=h, color="white", edgecolor=c, hatch="////", lw=1.0)
        for y, v in ((k - h / 2, r.tokens_loaded_from_cpu), (k + h / 2, r.tokens_recomputed)):
            ax_tok.text(v, y, " " + _tokens(v), va="center", ha="left", fontsize=7, color="0.2")
    ax_tok.set_yticks(range(n), [nm + (" (stalled)" if r.result.stalled else "") for nm, r in zip(names, runs)],
                      fontsize=7.5)
    ax_tok.set_ylim(n - 0.5, -0.5)
    ax_tok.xaxis.set_major_formatter(FuncFormatter(_tokens))
    ax_tok.xaxis.set_major_locator(MaxNLocator(5))
    ax_tok.set_xlim(0, max([r.result.tokens_loaded_from_cpu for r in runs]
                           + [r.result.tokens_recomputed for r in runs] + [1]) * 1.25)
    ax_tok.set_xlabel(TOKENS_LABEL, fontsize=8.5)
    ax_tok.set_title("loaded from CPU (solid) vs recomputed (hatched)", fontsize=9, loc="left")
    ax_tok.grid(alpha=0.25, axis="x")
    ax_tok.tick_params(labelsize=7.5)

    # -------------------------------------------------------------------------------- time to first token
    ax_ttft = fig.add_subplot(bottom_gs[1], sharey=None if cdf else ax_tok)
    if cdf:
        for k, run in enumerate(runs):  # later runs thinner, on top: coinciding CDFs stay visible
            v = sorted(run.series.get("ttft") or [])
            if not v:
                continue
            y = [(j + 1) / len(v) for j in range(len(v))]
            ax_ttft.step(v, y, where="post", color=color[run.result.connector], lw=max(0.9, 3.2 - 0.55 * k),
                         ls=_DASHES[k % len(_DASHES)], alpha=0.9)
        ax_ttft.set_ylabel("fraction of requests", fontsize=8.5)
        ax_ttft.set_ylim(0, 1.02)
        ax_ttft.set_title("TTFT distribution (CDF)", fontsize=9, loc="left")
    else:  # only the percentiles the results keep: one row per connector, nothing overlaps
        for k, run in enumerate(runs):
            r, c = run.result, color[run.result.connector]
            if r.ttft_p50_s is None:
                continue
            ax_ttft.plot([r.ttft_p50_s, r.ttft_p95_s], [k, k], color=c, lw=2.5, solid_capstyle="butt")
            ax_ttft.plot([r.ttft_p50_s], [k], "o", color=c, ms=7)
            ax_ttft.plot([r.ttft_p95_s], [k], "D", color=c, ms=6, mfc="white", mew=1.6)
        ax_ttft.tick_params(labelleft=False)  # the same rows as the token bars to its left
        ax_ttft.set_title("TTFT p50 (●) to p95 (◇) of the requests that got a first token", fontsize=9, loc="left")
    ax_ttft.set_xlabel(TTFT_LABEL, fontsize=8.5)
    ax_ttft.set_xlim(left=0)
    ax_ttft.grid(alpha=0.25)
    ax_ttft.tick_params(labelsize=7.5)

    # ------------------------------------------------------------------- title and legend, outside the axes
    cfg = out.config
    fig.suptitle(f"{out.workload} on {cfg.model}: {cfg.num_gpu_blocks:,} GPU blocks, "
                 f"{cfg.cpu_bytes / 2**30:.0f} GiB CPU tier, {out.requests:,} requests", fontsize=10.5,
                 y=1 - 0.25 / (1.05 * n + 5.2), va="top")
    handles = [Line2D([], [], color=color[nm], lw=2.6 if cdf else 5, ls=_DASHES[k % len(_DASHES)] if cdf else "-",
                      label=nm + (f" ({_stall_note(r)})" if r.result.stalled else ""))
               for k, (nm, r) in enumerate(zip(names, runs))]
    handles.append(Line2D([], [], color=STALL_COLOR, ls="--", marker="x", mew=2, label="stall (the run stops)"))
    if getattr(out, "phase_marks", None):
        handles.append(Line2D([], [], color="0.55", ls=":", label="workload phase"))
    fig.legend(handles=handles, loc="lower center", ncol=min(4, len(handles)), fontsize=7.5, frameon=False,
               bbox_to_anchor=(0.5, 0.0))
    return fig


def plot(out: Any, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    fig = build_figure(out)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=90)
    plt.close(fig)
    return p
