"""Prompts of a request as token id lists, checked against the model's length limit."""

from launch.api_server.errors import ApiError
from launch.api_server.text_model import TextModel


def completion_prompts(prompt: str | list, text: TextModel) -> list[list[int]]:
    """A text, a list of texts, token ids, or a list of token id lists."""
    if isinstance(prompt, str):
        return [text.encode(prompt)]
    if not prompt:
        raise ApiError(400, "prompt is empty", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return [text.encode(p) for p in prompt]
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [list(prompt)]
    if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise ApiError(400, "prompt must be a string, a list of strings, token ids or a list of token id lists",
                   "prompt")


def chat_messages(messages: list[dict]) -> list[dict]:
    """Messages for the template: content given as a list of text parts becomes one string."""
    out = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, "each message needs a 'role' string", "messages")
        content = message.get("content")
        if isinstance(content, list):
            texts = [str(p.get("text")) for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(texts) != len(content):
                raise ApiError(400, "only text content parts are supported", "messages")
            message = {**message, "content": "\n".join(texts)}
        out.append(message)
    return out


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
