"""Eager calls replayed as CUDA graphs (the transformers integration's decode steps and prompts).

An eager caller such as transformers' ``generate`` launches every kernel from Python, and at
decode and prompt sizes the host, not the GPU, sets the pace (measured on the H200 host: about
700 µs of launches for one Qwen3-MoE experts call whose kernels run 30 µs at one token, ~600 µs
for 330 µs of kernels at 512). ``call`` runs a module's forward eagerly the first time it sees an
input signature, captures it into a CUDA graph the second time (after a warm-up run on the capture
stream), and from then on copies the inputs into the graph's static tensors, replays it on the
current stream and returns clones of its outputs: a few small copies instead of every launch.

Sizes. Calls of at most ``exact`` rows get a graph of their own size (decode steps repeat one
size). Larger calls, up to ``max_tokens`` rows, where the caller says how to pad (``pad``), run
in a graph of the next *bucket* of rows (``bucket``: powers of two and 1.5x powers of two, so at
most a third of the rows are padding): the inputs are copied into the first rows of the static
tensors and each input's padding rows are filled with its ``pad`` value (the transformers experts
pad their routing with expert id -1, which makes no row: padding costs no GEMM work), and the first
rows of the outputs are returned.

Memory. All graphs on one device share one memory pool (their intermediates overlap: they run one
after another on the caller's stream), and graphs of one signature share their static input and
output tensors (every replay fills them first), so the layers of a model add graphs, not memory.

What a graph is keyed on: every input's padded shape and dtype, the device, the pointers of the
module's parameters and buffers and of any extra tensors the forward reads (e.g. repacked weight
copies; or, from a caller that knows them, only the pointers of the weights it reads), and the
caller's option values. Weights updated in place keep their pointers, so the
graph reads the new values; a new tensor (a load, ``.to()``) is a new key.

Limits (documented in the integration): graphs only when nothing else is capturing and nothing
traces (torch.compile); graphs must not be replayed from two streams at once (they share static
tensors and one memory pool). A capture that fails (an op that cannot be captured) is reported
once and that signature stays eager.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch

_ATTR = "_moekit_graphs"
_POOLS: dict = {}  # device -> (pool handle, anchor graph) shared by every moekit graph on it
_STATIC: dict = {}  # (device, role, index, shape, dtype) -> static tensor shared by graphs of that signature
_SIDE: dict = {}  # device -> capture stream


class _Entry:
    __slots__ = ("seen", "graph", "inputs", "outputs", "failed")

    def __init__(self) -> None:
        self.seen = 0
        self.graph = None
        self.inputs: tuple = ()
        self.outputs: Any = None
        self.failed = False


def bucket(rows: int, exact: int) -> int:
    """The padded row count of a graph for ``rows`` rows: ``rows`` itself up to ``exact``, else the
    smallest power of two or 1.5x power of two at least ``rows`` (and above ``exact``)."""
    if rows <= exact:
        return rows
    p = 1 << (rows - 1).bit_length()
    h = p // 4 * 3
    return h if rows <= h and h > exact else p


def eligible(tensors: tuple[torch.Tensor, ...], rows: int, max_tokens: int) -> bool:
    """Whether a call with ``tensors`` (``rows`` tokens) may be served by a graph."""
    if max_tokens <= 0 or rows > max_tokens or rows == 0:
        return False
    if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
        return False
    if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return False
    return True


def _shared(device: torch.device, role: str, i: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    key = (device, role, i, shape, dtype)
    t = _STATIC.get(key)
    if t is None:
        t = _STATIC[key] = torch.zeros(shape, dtype=dtype, device=device)
    return t


def call(module: torch.nn.Module, forward: Callable[..., Any], inputs: tuple[torch.Tensor, ...],
         extra: tuple = (), *, exact: int, pad: Optional[tuple] = None, params: bool = True) -> Any:  # fmt: skip
    """``forward(*inputs)`` (each input ``[rows, ...]``; a tensor or a tuple of ``[rows, ...]``
    tensors returned), through ``module``'s graph cache (see the module docstring). ``exact``:
    calls of at most this many rows get a graph of their size; larger ones are padded to
    ``bucket(rows)`` when ``pad`` gives each input's padding value (``None``: the padding rows keep
    whatever they held, for inputs whose padding rows no output row reads), else run eagerly.
    ``extra``: hashable values (and tensors, keyed by pointer) the result also depends on;
    ``params=False``: the caller's ``extra`` already stands for the pointers of every parameter and
    buffer the forward reads (saves walking the module on every call)."""
    rows = inputs[0].shape[0]
    if rows > exact and pad is None:
        return forward(*inputs)
    padded = bucket(rows, exact)
    cache = module.__dict__.get(_ATTR)
    if cache is None:
        cache = module.__dict__[_ATTR] = {}
    if params:
        ptrs = tuple(p.data_ptr() for p in module.parameters()) + tuple(b.data_ptr() for b in module.buffers())
        extra = ptrs + tuple(e.data_ptr() if isinstance(e, torch.Tensor) else e for e in extra)
    sig = tuple(((padded, *t.shape[1:]), t.dtype) for t in inputs)
    key = (sig, inputs[0].device, extra)
    e = cache.get(key)
    if e is None:
        e = cache[key] = _Entry()
    if e.graph is None:
        e.seen += 1
        if e.failed or e.seen < 2:
            return forward(*inputs)
        try:
            _capture(e, forward, inputs, sig, pad)
        except Exception as exc:  # noqa: BLE001 - any capture failure falls back to eager, said once
            e.failed, e.graph = True, None
            warnings.warn(
                f"moekit: could not capture {type(module).__name__}'s forward for inputs "
                f"{[tuple(t.shape) for t in inputs]} into a CUDA graph ({type(exc).__name__}: {exc}); "
                "it runs eagerly",
                UserWarning,
                stacklevel=3,
            )
            return forward(*inputs)
    _fill(e.inputs, inputs, pad)
    e.graph.replay()
    outs = e.outputs
    if isinstance(outs, torch.Tensor):
        return outs[:rows].clone()
    return tuple(o[:rows].clone() for o in outs)


def _fill(static: tuple, inputs: tuple, pad: Optional[tuple]) -> None:
    for i, (dst, src) in enumerate(zip(static, inputs)):
        n = src.shape[0]
        if n == dst.shape[0]:
            dst.copy_(src)
            continue
        dst[:n].copy_(src)
        if pad is not None and pad[i] is not None:
            dst[n:].fill_(pad[i])


def _pool(dev: torch.device, side: torch.cuda.Stream) -> tuple:
    """The device's shared pool. A private pool is freed when the last graph using it is (and a
    capture naming a freed pool's handle fails an allocator assertion), so a one-kernel *anchor*
    graph captured into it holds it for as long as ``_POOLS`` does."""
    p = _POOLS.get(dev)
    if p is None:
        handle = torch.cuda.graph_pool_handle()
        anchor, t = torch.cuda.CUDAGraph(), torch.zeros(1, device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            anchor.capture_begin(pool=handle)
            try:
                t.add_(1)
            finally:
                anchor.capture_end()
        torch.cuda.current_stream(dev).wait_stream(side)
        p = _POOLS[dev] = (handle, anchor, t)
    return p[0]


def _capture(e: _Entry, forward: Callable[..., Any], inputs: tuple, sig: tuple, pad: Optional[tuple]) -> None:
    dev = inputs[0].device
    side = _SIDE.get(dev)
    if side is None:
        side = _SIDE[dev] = torch.cuda.Stream(dev)
    pool = _pool(dev, side)
    static = tuple(_shared(dev, "in", i, shape, dtype) for i, (shape, dtype) in enumerate(sig))
    _fill(static, inputs, pad)
    cur = torch.cuda.current_stream(dev)
    side.wait_stream(cur)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        first = forward(*static)  # warm-up on the capture stream (lazy initializations happen outside the graph)
        single = isinstance(first, torch.Tensor)
        outs = tuple(
            _shared(dev, "out", i, tuple(o.shape), o.dtype) for i, o in enumerate((first,) if single else first)
        )
        del first
        g.capture_begin(pool=pool)
        try:
            res = forward(*static)
            for dst, src in zip(outs, (res,) if single else res):
                dst.copy_(src)  # into the shared outputs: the pool's intermediates are free for other graphs
            del res
        finally:
            g.capture_end()
    cur.wait_stream(side)
    e.graph, e.inputs, e.outputs = g, static, outs[0] if single else outs


def clear(module: torch.nn.Module) -> None:
    """Drop ``module``'s graphs."""
    module.__dict__.pop(_ATTR, None)


def release_shared() -> None:
    """Forget the shared static tensors and pools (graphs still held keep theirs and their pool
    alive; new graphs make new ones)."""
    _STATIC.clear()
    _POOLS.clear()


def count(module: torch.nn.Module) -> int:
    """Captured graphs held by ``module``."""
    cache = module.__dict__.get(_ATTR, {})
    return sum(1 for v in cache.values() if v.graph is not None)
