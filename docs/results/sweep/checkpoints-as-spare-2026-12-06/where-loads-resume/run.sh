# Run from the repository root: LAYOUTS=<the layouts/ folder a layout-sweep writes> bash <this file>
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_TARGET_DEVICE=cpu PYTHONPATH=$PWD:$PWD/benchmarks
E=${E:-.venv-vllm033}  # the vLLM 0.33 environment that scripts/setup-envs links
o=$(cd "$(dirname "$0")" && pwd)
L=${LAYOUTS:?set LAYOUTS to the layouts/ folder of a layout-sweep run}
run() { name=$1; shift; $E/bin/python $o/ckpt.py replay "$@" --connectors offload --no-progress --json $o/$name.json > $o/$name.txt 2>&1; grep RESUMES $o/$name.txt | sed "s/^/$name /" >> $o/resumes.txt; }
run gptoss-w128-b64-mooncake --model $L/gpt-oss-w128-b64/config.json --trace mooncake-synthetic --block-size 64 --limit 1000
run gptoss-w1024-b16-mooncake --model $L/gpt-oss-w1024-b16/config.json --trace mooncake-synthetic --block-size 16 --limit 1000
run gemma31b-mooncake --model gemma-4-31b --trace mooncake-synthetic
run gptoss20b-decode-heavy --model gpt-oss-20b --trace decode-heavy
run gptoss20b-rag --model gpt-oss-20b --trace rag-shared-docs
run gptoss-w128-b64-decode-heavy --model $L/gpt-oss-w128-b64/config.json --trace decode-heavy --block-size 64
run gemma-w128-k1-b16-decode-heavy --model $L/gemma4-w128-k1-b16/config.json --trace decode-heavy --block-size 16
echo done >> $o/resumes.txt
