"""What /v1/chat/completions asks of the tools: the request's choice checked against the server's flags, the answer
shaped from it (a pass-through without tools), and the decode that keeps a format's special-token markers."""

from launch.api_server.state import Served
from launch.api_server.tools.answer import ToolAnswer
from launch.api_server.tools.choice import ToolChoice, tool_choice


def chat_tools(served: Served, req) -> ToolAnswer:
    """req's tools and tool_choice as its answer's shaper (400 naming tools or tool_choice when they are not
    valid). A parser whose markers are special tokens (mistral, llama3_json) has the answer decoded with them, as
    vLLM does; the model's EOS text, which such a decode ends with, is not the answer's."""
    choice = tool_choice(req.tools, req.tool_choice, req.parallel_tool_calls, served.config) or ToolChoice("none", [])
    answer = ToolAnswer(choice)
    if answer.keeps_special_tokens:  # only then is the EOS text at the end the decode's, not the client's ask
        req.skip_special_tokens = False
        eos = served.text.special_tokens.get("eos_token")
        answer = ToolAnswer(choice, (eos,) if eos else ())
    return answer
