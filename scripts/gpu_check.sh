#!/usr/bin/env bash
# The GPU checks (issue 22) on a machine with a CUDA GPU, PyTorch, transformers and Triton:
# `pytest -m gpu`, then `textgen bench` on the SmolLM2-135M and Llama-3.2-1B shapes (random
# weights, bf16, 128-token prompts, 128 new tokens) at 1, 32 and 256 streams, with the
# in-process engine beside the server at 32 and the batch-1 memory roofline. Results land in
# DIR: gpu.txt, pytest.txt, bench.log and one JSON report per bench run.
#   [SKIP_PYTEST=1] [SHAPES="smollm2-135m llama-3.2-1b"] [STAGES="c32 c1"] \
#       scripts/gpu_check.sh DIR
# STAGES: c32 (32 and 256 streams, the in-process engine at 32), c1 (1 stream and --ceiling),
# c256 (256 streams alone)
set -u
out=${1:-gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, transformers, triton; print('torch', torch.__version__,
'transformers', transformers.__version__, 'triton', triton.__version__)"
    echo "cpus $(nproc)"
} >>"$out/gpu.txt" 2>&1
if [ -z "${SKIP_PYTEST:-}" ]; then
    timeout "${PYTEST_TIMEOUT:-150}" python3 -m pytest -m gpu -q -p no:cacheprovider \
        tests/worker/test_cuda_path.py tests/worker/test_triton_attention.py \
        tests/worker/test_flash_attention.py >"$out/pytest.txt" 2>&1
    echo "pytest exit $?" >>"$out/gpu.txt"
fi
bench() {  # NAME SHAPE ARGS...
    local name=$1 shape=$2 started=$SECONDS
    shift 2
    echo "=== $name" >>"$out/bench.log"
    timeout "${BENCH_TIMEOUT:-150}" python3 -m services.launcher.cli bench --random-model "$shape" \
        --input-len-range 128:128 --output-len-range 128:128 --json --no-progress "$@" \
        >"$out/$name.json" 2>>"$out/bench.log"
    echo "$name exit $? in $((SECONDS - started)) s" >>"$out/gpu.txt"
}
# the launched server keeps 16 GB of KV cache (the in-process engine loads beside it) and
# admits 512 requests (TGI's default of 128 would turn 256 streams away)
memory=(--launch-arg=--kv-cache-memory --launch-arg=16000000000
    --launch-arg=--max-concurrent-requests --launch-arg=512)
shapes=${SHAPES:-smollm2-135m llama-3.2-1b}
for stage in ${STAGES:-c32 c1}; do
    for shape in $shapes; do
        case $stage in
        c32) bench "$shape-c32-c256" "$shape" --concurrency 32,256 --num-requests 512 \
            --compare-inprocess "${memory[@]}" ;;
        c1) bench "$shape-c1" "$shape" --concurrency 1 --num-requests ${C1_REQUESTS:-16} --ceiling "${memory[@]}" ;;
        c256) bench "$shape-c256" "$shape" --concurrency 256 --num-requests 512 "${memory[@]}" ;;
        esac
    done
done
