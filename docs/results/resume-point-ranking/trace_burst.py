"""Prints the hit, the full-attention prefix and the upper bound of every long request of gpt-oss-w128-b64 on the
million-token trace. Run from the repository root: PYTHONPATH=.:benchmarks python docs/results/resume-point-ranking/trace_burst.py"""
import sys, json
sys.argv = sys.argv[:1]
from offload_connector.scheduler import admission as adm
from offload_connector.scheduler.lookup import full_prefix_tokens
orig = adm.AdmissionControl.hit
def hit(self, request, upper, local=0, step=0):
    h = orig(self, request, upper, local, step)
    if request.num_prompt_tokens > 30000:
        keys = self.layout.keys(request)
        full = full_prefix_tokens(self.layout.groups, keys, self.tier.is_ready, upper)
        missing = {}
        for g in self.layout.groups:
            if g.recycling:
                p = full - full % self.layout.alignment
                missing[g.index] = [i for i in g.restore_range(p) if not self.tier.is_ready(keys(g.index, i))]
        print(f"TRACE {request.request_id} prompt={request.num_prompt_tokens} upper={upper} local={local} hit={h} full={full} missing_at_full={missing} hashed={keys.hashed_tokens()}", flush=True)
    return h
adm.AdmissionControl.hit = hit
from offload_bench.cli import main
main(["replay", "--model", "docs/results/sweep/layouts/gpt-oss-w128-b64/config.json", "--trace", "deepseek-v4-flash-1m",
      "--connectors", "offload", "--no-progress", "--json", "/tmp/tb.json", "--block-size", "64"])
