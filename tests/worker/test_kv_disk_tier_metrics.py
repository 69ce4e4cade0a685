"""The disk tier's counters on Prometheus (kvengine:kv_tier_*{medium="DISK"}): a real engine restarted on its tier
folder loads the prefix, and the series say how many tokens hit, how many blocks and bytes moved each way."""

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine_core.kv_connector.metrics import SERIES
from engine_core.metrics import EngineMetrics
from protocol.kv_transfer import KVTierStats
from tests.worker.kv_disk_support import BLOCK, PREFIX, block_files, make_engine, run, served_once


def samples(metrics: EngineMetrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def tier_value(got: dict, name: str, medium: str = "DISK") -> float:
    return got[(f"kvengine:{name}_total", (("medium", medium),))]


def test_a_restart_shows_its_hits_loads_and_saves(tmp_path):
    served_once(tmp_path, {"a": PREFIX + [5, 6, 7]})
    saved_before = sum(f.stat().st_size for f in block_files(tmp_path))
    engine = make_engine(tmp_path)
    metrics = EngineMetrics(block_size=BLOCK)
    try:
        metrics.update_tier_stats(engine.get_tier_stats())
        assert all(tier_value(samples(metrics), name) == 0 for name, _ in SERIES.values())
        _, cached = run(engine, {"a": PREFIX + [5, 6, 7], "b": [9] * (3 * BLOCK + 1)})
        (tier,) = engine.get_tier_stats()
    finally:
        engine.shutdown()
    metrics.update_tier_stats([tier])
    got = samples(metrics)
    assert cached["a"] == 6 * BLOCK == tier.hits == tier_value(got, "kv_tier_hits")
    assert tier_value(got, "kv_tier_loaded_blocks") == 6
    assert tier_value(got, "kv_tier_load_bytes") == tier.load_bytes > 0
    assert tier_value(got, "kv_tier_saved_blocks") == 3  # b's three full blocks
    saved_now = sum(f.stat().st_size for f in block_files(tmp_path))
    assert tier_value(got, "kv_tier_save_bytes") == saved_now - saved_before
    assert tier_value(got, "kv_tier_failed_blocks") == tier_value(got, "kv_tier_removed_blocks") == 0


def test_counters_follow_the_totals_per_medium():
    metrics = EngineMetrics(block_size=BLOCK)
    metrics.update_tier_stats([KVTierStats(medium="DISK", hits=32, loaded_blocks=2, removed_blocks=1)])
    metrics.update_tier_stats([KVTierStats(medium="DISK", hits=48, loaded_blocks=3, removed_blocks=1),
                               KVTierStats(medium="CPU", saved_blocks=4)])
    got = samples(metrics)
    assert tier_value(got, "kv_tier_hits") == 48 and tier_value(got, "kv_tier_loaded_blocks") == 3
    assert tier_value(got, "kv_tier_removed_blocks") == 1
    assert tier_value(got, "kv_tier_saved_blocks", "CPU") == 4


def test_no_tier_no_series(tmp_path):
    metrics = EngineMetrics(block_size=BLOCK)
    metrics.update_tier_stats([])
    assert not [key for key in samples(metrics) if key[0].startswith("kvengine:kv_tier")]
