"""Log-probabilities in OpenAI's two shapes: the legacy completions object and chat's per-token content list.

Each token is shown as its own decoded text (a token that ends inside a multi-byte character decodes to
U+FFFD, as in other servers); `bytes` are that text's UTF-8 bytes.
"""

from collections.abc import Callable

from protocol import TokenLogprobs

Decode = Callable[[list[int]], str]


def completion_logprobs(decode: Decode, token_ids: list[int], logprobs: list[TokenLogprobs], offset: int) -> dict:
    """{tokens, token_logprobs, top_logprobs, text_offset}; offset: where this piece's text starts in the choice."""
    tokens = [decode([t]) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{decode([t]): p for t, p in zip(lp.top_token_ids, lp.top_logprobs, strict=True)}
                         for lp in logprobs],
        "text_offset": offsets,
    }


def chat_logprobs(decode: Decode, token_ids: list[int], logprobs: list[TokenLogprobs]) -> dict:
    """{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""

    def entry(token_id: int, logprob: float) -> dict:
        text = decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [
        {**entry(t, lp.logprob), "top_logprobs": [entry(i, p) for i, p in zip(lp.top_token_ids, lp.top_logprobs,
                                                                               strict=True)]}
        for t, lp in zip(token_ids, logprobs, strict=True)
    ]}
