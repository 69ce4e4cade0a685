#!/usr/bin/env bash
# The GPU checks, on one CUDA device in under 5 minutes, after `pip install -e ".[test,cuda]"` with a CUDA torch:
#   bash bench/gpu_check.sh
# 1. memory profile: a worker sizes its KV cache from a profile forward, allocates it and captures its CUDA graphs;
# 2. greedy parity with transformers on CUDA: the torch path and the Triton kernel, CUDA graphs replayed and
#    --enforce-eager, float32 token for token; bfloat16 logits within the tests' BF16_LOGIT_TOL (5% of the
#    logits' std) of transformers' float32;
# 3. the Triton kernel compiled for the GPU against the torch path and dense attention;
# 4. output tok/s of a ~1B-parameter model written by `kvengine make-model` (hidden 2048, 24 layers, 16/8 heads,
#    random weights) at 64 and 256 concurrent requests, with and without CUDA graphs, beside HF generate.
# Each part runs under `timeout`, all within BUDGET_S seconds; everything written goes to one temp dir, removed at
# the end. DEVICE=cpu runs the parts that can run without a GPU (a dry run of the script: small model, no graphs).
set -uo pipefail
cd "$(dirname "$0")/.."

DEVICE=${DEVICE:-cuda}
if [ "$DEVICE" = cuda ]; then SCALE=1; else SCALE=4; fi  # a CPU dry run (2 cores, kernels compiled) takes longer
BUDGET_S=${BUDGET_S:-$((290 * SCALE))}
if [ "$DEVICE" = cuda ]; then
    python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
        echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False): nothing to check." >&2
        echo "gpu_check: DEVICE=cpu bash bench/gpu_check.sh runs the parts that need no GPU." >&2
        exit 1
    }
    MODEL_ARGS=(--hidden-size 2048 --num-layers 24 --num-heads 16 --num-kv-heads 8 --intermediate-size 4096
                --vocab-size 32000)
    CONCURRENCY=${CONCURRENCY:-64,256}
    BENCH_ARGS=()
else
    MODEL_ARGS=(--hidden-size 256 --num-layers 4 --num-heads 8 --num-kv-heads 4 --intermediate-size 512
                --vocab-size 1024)
    CONCURRENCY=${CONCURRENCY:-4,8}
    BENCH_ARGS=(--input-len 32 --output-len 16 --kv-cache-gib 1)
fi

TMP=$(mktemp -d -t kvengine-gpu-check.XXXXXX)
trap 'rm -rf "$TMP"' EXIT
# every cache the parts would fill lives in TMP
export XDG_CACHE_HOME="$TMP/cache" TRITON_CACHE_DIR="$TMP/triton" CUDA_CACHE_PATH="$TMP/nv" HF_HOME="$TMP/hf"
export PYTHONDONTWRITEBYTECODE=1 KVENGINE_TEST_DEVICE="$DEVICE"
unset TRITON_INTERPRET
PYTEST=(python -m pytest -q -p no:cacheprovider --basetemp "$TMP/pytest")
START=$SECONDS
NAMES=() RESULTS=() TIMES=()

# part NAME LIMIT_S CMD...: run CMD under timeout, at most LIMIT_S and what is left of BUDGET_S
part() {
    local name=$1 limit=$(($2 * SCALE)) left=$((BUDGET_S - (SECONDS - START))) t0=$SECONDS rc
    shift 2
    [ "$left" -lt "$limit" ] && limit=$left
    echo
    echo "== $name (at most ${limit} s)"
    if [ "$limit" -le 0 ]; then
        rc=124
    else
        timeout "$limit" "$@"
        rc=$?
    fi
    case $rc in 0) r=ok ;; 124) r="TIMED OUT" ;; 5) r="nothing ran" ;; *) r="FAILED (exit $rc)" ;; esac
    NAMES+=("$name") RESULTS+=("$r") TIMES+=($((SECONDS - t0)))
}

python - <<'PY'
import torch
name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
try:
    import triton
    tv = triton.__version__
except ImportError:
    tv = "not installed"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {tv}, {name}")
PY

# The model is written on the CPU while the GPU parts run.
kvengine make-model "$TMP/model" "${MODEL_ARGS[@]}" >"$TMP/make-model.log" 2>&1 &
MAKE_PID=$!

if [ "$DEVICE" = cuda ]; then
    part "memory profile, KV cache and CUDA graph capture (built-in tiny model)" 60 python - <<'PY'
import logging, torch
logging.basicConfig(level=logging.INFO, format="%(message)s")
from protocol.config import engine_config
from protocol.kv_cache_spec import bytes_per_block, group_layers
from tests.worker.harness import kv_config
from worker.worker import Worker
w = Worker(engine_config(device="cuda", max_model_len=4096, max_num_batched_tokens=8192))
r = w.report_kv()
print(r.memory_detail)
free, total = torch.cuda.mem_get_info()
assert 0 < r.available_kv_bytes < total, r.available_kv_bytes
blocks = r.available_kv_bytes // bytes_per_block(group_layers(w.kv_cache_specs()))
w.init_kv_cache(kv_config(w, blocks))
print(f"{blocks} KV blocks allocated; CUDA graphs for decode sizes {sorted(w.runner.graphs.graphs)}")
assert sorted(w.runner.graphs.graphs) == w.runner.cuda_graph_sizes
PY
fi

part "greedy parity with transformers on $DEVICE: the torch path (float32)" 90 \
    "${PYTEST[@]}" tests/worker/test_worker_parity.py -k "ragged or chunked or padded_steps or second_wave"
part "greedy parity on $DEVICE: Triton kernel, CUDA graphs vs --enforce-eager (float32), bf16 logits" 90 \
    "${PYTEST[@]}" -rs tests/worker/test_cuda_graphs_gpu.py
part "Triton kernel compiled for $DEVICE vs the torch path and dense attention" 90 \
    "${PYTEST[@]}" -rs tests/worker/test_triton_attention_gpu.py

echo
echo "== waiting for kvengine make-model ${MODEL_ARGS[*]}"
if wait "$MAKE_PID"; then
    cat "$TMP/make-model.log"
    part "output tok/s: engine with CUDA graphs, --enforce-eager, HF generate" 240 \
        python -m bench.gpu_bench --model "$TMP/model" --device "$DEVICE" --concurrency "$CONCURRENCY" \
        ${BENCH_ARGS[@]+"${BENCH_ARGS[@]}"}
else
    cat "$TMP/make-model.log"
    NAMES+=("kvengine make-model") RESULTS+=("FAILED") TIMES+=(0)
fi

echo
echo "== gpu_check on $DEVICE: $((SECONDS - START)) s"
failed=0
printf '%-100s  %-16s  %s\n' part result seconds
for i in "${!NAMES[@]}"; do
    printf '%-100s  %-16s  %s\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${TIMES[$i]}"
    [ "${RESULTS[$i]}" = ok ] || failed=1
done
exit $failed
