"""Greedy runs with sampling controls equal transformers' generate with the same processors (float32, tiny model).

The processors are handed to generate in vLLM's order; frequency and presence penalties, which transformers
lacks, are vLLM's formula as a processor here; bad words look at the generated tokens only, as in vLLM."""

import pytest
import torch

from protocol import SamplingParams
from tests.worker.harness import Driver, hf_greedy
from tests.worker.parity_support import RAGGED, make_worker
from worker.model.tiny import write_model

tlp = pytest.importorskip("transformers.generation.logits_process")

MAX_NEW = 12


class FrequencyPresence(tlp.LogitsProcessor):
    """vLLM's frequency and presence penalties over the generated tokens."""

    def __init__(self, prompt_len: int, frequency: float, presence: float):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        for row, ids in zip(scores, input_ids[:, self.prompt_len:], strict=True):
            counts = torch.bincount(ids, minlength=row.shape[0]).to(row.dtype)
            row -= self.frequency * counts + self.presence * (counts > 0).to(row.dtype)
        return scores


class GeneratedOnly(tlp.LogitsProcessor):
    """A processor that sees the generated tokens only (after a token no bad word contains)."""

    def __init__(self, prompt_len: int, inner):
        self.prompt_len, self.inner = prompt_len, inner

    def __call__(self, input_ids, scores):
        generated = input_ids[:, self.prompt_len:]
        return self.inner(torch.cat([torch.zeros_like(input_ids[:, :1]), generated], dim=1), scores)


def hf_generate(folder, prompts, processors, **kw) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            gen = model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False,
                                 logits_processor=tlp.LogitsProcessorList(processors(len(p))), **kw)
            outs.append(gen[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM", eos_token_id=None)


def test_penalties_bias_and_bad_words_match_transformers(folder):
    plain = hf_greedy(folder, RAGGED, MAX_NEW)
    bad = [[plain[0][1], plain[0][2]], [plain[2][0]]]  # words the plain run generates: they must be barred
    bias = {plain[1][0]: -5.0, 17: 3.0}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, repetition_penalty=1.6, frequency_penalty=0.4,
                            presence_penalty=0.3, logit_bias=bias, bad_words_token_ids=bad)

    def processors(prompt_len):
        return [GeneratedOnly(prompt_len, tlp.NoBadWordsLogitsProcessor(bad, eos_token_id=0)),
                tlp.SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()}),
                tlp.RepetitionPenaltyLogitsProcessor(1.6),
                FrequencyPresence(prompt_len, 0.4, 0.3)]

    expected = hf_generate(folder, RAGGED, processors)
    assert expected != plain
    w, cfg = make_worker(folder, "cpu")
    assert Driver(w, cfg, chunk=7).run(RAGGED, MAX_NEW, params) == expected


def test_allowed_token_ids_match_transformers(folder):
    allowed = list(range(100, 140))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, allowed_token_ids=allowed, repetition_penalty=1.3)

    def processors(prompt_len):
        return [tlp.PrefixConstrainedLogitsProcessor(lambda batch, ids: allowed, num_beams=1),
                tlp.RepetitionPenaltyLogitsProcessor(1.3)]

    expected = hf_generate(folder, RAGGED, processors)
    assert all(t in allowed for out in expected for t in out)
    w, cfg = make_worker(folder, "cpu")
    assert Driver(w, cfg).run(RAGGED, MAX_NEW, params) == expected


def test_min_tokens_holds_eos_back_like_transformers(tmp_path):
    """The model's EOS is the token the plain run makes second: with min_tokens=6 neither makes it before 6."""
    probe = write_model(tmp_path / "probe", "LlamaForCausalLM", eos_token_id=None)
    eos = hf_greedy(probe, RAGGED[:1], 2)[0][1]
    folder = write_model(tmp_path / "eos", "LlamaForCausalLM", eos_token_id=eos)
    expected = hf_generate(folder, RAGGED[:1], lambda n: [tlp.MinNewTokensLengthLogitsProcessor(n, 6, eos)],
                           eos_token_id=eos)[0]
    w, cfg = make_worker(folder, "cpu")
    got = Driver(w, cfg).run(RAGGED[:1], MAX_NEW, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=6))[0]
    assert eos not in got[:6] and got[: len(expected)] == expected
    assert Driver(w, cfg).run(RAGGED[:1], 2, SamplingParams(temperature=0.0, max_tokens=2))[0][1] == eos


def test_a_request_without_controls_beside_one_with_them_is_plain_greedy(folder):
    w, cfg = make_worker(folder, "cpu")
    driver = Driver(w, cfg)
    plain = hf_greedy(folder, RAGGED[:2], MAX_NEW)
    penalised = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, repetition_penalty=2.0, logit_bias={5: 50.0})
    outs = driver.run(RAGGED[:2], MAX_NEW, [penalised, SamplingParams(temperature=0.0, max_tokens=MAX_NEW)])
    assert outs[1] == plain[1] and outs[0] != plain[0]
