"""Who holds the GPU block pool when a run stalls (models-and-traces.md §5's split)."""

from __future__ import annotations

from dataclasses import asdict, is_dataclass
from typing import Any


def pool_holders(eng: Any, top: int = 8) -> dict[str, Any]:
    """Free, cached-evictable, and blocks held by RUNNING, WAITING with computed tokens, and
    WAITING_FOR_REMOTE_KVS requests (distinct block ids), plus the largest holders."""
    sched = eng.sched
    pool = sched.kv_cache_manager.block_pool
    managers = list(sched.kv_cache_manager.coordinator.single_type_managers)
    free = pool.get_num_free_blocks()
    cached = sum(1 for b in getattr(pool, "blocks", ()) if b.ref_cnt == 0 and b.block_hash is not None)
    by_cat: dict[str, set[int]] = {"running": set(), "waiting_with_computed": set(), "waiting_for_remote_kvs": set(),
                                   "other": set()}
    holders = []
    for rid, req in sched.requests.items():
        ids = set()
        per_group = []
        for mgr in managers:
            blocks = [b.block_id for b in mgr.req_to_blocks.get(rid, ()) if not b.is_null]
            per_group.append(len(blocks))
            ids.update(blocks)
        if not ids:
            continue
        status = req.status.name
        if status == "RUNNING":
            cat = "running"
        elif status == "WAITING_FOR_REMOTE_KVS":
            cat = "waiting_for_remote_kvs"
        elif status.startswith("WAITING") or status == "PREEMPTED":
            cat = "waiting_with_computed" if req.num_computed_tokens > 0 else "other"
        else:
            cat = "other"
        by_cat[cat].update(ids)
        holders.append({"request": rid, "status": status, "num_computed_tokens": req.num_computed_tokens,
                        "num_prompt_tokens": req.num_prompt_tokens, "blocks": len(ids),
                        "blocks_per_group": per_group})
    holders.sort(key=lambda h: -h["blocks"])
    dump: dict[str, Any] = {
        "num_blocks": sched.kv_cache_config.num_blocks, "free": free, "cached_evictable": cached,
        **{f"held_by_{k}": len(v) for k, v in by_cat.items()},
        "running": len(sched.running), "waiting": eng.waiting_count(), "top_holders": holders[:top],
    }
    side = getattr(eng, "side", None)
    if side is not None:
        snap = side.snapshot()
        dump["ledger"] = {"free_blocks": snap.free_blocks, "watermark_blocks": snap.watermark_blocks,
                          "reserved_blocks": snap.reserved_blocks, "deferred": list(snap.deferred),
                          "rows": [asdict(r) if is_dataclass(r) else repr(r) for r in snap.rows[:top]]}
    return dump


def format_dump(kind: str, dump: dict[str, Any]) -> str:
    lines = [f"[{kind}] pool at the stall: {dump['num_blocks']} blocks, free {dump['free']} "
             f"(cached-evictable {dump['cached_evictable']}), held by RUNNING {dump['held_by_running']}, "
             f"WAITING with computed tokens {dump['held_by_waiting_with_computed']}, "
             f"WAITING_FOR_REMOTE_KVS {dump['held_by_waiting_for_remote_kvs']}; "
             f"running {dump['running']}, waiting {dump['waiting']}"]
    for h in dump["top_holders"]:
        lines.append(f"    {h['request']:>8} {h['status']:<24} computed {h['num_computed_tokens']:>8,} of "
                     f"{h['num_prompt_tokens']:>8,} prompt tokens, {h['blocks']:>5} blocks {h['blocks_per_group']}")
    return "\n".join(lines)
