"""The scheduler side of a second KV tier (vLLM's KV connector shape): what a tier holds beyond the memory
prefix hit, what to load into freshly allocated blocks, what to save, and the transfers the workers report."""
