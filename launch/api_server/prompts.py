"""Prompts and messages of a request, checked before any tokenising: shapes, token ids, sizes, nesting."""

from launch.api_server.errors import ApiError
from protocol.sampling import MAX_INT32

MAX_NESTING = 32  # levels of lists and objects inside a message or a template argument
RENDER_ARGUMENTS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})


def completion_prompts(prompt: str | list, max_prompts: int) -> list[str] | list[list[int]]:
    """A text, a list of texts, token ids, or a list of token id lists: as a list of texts or of id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt is empty", "prompt")
    if all(type(t) is int for t in prompt):
        prompts: list = [prompt]
    elif all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) and p for p in prompt):
        prompts = prompt
    else:
        raise ApiError(400, "prompt must be a string, a list of strings, token ids or a list of token id lists",
                       "prompt")
    if len(prompts) > max_prompts:
        raise ApiError(400, f"a request takes at most {max_prompts} prompts (--max-request-prompts); this one has "
                            f"{len(prompts)}", "prompt")
    if not isinstance(prompts[0], str):
        for ids in prompts:
            check_token_ids(ids, "prompt")
    return prompts


def check_token_ids(ids: list, param: str) -> None:
    if not all(type(t) is int for t in ids) or (ids and not (min(ids) >= 0 and max(ids) <= MAX_INT32)):
        raise ApiError(400, f"token ids are integers in [0, {MAX_INT32}]", param)


def check_length(text: str, max_chars: int, max_model_len: int, param: str) -> None:
    """Refuse, before tokenising, a text longer than max_model_len tokens of the longest token could cover."""
    if len(text) > max_chars:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                            f"{len(text)} characters, more than that many tokens can hold", param)


def chat_messages(messages: list[dict]) -> list[dict]:
    """Messages for the template: text parts joined into one string, a null content (an assistant turn with
    tool_calls) as an empty one; any other content is refused, naming the message."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message.get("role"), str):
            raise ApiError(400, "each message needs a 'role' string", f"messages[{i}].role")
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, "only text content parts are supported", f"messages[{i}].content")
            content = "\n".join(p["text"] for p in content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ApiError(400, "content is a string, a list of text parts, or null", f"messages[{i}].content")
        check_nesting(message, f"messages[{i}]")
        out.append({**message, "content": content})
    return out


def template_variables(kwargs: dict | None) -> dict:
    """chat_template_kwargs: extra template arguments, none of which may replace one the server passes."""
    kwargs = kwargs or {}
    taken = sorted(RENDER_ARGUMENTS.intersection(kwargs))
    if taken:
        raise ApiError(400, f"chat_template_kwargs may not set {', '.join(taken)}: the server passes them",
                       "chat_template_kwargs")
    check_nesting(kwargs, "chat_template_kwargs")
    return kwargs


def check_nesting(value: object, param: str) -> None:
    """Refuse lists and objects nested deeper than MAX_NESTING (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > MAX_NESTING:
                raise ApiError(400, f"nested deeper than {MAX_NESTING} levels", param)
            stack += [(child, depth + 1) for child in (item.values() if isinstance(item, dict) else item)]


def max_tokens_for(prompt: list[int], requested: int | None, max_model_len: int) -> int:
    """requested, or what is left of the context; 400 when the prompt (with the requested output) does not fit."""
    if not prompt:
        raise ApiError(400, "the prompt is empty", "prompt")
    if len(prompt) >= max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                            f"{len(prompt)} tokens", "prompt")
    if requested is None:
        return max_model_len - len(prompt)
    if requested >= 1 and len(prompt) + requested > max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens; you requested "
                            f"{len(prompt) + requested} tokens ({len(prompt)} in the prompt, {requested} for the "
                            "completion)", "max_tokens")
    return requested
