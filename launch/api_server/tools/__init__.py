"""Tool calling for /v1/chat/completions (and /v1/responses): the request's tools and tool_choice, the parsers
that find the model's calls in its text (--tool-call-parser), and the calls in OpenAI's shapes."""
