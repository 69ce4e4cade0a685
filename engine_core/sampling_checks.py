"""Checks of a request's sampling parameters that need the model: token ids inside its vocabulary.

The wire bounds (protocol/sampling.py) hold any id below 2**31; the worker indexes [rows, vocab] tensors with
these, so an id past the model's vocabulary is refused here, by the field's name, before the request is queued.
"""

from itertools import chain

from protocol import SamplingParams


def out_of_vocabulary(params: SamplingParams, vocab_size: int) -> str | None:
    """The first sampling control naming a token id outside [0, vocab_size), as an error message; None if none."""
    fields = {
        "logit_bias": params.logit_bias,
        "allowed_token_ids": params.allowed_token_ids or (),
        "bad_words_token_ids": chain.from_iterable(params.bad_words_token_ids),
    }
    for name, ids in fields.items():
        outside = sorted({t for t in ids if t >= vocab_size})
        if outside:
            shown = ", ".join(map(str, outside[:5])) + (", ..." if len(outside) > 5 else "")
            return f"{name} has token ids outside the vocabulary [0, {vocab_size}): {shown}"
    return None
