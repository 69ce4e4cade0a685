"""Trace replay: the real EngineCore (scheduler + KV ledger) on a simulated clock, no model.

The engine behind `kvengine simulate` (launch/commands/simulate.py), for capacity planning: "how
many KV blocks for this traffic, and what prefix-cache hit rate?". One module per piece, in the
order a replay uses them:

- `trace`: Mooncake-format JSONL records.
- `tokens`: each trace hash id becomes 512 token ids, so the engine's own block hashes see exactly
  the sharing the trace records.
- `ceiling`: the infinite-cache hit count, counted directly over hash ids.
- `executor`: a model-free executor that follows the SchedulerOutput protocol and prices each step
  with a cost model (the simulated clock).
- `replay`: the loop that feeds arrivals to the engine core and advances the clock; `result` holds
  its figures and `sweep` repeats it over cache sizes. `report` prints them.
- `dp_replay`: N engine cores behind the real router (launch/data_parallel/routing.py) on one clock.
"""
