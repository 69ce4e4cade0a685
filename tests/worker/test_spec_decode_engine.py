"""n-gram speculative decoding through the real EngineCore and model: greedy tokens equal plain decoding, with
forced preemptions and prefix-cache hits, with a sliding-window group, with async scheduling, and over tensor
parallel size 2 (gloo); a batch mixing drafting and non-drafting requests gives each what plain decoding gives it."""

import pytest
import torch

from engine_core.core import EngineCore
from protocol import EngineCoreRequest, SamplingParams
from protocol.config import engine_config
from tests.worker.parity_support import FAMILIES, preempting_waves, prompts
from tests.worker.rank_support import run_ranks
from worker.inproc_executor import InProcExecutor
from worker.model.tiny import write_model
from worker.worker import Worker

LONGER = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)  # long enough for the model to repeat
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
POOL = 12  # blocks: the waves preempt


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("tiny"), eos_token_id=None)


@pytest.fixture(scope="module")
def plain(folder):
    return preempting_waves(folder, POOL, LONGER)[1]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("name,pool", [("llama", POOL), ("qwen2_sliding", 13)])  # one group; full + sliding window
def test_greedy_equals_plain_decoding_with_preemption_and_prefix_hits(name, pool, async_scheduling, tmp_path):
    spec = dict(FAMILIES[name])
    family = write_model(tmp_path, spec.pop("architecture"), eos_token_id=None, **spec)
    plain = preempting_waves(family, pool, LONGER)[1]
    _, got, stats = preempting_waves(family, pool, LONGER, speculative_config=NGRAM, async_scheduling=async_scheduling)
    assert got == plain
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens  # both outcomes happen


def _engine_outputs(folder, requests, **settings):
    config = engine_config(model=str(folder), dtype="float32", max_model_len=128, kv_cache_memory_bytes=[1 << 24],
                           check_block_tables=True, **settings)
    engine = EngineCore(config, InProcExecutor(config))
    try:
        for r in requests:
            engine.add_request(r)
        got: dict[str, list] = {r.request_id: [[], []] for r in requests}
        while engine.has_work():
            for o in engine.step().outputs:
                assert o.error is None, o.error
                got[o.request_id][0] += o.new_token_ids
                got[o.request_id][1] += o.logprobs or []
        return got, engine.get_stats()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mixed_batch_drafting_and_plain_requests(folder, async_scheduling):
    """Greedy and sampled requests draft; one with logprobs and one with a repetition penalty do not, and get plain
    decoding's tokens and log-probabilities in the same steps (async: they keep their steps in flight)."""
    loop = [5, 6, 7, 8] * 6
    asks = [("greedy", loop, LONGER),
            ("sampled", loop, SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_tokens=24, ignore_eos=True)),
            ("logprobs", loop, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)),
            ("penalty", prompts([30], seed=9)[0], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                                 repetition_penalty=1.3))]
    requests = [EngineCoreRequest(rid, p, params, arrival_time=0.0) for rid, p, params in asks]
    plain, _ = _engine_outputs(folder, requests, async_scheduling=async_scheduling)
    spec, stats = _engine_outputs(folder, requests, speculative_config=NGRAM, async_scheduling=async_scheduling)
    for rid in ("greedy", "logprobs", "penalty"):
        assert spec[rid] == plain[rid], rid
    assert len(spec["sampled"][0]) == 24
    assert stats.spec_decode_num_drafts > 0


class _RankExecutor:
    """One tensor-parallel rank's worker as an engine core's executor: each rank runs the same deterministic
    engine core, so both see the same SchedulerOutputs (rank 0 decides the tokens and broadcasts them)."""

    def __init__(self, config, rank: int, port: int):
        self.worker = Worker(config, rank, dist_init_method=f"tcp://127.0.0.1:{port}")

    def determine_available_memory(self):
        return [self.worker.report_kv()]

    def initialize_kv_cache(self, kv_cache_config):
        self.worker.init_kv_cache(kv_cache_config)

    def execute_model(self, so):
        return self.worker.execute_model(so)

    def shutdown(self):
        self.worker.shutdown()


def _rank_main(rank: int, port: int, results, folder: str) -> None:
    torch.set_num_threads(1)
    _, got, stats = preempting_waves(folder, POOL, LONGER, lambda c: _RankExecutor(c, rank, port),
                                     tensor_parallel_size=2, speculative_config=NGRAM)
    results.put((rank, got, stats.spec_decode_num_accepted_tokens))


def test_tensor_parallel_2_equals_plain_decoding(folder, plain):
    got = {rank: (tokens, accepted) for rank, tokens, accepted in run_ranks(_rank_main, (str(folder),), 2)}
    assert got[0][0] == plain and got[1][0] == plain
    assert got[0][1] > 0
