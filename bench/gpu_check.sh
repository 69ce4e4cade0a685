#!/usr/bin/env bash
# On a CUDA machine (< 5 minutes): the CUDA memory profile of a worker, a TP=1 parity test of the
# worker on the GPU against transformers on the CPU, and the model bench (quick workloads).
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: nothing to check')"

echo "== CUDA memory profile (built-in tiny model, profile forward of 8192 tokens)"
python - <<'PY'
import logging, torch
logging.basicConfig(level=logging.INFO)
from worker.worker import Worker
w = Worker(device="cuda", max_model_len=4096, max_num_batched_tokens=8192)
r = w.report_kv()
print(r.memory_detail)
free, total = torch.cuda.mem_get_info()
assert 0 < r.available_kv_bytes < total, r.available_kv_bytes
PY

echo "== TP=1 parity on CUDA (float32)"
KVENGINE_TEST_DEVICE=cuda timeout 150 python -m pytest -q -p no:cacheprovider \
    tests/worker/test_worker_parity.py -k "ragged or chunked"

echo "== model bench"
timeout 150 python bench/model_bench.py --device cuda --quick
