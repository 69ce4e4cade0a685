"""A chat request's prompt: the messages rendered by a chat template (the model's, --chat-template's, or the
request's own, all in the same sandbox) and tokenised, with vLLM's options."""

from dataclasses import dataclass

from launch.api_server.errors import ApiError
from launch.api_server.prompts import chat_messages, check_length, template_variables
from launch.api_server.state import Served


@dataclass(frozen=True)
class ChatPrompt:
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the text ends right after the last message's content
    template: str | None = None  # the request's chat_template
    documents: list[dict] | None = None  # vLLM hands them to the template
    add_special_tokens: bool = False  # on top of those the template writes


async def chat_prompt(served: Served, messages: list[dict], kwargs: dict | None, options: ChatPrompt) -> list[int]:
    """The conversation as token ids."""
    checked, variables = chat_messages(messages), template_variables(kwargs)
    if options.documents is not None:
        variables = {**variables, "documents": options.documents}
    return await served.run_text(_chat_prompt, served, checked, variables, options)


def _chat_prompt(served: Served, messages: list[dict], variables: dict, options: ChatPrompt) -> list[int]:
    try:
        text = served.text.render_chat(messages, options.add_generation_prompt, options.template, **variables)
    except ValueError as e:
        raise ApiError(400, str(e), "chat_template" if options.template else "messages") from None
    if options.continue_final_message:
        text = _continued(text, messages)
    check_length(text, served.max_prompt_chars, served.max_model_len, "messages")
    return served.text.encode(text, add_special_tokens=options.add_special_tokens)


def _continued(text: str, messages: list[dict]) -> str:
    """The rendered text cut right after the last message's content (as transformers does: where the template
    trims the content, the trimmed content), so that the model continues that message."""
    final = messages[-1]["content"] if messages else ""
    for content in (final, final.strip()):
        at = text.rfind(content)
        if content and at != -1:
            return text[: at + len(content)]
    raise ApiError(400, "continue_final_message: the last message's content is not in the rendered prompt",
                   "continue_final_message")
