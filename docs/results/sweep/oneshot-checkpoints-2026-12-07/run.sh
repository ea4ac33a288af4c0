# Run from a checkout with oneshot-checkpoints.diff applied: LAYOUTS=<the layouts/ folder a layout-sweep writes> bash <this file> OUT
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_TARGET_DEVICE=cpu PYTHONPATH=$PWD:$PWD/benchmarks
E=${E:-.venv-vllm033}  # the vLLM 0.33 environment that scripts/setup-envs links
L=${LAYOUTS:?set LAYOUTS to the layouts/ folder of a layout-sweep run}
O=${1:?an output folder}; mkdir -p $O
run() { name=$1; shift; $E/bin/offload-connector replay "$@" --connectors offload --no-progress --json $O/$name.json > $O/$name.txt 2>&1; }
run gpt-oss-w128-b64--decode-heavy --model $L/gpt-oss-w128-b64/config.json --trace decode-heavy --block-size 64
run gemma4-w128-k1-b16--decode-heavy --model $L/gemma4-w128-k1-b16/config.json --trace decode-heavy --block-size 16
run decode-heavy--gpt-oss-20b --model gpt-oss-20b --trace decode-heavy
run rag-shared-docs--gpt-oss-20b --model gpt-oss-20b --trace rag-shared-docs
run gpt-oss-w128-b64--mooncake-synthetic --model $L/gpt-oss-w128-b64/config.json --trace mooncake-synthetic --block-size 64 --limit 1000
run mooncake-synthetic--gemma-4-31b --model gemma-4-31b --trace mooncake-synthetic
run gpt-oss-w1024-b16--mooncake-synthetic --model $L/gpt-oss-w1024-b16/config.json --trace mooncake-synthetic --block-size 16 --limit 1000
run gemma4-w128-k1-b16--mooncake-synthetic --model $L/gemma4-w128-k1-b16/config.json --trace mooncake-synthetic --block-size 16 --limit 1000
run gemma4-w1024-k3-b64--mooncake-synthetic --model $L/gemma4-w1024-k3-b64/config.json --trace mooncake-synthetic --block-size 64 --limit 1000
run gemma4-w512-k5-b16--deepseek-v4-flash-1m --model $L/gemma4-w512-k5-b16/config.json --trace deepseek-v4-flash-1m --block-size 16
run gemma4-w128-k1-b16--rag-shared-docs --model $L/gemma4-w128-k1-b16/config.json --trace rag-shared-docs --block-size 16
