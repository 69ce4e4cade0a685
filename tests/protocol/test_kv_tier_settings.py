"""What the disk tier still refuses, each by the setting that asks for it; tensor parallelism on one host and
sliding-window models are served (tests/worker/test_kv_disk_tier_hybrid.py, tests/e2e/test_kv_disk_tier.py)."""

import pytest

from protocol.config import engine_config


@pytest.mark.parametrize(("settings", "named"), [
    ({"kv_disk_path": "tier", "enable_prefix_caching": False}, "enable_prefix_caching"),
    ({"preemption_mode": "swap"}, "kv_disk_path"),
    ({"kv_disk_bytes": 1 << 30}, "kv_disk_path"),
    ({"kv_disk_path": "tier", "tensor_parallel_size": 2, "nnodes": 2}, "nnodes"),
])
def test_refused_by_name(settings, named):
    with pytest.raises(ValueError, match=named):
        engine_config(**settings)


def test_tensor_parallel_on_one_host_is_served():
    assert engine_config(kv_disk_path="tier", tensor_parallel_size=2).parallel.tensor_parallel_size == 2
