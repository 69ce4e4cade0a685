"""The serve side of data parallelism, without processes: each engine's cores, the summed stats, refusals."""

from launch.data_parallel.engines import engine_cpu_binds
from launch.data_parallel.server import check_data_parallel, sum_stats
from protocol import SchedulerStats
from protocol.config import engine_config


def test_auto_binding_splits_the_cores_among_the_engines():
    assert engine_cpu_binds(engine_config(data_parallel_size=2), [0, 1]) == ["0", "1"]
    # 8 cores, DP 2: each engine binds its ranks in its share as one engine would in all of them
    assert engine_cpu_binds(engine_config(data_parallel_size=2), list(range(8))) == ["0-3", "4-7"]
    assert engine_cpu_binds(engine_config(data_parallel_size=2, tensor_parallel_size=2), list(range(8))) == \
        ["0-1|2-3", "4-5|6-7"]
    assert engine_cpu_binds(engine_config(data_parallel_size=3), [0, 1]) == ["0", "1", "0"]  # fewer cores: shared
    assert engine_cpu_binds(engine_config(data_parallel_size=2, cpu_threads_bind="nobind"), [0, 1]) == ["nobind"] * 2


def test_stats_sum_counters_and_average_the_usage():
    total = sum_stats([SchedulerStats(num_running_reqs=2, kv_cache_usage=0.5, prefix_cache_hits=16),
                       SchedulerStats(num_running_reqs=1, kv_cache_usage=0.1, prefix_cache_hits=32)])
    assert (total.num_running_reqs, total.prefix_cache_hits, round(total.kv_cache_usage, 6)) == (3, 48, 0.3)
    assert total.engines is None and sum_stats([]) == SchedulerStats()


def test_settings_data_parallelism_cannot_run_with():
    assert check_data_parallel(engine_config(data_parallel_size=2)) is None
    assert "multi-host" in (check_data_parallel(engine_config(data_parallel_size=2, nnodes=2,
                                                              tensor_parallel_size=2)) or "")
    assert "--kv-events-endpoint" in (check_data_parallel(engine_config(
        data_parallel_size=2, kv_events_endpoint="tcp://127.0.0.1:5557")) or "")
