import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread_per_process():
    """Tests run beside other suites on 2 cores; one torch thread avoids oversubscription."""
    torch.set_num_threads(1)
