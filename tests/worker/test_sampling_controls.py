"""The sampling controls against a reference on the same logits: transformers' logits processors where they share
vLLM's semantics, vLLM's formulas (written out plainly here) where transformers has none or differs."""

import numpy as np
import pytest
import torch

from protocol import SamplingParams
from worker.sampler import apply_logits_processors, apply_min_p, sample
from worker.sampling_state import SamplingState

tlp = pytest.importorskip("transformers.generation.logits_process")

VOCAB = 40
EOS = 39


def logits(rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def state_of(params: list[SamplingParams], prompts: list[list[int]], outputs: list[list[int]],
             vocab: int = VOCAB) -> SamplingState:
    state = SamplingState(len(params), vocab, [EOS], torch.device("cpu"))
    for row, (p, prompt, out) in enumerate(zip(params, prompts, outputs, strict=True)):
        state.add(row, p, prompt, out)
    return state


def processed(x: torch.Tensor, state: SamplingState, rows: list[int] | None = None) -> torch.Tensor:
    rows = list(range(x.shape[0])) if rows is None else rows
    return apply_logits_processors(x.clone(), state.metadata(np.array(rows)))


def hf(processor, x: torch.Tensor, input_ids: list[list[int]]) -> torch.Tensor:
    """A transformers processor over rows of equal-length ids."""
    return processor(torch.tensor(input_ids), x.clone())


PROMPTS = [[1, 2, 3, 2, 30], [5, 6, 7, 8, 9]]
OUTPUTS = [[4, 4, 10, 2], [11, 12, 5, 13]]


def test_repetition_penalty_equals_transformers_over_prompt_and_outputs():
    x = logits(2)
    state = state_of([SamplingParams(repetition_penalty=1.7), SamplingParams(repetition_penalty=0.6)], PROMPTS,
                     OUTPUTS)
    got = processed(x, state)
    for i, penalty in enumerate([1.7, 0.6]):
        expected = hf(tlp.RepetitionPenaltyLogitsProcessor(penalty), x[i : i + 1], [PROMPTS[i] + OUTPUTS[i]])
        torch.testing.assert_close(got[i : i + 1], expected)
    assert not torch.equal(got, x)


def vllm_frequency_presence(x: torch.Tensor, outputs: list[int], frequency: float, presence: float) -> torch.Tensor:
    """OpenAI's definition as vLLM applies it: output tokens only, count x frequency and presence once."""
    out = x.clone()
    for token in set(outputs):
        out[token] -= frequency * outputs.count(token) + presence
    return out


def test_frequency_and_presence_penalties_follow_vllms_formula_on_output_tokens_only():
    x = logits(2)
    params = [SamplingParams(frequency_penalty=0.8, presence_penalty=0.3),
              SamplingParams(frequency_penalty=-1.5, presence_penalty=2.0)]
    got = processed(x, state_of(params, PROMPTS, OUTPUTS))
    for i, p in enumerate(params):
        expected = vllm_frequency_presence(x[i], OUTPUTS[i], p.frequency_penalty, p.presence_penalty)
        torch.testing.assert_close(got[i], expected)
    assert got[0, 1] == x[0, 1]  # a prompt token: not an output, not penalised


def test_logit_bias_equals_transformers_sequence_bias_of_one_token():
    x = logits(1)
    bias = {3: 5.0, 17: -100.0, 22: 0.25}
    got = processed(x, state_of([SamplingParams(logit_bias=bias)], [[1]], [[]]))
    expected = hf(tlp.SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()}), x, [[1]])
    torch.testing.assert_close(got, expected)


def test_allowed_token_ids_equal_transformers_prefix_constraint():
    x = logits(1)
    allowed = [4, 9, 33]
    got = processed(x, state_of([SamplingParams(allowed_token_ids=allowed)], [[1]], [[]]))
    expected = hf(tlp.PrefixConstrainedLogitsProcessor(lambda batch, ids: allowed, num_beams=1), x, [[1]])
    torch.testing.assert_close(got, expected)
    assert got.argmax().item() in allowed


@pytest.mark.parametrize("outputs", [[], [7], [7, 8], [3, 7, 8], [8, 7]])
def test_bad_words_equal_transformers_over_the_outputs(outputs):
    """vLLM looks at the generated tokens only (transformers at the prompt too): the reference gets the outputs."""
    words = [[5], [7, 8, 20], [8, 21], [1, 2, 3, 4, 22]]
    x = logits(1)
    got = processed(x, state_of([SamplingParams(bad_words_token_ids=words)], [[1, 2, 3, 4]], [outputs]))
    expected = hf(tlp.NoBadWordsLogitsProcessor(words, eos_token_id=EOS), x, [[0] + outputs])
    torch.testing.assert_close(got, expected)
    assert got[0, 22] == x[0, 22]  # its prefix ends the prompt, not the outputs: vLLM does not bar it


def test_bad_words_follow_the_tokens_sampled_step_by_step():
    state = state_of([SamplingParams(bad_words_token_ids=[[7, 8, 20]])], [[1]], [[]])
    rows = np.array([0])
    for token in (7, 8):
        state.record(rows, torch.tensor([token]))
    x = logits(1)
    assert processed(x, state)[0, 20] == float("-inf")
    state.record(rows, torch.tensor([9]))
    assert processed(x, state)[0, 20] == x[0, 20]


@pytest.mark.parametrize("num_outputs", [0, 2, 4, 5])
def test_min_tokens_bars_eos_like_transformers_and_stop_ids_too(num_outputs):
    x = logits(1)
    params = SamplingParams(min_tokens=5, stop_token_ids=[11, 12])
    got = processed(x, state_of([params], [[1, 2, 3]], [[30] * num_outputs]))
    prompt_len = 3
    expected = hf(tlp.MinNewTokensLengthLogitsProcessor(prompt_len, 5, EOS), x, [[1, 2, 3] + [30] * num_outputs])
    barred = num_outputs < 5
    assert (got[0, 11] == float("-inf")) == barred and (got[0, 12] == float("-inf")) == barred
    keep = [t for t in range(VOCAB) if t not in (11, 12)]
    torch.testing.assert_close(got[0, keep], expected[0, keep])


def test_min_tokens_counts_the_tokens_sampled_since():
    state = state_of([SamplingParams(min_tokens=2)], [[1]], [[]])
    x = logits(1)
    assert processed(x, state)[0, EOS] == float("-inf")
    state.record(np.array([0]), torch.tensor([3]))
    assert processed(x, state)[0, EOS] == float("-inf")
    state.record(np.array([0]), torch.tensor([4]))
    assert state.metadata(np.array([0])).banned is None


@pytest.mark.parametrize("min_p,temperature", [(0.05, 1.0), (0.3, 0.7), (0.9, 2.0)])
def test_min_p_equals_transformers_after_temperature(min_p, temperature):
    x = logits(3)
    scaled = x / temperature
    got = apply_min_p(scaled, torch.full((3,), min_p))
    expected = tlp.MinPLogitsWarper(min_p)(torch.zeros(3, 1, dtype=torch.long), scaled.clone())
    assert torch.equal(got == float("-inf"), expected == float("-inf"))


def test_vllms_order_bias_then_bans_then_penalties_equals_transformers_chain():
    """Every control on one request: transformers' processors chained in vLLM's order give the same logits."""
    x = logits(1, seed=4)
    prompt, outputs = [1, 2, 3, 7], [4, 7, 7, 9]
    p = SamplingParams(repetition_penalty=1.4, logit_bias={7: 3.0, 2: -2.0, 25: 1.5}, min_tokens=8,
                       allowed_token_ids=list(range(30)) + [EOS], bad_words_token_ids=[[6], [7, 9, 10]],
                       frequency_penalty=0.5, presence_penalty=0.25)
    got = processed(x, state_of([p], [prompt], [outputs]))
    ids = [prompt + outputs]
    chain = [
        tlp.PrefixConstrainedLogitsProcessor(lambda batch, i: p.allowed_token_ids, num_beams=1),
        tlp.NoBadWordsLogitsProcessor(p.bad_words_token_ids, eos_token_id=EOS),
        tlp.MinNewTokensLengthLogitsProcessor(len(prompt), 8, EOS),
        tlp.SequenceBiasLogitsProcessor({(t,): b for t, b in p.logit_bias.items()}),
        tlp.RepetitionPenaltyLogitsProcessor(1.4),
    ]
    expected = x.clone()
    for processor in chain:
        expected = hf(processor, expected, ids)
    expected[0] = vllm_frequency_presence(expected[0], outputs, 0.5, 0.25)
    torch.testing.assert_close(got, expected)


def test_rows_without_controls_are_untouched_and_pay_nothing():
    x = logits(4)
    params = [SamplingParams(), SamplingParams(repetition_penalty=2.0, logit_bias={1: 9.0}), SamplingParams(),
              SamplingParams(min_tokens=3)]
    state = state_of(params, [[1, 2]] * 4, [[3]] * 4)
    got = processed(x, state)
    assert torch.equal(got[[0, 2]], x[[0, 2]])
    plain = state_of([SamplingParams(temperature=0.5, top_k=3)] * 2, [[1]] * 2, [[2]] * 2)
    meta = plain.metadata(np.arange(2))
    assert not meta.processes_logits and meta.min_p is None
    assert plain.penalties is None and plain.additive is None  # no [rows, vocab] tensor was made


def test_state_of_a_resumed_request_equals_the_state_built_step_by_step():
    """After a preemption the request comes back with its outputs: the same counts, history and barred ids."""
    p = SamplingParams(frequency_penalty=0.7, repetition_penalty=1.2, min_tokens=6, bad_words_token_ids=[[8, 9, 10]])
    outputs = [8, 9, 8, 9]
    stepped = state_of([p], [[1, 2]], [[]])
    for token in outputs:
        stepped.record(np.array([0]), torch.tensor([token]))
    resumed = state_of([p], [[1, 2]], [outputs])
    x = logits(1)
    torch.testing.assert_close(processed(x, stepped), processed(x, resumed))
    assert processed(x, resumed)[0, 10] == float("-inf")


def test_a_reused_row_forgets_the_previous_request():
    state = state_of([SamplingParams(logit_bias={3: 50.0}, min_tokens=4, frequency_penalty=1.0)], [[1]], [[3, 3]])
    state.remove(0)
    state.add(0, SamplingParams(), [1], [])
    x = logits(1)
    meta = state.metadata(np.array([0]))
    assert not meta.processes_logits
    assert torch.equal(apply_logits_processors(x.clone(), meta), x)


def test_penalties_apply_at_temperature_zero():
    x = torch.zeros(1, VOCAB)
    x[0, 5] = 2.0
    x[0, 6] = 1.9
    greedy = [SamplingParams(temperature=0.0, presence_penalty=0.5)]
    state = state_of(greedy, [[1]], [[5]])
    assert sample(x, state.metadata(np.array([0]))).item() == 6
    assert sample(x, state_of([SamplingParams(temperature=0.0)], [[1]], [[5]]).metadata(np.array([0]))).item() == 5


def test_seeded_sampling_draws_from_the_processed_distribution():
    """20,000 seeded draws of one step (penalties, bias, min_p and temperature together) against the
    distribution they define: total variation within 0.02 (deterministic: every draw is seeded)."""
    vocab = 8
    x = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -3.0, 1.2]])
    n = 20_000
    params = [SamplingParams(seed=s, temperature=0.8, repetition_penalty=1.3, presence_penalty=0.4,
                             logit_bias={4: 1.0}, min_p=0.05) for s in range(n)]
    state = state_of(params, [[0, 1]] * n, [[1, 3, 3]] * n, vocab=vocab)
    draws = sample(x.expand(n, vocab), state.metadata(np.arange(n)))
    counts = np.bincount(draws.numpy(), minlength=vocab) / n
    ref = x.clone()
    ref[0, 4] += 1.0
    for t in (0, 1, 3):  # prompt or output tokens: divided (positive logits)
        ref[0, t] /= 1.3
    ref[0, [1, 3]] -= 0.4
    probs = torch.softmax(ref / 0.8, dim=-1)
    probs[probs < 0.05 * probs.max()] = 0
    probs /= probs.sum()
    assert counts[6] == 0  # below min_p
    assert 0.5 * np.abs(counts - probs[0].numpy()).sum() < 0.02


def test_penalties_over_more_distinct_tokens_than_the_lists_first_width():
    """A 600-token prompt and new output tokens: the per-row lists grow, and every seen token is penalised."""
    vocab = 1000
    prompt = list(range(0, 600))
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5)
    state = state_of([p, p], [prompt, [5]], [[700], [6]], vocab=vocab)
    for token in (701, 700, 5):
        state.record(np.array([0, 1]), torch.tensor([token, 999]))
    x = logits(2, vocab=vocab).abs() + 1  # positive: divided by the repetition penalty
    got = processed(x, state)
    counts = {700: 2, 701: 1, 5: 1}
    for t in range(vocab):
        seen = t < 600 or t in counts
        expected = x[0, t] / 2.0 - 0.5 * counts.get(t, 0) if seen else x[0, t]
        assert got[0, t] == pytest.approx(float(expected), rel=1e-6)
    assert got[1, 999] == pytest.approx(float(x[1, 999] / 2.0 - 1.5), rel=1e-6)
    state.remove(0)
    assert state.penalties is not None and int((state.penalties.slot_of[0] >= 0).sum()) == 0
