"""Development scripts under ``scripts/`` that run on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def _k(x_ptr, N: tl.constexpr):
    """doc {doc}"""
    v = tl.load(x_ptr + tl.arange(0, N))
    tl.store(x_ptr + tl.arange(0, N), v {op} 1)
'''


@pytest.mark.reference
def test_jit_ast_diff_tells_moved_kernels_from_changed_ones(tmp_path):
    """A kernel moved to another file with another docstring and spacing is identical; a changed
    operator is not (exit 1, named)."""
    a, b, c = (tmp_path / n for n in "abc")
    for d in (a, b, c):
        d.mkdir()
    (a / "one.py").write_text(_KERNEL.format(doc="a", op="+"))
    (b / "two.py").write_text("\n\n" + _KERNEL.format(doc="moved", op="+").replace("v + 1", "v  +  1"))
    (c / "one.py").write_text(_KERNEL.format(doc="a", op="-"))
    script = os.path.join(ROOT, "scripts", "jit_ast_diff.py")
    same = subprocess.run([sys.executable, script, str(a), str(b)], capture_output=True, text=True)
    assert same.returncode == 0 and "1 @triton.jit functions identical, 0 differ" in same.stdout, same.stdout
    diff = subprocess.run([sys.executable, script, str(a), str(c)], capture_output=True, text=True)
    assert diff.returncode == 1 and "differs: _k" in diff.stdout, diff.stdout
