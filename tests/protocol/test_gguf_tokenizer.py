"""The tokenizer rebuilt from a GGUF file encodes and decodes as the model's own tokenizer does.

Small tokenizers are trained here in each family's style: byte-level BPE with Qwen2's split (transformers'
Qwen2Tokenizer over the trained vocabulary and merges) and with Llama 3's (the tokenizers library, BOS added,
whole-word tokens taken before merges), and SentencePiece BPE models with byte fallback (Gemma's settings: no
space prefix; Llama 2 / Mistral 7B's: a space prefix). Each is written into a GGUF file as llama.cpp's conversion
lays it out, loaded back through protocol/model/tokenizer.py and compared on varied text.
"""

import io
import json

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from protocol.model.tokenizer import load_tokenizer

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from tests.protocol.gguf_vocab import add_byte_level_vocab, add_sentencepiece_vocab, write_gguf_file

PLAIN = [
    "Hello world! It's a test: don't we'LL SEE? I'm sure they'd've",
    "Prices: 1234567 and 3.14159, 2024-05-06; 42nd x10 00007",
    "a  b   c\n\n\n\tindent    end   ",
    "   leading spaces, trailing tab\t",
    "naïve café — Ünïcödé; 日本語のテキスト; Ελληνικά; emoji 🎉🚀 ok",
    "def f(x):\n    return x**2  # square\r\n\r\nprint(f(3))",
    "",
]
SPECIAL = [
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "before<tool_call>{\"a\": 1}</tool_call> after <|im_end|>",
]
# kept out of the training corpus: words no merge makes, characters no token holds
WHOLE_WORDS_TEXT = " kvengine pages the cache; kvengine"
UNSEEN_TEXT = "never trained on: \U0001f999 \u03a9mega \u2211 \u27e8x\u27e9 \u200b zero-width"
TEXTS = [*PLAIN, WHOLE_WORDS_TEXT, UNSEEN_TEXT]
CORPUS = (PLAIN + SPECIAL + ["The quick brown fox jumps over the lazy dog. " * 3, "numbers 0 1 2 3 4 5 6 7 8 9 10 100"]) * 20
QWEN2_CHAT = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def trained_bpe(split: str, nfc: bool, specials: list[str]) -> dict:
    """The model part (vocab, merges) of a byte-level BPE trained on CORPUS with the given split."""
    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = byte_level_split(split)
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return json.loads(tok.to_str())["model"]


def byte_level_split(split: str):
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


DIGIT_PAIRS = [("1", "2"), ("4", "5")]


def qwen2_tokenizer():
    """transformers' Qwen2Tokenizer (its own split regex and NFC) over a vocabulary trained the same way."""
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

    model = trained_bpe(PRETOKENIZE_REGEX, True, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    vocab, merges = model["vocab"], [tuple(m) for m in model["merges"]]
    for pair in DIGIT_PAIRS:  # tokens Qwen2's one-digit split never lets the merges make
        vocab["".join(pair)] = len(vocab)
        merges.append(pair)
    hf = Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.add_tokens([AddedToken("<|im_start|>", special=True, normalized=False)], special_tokens=True)
    hf.add_tokens([AddedToken("<tool_call>", special=False, normalized=False),
                   AddedToken("</tool_call>", special=False, normalized=False)])
    hf.chat_template = QWEN2_CHAT
    return hf


LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # Llama 3's tokenizer.json
WHOLE_WORDS = ["Ġkvengine", "Ġkveng"]  # tokens no merge makes: only Llama 3's take-whole-words rule finds them


def llama3_tokenizer():
    model = trained_bpe(LLAMA3_SPLIT, False, ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"])
    vocab = dict(model["vocab"])
    assert not set(WHOLE_WORDS) & set(vocab)
    vocab.update({w: len(vocab) + i for i, w in enumerate(WHOLE_WORDS)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m) for m in model["merges"]], ignore_merges=True))
    tok.pre_tokenizer = byte_level_split(LLAMA3_SPLIT)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in
                            ("<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>")])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", 0)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                                eos_token="<|end_of_text|>")


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


def sentencepiece_model(add_dummy_prefix: bool):
    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=model, model_type="bpe", vocab_size=420, byte_fallback=True,
        add_dummy_prefix=add_dummy_prefix, normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=True, allow_whitespace_only_pieces=True, character_coverage=1.0, hard_vocab_limit=False,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, user_defined_symbols=["<start_of_turn>", "<end_of_turn>"],
        minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


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
