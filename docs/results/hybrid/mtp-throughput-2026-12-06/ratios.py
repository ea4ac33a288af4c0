"""Ratios ours / vLLM's connector of the runs in a folder: python3 ratios.py stream (or per-position)."""
import json,glob,os,sys
for f in sorted(glob.glob(sys.argv[1]+'/*.json')):
    d=json.load(open(f)); c={r['connector']:r for r in d['results']}
    a,b=c['offload'],c['vllm-offloading']
    print('%-55s thr(sim end) %.5f  thr(last token) %.5f  p50 %.4f p95 %.4f rec %s/%s  last token %.4f / %.4f  sim end %.4f / %.4f' % (os.path.basename(f)[:-5],
      a['output_tokens_per_s']/b['output_tokens_per_s'], a['extra']['output_tokens_per_s_to_last_token']/b['extra']['output_tokens_per_s_to_last_token'],
      a['ttft_p50_s']/b['ttft_p50_s'], a['ttft_p95_s']/b['ttft_p95_s'], a['tokens_recomputed'], b['tokens_recomputed'],
      a['extra']['last_token_s'], b['extra']['last_token_s'], a['simulated_seconds'], b['simulated_seconds']))
