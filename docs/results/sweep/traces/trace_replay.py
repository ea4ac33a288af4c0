"""Run `offload_bench replay` with extra per-request accounting of where recomputed tokens come from.

Usage: python trace_replay.py OUT.json <replay args...>   (one connector per run recommended)

Per request, at the last connector lookup before the request is first scheduled, it records:
  local     tokens vLLM's GPU prefix cache already had (num_computed_tokens passed to the lookup)
  resident  full-attention prefix in the CPU tier (recorder's figure)
  restor    prefix the connector could restore (ours: admission.hit; vLLM: local + its answer)
  ever      longest full-attention prefix whose every block was *ever* stored into the CPU tier (any time before)
and from the recorder: prompt, reusable, first_hit, prefill_computed, loaded.
The recomputed tokens of each request are then split into:
  restorable_not_loaded  [fh, restor)        the tier could restore it, but it was not loaded (deferral, refusal)
  window_missing         [restor, resident)  full-attention KV in the tier, a group's window/state at that point not
  evicted                [resident, ever)    stored once, gone by the lookup
  never_stored           [ever, reusable)    computed by an earlier request but never stored
  preempt                prefill beyond (prompt - first_hit)
"""
from __future__ import annotations

import json
import sys
from collections import Counter

from offload_bench.platform import use_cpu_platform

use_cpu_platform()
from offload_bench.replay import connectors as C  # noqa: E402
from offload_bench.replay import runner as R

OUT = sys.argv[1]
ARGS = sys.argv[2:]

ENGINES: list = []
import os
SNAP = set(filter(None, os.environ.get("SNAP", "").split(",")))
ALLREQ: dict = {}
_orig_add = C.ReplayEngine.add


def _add(self, request, phase=""):
    ALLREQ.setdefault(id(self), {})[request.request_id] = (request, phase)
    return _orig_add(self, request, phase)


C.ReplayEngine.add = _add


def snapshot(eng):
    """Per earlier request: full-attention tokens of its prompt ready in the CPU tier now (ours or vLLM's)."""
    out = {}
    side = eng.side
    if side is not None:
        g = [x for x in side.groups if not x.recycling][0]
        tier = side.tier
        pol = tier.policy
        for rid, (req, ph) in ALLREQ[id(eng)].items():
            keys = side.layout.keys(req)
            nb = keys.num_blocks(g.index)
            ks = [keys(g.index, i) for i in range(nb)]
            ready = [k for k in ks if tier.is_ready(k)]
            if not ready:
                continue
            prot = sum(1 for k in ready if k in getattr(pol, "_protected", ()))
            unsh = sum(1 for k in ready if k in getattr(pol, "_unshared", ()))
            out[rid] = dict(phase=ph, ready_tokens=len(ready) * g.block_size, protected=prot * g.block_size,
                            unshared=unsh * g.block_size)
        out["_used_slots"] = tier.used_slots()
        out["_by_group"] = dict(__import__("collections").Counter(k[0] for k in tier.keys()))
    else:
        cs = eng.conn.connector_scheduler
        from vllm.v1.kv_offload.base import LookupResult
        idx = cs._full_attention_groups[0]
        for rid, (req, ph) in ALLREQ[id(eng)].items():
            st = cs._req_status.get(rid)
            if st is None:
                continue
            gc, gs = cs.config.kv_group_configs[idx], st.group_states[idx]
            n = sum(cs.manager.lookup(k, st.req_context) is LookupResult.HIT for k in gs.offload_keys)
            if n:
                out[rid] = dict(phase=ph, ready_tokens=n * gc.tokens_per_chunk)
    return out
EXTRA: dict = {}

_orig_instrument = C.ReplayEngine._instrument


def _instrument(self):
    _orig_instrument(self)
    ENGINES.append(self)
    self._trace = {"ever": set(), "lk": {}, "stored_blocks": Counter(), "stored_spare": Counter(),
                   "evicted": 0, "store_calls": 0}
    tr = self._trace
    if self.conn is None:
        return
    side = self.side
    if side is not None:
        tier = side.tier
        full_groups = [g for g in side.groups if not g.recycling]
        orig_bs = tier.begin_store

        def begin_store(keys, unshared=False, spare=()):
            res = orig_bs(keys, unshared=unshared, spare=spare)
            for k, _slot in res:
                tr["stored_blocks"][k[0]] += 1
                if k in spare:
                    tr["stored_spare"][k[0]] += 1
                    tr.setdefault("ever_spare", set()).add(k)
                else:
                    tr.setdefault("ever_regular", set()).add(k)
                tr["ever"].add(k)
            return res
        tier.begin_store = begin_store
        # the StorePlanner holds the same tier object; begin_store looked up on it at call time -> patched

        def ever_prefix(req):
            keys = side.layout.keys(req)
            best = None
            for g in full_groups:
                n = 0
                nb = keys.num_blocks(g.index)
                while n < nb and keys(g.index, n) in tr["ever"]:
                    n += 1
                t = n * g.block_size
                best = t if best is None else min(best, t)
            return min(best or 0, req.num_tokens - 1)

        def extra_info(req):
            keys = side.layout.keys(req)
            g = full_groups[0]
            nb = keys.num_blocks(g.index)
            ready = [tier.is_ready(keys(g.index, i)) for i in range(nb)]
            pol = tier.policy
            first_ready = next((i for i, x in enumerate(ready) if x), None)
            fa = 0
            while fa < nb and ready[fa]:
                fa += 1
            P = fa * g.block_size
            P -= P % side.layout.alignment
            win = {}
            if P > 0:
                for sg in side.groups:
                    if not sg.recycling:
                        continue
                    need = [keys(sg.index, i) for i in sg.restore_range(P)]
                    win[sg.index] = dict(need=len(need), ready=sum(tier.is_ready(k) for k in need),
                                         spare_now=sum(tier.has(k) and tier.is_spare(k) for k in need),
                                         ever_spare=sum(k in tr.get("ever_spare", ()) for k in need),
                                         ever_regular=sum(k in tr.get("ever_regular", ()) for k in need))
            return {"any_ready_tokens": sum(ready) * g.block_size, "fa_prefix": P, "win": win,
                    "first_ready_token": None if first_ready is None else first_ready * g.block_size,
                    "bias": round(getattr(pol, "bias", 0.0), 3),
                    "protected": len(getattr(pol, "_protected", ())),
                    "spare_idle": len(tier._spare)}
    else:
        cs = self.conn.connector_scheduler
        mgr = cs.manager
        orig_ps = mgr.prepare_store

        def prepare_store(keys, req_context):
            out = orig_ps(keys, req_context)
            if out is not None:
                tr["ever"].update(out.keys_to_store)
                tr["evicted"] += len(out.evicted_keys)
                for k in out.keys_to_store:
                    tr["stored_blocks"][int.from_bytes(bytes(k)[-4:], "big")] += 1
            return out
        mgr.prepare_store = prepare_store

        def ever_prefix(req):
            st = cs._req_status.get(req.request_id)
            if st is None:
                return None
            best = None
            for idx in cs._full_attention_groups:
                gc, gs = cs.config.kv_group_configs[idx], st.group_states[idx]
                n = 0
                for key in gs.offload_keys:
                    if key not in tr["ever"]:
                        break
                    n += 1
                best = n * gc.tokens_per_chunk if best is None else min(best, n * gc.tokens_per_chunk)
            return None if best is None else min(best, req.num_tokens - 1)

        def extra_info(req):
            st = cs._req_status.get(req.request_id)
            if st is None:
                return {}
            from vllm.v1.kv_offload.base import LookupResult
            idx = cs._full_attention_groups[0]
            gc, gs = cs.config.kv_group_configs[idx], st.group_states[idx]
            hits = [cs.manager.lookup(k, st.req_context) is LookupResult.HIT for k in gs.offload_keys]
            fr = next((i for i, x in enumerate(hits) if x), None)
            return {"any_ready_tokens": sum(hits) * gc.tokens_per_chunk,
                    "first_ready_token": None if fr is None else fr * gc.tokens_per_chunk}

    if side is not None and os.environ.get("TAILFIRST"):
        # Experiment: at a request's end, touch its tier entries tail first (head most recent), as vLLM 0.33's LRU
        # ranks a request's chunks, so a partly evicted prefix keeps its head.
        def wrap_rf(orig_rf):
          def request_finished(request, *a, **kw):
            res = orig_rf(request, *a, **kw)
            keys = side.layout.keys(request)
            items = []
            for g in side.groups:
                for i in range(keys.num_blocks(g.index)):
                    k = keys(g.index, i)
                    if side.tier.is_ready(k):
                        items.append(((i + 1) * g.block_size, k))
            items.sort(key=lambda x: x[0])  # tier.touch reverses: head ends most recent
            side.tier.touch([k for _, k in items])
            tr["tailfirst_touched"] = tr.get("tailfirst_touched", 0) + len(items)
            return res
          return request_finished
        self.conn.request_finished = wrap_rf(self.conn.request_finished)
        if hasattr(self.conn, "request_finished_all_groups"):
            self.conn.request_finished_all_groups = wrap_rf(self.conn.request_finished_all_groups)

    rec = self.recorder
    inner = self.conn.get_num_new_matched_tokens

    def lookup(request, num_computed_tokens, *a, **kw):
        res = inner(request, num_computed_tokens, *a, **kw)
        r = rec.reqs.get(request.request_id)
        if r is not None and r.first_hit is None:
            prev = tr["lk"].get(request.request_id, {})
            ei = extra_info(request)
            if request.request_id in SNAP and not prev:
                tr.setdefault("snaps", {})[request.request_id] = snapshot(self)
            first = prev.get("first") or {"ans": res[0], "any_ready": ei.get("any_ready_tokens"),
                                          "first_ready": ei.get("first_ready_token"), "local": num_computed_tokens}
            _lt = _LAST_T.get(id(rec), None)
            tr["lk"][request.request_id] = {"first": first, "t_first": prev.get("t_first", _lt), "t_last": _lt, "local": num_computed_tokens, "ans": res[0],
                                            "ever": ever_prefix(request), **ei,
                                            "n": prev.get("n", 0) + 1, "none": prev.get("none", 0) + (res[0] is None)}
        return res
    self.conn.get_num_new_matched_tokens = lookup


C.ReplayEngine._instrument = _instrument

from offload_bench.replay import metrics as M
_LAST_T = {}
_o_sched = M.Recorder.on_schedule
def _on_schedule(self, out, requests):
    for rid in out.num_scheduled_tokens:
        r = self.reqs.get(rid)
        if r is not None and r.first_hit is None:
            r.sched_t = _LAST_T.get(id(self), 0.0)
            r.sched_n = 0
        if r is not None and getattr(r, "sched_n", None) is not None and r.first_token is None:
            r.sched_n += 1
    return _o_sched(self, out, requests)
M.Recorder.on_schedule = _on_schedule
_o_loaded = M.Recorder.on_loaded
def _on_loaded(self, rid, tokens):
    r = self.reqs.get(rid)
    if r is not None:
        r.loaded_t = _LAST_T.get(id(self))
    return _o_loaded(self, rid, tokens)
M.Recorder.on_loaded = _on_loaded
_o_applied = M.Recorder.on_applied
def _on_applied(self, eo, t):
    res = _o_applied(self, eo, t)
    _LAST_T[id(self)] = t
    return res
M.Recorder.on_applied = _on_applied

_orig_finish = R._finish


def _finish(kind, eng, clock, total, stall_step, reason, wall):
    out = _orig_finish(kind, eng, clock, total, stall_step, reason, wall)
    tr = eng._trace
    rows = []
    cats = Counter()
    for rid, r in eng.recorder.reqs.items():
        if r.first_hit is None:
            continue
        lk = tr["lk"].get(rid, {})
        fh, ru = r.first_hit, r.reusable
        rec = max(0, r.prefill_computed - (r.prompt - ru))
        restor = max(r.cpu_prefix, lk.get("local", 0))
        resident = max(r.resident, restor)
        ever = max(lk.get("ever") or 0, resident)
        lo = fh
        parts = {}
        for name, hi in (("restorable_not_loaded", restor), ("window_missing", resident), ("evicted", ever),
                         ("never_stored", ru)):
            hi = min(max(hi, lo), ru) if ru > lo else lo
            parts[name] = hi - lo
            lo = hi
        pre = max(0, r.prefill_computed - (r.prompt - fh))
        parts["preempt"] = pre
        s = sum(parts.values())
        parts["unexplained"] = rec - s
        for k, v in parts.items():
            cats[k] += v
        rows.append(dict(id=rid, arrival=r.arrival, prompt=r.prompt, reusable=ru, first_hit=fh, local=lk.get("local"),
                         restor=r.cpu_prefix, resident=r.resident, ever=lk.get("ever"), loaded=r.loaded,
                         prefill=r.prefill_computed, recomputed=rec, lookups=lk.get("n"), deferred=lk.get("none"),
                         phase=r.phase, any_ready=lk.get("any_ready_tokens"), first_lookup=lk.get("first"), first_ready=lk.get("first_ready_token"),
                         bias=lk.get("bias"), protected=lk.get("protected"), fa_prefix=lk.get("fa_prefix"),
                         win=lk.get("win"), first_token=r.first_token, sched_t=getattr(r, "sched_t", None),
                         t_lookup_first=lk.get("t_first"), t_lookup_last=lk.get("t_last"), loaded_t=getattr(r, "loaded_t", None),
                         steps_to_first_token=getattr(r, "sched_n", None),
                         ttft=None if r.first_token is None else r.first_token - r.arrival, **{"c_" + k: v for k, v in parts.items()}))
    info = {"connector": kind, "recomputed_total": out.result.tokens_recomputed, "categories": dict(cats),
            "stored_blocks_per_group": dict(tr["stored_blocks"]), "stored_spare_per_group": dict(tr["stored_spare"])}
    side = eng.side
    if side is not None:
        st = side.tier.stats()
        info["tier_stats"] = st.__dict__ if hasattr(st, "__dict__") else str(st)
        info["slot_bytes"] = side.slot_bytes
        info["groups"] = [dict(index=g.index, kind=g.kind.value, block_size=g.block_size, block_bytes=g.block_bytes,
                               window=g.sliding_window, chunk=g.chunk_size, layers=g.num_layers) for g in side.groups]
        per = Counter()
        spare = Counter()
        for k in side.tier.keys():
            per[k[0]] += 1
            if side.tier.is_spare(k):
                spare[k[0]] += 1
        info["tier_entries_per_group"] = dict(per)
        info["tier_spare_entries_per_group"] = dict(spare)
        info["counters"] = {k: v for k, v in side.counters.__dict__.items() if isinstance(v, (int, float))}
        info["window_checkpoint_tokens_resolved"] = getattr(side.layout, "spacing", None)
        try:
            from offload_connector.scheduler.windows import checkpoint_spacing
            info["derived_spacing"] = checkpoint_spacing(side.groups, side.layout.alignment)
            info["alignment"] = side.layout.alignment
        except Exception as e:  # noqa
            info["derived_spacing_err"] = repr(e)
        info["config"] = {k: str(v) for k, v in side.config.__dict__.items() if k != "debug"}
    else:
        info["vllm_evicted_keys"] = tr["evicted"]
        try:
            cs = eng.conn.connector_scheduler
            info["vllm_group_configs"] = [str(gc) for gc in cs.config.kv_group_configs]
            info["vllm_chunk_bytes"] = eng.vllm_chunk_bytes()
            info["vllm_num_chunks"] = cs.manager._num_chunks
        except Exception as e:  # noqa
            info["vllm_err"] = repr(e)
    info["snaps"] = tr.get("snaps", {})
    info["tailfirst_touched"] = tr.get("tailfirst_touched")
    info["block_id_bytes"] = str(eng.block_bytes)
    with open(OUT.replace(".json", f".{kind}.json"), "w") as f:
        json.dump({"info": info, "rows": rows}, f)
    print("TRACE", kind, json.dumps(info["categories"]), file=sys.stderr)
    return out


R._finish = _finish

from offload_bench.cli import main  # noqa: E402

sys.exit(main(ARGS))
