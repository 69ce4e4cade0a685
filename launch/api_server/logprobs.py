"""Log-probabilities in OpenAI's two shapes (the legacy completions object, chat's per-token content list) and in
vLLM's prompt_logprobs shape.

Each token is shown as its own decoded text (a token that ends inside a multi-byte character decodes to
U+FFFD, as in other servers), or as "token_id:N" with vLLM's return_tokens_as_token_ids; `bytes` are the shown
text's UTF-8 bytes. In a completion with echo the prompt's tokens come first, the first of them with null.
"""

from collections.abc import Callable

from protocol import TokenLogprobs

Decode = Callable[[list[int]], str]
Show = Callable[[int], str]  # token id -> the text that stands for it


def token_shower(decode: Decode, as_token_ids: bool) -> Show:
    if as_token_ids:
        return lambda t: f"token_id:{t}"
    return lambda t: decode([t])


def completion_logprobs(show: Show, token_ids: list[int], logprobs: list[TokenLogprobs | None], offset: int) -> dict:
    """{tokens, token_logprobs, top_logprobs, text_offset}; offset: where this piece's text starts in the choice.
    A None entry (an echoed prompt's first token) has null log-probabilities. Each top_logprobs map holds the
    chosen token and the k most likely (k + 1 entries when the chosen is not among them), as OpenAI's legacy
    completions and vLLM give it."""
    tokens = [show(t) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [None if lp is None else lp.logprob for lp in logprobs],
        "top_logprobs": [None if lp is None else top_map(show, t, lp) for t, lp in zip(token_ids, logprobs,
                                                                                       strict=True)],
        "text_offset": offsets,
    }


def top_map(show: Show, token_id: int, lp: TokenLogprobs) -> dict[str, float]:
    """The chosen token first, then the k most likely (a token shown as the same text keeps the later value)."""
    pairs = [(token_id, lp.logprob), *zip(lp.top_token_ids, lp.top_logprobs, strict=True)]
    return {show(t): p for t, p in pairs}


def chat_logprobs(show: Show, token_ids: list[int], logprobs: list[TokenLogprobs]) -> dict:
    """{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""

    def entry(token_id: int, logprob: float) -> dict:
        text = show(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [
        {**entry(t, lp.logprob), "top_logprobs": [entry(i, p) for i, p in zip(lp.top_token_ids, lp.top_logprobs,
                                                                               strict=True)]}
        for t, lp in zip(token_ids, logprobs, strict=True)
    ]}


def prompt_logprobs_entries(decode: Decode, prompt: list[int], logprobs: list[TokenLogprobs]) -> list[dict | None]:
    """vLLM's prompt_logprobs: one entry per prompt token, the first null; each maps the token's id and the k most
    likely ids to {logprob, rank, decoded_token}."""
    out: list[dict | None] = [None]
    for token, lp in zip(prompt[1:], logprobs, strict=True):
        entry = {str(token): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": decode([token])}}
        for rank, (t, p) in enumerate(zip(lp.top_token_ids, lp.top_logprobs, strict=True), 1):
            entry.setdefault(str(t), {"logprob": p, "rank": rank, "decoded_token": decode([t])})
        out.append(entry)
    return out
