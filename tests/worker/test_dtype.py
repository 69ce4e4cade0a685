"""--dtype on the CPU: auto follows the CPU's bf16 instructions; an explicit bfloat16 where they are missing is
honoured with a warning that it is emulated; an unknown name is refused by name."""

import logging

import pytest
import torch

from worker import worker as worker_module

CPU = torch.device("cpu")


@pytest.mark.parametrize("has_bf16", [True, False])
def test_auto_and_explicit_bfloat16(monkeypatch, caplog, has_bf16):
    monkeypatch.setattr(worker_module, "cpu_has_bf16", lambda: has_bf16)
    with caplog.at_level(logging.WARNING, logger="worker.worker"):
        assert worker_module._resolve_dtype("auto", CPU) == (torch.bfloat16 if has_bf16 else torch.float32)
        assert not caplog.records
        assert worker_module._resolve_dtype("bfloat16", CPU) == torch.bfloat16
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == (0 if has_bf16 else 1)
    assert all("emulated" in w and "float32" in w for w in warned)


def test_float32_never_warns_and_unknown_is_refused(monkeypatch, caplog):
    monkeypatch.setattr(worker_module, "cpu_has_bf16", lambda: False)
    with caplog.at_level(logging.WARNING, logger="worker.worker"):
        assert worker_module._resolve_dtype("float32", CPU) == torch.float32
    assert not caplog.records
    with pytest.raises(ValueError, match="unsupported dtype 'fp8'"):
        worker_module._resolve_dtype("fp8", CPU)
