"""Checks of a request's sampling parameters that need the engine: one sequence per request, and token ids
inside the model's vocabulary.

The wire bounds (protocol/sampling.py) hold any id below 2**31; the worker indexes [rows, vocab] tensors with
these, so an id past the model's vocabulary is refused here, by the field's name, before the request is queued.
"""

from itertools import chain

from protocol import SamplingParams


def sampling_error(params: SamplingParams, vocab_size: int | None) -> str | None:
    """Why the engine core cannot run these parameters, naming the field; None if it can."""
    if params.num_sequences > 1:
        return (f"n={params.n}, best_of={params.best_of}: the engine core runs one sequence per request; "
                "the client fans n > 1 out (launch/client/parallel_sampling.py)")
    return None if vocab_size is None else _out_of_vocabulary(params, vocab_size)


def _out_of_vocabulary(params: SamplingParams, vocab_size: int) -> str | None:
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
