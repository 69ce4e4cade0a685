"""A byte-level tokenizer for the built-in tiny model, so that text works with no download.

Ids 0-2 are <unk>, <s> (BOS) and </s> (EOS, as in the tiny model's config); ids 3-258 are the 256 bytes.
"""

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<s>' + message['role'] + '\\n' + message['content'] + '</s>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<s>assistant\\n' }}{% endif %}"
)


def builtin_tokenizer() -> Tokenizer:
    alphabet = sorted(ByteLevel.alphabet(), key=lambda ch: _byte_of(ch))
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    return tok


def _byte_of(char: str) -> int:
    """The byte that ByteLevel's printable alphabet maps to char (GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    code = ord(char)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]
