"""The side-by-side results table (one column per connector) and the header that says what was simulated."""

from __future__ import annotations

from typing import Any, Callable

from offload_bench.replay.metrics import ConnectorResult


def fmt(spec: str) -> Callable[[Any], str]:
    return lambda v: "-" if v is None else format(v, spec)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def fmt_bytes(v: float | None) -> str:
    if v is None:
        return "-"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(v) >= div:
            return f"{v / div:.1f} {unit}"
    return f"{v:.0f} B"


def _share(part: int | None, whole: int | None) -> str:
    if part is None:
        return "-"
    return f"{part:,} ({100 * part / whole:.1f}%)" if whole else f"{part:,}"


ROWS: list[tuple[str, Callable[[ConnectorResult], Any], Callable[[Any], str]]] = [
    ("stalled", lambda r: r.stalled, str),
    ("first_stall_step", lambda r: r.first_stall_step, fmt(",")),
    ("requests completed/total", lambda r: f"{r.requests_completed}/{r.requests_total}", str),
    ("simulated seconds", lambda r: r.simulated_seconds, fmt(",.1f")),
    ("steps", lambda r: r.steps, fmt(",")),
    ("output tokens / sim s", lambda r: (r.output_tokens_per_s, r.stalled),
     lambda v: f"{v[0]:,.1f}" + (" (to stall)" if v[1] else "")),
    ("  to the last output token", lambda r: r.extra.get("output_tokens_per_s_to_last_token"), fmt(",.1f")),
    ("TTFT p50 (s)", lambda r: r.ttft_p50_s, fmt(".3f")),
    ("TTFT p95 (s)", lambda r: r.ttft_p95_s, fmt(".3f")),
    ("tokens loaded from CPU", lambda r: r.tokens_loaded_from_cpu, fmt(",")),
    ("tokens recomputed", lambda r: r.tokens_recomputed, fmt(",")),
    ("  of which were in CPU tier", lambda r: r.recomputed_tokens_in_cpu, fmt(",")),
    ("  of which restorable", lambda r: r.recomputed_restorable, fmt(",")),
    ("prompt tokens computed", lambda r: r.prompt_tokens_computed, fmt(",")),
    ("GPU pool util mean", lambda r: r.gpu_pool_util_mean, _pct),
    ("GPU pool util p95", lambda r: r.gpu_pool_util_p95, _pct),
    ("admission deferrals", lambda r: r.admission_deferrals, fmt(",")),
    ("  of which held for an older load", lambda r: r.extra.get("held_for_older"), fmt(",")),
    ("  of which held behind a load in flight", lambda r: r.extra.get("held_behind_load"), fmt(",")),
    ("CPU-hit tokens at first lookup", lambda r: r.extra.get("cpu_hit_tokens"), fmt(",")),
    ("  aged out (recomputed)", lambda r: _share(r.extra.get("aged_out_tokens"), r.extra.get("cpu_hit_tokens")), str),
    ("  too big for the pool (recomputed)", lambda r: _share(r.extra.get("too_big_tokens"),
                                                               r.extra.get("cpu_hit_tokens")), str),
    ("CPU tier bytes", lambda r: r.cpu_tier_bytes, fmt_bytes),
    ("CPU tier bytes / cached token", lambda r: r.cpu_tier_bytes_per_cached_token, fmt_bytes),
    ("  without spare windows", lambda r: r.extra.get("cpu_tier_bytes_per_cached_token_without_spare"), fmt_bytes),
    ("bytes loaded / stored", lambda r: f"{fmt_bytes(r.transfer_bytes_loaded)} / {fmt_bytes(r.transfer_bytes_stored)}",
     str),
    ("loads content-checked", lambda r: r.extra.get("loads_content_checked"), fmt(",")),
    ("wall seconds (replay loop)", lambda r: r.wall_seconds, fmt(".1f")),
]


def render(results: list[ConnectorResult], spec: list[tuple[str, Callable[[ConnectorResult], Any],
                                                             Callable[[Any], str]]] | None = None,
           per_group: bool = True) -> str:
    """The table of `spec`'s rows (default: ROWS), one column per result, then each pool group's use
    (`per_group`)."""
    head = ["metric"] + [r.connector for r in results]
    rows = [head]
    for label, get, show in (ROWS if spec is None else spec):
        rows.append([label] + [show(get(r)) for r in results])
    groups = sorted({g for r in results for g in r.gpu_pool_util_per_group}) if per_group else []
    for g in groups:
        rows.append([f"  pool {g} mean/p95"] + [
            "-" if g not in r.gpu_pool_util_per_group else
            f"{_pct(r.gpu_pool_util_per_group[g]['mean'])}/{_pct(r.gpu_pool_util_per_group[g]['p95'])}"
            for r in results])
    return "\n".join(_grid(rows))


def _grid(rows: list[list[str]]) -> list[str]:
    """Rows as aligned text lines (first column left, the rest right), a rule under the first row."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def render_phases(results: list[ConnectorResult]) -> str:
    """Per phase of the workload, one column per connector: prompt tokens loaded by the connector / recomputed /
    TTFT p50 / p95. Empty when the requests carry no phase."""
    phases = sorted({p for r in results for p in r.per_phase})
    if not phases:
        return ""
    head = ["phase", "requests"] + [r.connector for r in results]
    rows = [head]
    for phase in phases:
        counts = {r.per_phase[phase]["requests"] for r in results if phase in r.per_phase}
        cells = []
        for r in results:
            f = r.per_phase.get(phase)
            cells.append("-" if f is None else
                         f"{f['loaded_tokens']:,} / {f['recomputed_tokens']:,} / {fmt('.3f')(f['ttft_p50_s'])} / "
                         f"{fmt('.3f')(f['ttft_p95_s'])}")
        rows.append([phase, "/".join(f"{c:,}" for c in sorted(counts))] + cells)
    return "\n".join(["per phase: prompt tokens loaded by the connector / tokens recomputed / TTFT p50 s / TTFT p95 s",
                      *_grid(rows)])


def header(out: Any) -> str:
    cfg = out.config
    tm = cfg.time_model
    import vllm

    return "\n".join([
        f"replay: {out.workload}, {out.requests} requests ({out.clipped} clipped to max_model_len), "
        f"model {cfg.model}, vLLM {vllm.__version__}",
        f"pool {cfg.num_gpu_blocks:,} GPU blocks, CPU tier {cfg.cpu_bytes / 2**30:.1f} GiB, "
        f"max_num_batched_tokens {cfg.max_num_batched_tokens}, max_model_len {cfg.max_model_len:,}, "
        f"max_num_seqs {cfg.max_num_seqs}, async scheduling ({_batches_in_flight(out)} batches in flight), "
        f"seed {cfg.seed}, time scale {cfg.time_scale}"
        + (f", offload config {dict(cfg.offload_extra)}" if getattr(cfg, "offload_extra", ()) else ""),
        *_parallel_note(out),
        f"step time = {tm.overhead_ms} ms + {tm.prefill_token_us} us x prompt tokens + {tm.decode_request_us} us x "
        f"decoding requests (empty step {tm.idle_step_ms} ms) [{tm.basis}]",
        f"transfers: bytes / {tm.bandwidth_gbps} GB/s per direction, one job after another per direction",
        f"stall: {cfg.stall_steps} consecutive steps with no token scheduled while requests wait and no transfer is "
        f"in flight",
        *_patched_note(out),
    ])


def _patched_note(out: Any) -> list[str]:
    """Says what the patched column changed, so a reader does not take it for vLLM as released."""
    for run in out.runs:
        if run.result.connector == "vllm-offloading-patched":
            groups = run.result.extra.get("admission_fix_groups") or []
            names = ", ".join(f"g{g}" for g in groups) or "none (no sliding-window or chunked-local group)"
            return [f"vllm-offloading-patched: vLLM's OffloadingConnector on a scheduler whose async-load admission "
                    f"count has the sliding-window/chunked-local fix (sim/vllm_patched.py) on groups {names}"]
    return []


def _batches_in_flight(out: Any) -> int:
    for run in out.runs:
        depth = run.result.extra.get("batches_in_flight")
        if depth:
            return int(depth)
    return 2


def _parallel_note(out: Any) -> list[str]:
    """Pipeline parallelism and speculative decoding, when on: what the replay simulates of them."""
    cfg = out.config
    pp, k = getattr(cfg, "pipeline_parallel_size", 1), getattr(cfg, "num_speculative_tokens", 0)
    notes = []
    if pp > 1:
        notes.append(f"pipeline parallel {pp}: {pp} batches in flight (vLLM's V1-runner max_concurrent_batches); "
                     f"one simulated worker holds every stage's layers and moves whole blocks")
    if k:
        acc = [(r.result.connector, r.result.extra.get("drafts_accepted"), r.result.extra.get("drafts_scheduled"))
               for r in out.runs if r.result.extra.get("drafts_scheduled")]
        rates = ", ".join(f"{c} {a / n:.0%}" for c, a, n in acc)
        notes.append(f"speculative decoding: MTP, {k} drafts per step ({k} lookahead slots; the MTP layer's window "
                     f"cache in the KV layout); a seeded uniform 0..{k} of each step's drafts accepted"
                     + (f" (accepted: {rates})" if rates else ""))
    return notes
