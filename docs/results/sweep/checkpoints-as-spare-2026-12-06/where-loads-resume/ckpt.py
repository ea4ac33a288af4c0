"""Where loads resume: at a checkpoint-only store point (a multiple of the spacing that no other rule asked for),
or elsewhere (prompt ends, the last boundaries, junctions, spare windows). Instrumentation for one replay column."""
import sys, json, collections
from offload_connector.scheduler import stores as S
from offload_bench.replay import metrics as M

cur = {}
reason = {}  # prefix hash at a point -> set of reasons
stored_ckpt = collections.Counter()
orig_sp = S.store_points
def store_points(scanned, upto, prompt_tokens, alignment, spacing, junctions=(), resend_upper=None):
    pts = orig_sp(scanned, upto, prompt_tokens, alignment, spacing, junctions, resend_upper)
    req = cur.get("r")
    if req is None:
        return pts
    other = set(orig_sp(scanned, upto, prompt_tokens, alignment, 0, junctions, resend_upper))
    hbs = cur["hbs"]
    for p in pts:
        h = req.block_hashes[p // hbs - 1] if p // hbs - 1 < len(req.block_hashes) else None
        if h is None:
            continue
        why = "other" if p in other else "checkpoint"
        reason.setdefault(h, set()).add(why)
        if why == "checkpoint":
            stored_ckpt["points"] += 1
    return pts
S.store_points = store_points
orig_plan = S.StorePlanner.plan
def plan(self, state, computed, block_ids):
    cur["r"] = state.request; cur["hbs"] = self.layout.hash_block_size if hasattr(self.layout, "hash_block_size") else None
    try:
        return orig_plan(self, state, computed, block_ids)
    finally:
        cur["r"] = None
S.StorePlanner.plan = plan
reqs = {}
orig_arr = M.Recorder.on_arrival
def on_arrival(self, request, t, phase=""):
    reqs[request.request_id] = request
    return orig_arr(self, request, t, phase)
M.Recorder.on_arrival = on_arrival
saved = []
orig_sum = M.Recorder.summary
def summary(self, *a, **k):
    out = collections.Counter()
    for rid, r in self.reqs.items():
        if not r.loaded or r.first_hit is None:
            continue
        p = r.first_hit; req = reqs[rid]; h = req.block_hashes[p // self.hbs - 1]
        why = reason.get(h, set())
        cls = "checkpoint" if why == {"checkpoint"} else ("other" if why else "spare/none")
        out[cls + "_loads"] += 1; out[cls + "_tokens"] += r.loaded
    out["checkpoint_points_stored"] = stored_ckpt["points"]
    saved.append(dict(out))
    return orig_sum(self, *a, **k)
M.Recorder.summary = summary
from offload_bench.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print("RESUMES", json.dumps(saved))
