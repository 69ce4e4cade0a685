"""Structured outputs decided in the engine core, through the real EngineCore, StructuredOutputManager (llguidance
over the built-in model's byte-level vocabulary) and ReferenceExecutor. The reference executor takes, for a
constrained request, the first token its bitmask allows at or after the reference token, and checks every step
that the bitmask's rows are exactly the step's constrained sampling requests in batch order: so a row given to
the wrong request, a missing or stale bitmask, or a grammar not advanced by the applied tokens fails here.
"""

import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import jsonschema
import pytest

from protocol import StructuredOutputsParams
from protocol.model.builtin_tokenizer import builtin_tokenizer
from tests.engine_core.scheduler_support import assert_pool_empty, expected_tokens, make_core, make_request, prompt_of
from tests.engine_core.scheduler_support import run as run_core

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "tier": {"enum": ["free", "pro"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 99}},
                  "required": ["age"], "additionalProperties": False},
    },
    "required": ["name", "tier", "tags", "owner"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-[0-9]{3}"
CHOICES = ["alpha", "beta", "gamma delta"]
TEXT = builtin_tokenizer()


def structured(kind: str) -> StructuredOutputsParams:
    return {"json": StructuredOutputsParams(json=json.dumps(SCHEMA)), "regex": StructuredOutputsParams(regex=REGEX),
            "choice": StructuredOutputsParams(choice=CHOICES),
            "json_object": StructuredOutputsParams(json_object=True)}[kind]


def check_output(kind: str, token_ids: list[int]) -> None:
    text = TEXT.decode(token_ids, skip_special_tokens=True)
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


KINDS = ["json", "regex", "choice"]  # json_object too, but the reference walk never closes an unbounded string


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mixed_batch_with_preemption_and_chunked_prefill(async_scheduling):
    """Constrained and unconstrained requests share steps in a pool small enough to preempt, with prompts
    prefilled in chunks: every constrained output matches its grammar and ends with "stop" at the grammar's end
    (ignore_eos: no EOS needed); every unconstrained one gets exactly its tokens alone."""
    core, ex = make_core(num_blocks=24, max_model_len=360, budget=40, max_num_seqs=8,
                         async_scheduling=async_scheduling, long_prefill_token_threshold=24)
    kinds = {}
    for i in range(16):
        kind = KINDS[i % 3] if i % 4 else None
        kinds[f"r{i}"] = kind
        core.add_request(make_request(f"r{i}", prompt_of(i, 10 + 5 * i), max_tokens=250 if kind else 40,
                                      structured_outputs=kind and structured(kind)))
    results = run_core(core, ex)
    assert core.scheduler.num_preemptions > 0
    for rid, kind in kinds.items():
        if kind is None:
            assert results.tokens[rid] == expected_tokens(prompt_of(int(rid[1:]), 10 + 5 * int(rid[1:])), 40)
        else:
            assert results.finish[rid] == "stop", (rid, results.finish[rid])
            check_output(kind, results.tokens[rid])
    assert not core.structured.matchers and not core.structured.waiting
    assert_pool_empty(core)


def test_a_grammar_that_does_not_compile_fails_its_request_only():
    core, ex = make_core()
    core.add_request(make_request("bad", prompt_of(1, 8), structured_outputs=StructuredOutputsParams(regex="a(")))
    core.add_request(make_request("bad-json", prompt_of(2, 8),
                                  structured_outputs=StructuredOutputsParams(json='{"type": 3}')))
    core.add_request(make_request("good", prompt_of(3, 8), max_tokens=100, structured_outputs=structured("regex")))
    core.add_request(make_request("plain", prompt_of(4, 8), max_tokens=10))
    results = run_core(core, ex)
    assert set(results.errors) == {"bad", "bad-json"}
    assert results.errors["bad"].startswith("structured_outputs.regex:") and "unclosed group" in results.errors["bad"]
    assert results.errors["bad-json"].startswith("structured_outputs.json:")
    check_output("regex", results.tokens["good"])
    assert results.tokens["plain"] == expected_tokens(prompt_of(4, 8), 10)
    assert_pool_empty(core)


def test_a_request_waits_for_its_grammar_without_holding_the_step():
    """The compile thread is kept busy: the constrained request waits (counted as waiting) while another runs to
    its end; once its grammar is ready it runs."""
    core, ex = make_core()
    gate = threading.Event()
    core.structured.pool.submit(gate.wait)
    core.add_request(make_request("json", prompt_of(1, 8), max_tokens=300, structured_outputs=structured("json")))
    core.add_request(make_request("plain", prompt_of(2, 8), max_tokens=12))
    results = core.results
    while "plain" not in results.finish:
        core.step()
        assert "json" not in core.scheduler.requests and core.get_stats().num_waiting_reqs == 1
    assert results.tokens["plain"] == expected_tokens(prompt_of(2, 8), 12) and "json" not in results.tokens
    gate.set()
    run_core(core, ex)
    check_output("json", results.tokens["json"])


def test_abort_while_waiting_and_while_running():
    core, ex = make_core()
    gate = threading.Event()
    core.structured.pool.submit(gate.wait)
    core.add_request(make_request("held", prompt_of(1, 8), max_tokens=300, structured_outputs=structured("json")))
    core.abort_requests(["held"])
    assert core.step().outputs[0].finish_reason == "abort" and not core.structured.waiting
    gate.set()
    core.add_request(make_request("running", prompt_of(2, 8), max_tokens=300, structured_outputs=structured("json")))
    while "running" not in core.structured.matchers or not core.results.tokens.get("running"):
        core.step()
    core.abort_requests(["running"])
    run_core(core, ex)
    assert core.results.finish == {"held": "abort", "running": "abort"}
    assert not core.structured.matchers
    assert_pool_empty(core)


def test_a_repeated_grammar_compiles_once():
    core, ex = make_core()
    for i in range(4):
        core.add_request(make_request(f"r{i}", prompt_of(i, 8), max_tokens=300, structured_outputs=structured("json")))
    results = run_core(core, ex)
    assert len(core.structured.compiled) == 1
    for i in range(4):
        check_output("json", results.tokens[f"r{i}"])


def test_eos_ends_a_regex_that_could_go_on():
    """A regex that may continue lets EOS through once it matches; the reference executor's token lands on EOS
    only by chance, so with ignore_eos off the request ends with "stop" at EOS or at the grammar's end."""
    core, ex = make_core(eos_token_ids=[2])
    core.add_request(make_request("r", prompt_of(5, 8), max_tokens=200, ignore_eos=False,
                                  structured_outputs=StructuredOutputsParams(regex="[a-c]+x?")))
    results = run_core(core, ex)
    assert results.finish["r"] == "stop"
    assert re.fullmatch("[a-c]+x?", TEXT.decode(results.tokens["r"], skip_special_tokens=True))


def test_grammars_keep_the_engine_core_torch_free():
    code = ("import sys; from engine_core.structured_output.grammar import GrammarCompiler; "
            "from protocol import StructuredOutputsParams as P; "
            "GrammarCompiler(None, 1024, [2]).compile(P(json='{\"type\": \"object\"}')); "
            "sys.exit('torch' in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
