"""Async scheduling is a Scheduler subclass (AsyncScheduler, as in vLLM): the engine core picks the class by
the flag, and a class built with the other setting refuses it rather than schedule the other way."""

import pytest

from engine_core.async_scheduler import AsyncScheduler
from engine_core.scheduler import Scheduler
from protocol import KVCacheConfig, KVCacheGroupSpec
from protocol.config import engine_config
from tests.engine_core.scheduler_support import SPEC, make_core


@pytest.mark.parametrize(("async_scheduling", "cls"), [(False, Scheduler), (True, AsyncScheduler)])
def test_the_engine_core_picks_the_class_by_the_flag(async_scheduling, cls):
    core, _ = make_core(async_scheduling=async_scheduling)
    assert type(core.scheduler) is cls


@pytest.mark.parametrize(("async_scheduling", "cls"), [(True, Scheduler), (False, AsyncScheduler)])
def test_a_class_refuses_the_other_setting(async_scheduling, cls):
    kv = KVCacheConfig(num_blocks=64, kv_cache_groups=[KVCacheGroupSpec(["layer.0"], SPEC)])
    with pytest.raises(ValueError, match=f"{cls.__name__} cannot run with async_scheduling"):
        cls(engine_config(async_scheduling=async_scheduling), kv, 256)
