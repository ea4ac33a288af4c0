"""This folder's cases (`window_checkpoint_tokens: 0`: every checkpoint a spare window) against the sweep at 85e5eb7
(derived checkpoints), and the nine rows against the 85e5eb7 runs. Run from this folder: python3 compare_with_85e5eb7.py sweep.jsonl"""
import json,sys
old={(r['layout'],r['workload']):r for r in map(json.loads,open('../../sweep-85e5eb7/sweep.jsonl'))}
rows=[json.loads(l) for l in open(sys.argv[1])]
ident=0; better=[]; worse=[]
fmt=lambda r:'%.4f / %.4f / %.4f / %s'%(r['throughput'],r['TTFT p50'],r['TTFT p95'],'%.3f'%r['recomputed'] if r['recomputed'] is not None else 'None')
print('| layout | workload | checkpoints as spare: thr / p50 / p95 / recompute | derived (85e5eb7) | host KiB / token without spares, ours (cp0 / derived) / patched | outside (cp0) |')
print('|---|---|---|---|---|---|')
for r in rows:
    o=old[(r['layout'],r['workload'])]
    keys=['throughput','TTFT p50','TTFT p95','recomputed_tokens']
    same=all(r[k]==o[k] for k in keys)
    ident+=same
    if not same:
        print(f"| {r['layout']} | {r['workload']} | {fmt(r)} | {fmt(o)} | {r['host_kib_per_cached_token_without_spare'][0]} / {o['host_kib_per_cached_token'][0]} / {r['host_kib_per_cached_token_without_spare'][1]} | {', '.join(r['outside']) or '-'} |")
print('identical (throughput, TTFT, recomputed tokens):',ident,'of',len(rows))
print('outside cp0:',sum(1 for r in rows if r['outside']),'outside base among these:',sum(1 for r in rows if old[(r['layout'],r['workload'])]['outside']))
