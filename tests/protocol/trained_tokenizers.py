"""Small tokenizers trained here in each family's style, the originals the GGUF tokenizer tests compare with:
byte-level BPE with Qwen2's split (transformers' Qwen2Tokenizer over the trained vocabulary and merges) and with
Llama 3's (the tokenizers library, BOS added, whole-word tokens taken before merges), and SentencePiece BPE models
with byte fallback."""

import io
import json

import pytest
import transformers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

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
QWEN2_CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def trained_bpe(split: str | None, nfc: bool, specials: list[str]) -> dict:
    """The model part (vocab, merges) of a byte-level BPE trained on CORPUS with the given split (None: GPT-2's)."""
    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else byte_level_split(split)
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


def gpt2_tokenizer():
    """transformers' GPT2Tokenizer (the ByteLevel pre-tokenizer's own split) over a vocabulary trained that way."""
    from transformers.models.gpt2.tokenization_gpt2 import GPT2Tokenizer

    model = trained_bpe(None, False, ["<|endoftext|>"])
    return GPT2Tokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]])


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
