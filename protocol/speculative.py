"""--speculative-config: vLLM's JSON object for speculative decoding, of which kvengine runs the n-gram method.

Keys and defaults follow vLLM's SpeculativeConfig for method "ngram": num_speculative_tokens is required;
prompt_lookup_min and prompt_lookup_max default to each other, or both to 5. Any other key or method is
refused by name: a draft model, EAGLE or MTP needs weights kvengine does not load.
"""

import msgspec

DEFAULT_PROMPT_LOOKUP = 5  # vLLM's choice when neither bound is given
EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'


class SpeculativeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    method: str
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """The config a --speculative-config JSON text asks for, bounds filled in; ValueError naming what is wrong."""
    try:
        raw = msgspec.json.decode(text, type=dict[str, object])
    except msgspec.DecodeError as e:  # ValidationError (not an object) is one too
        raise ValueError(f"speculative_config must be a JSON object, e.g. {EXAMPLE}: {e}") from None
    unknown = sorted(set(raw) - set(SpeculativeConfig.__struct_fields__))
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)} (kvengine takes method, "
                         "num_speculative_tokens, prompt_lookup_max, prompt_lookup_min)")
    if raw.get("method") != "ngram":
        raise ValueError(f"speculative_config: method {raw.get('method')!r} is not supported; kvengine drafts "
                         "only with method 'ngram' (no draft model)")
    try:
        config = msgspec.convert(raw, SpeculativeConfig)
    except msgspec.ValidationError as e:
        raise ValueError(f"speculative_config: {str(e).replace('$.', '')}") from None
    return _with_bounds(config)


def _with_bounds(config: SpeculativeConfig) -> SpeculativeConfig:
    k, lo, hi = config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
    if k is None or k < 1:
        raise ValueError(f"speculative_config: num_speculative_tokens must be given and >= 1, got {k}")
    if lo is None and hi is None:
        lo = hi = DEFAULT_PROMPT_LOOKUP
    lo = hi if lo is None else lo
    hi = lo if hi is None else hi
    assert lo is not None and hi is not None
    if lo < 1 or hi < lo:
        raise ValueError(f"speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}")
    return SpeculativeConfig("ngram", k, hi, lo)
