"""Helpers shared by the op wrappers and their Triton launchers."""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

import torch

from moekit import settings

try:  # Triton is optional: without it every op runs its PyTorch reference.
    import triton  # noqa: F401  (only probing that it imports)

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on machines without triton
    HAS_TRITON = False


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_WARNED: set = set()


def warn_once(key: str, message: str) -> None:
    """A ``UserWarning`` the first time ``key`` is seen in this process (explicit fallbacks).

    Silent while torch.compile traces: dynamo cannot trace ``warnings.warn`` (a graph break, an
    error with ``fullgraph=True``); the next eager call warns."""
    if key in _WARNED or torch.compiler.is_compiling():
        return
    _WARNED.add(key)
    warnings.warn(message, UserWarning, stacklevel=3)


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op on tensor ``t`` runs its Triton kernel (CUDA tensors) or its reference. CUDA
    tensors without Triton installed run the PyTorch references: said once, with a warning."""
    if not t.is_cuda:
        return False
    if not HAS_TRITON:
        warn_once("no-triton", "moekit: Triton is not installed, so CUDA tensors run the (slow) PyTorch "
                  "references of moekit's ops; install triton for the kernels")  # fmt: skip
    return HAS_TRITON


# Programmatic dependent launch (Hopper and newer): kernels that declare a ``USE_PDL`` constexpr
# are launched, inside CUDA-graph captures (``_pdl_ok``), with ``launch_pdl`` so that their grid is scheduled while the previous kernel on
# the stream drains; they wait (``griddepcontrol.wait``) before touching memory, then let the next
# kernel be scheduled in turn (``moekit.ops._triton._pdl``). ``settings.pdl`` ($MOEKIT_PDL=0) turns
# it off; ``settings.pdl_skip`` ($MOEKIT_PDL_SKIP) names the kernels left out, by default the
# grouped GEMM's tiled and streaming kernels: with them on PDL behind kernels that trigger at once,
# the whole layer measured 4-10% slower at T = 2048 than without PDL (H200, Llama 4 Scout and
# Qwen3-30B bf16, RESULTS.md session 4); without them it is level there and keeps the decode gain.
#
# Kernels whose successor is scheduled only as their programs exit (``USE_PDL=2``) rather than at
# once. The early trigger measured as fast or faster for every other kernel that keeps PDL
# (benchmarks/sweep_pdl.py; the EP shuffle, whose grid stays resident, gained 1-2% in all eight
# cells with its rows loaded whole). index_shuffling's last kernel is the exception (H200, run 36,
# RESULTS.md session 6): when it triggers at once, the next grid's programs are placed on the SMs
# beside its one wave of programs, unevenly; a one-wave successor (index_shuffling's own first
# kernel, replayed) then runs as slow as its most loaded SM. Late: T = 16384 E = 256 top-8 31.4 ->
# 23.2 µs, E = 128 top-4 17.4 -> 14.0, T = 2048 7.3 -> 6.6; T <= 128 and E = 384 within 1 µs.
# ``settings.pdl_mode`` ($MOEKIT_PDL_MODE, experiments) forces one mode everywhere.
PDL_LATE_TRIGGER: frozenset = frozenset({"_place_kernel", "_route_place_kernel"})


@functools.lru_cache(maxsize=None)
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _pdl_ok(args: tuple) -> bool:
    """PDL for this launch: enabled, on a real CUDA tensor of an sm_90+ device, inside a CUDA-graph
    capture, and never under tracing (torch.compile): the ``griddepcontrol`` inline asm is not
    pure, and inductor's mutation analysis would then count every argument as written.

    Captures only: a launch with ``launch_pdl`` costs the host far more than a plain one (H200
    host, one eager transformers experts call: Mixtral-8x7B T=1 671 -> 390 µs queued without PDL,
    Qwen3-30B 445 -> 357; RESULTS.md session 10), and what PDL saves, the next grid scheduled
    while the previous drains, shows only when the host runs ahead of the GPU: in graph replays
    (where every benchmark times, and where moekit's eager integrations replay decode steps)."""
    if not settings.get().pdl or interpreting():
        return False
    t = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if t is None or not t.is_cuda or torch.version.hip is not None or torch.compiler.is_compiling():
        return False  # (ROCm: griddepcontrol is NVIDIA PTX)
    if not torch.cuda.is_current_stream_capturing():
        return False
    if type(t) is not torch.Tensor:  # subclasses (fake tensors under tracing) go without
        from torch._subclasses.fake_tensor import is_fake

        if is_fake(t):
            return False
    return _capability_major(t.device.index if t.device.index is not None else torch.cuda.current_device()) >= 9


class _PdlLauncher:
    """``launch(kernel)[grid](*args, **kwargs)`` for a kernel with a ``USE_PDL`` parameter: passes
    ``USE_PDL`` always (inductor's analysis rejects a launch that leaves a parameter to its
    default): 0, or 1 / 2 (``pdl_prologue``) with ``launch_pdl=True`` when ``_pdl_ok``."""

    def __init__(self, wrapped: Any, name: str):
        self.wrapped = wrapped
        self.name = name

    def __getitem__(self, grid: Any) -> Any:
        run = self.wrapped[grid]

        def go(*args: Any, **kwargs: Any) -> Any:
            s = settings.get()
            if self.name not in s.pdl_skip and _pdl_ok(args):
                mode = s.pdl_mode or (2 if self.name in PDL_LATE_TRIGGER else 1)
                kwargs.update(USE_PDL=mode, launch_pdl=True)
            else:
                kwargs["USE_PDL"] = 0
            return run(*args, **kwargs)

        return go


_DIRECT: dict = {}


def _tracing() -> bool:
    """Whether a launch now is being traced (torch.compile, or make_fx / export / fake tensors:
    a dispatch mode is active), where a triton_op's kernels must go through ``wrap_triton``."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


def launch(kernel: Any) -> Any:
    """``kernel`` wrapped for ``torch.library.triton_op`` tracing (``wrap_triton``) while a trace
    runs (``_tracing``); otherwise the kernel itself, in the interpreter too. Kernels with a
    ``USE_PDL`` parameter get programmatic dependent launch where ``_pdl_ok``.

    Where ``wrap_triton`` is off (an op's eager implementation: the dispatcher's backend call or
    ``call_op``'s direct one) its wrapper would only forward to ``kernel[grid]``: the kernel itself
    (or its PDL launcher) is returned, made once per kernel, saving two wrapper objects per launch.
    Outside a trace with it on (a private launcher called directly: benchmarks, sweeps, tests) the
    wrapper would launch through torch's higher-order op, which files every call's non-tensor
    arguments in a process-wide side table for good: a TMA descriptor there keeps its tensor alive
    (session 31: ``sweep_swiglu.py`` kept every gathered row matrix it passed, 4 GiB per timed
    case)."""
    from torch._library.triton import is_wrap_triton_enabled

    if not is_wrap_triton_enabled() or not _tracing():
        d = _DIRECT.get(kernel)
        if d is None:
            pdl = "USE_PDL" in getattr(kernel, "arg_names", ())
            d = _DIRECT[kernel] = _PdlLauncher(kernel, kernel.__name__) if pdl else kernel
        return d
    from torch.library import wrap_triton

    w = wrap_triton(kernel)
    if "USE_PDL" in getattr(kernel, "arg_names", ()):
        return _PdlLauncher(w, kernel.__name__)
    return w


@functools.lru_cache(maxsize=None)
def _num_sms(device_type: str, index: int) -> int:
    if device_type == "cuda":
        return torch.cuda.get_device_properties(index).multi_processor_count
    return 4  # the interpreter: a small "machine" keeps grids (and test time) small


_SMS: dict = {}


# ``assume_constant_result``: torch.compile runs these lookups as Python while it traces and keeps
# their results as constants. Traced, the dict caches' first fill was a side effect Dynamo guarded
# on ("device not in _SMS"), which the same call then broke: torch 2.11 failed the compile of any
# first call that came under torch.compile (session 37).
@torch.compiler.assume_constant_result
def num_sms(device: torch.device) -> int:
    """Multiprocessor count of ``device`` (cached: no per-call device query; a tensor's device, which
    names its index, is one dict lookup)."""
    n = _SMS.get(device)
    if n is not None:
        return n
    if isinstance(device, torch.device) and (device.type != "cuda" or device.index is not None):
        n = _SMS[device] = _num_sms_of(device)
        return n
    return _num_sms_of(torch.device(device))


def _num_sms_of(device: torch.device) -> int:
    if device.type == "cuda":
        return _num_sms("cuda", device.index if device.index is not None else torch.cuda.current_device())
    return _num_sms(device.type, 0)


# L2 of the cards the rules were measured on (H100 and H200: 50 MB), where no device says its own
# (the interpreter, meta tensors).
DEFAULT_L2_BYTES = 50 * 2**20


_L2: dict = {}


@torch.compiler.assume_constant_result
def l2_bytes(device: torch.device) -> int:
    """L2 cache size of ``device`` in bytes, ``DEFAULT_L2_BYTES`` off CUDA (cached in a dict as
    ``num_sms`` is, and a constant to torch.compile as it is)."""
    n = _L2.get(device)
    if n is not None:
        return n
    dev = torch.device(device)
    if dev.type != "cuda":
        return DEFAULT_L2_BYTES
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    n = int(getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0)) or DEFAULT_L2_BYTES
    if dev.index is not None:
        _L2[dev] = n
    return n


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------------------------
# Eager calls without the dispatcher
# ----------------------------------------------------------------------------------------------
#
# Every op is a ``torch.library.triton_op`` so that torch.compile, export and fake tensors see it.
# Called eagerly, its Python dispatch layer (custom_op's autograd and backend wrappers, the
# dynamo-disable frame) costs 25 µs per call on a fast CPU and about twice that on the H200 hosts:
# more than a small GPU kernel runs, and what an eager caller (transformers' ``generate``) pays
# per launch. ``call_op`` runs the op's implementation directly where the dispatcher would do
# nothing else: plain tensors, no grad, no dispatch or function mode, not under tracing.


def _plain(a: Any, grad: bool) -> bool:
    if isinstance(a, torch.Tensor):
        return (type(a) is torch.Tensor or type(a) is torch.nn.Parameter) and not (grad and a.requires_grad)
    if isinstance(a, (list, tuple)):
        for b in a:
            if not _plain(b, grad):
                return False
    return True


def direct_ok(args: tuple, kwargs: dict) -> bool:
    """Whether an eager call with ``args`` / ``kwargs`` may skip the dispatcher."""
    if not settings.get().eager_direct or torch.compiler.is_compiling():
        return False
    if torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled():
        return False
    grad = torch.is_grad_enabled()
    for a in args:
        if not _plain(a, grad):
            return False
    for a in kwargs.values():
        if not _plain(a, grad):
            return False
    return True


def call_op(opdef: Any, *args: Any, **kwargs: Any) -> Any:
    """Call the registered op ``opdef`` (a ``triton_op`` definition): its implementation directly
    when ``direct_ok``, else through ``torch.ops.moekit``; under torch.compile with its
    ``cache_tag`` (``compile_cache_tag``)."""
    if direct_ok(args, kwargs):
        return opdef._init_fn(*args, **kwargs)
    if torch.compiler.is_compiling():
        kwargs["cache_tag"] = compile_cache_tag(_device_index(args))
    return opdef._opoverload(*args, **kwargs)


# ----------------------------------------------------------------------------------------------
# torch.compile's caches
# ----------------------------------------------------------------------------------------------
#
# torch.compile's AOTAutograd cache (on by default, on disk) keys a graph by what Dynamo traced:
# for a moekit op, its name and arguments (and the Triton kernels' source). What the op's launcher
# then decides, its tiles, its kernels, TMA or pointer loads, comes from moekit's settings, its
# knobs, tuned tables, the GPU and moekit's own Python, none of which that key held: a graph
# compiled under one state was served under another (H100, session 45: the A/B of knob
# GG_DEVICE_TMA under torch.compile timed the first setting's graph twice, in one process and
# across processes). Every op therefore takes a ``cache_tag`` string, ignored by its
# implementation, which ``call_op`` fills while Dynamo traces with a digest of that state: the
# traced graph, and so the key, changes with it.

_CODE_DIGEST: list = []


def _code_digest() -> str:
    """Digest of moekit's Python and JSON files (its launchers and tuned tables), read once."""
    if not _CODE_DIGEST:
        import hashlib

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        h = hashlib.sha256()
        paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith((".py", ".json")))
        for path in paths:
            h.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as fh:
                h.update(fh.read())
        _CODE_DIGEST.append(h.hexdigest()[:16])
    return _CODE_DIGEST[0]


def _device_index(args: tuple) -> int:
    t = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if t is None or t.device.type != "cuda":
        return -1
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


@torch.compiler.assume_constant_result
def compile_cache_tag(device_index: int) -> str:
    """The ``cache_tag`` of an op traced now on CUDA device ``device_index`` (-1: not CUDA): a
    digest of moekit's code, its settings and knobs, the tuned table in use (and the time its file
    was written) and the device (name, capability, multiprocessors). Dynamo takes the result for a
    constant of the graph."""
    import hashlib

    table = 0
    if HAS_TRITON:
        from moekit.ops._triton import gg_config

        table = gg_config.table_generation()
    dev = "cpu"
    if device_index >= 0:
        p = torch.cuda.get_device_properties(device_index)
        dev = f"{p.name}/{p.major}.{p.minor}/{p.multi_processor_count}"
    s = settings.get()
    tuned = s.gg_tuned and os.path.exists(s.gg_tuned) and os.stat(s.gg_tuned).st_mtime_ns  # (its file rewritten)
    state = f"{_code_digest()}|{s!r}|{table}|{tuned}|{dev}"
    return "moekit-" + hashlib.sha256(state.encode()).hexdigest()[:24]
