"""--cpu-threads-bind choices on an idle machine and with another process busy on one core, interleaved.

    python -m bench.binding_bench --model DIR [--binds auto,0-1,1] [--rounds 3] [-- kvengine bench flags]

Each round runs `kvengine bench` (its own server, the random workload) once per binding and condition: idle, and
busy (a `while 1: pass` process pinned to the mask's last core, started before the server and stopped after).
Prints the median output tok/s of each, each busy figure against its own idle one, and each idle figure against
the best idle one. Idle runs during which other processes used more than --max-foreign-load cores are discarded
(busy runs count the busy loop as their own load).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

from bench.timing import clean_round, foreign_load, interleaved

BUSY_LOOP = "import os, sys; os.sched_setaffinity(0, [int(sys.argv[1])])\nwhile 1: pass"


def run_bench(bind: str, busy: bool, args: argparse.Namespace) -> tuple[float | None, float]:
    """(output tok/s or None if it failed, cores other processes used meanwhile)."""
    cmd = [sys.executable, "-m", "launch.cli", "bench", "--json", "--cpu-threads-bind", bind, *args.bench_flags]
    if args.model:
        cmd += ["--model", args.model]
    loop = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(max(os.sched_getaffinity(0)))]) if busy else None
    try:
        with foreign_load() as load:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    finally:
        if loop is not None:
            loop.kill()
            loop.wait()
    if done.returncode != 0:
        print(f"  {bind}: failed: {done.stderr.strip()[-600:]}", file=sys.stderr)
        return None, load.cores
    return json.loads(done.stdout)["output_tokens_per_s"], load.cores


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF folder or GGUF file (default: the built-in model)")
    p.add_argument("--binds", default="auto,0-1,1", help="comma list of --cpu-threads-bind values")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-foreign-load", type=float, default=0.2)
    p.add_argument("bench_flags", nargs="*", help="after --: flags of kvengine bench (workload, sizes)")
    args = p.parse_args()
    variants = {}
    for bind in args.binds.split(","):
        for busy in (False, True):
            variants[f"{bind} {'busy' if busy else 'idle'}"] = make_run(bind, busy, args)
    results = interleaved(variants, args.rounds)
    report({name: statistics.median(runs) for name, runs in results.items() if runs}, results)
    return 0


def make_run(bind: str, busy: bool, args: argparse.Namespace):
    allowed = args.max_foreign_load + (1.0 if busy else 0.0)  # the busy loop holds one core
    name = f"{bind} {'busy' if busy else 'idle'}"
    return lambda r: clean_round(name, r, args.max_foreign_load, lambda: run_bench(bind, busy, args), allowed)


def report(medians: dict[str, float], results: dict[str, list[float]]) -> None:
    best = max((v for k, v in medians.items() if k.endswith("idle")), default=None)
    print(f"{'binding':<10} {'condition':<9} {'runs':>4} {'tok/s':>9} {'x own idle':>10} {'x best idle':>11}")
    for name, tok_s in medians.items():
        bind, condition = name.rsplit(" ", 1)
        own = medians.get(f"{bind} idle")
        print(f"{bind:<10} {condition:<9} {len(results[name]):>4} {tok_s:>9.1f} "
              f"{tok_s / own if own else float('nan'):>10.2f} {tok_s / best if best else float('nan'):>11.2f}")


if __name__ == "__main__":
    sys.exit(main())
