"""The OpenAI-compatible HTTP API: a process that is one more ZeroMQ client of the engine core.

Text lives here (tokenizer, chat template, detokenisation, stop strings); the engine core only sees token ids.
"""
