"""Test tiers (DESIGN.md §5).

- ``reference``: pure PyTorch on the CPU.
- ``interpreter``: the real Triton kernels with ``TRITON_INTERPRET=1`` on small CPU tensors.
  Without CUDA this conftest turns the interpreter on before any kernel is defined; on a CUDA
  machine the tier is skipped (run it there with ``TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=``).
- ``gpu`` / ``multigpu``: need one / two CUDA GPUs, skipped otherwise.
"""

import contextlib
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from moekit.ops._common import HAS_TRITON, interpreting  # noqa: E402


def pytest_collection_modifyitems(config, items):
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_interp = pytest.mark.skip(reason="interpreter tier needs TRITON_INTERPRET=1 and triton")
    skip_gpu = pytest.mark.skip(reason="gpu tier needs CUDA and triton")
    skip_multi = pytest.mark.skip(reason="needs 2 or more CUDA GPUs")
    for item in items:
        if "interpreter" in item.keywords and not (interpreting() and HAS_TRITON):
            item.add_marker(skip_interp)
        if "gpu" in item.keywords and not (ngpu >= 1 and HAS_TRITON and not interpreting()):
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and ngpu < 2:
            item.add_marker(skip_multi)


@pytest.fixture
def cuda():
    return torch.device("cuda")


@pytest.fixture
def pin_knobs():
    """``pin_knobs(NAME=value, ...)`` pins tuning knobs (``moekit.settings``, ``override(knobs=...)``)
    until the test ends: the launchers read them instead of their module constants."""
    from moekit import settings

    with contextlib.ExitStack() as stack:
        yield lambda **knobs: stack.enter_context(settings.override(knobs=knobs))
