"""The tokenizer rebuilt from a GGUF file encodes and decodes as the model's own tokenizer does.

Small tokenizers trained in each family's style (tests/protocol/trained_tokenizers.py: Qwen2's and Llama 3's
byte-level BPE, SentencePiece BPE models with Gemma's settings, no space prefix, and Llama 2 / Mistral 7B's, a
space prefix) are each written into a GGUF file as llama.cpp's conversion lays it out, loaded back through
protocol/model/tokenizer.py and compared on varied text.
"""

import pytest

from protocol.model.tokenizer import load_tokenizer

pytest.importorskip("gguf")
pytest.importorskip("transformers")
from tests.protocol.gguf_vocab import add_byte_level_vocab, add_sentencepiece_vocab, write_gguf_file
from tests.protocol.trained_tokenizers import (
    PLAIN,
    SPECIAL,
    TEXTS,
    UNSEEN_TEXT,
    gpt2_tokenizer,
    llama3_tokenizer,
    qwen2_tokenizer,
    sentencepiece_model,
)


def write_byte_level(path, hf, arch: str, pre: str, **kwargs) -> None:
    write_gguf_file(path, arch, lambda w: add_byte_level_vocab(w, hf.backend_tokenizer, pre, **kwargs))


def assert_same_as(hf, ours) -> None:
    for text in TEXTS + SPECIAL:
        for add_special in (True, False):
            ids = hf.encode(text, add_special_tokens=add_special)
            assert ours.encode(text, add_special_tokens=add_special).ids == ids, (text, add_special)
            assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), text
            assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False), text


def test_qwen2_file_tokenizes_as_qwen2_tokenizer(tmp_path):
    hf = qwen2_tokenizer()
    path = tmp_path / "qwen2.gguf"
    write_byte_level(path, hf, "qwen2", "qwen2", eos="<|im_end|>", vocab_size=len(hf) + 3)
    ours = load_tokenizer(path).tokenizer
    assert_same_as(hf, ours)
    assert ours.encode("e\u0301").ids == hf.encode("\u00e9") != hf.backend_tokenizer.model.tokenize("e\u0301")
    assert ours.decode(ours.encode(PLAIN[4]).ids) == PLAIN[4]
    assert "12" not in ours.encode("1234567").tokens
    assert ours.token_to_id("[PAD3]") is None and ours.token_to_id(f"[PAD{len(hf)}]") == len(hf)


def test_gpt2_file_tokenizes_as_gpt2_tokenizer(tmp_path):
    hf = gpt2_tokenizer()
    path = tmp_path / "gpt2.gguf"
    write_byte_level(path, hf, "gpt2", "gpt-2", eos="<|endoftext|>")
    assert_same_as(hf, load_tokenizer(path).tokenizer)


def test_llama3_file_tokenizes_as_llama3_tokenizer_with_bos_and_whole_words(tmp_path):
    hf = llama3_tokenizer()
    path = tmp_path / "llama3.gguf"
    write_byte_level(path, hf, "llama", "llama-bpe", bos="<|begin_of_text|>", eos="<|end_of_text|>", add_bos=True)
    ours = load_tokenizer(path).tokenizer
    assert_same_as(hf, ours)
    kvengine = hf.convert_tokens_to_ids("Ġkvengine")
    assert ours.encode(" kvengine").ids == [0, kvengine]  # BOS, and the word whole (no merge path makes it)
    assert [piece for piece, _ in ours.pre_tokenizer.pre_tokenize_str("1234567")] == ["123", "456", "7"]


def test_llama3_split_without_the_add_bos_key_adds_bos_as_llama_cpp_does(tmp_path):
    hf = llama3_tokenizer()
    path = tmp_path / "llama3.gguf"
    write_byte_level(path, hf, "llama", "llama-bpe", bos="<|begin_of_text|>")
    assert load_tokenizer(path).encode("hi") == hf.encode("hi")


@pytest.mark.parametrize("space_prefix", [False, True], ids=["gemma", "llama2-mistral"])
def test_sentencepiece_file_tokenizes_as_sentencepiece(space_prefix, tmp_path):
    sp = sentencepiece_model(space_prefix)
    path = tmp_path / "spm.gguf"
    add = (lambda w: add_sentencepiece_vocab(w, sp, ("<start_of_turn>", "<end_of_turn>"), False)) \
        if not space_prefix else (lambda w: add_sentencepiece_vocab(w, sp, ("<start_of_turn>", "<end_of_turn>")))
    write_gguf_file(path, "gemma2" if not space_prefix else "llama", add)
    ours = load_tokenizer(path).tokenizer
    turns = [] if space_prefix else ["<start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\n"]
    for text in TEXTS + turns:
        ids = sp.encode(text)
        assert ours.encode(text).ids == [sp.bos_id(), *ids], text
        assert ours.encode(text, add_special_tokens=False).ids == ids, text
        assert ours.decode(ids, skip_special_tokens=False) == sp.decode(ids), text
    assert "<0xF0>" in ours.encode(UNSEEN_TEXT).tokens  # byte fallback
    assert ours.decode(sp.encode(UNSEEN_TEXT)) == UNSEEN_TEXT


def test_byte_level_file_with_an_unknown_split_is_refused_by_name(tmp_path):
    hf = qwen2_tokenizer()
    path = tmp_path / "falcon.gguf"
    write_byte_level(path, hf, "qwen2", "falcon")
    with pytest.raises(ValueError, match="tokenizer.ggml.pre 'falcon' is not supported"):
        load_tokenizer(path)


def test_add_bos_without_a_bos_id_is_refused(tmp_path):
    hf = qwen2_tokenizer()
    path = tmp_path / "nobos.gguf"
    write_byte_level(path, hf, "qwen2", "qwen2", add_bos=True)
    with pytest.raises(ValueError, match="add_bos_token is true but the file has no tokenizer.ggml.bos_token_id"):
        load_tokenizer(path)


def test_unknown_tokenizer_model_is_refused_by_name(tmp_path):
    path = tmp_path / "bert.gguf"

    def add(w):
        w.add_tokenizer_model("bert")
        w.add_token_list(["[CLS]", "a"])

    write_gguf_file(path, "llama", add)
    with pytest.raises(ValueError, match="tokenizer.ggml.model 'bert' is not supported"):
        load_tokenizer(path)
