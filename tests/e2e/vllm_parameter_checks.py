"""The checks of tests/e2e/test_vllm_parameters.py (no tests here): per field of vLLM's request schemas, what
the server must do with it, against a server of the built-in model (token 2 is EOS "</s>", byte b is token 3 + b,
"A" is 68, ids past 258 decode to nothing)."""

import asyncio
import json
import re

from launch.client import AsyncEngineClient
from protocol import SamplingParams
from tests.e2e.conftest import wait_until
from tests.e2e.openai_server import sse_events

PROMPT = [5, 17, 300, 42, 9, 77, 120, 33]
A, EOS = 68, 2
USER = [{"role": "user", "content": "hi"}]
BIASED = {"logit_bias": {str(A): 5.0}}  # the model repeats "A", which the penalties then fight


def post(api, path: str, **fields) -> tuple[int, dict]:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "return_token_ids": True, **fields} \
        if path == "/v1/completions" else {"messages": USER, "max_tokens": 6, "temperature": 0,
                                           "return_token_ids": True, **fields}
    return api.request("POST", path, body)  # type: ignore[return-value]


def ok(api, path: str = "/v1/completions", **fields) -> dict:
    status, body = post(api, path, **fields)
    assert status == 200, body
    return body


def ids(body: dict, i: int = 0) -> list[int]:
    return body["choices"][i]["token_ids"]


def native(api, prompt: list[int], **params) -> list[int]:
    """The tokens the engine gives these SamplingParams through the native client."""
    async def go() -> list[int]:
        async with AsyncEngineClient(api.server.address) as client:
            return [t async for out in client.generate(prompt, SamplingParams(**params)) for t in out.new_token_ids]
    return asyncio.run(go())


def same_as_native(api, path: str = "/v1/completions", **fields) -> list[int]:
    """The request's tokens equal the native client's with the same parameters (max_tokens 6 and, unless given,
    temperature 0); returns them."""
    body = ok(api, path, **fields)
    prompt = body["choices"][0]["prompt_token_ids"]
    params = {"max_tokens": fields.pop("max_tokens", 6), "temperature": fields.pop("temperature", 0.0)}
    if "logit_bias" in fields:
        fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
    got = ids(body)
    assert got == native(api, prompt, **params, **fields)
    return got


def refused(api, name: str, value: object, path: str = "/v1/completions") -> None:
    status, body = post(api, path, **{name: value})
    assert status == 400 and body["error"]["param"] == name, body


def ignored(api, name: str, value: object, path: str = "/v1/completions") -> None:
    plain = ids(ok(api, path))
    assert ids(ok(api, path, **{name: value})) == plain
    assert wait_until(lambda: f"but ignored: {name} (" in api.server.output(), 30)


def penalised(name: str, value: float):
    def check(api, path="/v1/completions"):
        plain = ids(ok(api, path, max_tokens=12, **BIASED))
        assert same_as_native(api, path, max_tokens=12, **BIASED, **{name: value}) != plain
    return check


def greedy_under(**fields):
    """At temperature 2, a control that leaves only the most likely token gives the greedy tokens."""
    def check(api, path="/v1/completions"):
        assert same_as_native(api, path, temperature=2.0, seed=1, **fields) == ids(ok(api, path))
    return check


def check_stop(api, path="/v1/completions"):
    body = ok(api, path, logit_bias={str(A): 100}, stop=["AA"])
    assert text_of(body) == "" and body["choices"][0]["finish_reason"] == "stop"


def check_include_stop(api, path="/v1/completions"):
    body = ok(api, path, logit_bias={str(A): 100}, stop=["AA"], include_stop_str_in_output=True)
    assert text_of(body) == "AA" and body["choices"][0]["finish_reason"] == "stop"


def text_of(body: dict, i: int = 0) -> str:
    choice = body["choices"][i]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def check_ignore_eos(api, path="/v1/completions"):
    assert ids(ok(api, path, logit_bias={str(EOS): 100})) == [EOS]
    assert ids(ok(api, path, logit_bias={str(EOS): 100}, ignore_eos=True)) == [EOS] * 6


def check_min_tokens(api, path="/v1/completions"):
    got = same_as_native(api, path, logit_bias={str(EOS): 100}, min_tokens=3)
    assert len(got) == 4 and EOS not in got[:3] and got[3] == EOS


def check_stop_token_ids(api, path="/v1/completions"):
    """As in vLLM, the stop token's text is left out unless include_stop_str_in_output."""
    body = ok(api, path, logit_bias={str(A): 100}, stop_token_ids=[A])
    assert ids(body) == [A] and body["choices"][0]["finish_reason"] == "stop" and text_of(body) == ""
    assert text_of(ok(api, path, logit_bias={str(A): 100}, stop_token_ids=[A], include_stop_str_in_output=True)) == "A"


def check_skip_special_tokens(api, path="/v1/completions"):
    forced = {"logit_bias": {str(EOS): 100}, "ignore_eos": True, "max_tokens": 3}
    assert text_of(ok(api, path, **forced)) == ""
    assert text_of(ok(api, path, **forced, skip_special_tokens=False)) == "</s>" * 3
    stopped = ok(api, path, logit_bias={str(EOS): 100}, skip_special_tokens=False)  # EOS ends it: left out
    assert ids(stopped) == [EOS] and text_of(stopped) == ""


def check_spaces_between_special_tokens(api, path="/v1/completions"):
    """As vLLM with a fast (Rust) tokenizer: no effect."""
    forced = {"logit_bias": {str(EOS): 100}, "ignore_eos": True, "max_tokens": 3, "skip_special_tokens": False}
    assert text_of(ok(api, path, **forced, spaces_between_special_tokens=False)) == text_of(ok(api, path, **forced))


def check_truncate(api, path="/v1/completions"):
    body = ok(api, path, truncate_prompt_tokens=3)
    assert body["usage"]["prompt_tokens"] == 3
    prompt = body["choices"][0]["prompt_token_ids"]
    assert ids(body) == native(api, prompt, max_tokens=6, temperature=0.0)
    if path == "/v1/completions":
        assert prompt == PROMPT[-3:]


def check_truncation_side(api, path="/v1/completions"):
    body = ok(api, path, truncate_prompt_tokens=3, truncation_side="right")
    assert body["usage"]["prompt_tokens"] == 3
    if path == "/v1/completions":
        assert body["choices"][0]["prompt_token_ids"] == PROMPT[:3]


def check_logit_bias(api, path="/v1/completions"):
    assert same_as_native(api, path, logit_bias={str(A): 100}) == [A] * 6
    status, body = post(api, path, logit_bias={"5000": 1})
    assert status == 400 and body["error"]["param"] == "logit_bias" and "vocabulary" in body["error"]["message"]


def check_allowed(api, path="/v1/completions"):
    assert set(same_as_native(api, path, allowed_token_ids=[A, A + 1])) <= {A, A + 1}


def check_bad_words(api, path="/v1/completions"):
    got = ids(ok(api, path, logit_bias={str(A): 100}, bad_words=["A"]))
    assert A not in got and got == native(api, ok(api, path)["choices"][0]["prompt_token_ids"], max_tokens=6,
                                          temperature=0.0, logit_bias={A: 100}, bad_words_token_ids=[[A]])


def check_n(api, path="/v1/completions"):
    body = ok(api, path, n=3, temperature=1.0, seed=4)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    prompt = body["choices"][0]["prompt_token_ids"]
    assert [ids(body, i) for i in range(3)] == [native(api, prompt, max_tokens=6, seed=4 + i) for i in range(3)]
    status, stream = stream_events(api, path, n=2)
    assert status == 200 and {c["index"] for e in stream for c in e["choices"]} == {0, 1}


def check_best_of(api, path="/v1/completions"):
    body = ok(api, path, n=1, best_of=3, temperature=1.0, seed=7)
    prompt = body["choices"][0]["prompt_token_ids"]
    samples = []
    for i in range(3):
        outs = asyncio.run(_outputs(api, prompt, SamplingParams(max_tokens=6, seed=7 + i, logprobs=0)))
        samples.append((sum(lp.logprob for o in outs for lp in o.logprobs), [t for o in outs for t in o.new_token_ids]))
    assert len(body["choices"]) == 1 and ids(body) == max(samples)[1]


async def _outputs(api, prompt, params):
    async with AsyncEngineClient(api.server.address) as client:
        return [out async for out in client.generate(prompt, params)]


def check_seed(api, path="/v1/completions"):
    first = same_as_native(api, path, temperature=1.0, seed=11)
    assert ids(ok(api, path, temperature=1.0, seed=11)) == first


def check_temperature(api, path="/v1/completions"):
    same_as_native(api, path, temperature=1.5, seed=3)
    assert same_as_native(api, path, temperature=0.0) == native(api, ok(api, path)["choices"][0]["prompt_token_ids"],
                                                                max_tokens=6, temperature=0.0)


def stream_events(api, path: str, **fields) -> tuple[int, list[dict]]:
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=120)
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": USER}
    conn.request("POST", path, json.dumps({**body, "max_tokens": 4, "stream": True, **fields}),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    events = [json.loads(e) for e in sse_events(response) if e != "[DONE]"]
    conn.close()
    return response.status, events


def check_stream(api, path="/v1/completions"):
    status, events = stream_events(api, path, temperature=0)
    assert status == 200 and events[-1]["choices"][0]["finish_reason"] == "length"


def check_stream_options(api, path="/v1/completions"):
    # greedy, as check_stream: sampled at temperature 1, the built-in model may draw EOS before its 4th token
    _, events = stream_events(api, path, temperature=0, stream_options={"include_usage": True})
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
    _, events = stream_events(api, path, temperature=0,
                              stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert all("usage" in e for e in events)


def check_logprobs(api, path="/v1/completions"):
    if path == "/v1/completions":
        lps = ok(api, path, logprobs=2, return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
        assert len(lps["token_logprobs"]) == 6 and all(len(t) == 2 for t in lps["top_logprobs"])
    else:
        content = ok(api, path, logprobs=True)["choices"][0]["logprobs"]["content"]
        assert len(content) == 6 and all(e["top_logprobs"] == [] for e in content)


def check_top_logprobs(api, path="/v1/chat/completions"):
    content = ok(api, path, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
    assert all(len(e["top_logprobs"]) == 2 for e in content["content"])
    status, body = post(api, path, logprobs=True, top_logprobs=21)  # named as the chat field, not as the engine's
    assert status == 400 and body["error"]["param"] == "top_logprobs" and "top_logprobs" in body["error"]["message"]


def check_prompt_logprobs(api, path="/v1/completions"):
    choice = ok(api, path, prompt_logprobs=1)["choices"][0]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(choice["prompt_token_ids"]) and entries[0] is None
    assert all(str(t) in e for t, e in zip(choice["prompt_token_ids"][1:], entries[1:], strict=True))


def check_echo(api, path="/v1/completions"):
    body = ok(api, path, prompt="hello", echo=True, logprobs=1, max_tokens=2)
    choice = body["choices"][0]
    assert choice["text"].startswith("hello")
    assert choice["logprobs"]["token_logprobs"][0] is None and len(choice["logprobs"]["tokens"]) == 5 + 2


def check_chat_echo(api, path="/v1/chat/completions"):
    messages = [*USER, {"role": "assistant", "content": "Hel"}]
    body = ok(api, path, messages=messages, echo=True, continue_final_message=True)
    assert text_of(body).startswith("Hel")


def check_max_tokens(api, path="/v1/completions"):
    assert len(ids(ok(api, path, max_tokens=3))) == 3


def check_max_completion_tokens(api, path="/v1/chat/completions"):
    assert len(ids(ok(api, path, max_completion_tokens=2))) == 2


def check_request_id(api, path="/v1/completions"):
    body = ok(api, path, request_id="my-request")
    assert body["id"].endswith("-my-request")


def check_return_tokens_as_token_ids(api, path="/v1/completions"):
    field = {"logprobs": 1} if path == "/v1/completions" else {"logprobs": True}
    body = ok(api, path, return_tokens_as_token_ids=True, **field)
    logprobs = body["choices"][0]["logprobs"]
    shown = logprobs["tokens"] if "tokens" in logprobs else [e["token"] for e in logprobs["content"]]
    assert shown == [f"token_id:{t}" for t in ids(body)]


def check_return_token_ids(api, path="/v1/completions"):
    status, body = post(api, path, return_token_ids=False)
    assert status == 200 and "token_ids" not in body["choices"][0]
    assert len(ids(ok(api, path))) == 6


def check_cache_salt(api, path="/v1/completions"):
    given = {"prompt": list(range(40, 80))} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "a long question " * 3}]}
    ok(api, path, **given)
    assert ok(api, path, **given)["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    assert ok(api, path, **given, cache_salt="other")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def check_model(api, path="/v1/completions"):
    ok(api, path, model="tiny")
    status, body = post(api, path, model="other")
    assert status == 404 and body["error"]["param"] == "model"


def check_prompt(api, path="/v1/completions"):
    assert ids(ok(api, path, prompt="hi")) == ids(ok(api, path, prompt=[107, 108]))


def check_messages(api, path="/v1/chat/completions"):
    body = ok(api, path, messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert ids(body) == ids(ok(api, path))


def check_add_special_tokens(api, path="/v1/completions"):
    """The built-in tokenizer has no special tokens to add (no BOS template): the prompt is the same either way, and
    what /tokenize gives."""
    text = {"prompt": "hi"} if path == "/v1/completions" else {}
    prompts = [ok(api, path, add_special_tokens=flag, **text)["choices"][0]["prompt_token_ids"] for flag in (True, False)]
    status, tokenized = api.request("POST", "/tokenize", {"prompt": "hi"} if text else {"messages": USER})
    assert status == 200 and prompts[0] == prompts[1] == tokenized["tokens"]


def structured(field: str, value: object, allowed: set[str] | str):
    def check(api, path="/v1/completions"):
        text = text_of(ok(api, path, max_tokens=40, **{field: value}))
        assert re.fullmatch(allowed, text) if isinstance(allowed, str) else text in allowed
    return check


def check_priority(api, path="/v1/completions"):
    refused(api, "priority", 1, path)
    ok(api, path, priority=0)


def check_suffix(api, path="/v1/completions"):
    refused(api, "suffix", "the end", path)


def template(source: str, prompt_text: str, **extra):
    def check(api, path="/v1/chat/completions"):
        body = ok(api, path, chat_template=source, **extra)
        assert body["choices"][0]["prompt_token_ids"] == [3 + b for b in prompt_text.encode()]
    return check


def check_add_generation_prompt(api, path="/v1/chat/completions"):
    with_prompt = ok(api, path)["choices"][0]["prompt_token_ids"]
    without = ok(api, path, add_generation_prompt=False)["choices"][0]["prompt_token_ids"]
    assert with_prompt[: len(without)] == without
    assert with_prompt[len(without):] == [1] + [3 + b for b in b"assistant\n"]  # <s> is token 1


def check_continue_final_message(api, path="/v1/chat/completions"):
    messages = [*USER, {"role": "assistant", "content": "Hel"}]
    prompt = ok(api, path, messages=messages, continue_final_message=True)["choices"][0]["prompt_token_ids"]
    assert prompt[-3:] == [3 + b for b in b"Hel"]
    status, body = post(api, path, messages=messages, continue_final_message=True, add_generation_prompt=True)
    assert status == 400 and body["error"]["param"] == "continue_final_message"


TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {  # bounded: the random model finishes it
    "type": "object", "properties": {"q": {"type": "string", "maxLength": 3}}, "required": ["q"],
    "additionalProperties": False}}}


def tool_calls(api, **fields) -> list[dict]:
    body = ok(api, "/v1/chat/completions", tools=[TOOL], max_tokens=60, **fields)
    return body["choices"][0]["message"].get("tool_calls") or []


def check_tools(api, path="/v1/chat/completions"):
    assert tool_calls(api, tool_choice="none") == []
    assert {c["function"]["name"] for c in tool_calls(api, tool_choice="required")} == {"lookup"}


def check_tool_choice(api, path="/v1/chat/completions"):
    [call] = tool_calls(api, tool_choice={"type": "function", "function": {"name": "lookup"}})
    assert call["function"]["name"] == "lookup" and "q" in json.loads(call["function"]["arguments"])


def check_parallel_tool_calls(api, path="/v1/chat/completions"):
    assert len(tool_calls(api, tool_choice="required", parallel_tool_calls=False)) == 1


REFUSED = {"prompt_embeds": "AAAA", "use_beam_search": True, "watermarking": True, "logprob_token_ids": [5],
           "guided_decoding_backend": "outlines", "guided_whitespace_pattern": " ", "logits_processors": ["m.P"],
           "routed_experts_prompt_start": 2, "kv_transfer_params": {"a": 1}, "ec_transfer_params": {"a": 1},
           "vllm_xargs": {"a": 1}, "repetition_detection": {"n": 2}, "thinking_token_budget": 10,
           "stream_interval": 4, "reasoning_effort": "low", "media_io_kwargs": {"a": {}}, "mm_processor_kwargs": {"a": 1},
           "structural_tag": "{}", "return_prompt_text": True}
IGNORED = {"user": "someone", "length_penalty": 0.5, "session_id": "s", "return_token_offsets": True,
           "return_mm_kwargs": False, "include_reasoning": False}

CHECKS = {
    "model": check_model, "prompt": check_prompt, "messages": check_messages, "echo": check_echo,
    "frequency_penalty": penalised("frequency_penalty", 2.0), "presence_penalty": penalised("presence_penalty", 2.0),
    "repetition_penalty": penalised("repetition_penalty", 3.0), "logit_bias": check_logit_bias,
    "logprobs": check_logprobs, "top_logprobs": check_top_logprobs, "max_tokens": check_max_tokens,
    "max_completion_tokens": check_max_completion_tokens, "n": check_n, "best_of": check_best_of, "seed": check_seed,
    "stop": check_stop, "stream": check_stream, "stream_options": check_stream_options, "suffix": check_suffix,
    "temperature": check_temperature, "top_p": greedy_under(top_p=1e-9), "top_k": greedy_under(top_k=1),
    "min_p": greedy_under(min_p=1.0), "stop_token_ids": check_stop_token_ids,
    "include_stop_str_in_output": check_include_stop, "ignore_eos": check_ignore_eos, "min_tokens": check_min_tokens,
    "skip_special_tokens": check_skip_special_tokens,
    "spaces_between_special_tokens": check_spaces_between_special_tokens, "truncate_prompt_tokens": check_truncate,
    "truncation_side": check_truncation_side, "allowed_token_ids": check_allowed, "prompt_logprobs": check_prompt_logprobs,
    "bad_words": check_bad_words, "add_special_tokens": check_add_special_tokens,
    "response_format": structured("response_format",
                                  {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["a", "b"]}}},
                                  {'"a"', '"b"'}),
    "structured_outputs": structured("structured_outputs", {"choice": ["yes", "no"]}, {"yes", "no"}),
    "guided_json": structured("guided_json", {"enum": [1, 2]}, {"1", "2"}),
    "guided_regex": structured("guided_regex", "[ab]{3}", "[ab]{3}"),
    "guided_choice": structured("guided_choice", ["left", "right"], {"left", "right"}),
    "guided_grammar": structured("guided_grammar", 'start: "ab" | "cd"', {"ab", "cd"}),
    "priority": check_priority, "request_id": check_request_id,
    "return_tokens_as_token_ids": check_return_tokens_as_token_ids, "return_token_ids": check_return_token_ids,
    "cache_salt": check_cache_salt, "add_generation_prompt": check_add_generation_prompt,
    "continue_final_message": check_continue_final_message,
    "chat_template": template("{% for m in messages %}<{{ m.content }}>{% endfor %}", "<hi>"),
    "chat_template_kwargs": template("{{ hello }}{% for m in messages %}{{ m.content }}{% endfor %}", "yohi",
                                     chat_template_kwargs={"hello": "yo"}),
    "documents": template("{% for d in documents %}{{ d.text }}{% endfor %}", "doc", documents=[{"text": "doc"}]),
    "tools": check_tools, "tool_choice": check_tool_choice, "parallel_tool_calls": check_parallel_tool_calls,
}


