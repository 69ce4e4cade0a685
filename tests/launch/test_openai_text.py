"""The API server's text side: chat templates rendered as transformers renders them, incremental
detokenisation that never emits a broken character, and stop strings that span tokens."""

from pathlib import Path

import pytest

from launch.api_server.chat_template import ChatTemplateError, render_chat
from launch.api_server.detokenizer import IncrementalDetokenizer
from launch.api_server.text_model import TextModel, load_text_model
from tests.launch.text_support import smollm2_path

TEMPLATES = Path(__file__).parent / "chat_templates"
CONVERSATION = [
    {"role": "system", "content": "  You answer briefly.  "},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris. ☀"},
    {"role": "user", "content": "And of Japan (日本)?"},
]
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "find a city’s country",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def smollm2() -> TextModel:
    return load_text_model(str(smollm2_path()))


def transformers_render(text: TextModel, template: str, messages: list[dict], **kwargs) -> str:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=text.tokenizer, **text.special_tokens)
    return tok.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", [CONVERSATION, CONVERSATION[1:2]])
def test_smollm2_template_renders_as_transformers(smollm2, messages, add_generation_prompt):
    assert smollm2.chat_template is not None
    ours = smollm2.render_chat(messages, add_generation_prompt)
    assert ours == transformers_render(smollm2, smollm2.chat_template, messages,
                                       add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("name", ["qwen2", "llama2", "llama3"])
@pytest.mark.parametrize("messages", [CONVERSATION, CONVERSATION[1:]])
def test_qwen2_and_llama_templates_render_as_transformers(smollm2, name, messages):
    template = (TEMPLATES / f"{name}.jinja").read_text()
    text = TextModel(smollm2.tokenizer, template, {"bos_token": "<s>", "eos_token": "</s>"})
    if name == "llama2" and messages[0]["role"] == "user":
        messages = messages[:-1]  # this template wants user/assistant turns to alternate after the system
    assert text.render_chat(messages) == transformers_render(text, template, messages, add_generation_prompt=True)


def test_tools_render_with_tojson_as_transformers(smollm2):
    template = (TEMPLATES / "qwen2.jinja").read_text()
    ours = render_chat(template, CONVERSATION[1:2], tools=TOOLS)
    assert "city’s" in ours  # tojson keeps non-ASCII text, as transformers' does
    assert ours == transformers_render(smollm2, template, CONVERSATION[1:2], tools=TOOLS, add_generation_prompt=True)


def test_raise_exception_in_a_template_is_a_chat_template_error():
    template = (TEMPLATES / "llama2.jinja").read_text()
    bad = [{"role": "assistant", "content": "first"}]
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat(template, bad, bos_token="<s>", eos_token="</s>")


def stream(text: TextModel, token_ids: list[int], stop: list[str]) -> list[str]:
    detok = IncrementalDetokenizer(text.decode, text.encode("Say:"), stop)
    pieces = [detok.add([t]) for t in token_ids]
    return [*pieces, detok.add([], final=True)]


def test_multi_byte_characters_split_across_tokens_are_never_emitted_broken(smollm2):
    sentence = "Café 日本語 👍🏽 naïve — done"
    ids = smollm2.encode(sentence, add_special_tokens=False)
    split = [i for i in ids if "\ufffd" in smollm2.decode([i])]
    assert split, "the sentence should hold characters that SmolLM2 splits into byte tokens"
    pieces = stream(smollm2, ids, [])
    assert "".join(pieces) == sentence
    assert not any("\ufffd" in p for p in pieces)
    assert all(p.encode("utf-8").decode("utf-8") == p for p in pieces)


def test_stop_strings_spanning_tokens_are_found_and_never_sent(smollm2):
    sentence = "The capital of France is Paris, and of Japan is Tokyo."
    ids = smollm2.encode(sentence, add_special_tokens=False)
    stop = "is Paris,"  # several tokens: " is", " Paris", ","
    assert len(smollm2.encode(stop, add_special_tokens=False)) > 1
    pieces = stream(smollm2, ids, [stop, "never"])
    assert "".join(pieces) == "The capital of France "
    assert all("P" not in p for p in pieces)


def test_earliest_stop_string_wins_and_text_after_it_is_dropped(smollm2):
    ids = smollm2.encode("one two three four", add_special_tokens=False)
    assert "".join(stream(smollm2, ids, ["four", "two"])) == "one "


def test_partial_character_at_the_end_is_flushed_as_replacement_when_the_request_ends(smollm2):
    ids = smollm2.encode("日", add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm2.decode, [], [])
    assert [detok.add([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add([], final=True) == "\ufffd"
