"""The parts of CUDA graph decode that run on the CPU: capture sizes, the bucket a batch runs as, padded decode
batches on the persistent step buffers (exactly transformers' greedy tokens in float32), and the eager fall-back
for batches that are not pure decodes or are larger than the largest size. Capture and replay themselves are in
test_cuda_graphs_gpu.py (CUDA only)."""

import numpy as np
import pytest
import torch

from tests.worker.harness import Driver, hf_greedy
from tests.worker.parity_support import FAMILIES, padded_worker, prompts, record_fills
from worker.cuda_graphs import cuda_graph_sizes, decode_bucket, default_capture_sizes
from worker.input_buffers import StepBuffers
from worker.model.tiny import write_model

pytest.importorskip("transformers")


def test_default_capture_sizes_follow_vllm():
    assert default_capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert default_capture_sizes(3) == [1, 2, 3]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_capture_sizes(1024)[-1] == 512


def test_graphs_only_where_they_can_run():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert cuda_graph_sizes(cuda, False, "triton", 1, 8) == [1, 2, 4, 8]
    assert cuda_graph_sizes(cuda, True, "triton", 1, 8) is None  # --enforce-eager
    assert cuda_graph_sizes(cpu, False, "cpu", 1, 8) is None
    assert cuda_graph_sizes(cuda, False, "torch", 1, 8) is None  # the torch path plans its spans on the host
    assert cuda_graph_sizes(cuda, False, "triton", 2, 8) is None


@pytest.mark.parametrize(("counts", "bucket"), [
    ([1], 2), ([1, 1], 2), ([1] * 3, 4), ([1] * 4, 4), ([1] * 8, 8),
    ([1] * 9, None),  # larger than the largest size: eager
    ([1, 5, 1], None),  # a prefill chunk among decodes: eager
    ([], None),
])
def test_decode_bucket(counts, bucket):
    assert decode_bucket([2, 4, 8], counts) == bucket
    assert decode_bucket(None, counts) is None  # graphs off (--enforce-eager, CPU)


def test_step_buffers_are_filled_in_place():
    buf = StepBuffers(64, 8, 4, 2, torch.device("cpu"))
    plan = [(5, 1), (0, 7), (30, 3)]  # (num_computed, num_scheduled) per request
    ids = list(range(100, 111))
    reqs = buf.fill(ids, [6, 0, 3], [c for c, _ in plan], [n for _, n in plan], 16, 0)
    assert reqs.positions.tolist() == [5, *range(7), 30, 31, 32]
    assert reqs.token_rows.tolist() == [6] + [0] * 7 + [3] * 3
    assert reqs.query_start.tolist() == [0, 1, 8]
    assert reqs.query_start_loc.tolist() == [0, 1, 8, 11] and reqs.query_start_loc.dtype == torch.int32
    assert reqs.seq_lens.tolist() == [6, 7, 33] and reqs.max_query_len == 7
    assert buf.padded_input_ids(16).tolist() == ids + [0] * 5
    assert buf.padded_positions(16)[11:].tolist() == [0] * 5
    # every tensor is a view of a buffer allocated once
    assert reqs.positions.data_ptr() == buf.positions.device.data_ptr()
    assert reqs.seq_lens.data_ptr() == buf.seq_lens.device.data_ptr()

    again = buf.fill([9, 9], [1, 2], [40, 50], [1, 1], 4, 4)  # a decode batch padded to 4 requests
    assert again.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert again.seq_lens.tolist() == [41, 51, 1, 1] and again.max_query_len == 1
    assert buf.padded_positions(4).tolist() == [40, 50, 0, 0]

    tables = [torch.arange(8 * 4, dtype=torch.int32).view(8, 4) + 1 for _ in range(2)]
    rows = buf.gather_block_tables(tables, again.rows, 4, 4, pad_block=99)
    assert rows[0][:2].tolist() == [[5, 6, 7, 8], [9, 10, 11, 12]]
    assert rows[1][2:, 0].tolist() == [99, 99]  # padding requests' one key lives in the pad block
    assert rows[0].data_ptr() == buf.block_tables[0].data_ptr()

    assert buf.sample_indices([0, 1], 2) is None  # a decode step samples its rows in order
    buf.fill(ids, [6, 0, 3], [c for c, _ in plan], [n for _, n in plan], 11, 0)
    assert buf.sample_indices([0, 2], 3).tolist() == [0, 10]
    with pytest.raises(ValueError, match="exceeds the buffers"):
        buf.fill([1] * 65, [0], [0], [65], 65, 0)


@pytest.fixture(scope="module", params=["llama", "qwen2_sliding"])
def folder(request, tmp_path_factory):
    spec = dict(FAMILIES[request.param])
    return write_model(tmp_path_factory.mktemp(request.param), spec.pop("architecture"), eos_token_id=None, **spec)


LENGTHS = [3, 17, 40, 75, 9]
OUT_LENS = [10, 8, 6, 4, 2]  # decode batches shrink 5 -> 1, so most are padded


def expected(folder, ps):
    return [out[:n] for out, n in zip(hf_greedy(folder, ps, max(OUT_LENS)), OUT_LENS, strict=True)]


def test_padded_decode_batches_match_transformers_and_the_unpadded_run(folder):
    ps = prompts(LENGTHS, seed=4)
    w, cfg = padded_worker(folder, [2, 4])
    steps = record_fills(w)
    padded = Driver(w, cfg).run(ps, OUT_LENS)
    plain_w, plain_cfg = padded_worker(folder, None)
    assert padded == Driver(plain_w, plain_cfg).run(ps, OUT_LENS) == expected(folder, ps)
    assert (3, 4, 4) in steps and (1, 2, 2) in steps and (2, 2, 2) in steps  # decodes padded to a size
    assert (5, 5, 0) in steps  # 5 decodes: more than the largest size, eager and unpadded
    assert steps[0] == (5, sum(LENGTHS), 0)  # the prefill: eager
    pad = w.runner.kv.pad_block
    assert all(kv[:, :, pad, 0].abs().sum() > 0 for kv in w.runner.kv.kv_tensors)  # the padding's K/V went there
    assert all(kv[:, :, pad, 1:].abs().sum() == 0 for kv in w.runner.kv.kv_tensors)  # and only to its first slot


def test_chunked_prefill_beside_decodes_runs_eagerly(folder):
    """A step mixing prefill chunks with decodes is not padded; its tokens stay transformers'."""
    ps = prompts(LENGTHS, seed=5)
    w, cfg = padded_worker(folder, [1, 2, 4, 8])
    steps = record_fills(w)
    assert Driver(w, cfg, chunk=7).run(ps, OUT_LENS) == expected(folder, ps)
    assert all(padded_reqs == 0 for n, tokens, padded_reqs in steps if tokens > n)  # steps with a chunk: eager
    assert any(padded_reqs > 0 for _, _, padded_reqs in steps)  # the pure decode steps went the graph way


def test_block_tables_change_on_the_host_without_tensors_per_change(folder):
    w, cfg = padded_worker(folder, None)
    table = w.runner.kv.tables.groups[0]
    assert table.table is table.host  # on the CPU the host table is the one the kernels read
    Driver(w, cfg).run(prompts([40]), 3)
    assert isinstance(table.np, np.ndarray) and not table.changed  # committed by the step
    table.overwrite(7, [5, 6])
    table.append(3, [9])
    assert table.changed == range(3, 8)  # on CUDA, the span of rows copied to the device at the next commit
    table.commit()
    assert not table.changed and table.block_ids(7) == [5, 6]
