"""The Triton paged attention kernel, run by Triton's interpreter on CPU tensors, against the torch path and
dense fp64 attention; and the worker's greedy tokens with it against transformers'.

TRITON_INTERPRET=1 is set here, before triton is first imported, so the kernels run on the CPU.
"""

import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

pytest.importorskip("triton", reason="triton is an optional extra: pip install 'kvengine[cuda]'")

from tests.worker.attention_support import Batch, check_new_keys_landed, make_batch
from worker.attention import GatherBuffer, StepRequests, build_metadata, paged_attention
from worker.attention_backends import TritonAttention, resolve_backend
from worker.ops.triton_attention import (
    TritonAttentionMetadata,
    paged_attention_triton,
    triton_paged_attention,
)

SMALL = [(37, 1), (0, 21), (50, 30), (1, 1), (70, 1), (32, 16), (0, 1), (90, 5), (7, 1)]  # MIXED, shorter


def triton_meta(b: Batch) -> TritonAttentionMetadata:
    counts = b.meta.query_start_loc[1:] - b.meta.query_start_loc[:-1]
    return TritonAttentionMetadata(**vars(b.meta), max_query_len=int(counts.max()))


def run(b: Batch) -> torch.Tensor:
    return triton_paged_attention(b.q, b.k, b.v, b.cache, triton_meta(b), b.q.shape[-1] ** -0.5).view(b.q.shape)


def step_requests(plan) -> StepRequests:
    counts, computed = torch.tensor([n for _, n in plan]), torch.tensor([c for c, _ in plan])
    rows = torch.arange(len(plan))
    return StepRequests(
        rows=rows,
        num_computed=computed,
        num_scheduled=counts,
        query_start=torch.cumsum(counts, 0) - counts,
        positions=torch.cat([torch.arange(c, c + n) for c, n in plan]),
        token_rows=torch.repeat_interleave(rows, counts),
    )


def torch_path(b: Batch, plan, block_size, window) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference path's output and cache, on a copy of the cache with the NaN slots zeroed
    (it reads whole blocks, unwritten slots included)."""
    cache = b.cache.nan_to_num(0.0)
    kv_heads, hd = cache.shape[1], cache.shape[4]
    meta = build_metadata(b.table, block_size, window, step_requests(plan), kv_bytes_per_token=2 * kv_heads * hd * 4)
    buffer = GatherBuffer(1024, kv_heads, hd, b.q.dtype, "cpu")
    return paged_attention(b.q, b.k, b.v, cache, meta, buffer, hd**-0.5).view(b.q.shape), cache


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 8), (8, 2), (8, 1)])
def test_mixed_batch_equals_the_torch_path_and_dense(heads, kv_heads, block_size, window):
    """Ragged prefills over cached prefixes and decodes with scattered blocks, in one launch; unowned blocks
    and the null block hold NaN, which must not reach any output."""
    b = make_batch(SMALL, heads, kv_heads, 32, block_size, window)
    expected, torch_cache = torch_path(b, SMALL, block_size, window)
    out = run(b)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), b.expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b.cache.nan_to_num(0.0), torch_cache, rtol=0, atol=0)  # the same slots written


HALF_TOL = 2e-2  # as the CPU kernel's bf16 bound, plus the probabilities rounded to half precision for P @ V


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype):
    b = make_batch(SMALL, 8, 2, 32, 16, 40, dtype)
    out = run(b)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), b.expected, atol=HALF_TOL, rtol=HALF_TOL)


def test_head_size_not_a_power_of_two_and_a_long_chunk():
    plan = [(150, 70), (5, 1), (0, 66)]  # chunks longer than one tile of query rows
    b = make_batch(plan, 6, 3, 40, 16, 33)
    torch.testing.assert_close(run(b).double(), b.expected, atol=1e-5, rtol=1e-5)


def test_sliding_window_reads_no_null_block():
    b = make_batch([(300, 1), (250, 40)], 4, 2, 32, 16, 32)
    assert (b.table[:, :10] == 0).all()  # the skipped blocks are null, and block 0 holds NaN
    assert torch.isnan(b.cache[:, :, 0]).all()
    out = run(b)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), b.expected, atol=1e-5, rtol=1e-5)


def test_new_keys_land_at_their_slots():
    b = make_batch([(20, 3), (0, 17)], 4, 2, 32, 16)
    run(b)
    check_new_keys_landed(b)


def test_swapping_two_block_ids_changes_the_output():
    b = make_batch([(64, 1), (40, 8)], 4, 2, 32, 16)
    before = run(b)  # also writes the new tokens
    table = b.meta.block_table.clone()
    table[1, [0, 2]] = table[1, [2, 0]]  # request 1's queries at 40..47 now see other keys at positions 0..15
    after = paged_attention_triton(b.q, b.cache, triton_meta(b), 32**-0.5, block_table=table).view(b.q.shape)
    assert not torch.allclose(before[1:], after[1:])
    torch.testing.assert_close(before[:1], after[:1], rtol=0, atol=0)  # request 0 is untouched


def test_the_backend_builds_the_cpu_kernels_metadata_from_the_step_buffers():
    from worker.input_buffers import StepBuffers

    table = torch.randint(1, 50, (4, 20), dtype=torch.int32)
    plan = [(5, 3), (40, 1), (0, 9)]
    buf = StepBuffers(64, 4, 20, 1, torch.device("cpu"))
    reqs = buf.fill(list(range(13)), [2, 0, 3], [c for c, _ in plan], [n for _, n in plan], 13, 0)
    rows = buf.gather_block_tables([table], reqs.rows, 3, 0, pad_block=0)[0]
    meta = TritonAttention(16).metadata(rows, 24, reqs)
    assert meta.max_query_len == 9 and meta.window == 24
    assert meta.query_start_loc.tolist() == [0, 3, 4, 13] and meta.seq_lens.tolist() == [8, 41, 9]
    assert torch.equal(meta.block_table, table[[2, 0, 3], :3])


def test_resolve_backend(monkeypatch):
    assert resolve_backend("triton", torch.device("cpu")) == "triton"  # TRITON_INTERPRET=1 is set here
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="only with TRITON_INTERPRET=1"):
        resolve_backend("triton", torch.device("cpu"))


def test_without_triton_the_worker_imports_and_auto_falls_back_to_torch():
    code = (
        "import sys; sys.modules['triton'] = None; import torch; import worker.worker;"
        "from worker.attention_backends import resolve_backend;"
        "print(resolve_backend('auto', torch.device('cuda'))); resolve_backend('triton', torch.device('cuda'))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False)
    assert done.stdout.strip() == "torch"
    assert "Attention falls back to the torch path: triton is not installed" in done.stderr
    assert "ValueError: --attention-backend triton: triton is not installed" in done.stderr


@pytest.mark.parametrize("family_name", ["llama", "qwen2_sliding"])
def test_worker_greedy_tokens_equal_transformers(tmp_path, family_name):
    pytest.importorskip("transformers")
    from tests.worker.harness import Driver, hf_greedy
    from tests.worker.parity_support import FAMILIES, make_worker, prompts
    from worker.model.tiny import write_model

    spec = dict(FAMILIES[family_name])
    folder = write_model(tmp_path, spec.pop("architecture"), eos_token_id=None, **spec)
    ragged = prompts([3, 17, 40])
    w, cfg = make_worker(folder, "triton")
    assert isinstance(w.runner.kv.attention, TritonAttention)
    assert Driver(w, cfg, chunk=16).run(ragged, 6) == hf_greedy(folder, ragged, 6)


def test_padded_decode_batches_equal_transformers(tmp_path):
    """The batches a CUDA graph replays, decodes padded with one-token requests on the pad block, through the
    Triton kernel (the interpreter here; on CUDA test_cuda_graphs_gpu.py replays them)."""
    pytest.importorskip("transformers")
    from tests.worker.harness import Driver, hf_greedy
    from tests.worker.parity_support import FAMILIES, padded_worker, prompts, record_fills
    from worker.model.tiny import write_model

    spec = dict(FAMILIES["qwen2_sliding"])
    folder = write_model(tmp_path, spec.pop("architecture"), eos_token_id=None, **spec)
    ragged, out_lens = prompts([3, 17, 40]), [5, 3, 1]
    w, cfg = padded_worker(folder, [2, 4], backend="triton")
    steps = record_fills(w)
    expected = [out[:n] for out, n in zip(hf_greedy(folder, ragged, 5), out_lens, strict=True)]
    assert Driver(w, cfg).run(ragged, out_lens) == expected
    assert (2, 2, 2) in steps and (1, 2, 2) in steps
