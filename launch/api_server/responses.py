"""POST /v1/responses, OpenAI's Responses API for text and function tools, stateless (responses_input.py): the
answer is a response object whose output holds an assistant message with an output_text part (and function_call
items for the calls), or, streamed, OpenAI's events (response.created ... response.completed, with
response.output_text.delta for the text and the function_call items at the end)."""

import time
import uuid
from collections.abc import AsyncIterator

import msgspec
from fastapi import Request
from fastapi.responses import Response

from launch.api_server.completions import admit, event_stream, json_response, read, served_of, until_disconnected
from launch.api_server.errors import ApiError
from launch.api_server.generation import Generation, Piece
from launch.api_server.guard import cleanup, user_of
from launch.api_server.prompts import chat_messages, check_length, template_variables
from launch.api_server.responses_input import ResponsesRequest, chat_request
from launch.api_server.serving import collect, start
from launch.api_server.state import Served
from launch.api_server.tools.answer import ToolAnswer
from launch.api_server.tools.call import ToolCall
from launch.api_server.tools.chat import chat_tools
from launch.api_server.tools.messages import template_messages

PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}  # chat name -> ours


async def responses(request: Request) -> Response:
    served = served_of(request)
    req = await read(request, ResponsesRequest)
    served.check_model(req.model)
    try:
        chat = chat_request(req)
        tools = chat_tools(served, chat)
        admit(request, 1)
        prompt = await served.run_text(_prompt, served, chat.messages, tools.template_kwargs(None))
        response_id, generation = start(served, user_of(request), chat, [prompt], chat.max_tokens, "resp")
    except ApiError as e:  # named as the Responses API names the field
        param = PARAMS.get(e.param or "", e.param)
        raise ApiError(e.status, e.message.replace(e.param or "\0", param or ""), param) from None
    cleanup(request, generation.close)
    await until_disconnected(request, generation.wait_accepted())
    shell = Shell(served, req, response_id)
    if req.stream:
        return event_stream(_events(shell, generation, tools, len(prompt)))
    wholes, finals = await until_disconnected(request, collect(generation, 1))
    content, calls = tools.calls(wholes[0].text)
    message = [message_item(content or "", item_status(finals[0].finish_reason))] if content is not None or not calls \
        else []
    output = message + [call_item(c) for c in calls]
    return json_response(shell.object(output, finals[0].finish_reason, usage(len(prompt), finals[0])))


def _prompt(served: Served, messages: list[dict], kwargs: dict | None) -> list[int]:
    try:
        text = served.text.render_chat(chat_messages(template_messages(messages)), add_generation_prompt=True,
                                       **template_variables(kwargs))
    except ValueError as e:
        raise ApiError(400, str(e), "input") from None
    check_length(text, served.max_prompt_chars, served.max_model_len, "input")
    return served.text.encode(text, add_special_tokens=False)


class Shell:
    """The response object around an output, as OpenAI writes it (the request's settings echoed back)."""

    def __init__(self, served: Served, req: ResponsesRequest, response_id: str) -> None:
        self.model, self.req, self.id, self.created = served.model_name, req, response_id, int(time.time())

    def object(self, output: list[dict], finish_reason: str | None, usage: dict | None) -> dict:
        req = self.req
        status = {None: "in_progress", "length": "incomplete", "error": "failed", "abort": "failed"}.get(
            finish_reason, "completed")
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
                "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "text": req.text or {"format": {"type": "text"}}, "previous_response_id": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "error": {"code": "server_error", "message": "the engine stopped"} if status == "failed" else None,
                "metadata": req.metadata or {}, "usage": usage}


def item_status(finish_reason: str | None) -> str:
    """An output item's status: incomplete where max_output_tokens cut the answer off, as OpenAI marks it."""
    return "incomplete" if finish_reason == "length" else "completed"


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    part = [{"type": "output_text", "text": text, "annotations": []}] if status != "in_progress" else []
    return {"type": "message", "id": item_id or f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": part}


def call_item(call: ToolCall, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "function_call", "id": item_id or f"fc_{uuid.uuid4().hex}", "call_id": call.id,
            "name": call.name, "arguments": call.arguments if status == "completed" else "", "status": status}


def usage(input_tokens: int, final: Piece) -> dict:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": final.cached_tokens},
            "output_tokens": final.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + final.completion_tokens}


async def _events(shell: Shell, generation: Generation, tools: ToolAnswer, input_tokens: int) -> AsyncIterator[bytes]:
    """OpenAI's Responses stream: the text as output_text deltas of one message item, then each call's item."""
    stream = EventStream()
    yield stream.event("response.created", response=shell.object([], None, None))
    yield stream.event("response.in_progress", response=shell.object([], None, None))
    message_id, text = f"msg_{uuid.uuid4().hex}", ""
    async for piece in generation.pieces():
        delta, finish_reason = tools.delta(piece.text, piece.finish_reason)
        if delta.get("content"):
            if not text:
                yield stream.event("response.output_item.added", output_index=0,
                                   item=message_item("", "in_progress", message_id))
                yield stream.event("response.content_part.added", item_id=message_id, output_index=0,
                                   content_index=0, part={"type": "output_text", "text": "", "annotations": []})
            text += delta["content"]
            yield stream.event("response.output_text.delta", item_id=message_id, output_index=0, content_index=0,
                               delta=delta["content"])
        if piece.finish_reason is not None:
            output = [message_item(text, item_status(piece.finish_reason), message_id)] \
                if text or not delta.get("tool_calls") else []
            for event in _closing(stream, output, text, delta.get("tool_calls") or []):
                yield event
            done = shell.object(output, finish_reason, usage(input_tokens, piece))
            yield stream.event({"completed": "response.completed", "incomplete": "response.incomplete"}.get(
                done["status"], "response.failed"), response=done)


def _closing(stream: "EventStream", output: list[dict], text: str, calls: list[dict]) -> list[bytes]:
    """The message item's closing events, then each call's item (added to output)."""
    events = []
    if output:
        item = output[0]
        part = item["content"][0]
        if not text:  # nothing was streamed: the item opens here
            events += [stream.event("response.output_item.added", output_index=0,
                                    item={**item, "status": "in_progress", "content": []}),
                       stream.event("response.content_part.added", item_id=item["id"], output_index=0,
                                    content_index=0, part={**part, "text": ""})]
        events += [stream.event("response.output_text.done", item_id=item["id"], output_index=0, content_index=0,
                                text=text),
                   stream.event("response.content_part.done", item_id=item["id"], output_index=0, content_index=0,
                                part=part),
                   stream.event("response.output_item.done", output_index=0, item=item)]
    for delta in calls:
        call = ToolCall(delta["function"]["name"], delta["function"]["arguments"], delta["id"])
        item, index = call_item(call), len(output)
        output.append(item)
        events += [stream.event("response.output_item.added", output_index=index,
                                item={**item, "status": "in_progress", "arguments": ""}),
                   stream.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                delta=call.arguments),
                   stream.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                arguments=call.arguments),
                   stream.event("response.output_item.done", output_index=index, item=item)]
    return events


class EventStream:
    def __init__(self) -> None:
        self.sequence_number = 0

    def event(self, kind: str, **fields: object) -> bytes:
        data = msgspec.json.encode({"type": kind, "sequence_number": self.sequence_number, **fields})
        self.sequence_number += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"
