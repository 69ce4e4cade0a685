"""Pictures of a run from sampled SchedulerStats (matplotlib is an optional dependency)."""

import sys
from itertools import pairwise

from protocol import SchedulerStats


def check_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit("--plot needs matplotlib: pip install 'kvengine[plot]'")


def plot_run(samples: list[tuple[float, SchedulerStats]], path: str, title: str) -> list[list[str]]:
    """Four panels over time: KV usage, blocks (held / cached-free), requests, throughput.
    Returns the series labels of each panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s[0] for s in samples]
    stats = [s[1] for s in samples]
    fig, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    axes[0].plot(t, [100 * s.kv_cache_usage for s in stats], label="KV cache usage")
    axes[0].set_ylabel("% of blocks")
    axes[0].set_ylim(0, 105)
    axes[1].plot(t, [s.num_blocks_held for s in stats], label="held by running requests")
    axes[1].plot(t, [s.num_cached_free_blocks for s in stats], label="cached but free (evictable)")
    axes[1].set_ylabel("blocks")
    axes[2].plot(t, [s.num_running_reqs for s in stats], label="running")
    axes[2].plot(t, [s.num_waiting_reqs for s in stats], label="waiting")
    preempt_t = [t1 for (t0, a), (t1, b) in pairwise(samples) if b.num_preemptions > a.num_preemptions]
    for x in preempt_t:
        axes[2].axvline(x, color="red", alpha=0.3, linewidth=1)
    if preempt_t:
        axes[2].plot([], [], color="red", alpha=0.3, label="preemptions")
    axes[2].set_ylabel("requests")
    rates = [
        ((b.num_generation_tokens - a.num_generation_tokens) / (t1 - t0),
         (b.num_prompt_tokens - a.num_prompt_tokens) / (t1 - t0))
        for (t0, a), (t1, b) in pairwise(samples)
    ]
    axes[3].plot(t[1:], [r[0] for r in rates], label="generation")
    axes[3].plot(t[1:], [r[1] for r in rates], label="prompt")
    axes[3].set_ylabel("tokens/s")
    axes[3].set_xlabel("seconds since the start of the run")
    for ax in axes:
        ax.legend(loc="upper right", fontsize="small")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [[line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")] for ax in axes]
