"""How `kvengine simulate` shows its figures: a table per replay, one line per sweep point, a plot."""

from launch.commands.plot import check_matplotlib
from launch.simulate.dp_replay import DPResult
from launch.simulate.result import SimResult


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.1f} ms"


def result_table(r: SimResult) -> str:
    rows = [
        ("requests", f"{r.num_requests:,} ({r.num_finished:,} finished, {r.num_rejected:,} rejected)"),
        ("prompt tokens", f"{r.num_prompt_tokens:,}"),
        ("prefix-cache hit tokens", f"{r.num_cached_tokens:,}"),
        ("prefix-cache hit rate", f"{r.hit_rate:.2%}" if r.prefix_caching else "- (prefix caching off)"),
        ("infinite-cache hit tokens", f"{r.ceiling_cached_tokens:,}"),
        ("infinite-cache hit rate", f"{r.ceiling_hit_rate:.2%}"),
        ("output tokens", f"{r.num_output_tokens:,}"),
        ("preemptions", f"{r.num_preemptions:,}"),
        ("KV cache", f"{r.kv_cache_tokens:,} tokens ({r.num_blocks:,} blocks of {r.block_size})"),
        ("peak KV usage", f"{r.peak_kv_usage:.1%}"),
        ("mean KV usage", f"{r.mean_kv_usage:.1%}"),
        ("simulated time", f"{r.sim_time_s:,.1f} s in {r.num_steps:,} steps"),
        ("TTFT p50 / p90 / p99", f"{_ms(r.ttft_p50_s)} / {_ms(r.ttft_p90_s)} / {_ms(r.ttft_p99_s)}"),
        ("max_model_len", f"{r.max_model_len:,}"),
        ("block hash", r.hash_algo),
        ("wall time", f"{r.wall_time_s:,.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def dp_result_table(r: DPResult) -> str:
    """The totals, then one line per engine core."""
    rows = [
        ("engine cores", f"{r.num_engines} behind the router, policy {r.router_policy}"),
        ("requests", f"{r.num_requests:,} ({r.num_finished:,} finished, {r.num_rejected:,} rejected)"),
        ("prefix-cache hit rate", f"{r.hit_rate:.2%} ({r.num_cached_tokens:,} of {r.num_prompt_tokens:,} tokens)"),
        ("one infinite cache", f"{r.ceiling_hit_rate:.2%}"),
        ("KV cache", f"{r.kv_cache_tokens:,} tokens ({r.kv_cache_tokens_per_engine:,} per engine)"),
        ("simulated time", f"{r.sim_time_s:,.1f} s"),
        ("TTFT p50 / p90 / p99", f"{_ms(r.ttft_p50_s)} / {_ms(r.ttft_p90_s)} / {_ms(r.ttft_p99_s)}"),
        ("wall time", f"{r.wall_time_s:,.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines.append(f"{'engine':>6} {'requests':>9} {'prompt tokens':>14} {'hit rate':>9} {'preempt':>8} {'steps':>8}")
    lines += [f"{i:>6} {e.num_requests:>9,} {e.num_prompt_tokens:>14,} {e.hit_rate:>9.2%} {e.num_preemptions:>8,} "
              f"{e.num_steps:>8,}" for i, e in enumerate(r.engines)]
    return "\n".join(lines)


def sweep_table(results: list[SimResult]) -> str:
    head = (f"{'KV tokens':>14} {'blocks':>11} {'hit rate':>9} {'ceiling':>8} {'rejected':>8} {'preempt':>8} "
            f"{'peak KV':>8} {'TTFT p50':>11} {'TTFT p99':>11} {'wall':>7}")
    lines = [head]
    lines += [
        f"{r.kv_cache_tokens:>14,} {r.num_blocks:>11,} {r.hit_rate:>9.2%} {r.ceiling_hit_rate:>8.2%} "
        f"{r.num_rejected:>8,} {r.num_preemptions:>8,} {r.peak_kv_usage:>8.1%} {_ms(r.ttft_p50_s):>11} "
        f"{_ms(r.ttft_p99_s):>11} {r.wall_time_s:>6.0f}s"
        for r in results
    ]
    return "\n".join(lines)


def plot_sweep(results: list[SimResult], path: str, title: str) -> None:
    check_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r.kv_cache_tokens for r in results]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [100 * r.hit_rate for r in results], marker="o", label="replay (LRU, engine ledger)")
    ax.axhline(100 * results[0].ceiling_hit_rate, linestyle="--", color="gray", label="infinite cache")
    ax.set_xscale("log")
    ax.set_xlabel("KV cache capacity (tokens)")
    ax.set_ylabel("prefix cache hit rate (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
