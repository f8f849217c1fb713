"""CPU-side compile check of moekit's Triton launchers for sm_90 (H100/H200), no GPU needed.

``compile_launches(snippet, modules)`` runs ``snippet`` in a subprocess with
``TRITON_INTERPRET=0`` (kernels defined under the interpreter cannot be compiled), where the
``launch`` of each module in ``modules`` is replaced by a recorder and ``num_sms`` returns 132.
The snippet calls private launchers on ``meta`` tensors; every recorded launch is compiled with
the real Triton compiler (through ptxas) for ``GPUTarget("cuda", 90, 32)``. Python float
arguments are typed ``fp64``, as torch.compile (inductor) passes them to user-defined Triton
kernels; ints equal to 1 are specialized as Triton's launcher does. Returns one dict per launch
(``kernel``, ``constants``, ``num_warps``, ``shared`` bytes, ``regs`` per thread, ``stack``
frame bytes (spills; None when ``cuobjdump`` is missing), ``loop_spills`` (local-memory accesses
inside the MMA loops), ``adds`` (the global atomic adds in the SASS: ``{"ATOMG": n, "REDG": n}``,
those that read the old value back and the fire-and-forget ones), ``serialized`` (with
``serialized=True``: ptxas's reason for making the wgmma instructions synchronous, else False),
``lead_bars`` (the block barriers ``BAR.SYNC`` in the SASS ahead of the first asynchronous copy
into shared memory, ``LDGSTS`` or ``UTMALDG``: what a prologue makes every warp wait on before
its stream starts), ``error`` or None). With
``SM90_DUMP_DIR=<folder>`` each launch's TTGIR, PTX and cubin are written there (for
``cuobjdump -sass``).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest

_DRIVER = r"""
import importlib, json, os, re, subprocess, sys, tempfile, traceback
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
      torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv", torch.uint8: "u8", torch.int16: "i16",
      torch.int8: "i8"}
RECORDS = []


def registers(cubin):
    # (registers per thread, stack frame bytes, local-memory accesses inside the MMA loops) of the
    # compiled kernel (cuobjdump -res-usage and -sass; the loops: from a warpgroup MMA fence to
    # the wait for every MMA group, ``DEPBAR.LE gsb0, 0x0``, as the Gluon compile tests count).
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None, None, None, None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout.splitlines()
    m = re.search(r"REG:(\d+)", out)
    st = re.search(r"STACK:(\d+)", out)
    adds = {op: sum(op + ".E.ADD" in ln for ln in sass) for op in ("ATOMG", "REDG")}
    # block barriers ahead of the first asynchronous copy into shared memory (cp.async or TMA)
    first = next((i for i, ln in enumerate(sass) if "LDGSTS" in ln or "UTMALDG" in ln), len(sass))
    lead = sum("BAR.SYNC" in ln for ln in sass[:first])
    return (int(m.group(1)) if m else None), (int(st.group(1)) if st else None), sass_loop_spills(sass), adds, lead


def compile_one(kernel, args, kwargs):
    opts = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "launch_pdl", "maxnreg") if k in kwargs}
    names = kernel.arg_names
    # Parameters left out take their default (e.g. an optional constexpr flag).
    values = list(args) + [kwargs[n] if n in kwargs else kernel.params[len(args) + j].default
                           for j, n in enumerate(names[len(args):])]
    sig, consts, attrs = {}, {}, {}
    for i, (name, v) in enumerate(zip(names, values)):
        p = kernel.params[i]
        if p.is_constexpr or v is None:
            sig[name] = "constexpr"
            consts[name] = v
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + TY[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif type(v).__name__ == "TensorDescriptor":  # a host TMA descriptor (triton.tools)
            sig[name] = "tensordesc<%s[%s]>" % (TY[v.base.dtype], ", ".join(str(b) for b in v.block_shape))
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            if v == 1 and not p.do_not_specialize:
                sig[name] = "constexpr"
                consts[name] = 1
                continue
            sig[name] = "i32" if -2**31 <= v < 2**31 else "i64"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp64"  # what inductor passes for a Python float
        else:
            raise TypeError(f"{kernel.__name__}: unsupported argument {name}={v!r}")
    rec = {"kernel": kernel.__name__, "num_warps": opts.get("num_warps", 4), "launch_pdl": opts.get("launch_pdl", False),
           "constants": {k: repr(v) for k, v in consts.items()}, "shared": None, "regs": None, "stack": None, "loop_spills": None,
           "serialized": None, "adds": None, "lead_bars": None, "error": None}
    try:
        k = triton.compile(ASTSource(kernel, sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options=opts)
        assert k.asm.get("cubin"), "no cubin"
        rec["shared"] = int(k.metadata.shared)
        rec["regs"], rec["stack"], rec["loop_spills"], rec["adds"], rec["lead_bars"] = registers(k.asm["cubin"])
        if SERIALIZED:
            rec["serialized"] = wgmma_serialized(k.asm["ptx"])
        dump = os.environ.get("SM90_DUMP_DIR")  # a folder: each launch's TTGIR, PTX and cubin
        if dump:
            base = os.path.join(dump, "%s_%d" % (kernel.__name__, len(RECORDS)))
            for ext in ("ttgir", "ptx", "cubin"):
                mode = "wb" if ext == "cubin" else "w"
                with open(base + "." + ext, mode) as f:
                    f.write(k.asm[ext])
    except Exception as e:  # noqa: BLE001
        root = e  # a nested jit function's error is chained: keep the innermost message too
        for _ in range(16):  # (bounded: a chain could loop)
            if root.__cause__ is None and root.__context__ is None:
                break
            root = root.__cause__ or root.__context__
        msg = f"{type(e).__name__}: {e}"[-2000:]
        rec["error"] = msg if root is e else msg + f"\n  caused by {type(root).__name__}: {root}"[:1500]
    RECORDS.append(rec)


def wgmma_serialized(ptx):
    # ptxas's reason for making every wgmma of the kernel synchronous (its info C7515, which
    # triton.compile does not show), or False: the PTX compiled again with ptxas -v.
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        err = subprocess.run([os.environ.get("TRITON_PTXAS_PATH") or tool, "--gpu-name", "sm_90a", "-v", src, "-o",
                              os.path.join(d, "k.cubin")], capture_output=True, text=True).stderr
    m = re.search(r"serialized due to (.*?) in the function", err)
    return m.group(1) if m else False


class Recorder:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def go(*args, **kwargs):
            kwargs = dict(kwargs)
            if PDL and "USE_PDL" in self.kernel.arg_names:  # as moekit.ops._common's launcher does
                kwargs.update(USE_PDL=2 if self.kernel.__name__ in common.PDL_LATE_TRIGGER else 1, launch_pdl=True)
            compile_one(self.kernel, args, kwargs)
        return go


import moekit.ops._common as common
PDL = json.loads(sys.argv[2])
SERIALIZED = json.loads(sys.argv[3])
for name in json.loads(sys.argv[1]):
    mod = importlib.import_module(name)
    mod.launch = Recorder
    if hasattr(mod, "num_sms"):
        mod.num_sms = lambda device: 132
exec(sys.stdin.read())
print("@@RECORDS@@" + json.dumps(RECORDS))
"""


def sass_loop_spills(sass: list[str]) -> int:
    """Local-memory loads and stores inside the MMA loops of a kernel's SASS lines: from a
    warpgroup's first wgmma fence (``WARPGROUP.ARRIVE``) to its wait for every MMA group."""
    loop_spills, inside = 0, False
    for ln in sass:
        if "WARPGROUP.ARRIVE" in ln:
            inside = True
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in ln:
            inside = False
        loop_spills += inside and ("STL" in ln or "LDL" in ln)
    return loop_spills


def _with_helpers(script: str) -> str:
    """A compile script with this module's SASS helpers defined ahead of it (``sass_loop_spills``)."""
    return inspect.getsource(sass_loop_spills) + "\n\n" + script


def _ptxas_available() -> bool:
    try:
        import triton
    except ImportError:
        return False
    if os.environ.get("TRITON_PTXAS_PATH"):
        return True
    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))


def compile_launches(snippet: str, modules: list[str], timeout: int = 600, pdl: bool = False,
                     serialized: bool = False) -> list[dict]:  # fmt: skip
    """``pdl``: launch every kernel that has a ``USE_PDL`` parameter as the launcher does on an
    sm_90 GPU (``USE_PDL`` 1 or 2, ``launch_pdl=True``). ``serialized``: each record's
    ``serialized`` is ptxas's reason for making the kernel's wgmma instructions synchronous
    (its info C7515), else False (the PTX compiled once more, with ``ptxas -v``)."""
    if not _ptxas_available():
        pytest.skip("triton's NVIDIA backend (ptxas) is not available")
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run(
        [sys.executable, "-c", _with_helpers(_DRIVER), json.dumps(modules), json.dumps(pdl), json.dumps(serialized)],
        input="import torch\n" + textwrap.dedent(snippet),
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    out = [line for line in proc.stdout.splitlines() if line.startswith("@@RECORDS@@")]
    if proc.returncode != 0 or not out:
        tail = f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        raise AssertionError(f"compile driver failed (rc {proc.returncode}):\n{tail}")
    return json.loads(out[-1][len("@@RECORDS@@") :])


def run_compile_script(script: str, cases: list, timeout: int = 900) -> list[dict]:
    """A Gluon compile script (its own ``GluonASTSource`` compiles, one ``@@``-prefixed JSON list
    of records printed last) run in a subprocess with ``TRITON_INTERPRET=0`` and ``CASES`` (JSON)
    in its environment; skips where ptxas is not available. Returns one record per case."""
    if not _ptxas_available():
        pytest.skip("triton's NVIDIA backend (ptxas) is not available")
    env = dict(os.environ, TRITON_INTERPRET="0", CASES=json.dumps(cases))
    proc = subprocess.run([sys.executable, "-c", _with_helpers(textwrap.dedent(script))], capture_output=True, text=True, env=env,
                          timeout=timeout)  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    recs = json.loads(lines[-1][2:])
    assert len(recs) == len(cases)
    return recs


def assert_all_compiled(records: list[dict], at_least: int) -> None:
    errors = [f"{r['kernel']} {r['constants']}: {r['error']}" for r in records if r["error"]]
    assert not errors, "kernels that do not compile for sm_90:\n" + "\n".join(errors)
    assert len(records) >= at_least, f"expected at least {at_least} launches, recorded {len(records)}"
    big = [r for r in records if r["shared"] > 227 * 1024]
    assert not big, f"kernels over the 227 KB shared-memory limit of one block: {big}"
