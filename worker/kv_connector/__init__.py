"""The workers' side of a second KV tier: move blocks between the KV cache and the tier, and say which transfers
finished (the engine core decides which: engine_core/kv_connector/)."""
