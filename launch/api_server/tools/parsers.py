"""The tool-call parsers by --tool-call-parser name, as vLLM names them."""

from launch.api_server.tools.call import ToolParser
from launch.api_server.tools.hermes import HermesParser
from launch.api_server.tools.llama3_json import Llama3JsonParser
from launch.api_server.tools.mistral import MistralParser

PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser,
                                        "mistral": MistralParser}
