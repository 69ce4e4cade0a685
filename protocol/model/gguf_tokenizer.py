"""A `tokenizers` Tokenizer rebuilt from the vocabulary in a GGUF file, tokenizing as the model's own tokenizer does.

Two kinds of vocabulary (tokenizer.ggml.model):
- "gpt2", byte-level BPE (Qwen2 / Qwen3, Llama 3, SmolLM, GPT-2): tokens and merges from the file; the split of
  the text before the merges is named by tokenizer.ggml.pre and rebuilt as that family's tokenizer.json has it.
- "llama", SentencePiece (Gemma, Llama 2, Mistral 7B): the merges are implied by the token scores (the adjacent
  pair whose join scores highest merges first), characters no token holds fall back to the <0xXX> byte tokens,
  spaces are written as U+2581, with one prepended to the text unless tokenizer.ggml.add_space_prefix is false.
Token types: control tokens are special (split out of any text, dropped when decoding), user-defined tokens are
matched whole and kept. BOS / EOS are added as tokenizer.ggml.add_bos_token / add_eos_token say, with llama.cpp's
defaults where the file is silent (BOS for SentencePiece and for Llama 3's split, none otherwise).
"""

from dataclasses import dataclass

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from protocol.model.gguf_meta import field

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4  # llama.cpp's token types (gguf.TokenType)
SPACE = "\u2581"  # SentencePiece's visible space

_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class ByteLevelSplit:
    """How one tokenizer.ggml.pre value splits text before the merges, and what its family's tokenizer does."""

    regex: str | None  # None: GPT-2's own split (the ByteLevel pre-tokenizer's regex)
    digits: bool = False  # every digit a piece of its own first (SmolLM)
    nfc: bool = False  # text NFC-normalised first (Qwen2's tokenizer.json)
    ignore_merges: bool = False  # a piece that is a token is taken whole, not merged up (Llama 3)
    add_bos: bool = False  # llama.cpp's default where the file has no tokenizer.ggml.add_bos_token


_LLAMA3 = ByteLevelSplit(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True)
PRE_TOKENIZERS = {  # llama.cpp's names of the splits whose tokenizer.json is known here; others are refused
    "qwen2": ByteLevelSplit(_QWEN2_SPLIT, nfc=True),
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "smollm": ByteLevelSplit(None, digits=True),
    "gpt-2": ByteLevelSplit(None),
}


def gguf_tokenizer(reader, source: str) -> Tokenizer:
    """The tokenizer of an open GGUF file (reader); ValueError naming source and the field it cannot follow."""
    kind = field(reader, "tokenizer.ggml.model")
    if kind == "gpt2":
        tokenizer, add_bos = _byte_level(reader, source)
    elif kind == "llama":
        tokenizer, add_bos = _sentencepiece(reader, source), True
    else:
        raise ValueError(f"{source}: tokenizer.ggml.model {kind!r} is not supported "
                         "(byte-level BPE 'gpt2' or SentencePiece 'llama')")
    _add_typed_tokens(tokenizer, reader, normalized=kind == "llama")
    _add_bos_eos(tokenizer, reader, source, add_bos)
    return tokenizer


def _byte_level(reader, source: str) -> tuple[Tokenizer, bool]:
    pre = field(reader, "tokenizer.ggml.pre")
    split = PRE_TOKENIZERS.get(pre)
    if split is None:
        raise ValueError(f"{source}: tokenizer.ggml.pre {pre!r} is not supported; supported: "
                         f"{', '.join(PRE_TOKENIZERS)}")
    tokens = field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                     ignore_merges=split.ignore_merges))
    if split.nfc:
        tokenizer.normalizer = normalizers.NFC()
    steps: list[pre_tokenizers.PreTokenizer] = [pre_tokenizers.Digits(individual_digits=True)] if split.digits else []
    if split.regex is not None:
        steps.append(pre_tokenizers.Split(Regex(split.regex), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split.regex is None))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, split.add_bos


def _sentencepiece(reader, source: str) -> Tokenizer:
    if field(reader, "tokenizer.ggml.remove_extra_whitespaces"):
        raise ValueError(f"{source}: tokenizer.ggml.remove_extra_whitespaces is not supported")
    tokens, scores = field(reader, "tokenizer.ggml.tokens"), field(reader, "tokenizer.ggml.scores")
    if scores is None:
        raise ValueError(f"{source}: a SentencePiece vocabulary needs tokenizer.ggml.scores")
    types = field(reader, "tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = field(reader, "tokenizer.ggml.unknown_token_id")
    model = models.BPE(vocab=vocab, merges=score_merges(tokens, scores, types, vocab), byte_fallback=True,
                       unk_token=None if unk is None else tokens[unk], fuse_unk=True)
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.Replace(" ", SPACE)
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    if field(reader, "tokenizer.ggml.add_space_prefix", True):  # a space before each piece of text (llama.cpp)
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), tokenizer.normalizer])
        tokenizer.decoder = decoders.Sequence([tokenizer.decoder, decoders.Strip(" ", 1, 0)])
    return tokenizer


def score_merges(tokens: list[str], scores: list[float], types: list[int], vocab: dict[str, int]) -> list:
    """Every split of a normal token into two tokens, ranked by the joined token's score (best first)."""
    ranked: list[tuple[float, int, int]] = []
    for i, token in enumerate(tokens):
        if types[i] != NORMAL:
            continue
        ranked.extend((-scores[i], i, cut) for cut in range(1, len(token))
                      if token[:cut] in vocab and token[cut:] in vocab)
    ranked.sort()
    return [(tokens[i][:cut], tokens[i][cut:]) for _, i, cut in ranked]


def _add_typed_tokens(tokenizer: Tokenizer, reader, normalized: bool) -> None:
    """Control tokens as special added tokens, user-defined ones as plain added tokens (both matched whole)."""
    tokens = field(reader, "tokenizer.ggml.tokens")
    types = field(reader, "tokenizer.ggml.token_type") or []  # absent (empty): no token is special
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, ty in zip(tokens, types, strict=False) if ty == CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=normalized)
                          for t, ty in zip(tokens, types, strict=False) if ty == USER_DEFINED])


def _add_bos_eos(tokenizer: Tokenizer, reader, source: str, add_bos: bool) -> None:
    tokens, single, specials = field(reader, "tokenizer.ggml.tokens"), ["$A"], []
    for name, default in (("bos", add_bos), ("eos", False)):
        if not field(reader, f"tokenizer.ggml.add_{name}_token", default):
            continue
        token_id = field(reader, f"tokenizer.ggml.{name}_token_id")
        if token_id is None:
            raise ValueError(f"{source}: tokenizer.ggml.add_{name}_token is true but the file has no "
                             f"tokenizer.ggml.{name}_token_id")
        specials.append((tokens[token_id], token_id))
        single = [tokens[token_id], *single] if name == "bos" else [*single, tokens[token_id]]
    if specials:
        tokenizer.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
