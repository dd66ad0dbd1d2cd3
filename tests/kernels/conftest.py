import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _two_threads():
    # CI and the shared dev machine have 2 cores.
    torch.set_num_threads(2)
