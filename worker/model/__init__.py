"""Llama-family models over the paged KV cache."""
