"""Small eager calls replayed as CUDA graphs (the transformers integration's decode steps).

An eager caller such as transformers' ``generate`` launches every kernel from Python: at decode
sizes the host, not the GPU, sets the pace (measured on the H200 host: about 700 µs of launches for
one Qwen3-MoE experts call whose kernels run 30 µs). ``GraphCache.call`` runs a module's forward
eagerly the first time it sees an input signature, captures it into a CUDA graph the second time
(after a warm-up run on the capture stream), and from then on copies the inputs into the graph's
static tensors, replays it on the current stream and returns clones of its outputs.

What it keys on: every input's shape, dtype and strides, the device, the pointers of the module's
parameters and buffers and of any extra tensors the forward reads (e.g. repacked weight copies),
and the caller's option values. Weights updated in place keep their pointers, so the graph reads
the new values; a new tensor (a load, ``.to()``) is a new key.

Limits (documented in the integration): graphs only for at most ``max_tokens`` rows and only
when nothing else is capturing and nothing traces (torch.compile); one module must not be called
from two streams at once (its graphs share static inputs and one memory pool). A capture that
fails (an op that cannot be captured) is reported once and that signature stays eager.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

_ATTR = "_moekit_graphs"


class _Entry:
    __slots__ = ("seen", "graph", "inputs", "outputs", "failed")

    def __init__(self) -> None:
        self.seen = 0
        self.graph = None
        self.inputs: tuple = ()
        self.outputs: Any = None
        self.failed = False


def _signature(tensors: tuple[torch.Tensor, ...]) -> tuple:
    return tuple((tuple(t.shape), t.stride(), t.dtype) for t in tensors)


def _clone(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, tuple):
        return tuple(_clone(o) for o in out)
    return out


def eligible(tensors: tuple[torch.Tensor, ...], rows: int, max_tokens: int) -> bool:
    """Whether a call with ``tensors`` (``rows`` tokens) may be served by a graph."""
    if max_tokens <= 0 or rows > max_tokens or rows == 0:
        return False
    if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
        return False
    if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return False
    return True


def call(module: torch.nn.Module, forward: Callable[..., Any], inputs: tuple[torch.Tensor, ...],
         extra: tuple = ()) -> Any:  # fmt: skip
    """``forward(*inputs)``, through ``module``'s graph cache (see the module docstring).
    ``extra``: hashable values (and tensors, keyed by pointer) the result also depends on."""
    cache = module.__dict__.setdefault(_ATTR, {})
    params = tuple(p.data_ptr() for p in module.parameters()) + tuple(b.data_ptr() for b in module.buffers())
    ext = tuple(e.data_ptr() if isinstance(e, torch.Tensor) else e for e in extra)
    key = (_signature(inputs), inputs[0].device, params, ext)
    e = cache.get(key)
    if e is None:
        e = cache[key] = _Entry()
    if e.graph is None:
        e.seen += 1
        if e.failed or e.seen < 2:
            return forward(*inputs)
        try:
            _capture(module, e, forward, inputs)
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
    for dst, src in zip(e.inputs, inputs):
        dst.copy_(src)
    e.graph.replay()
    return _clone(e.outputs)


def _capture(module: torch.nn.Module, e: _Entry, forward: Callable[..., Any], inputs: tuple) -> None:
    cache = module.__dict__[_ATTR]
    pool = cache.get("pool")
    if pool is None:
        pool = cache["pool"] = torch.cuda.graph_pool_handle()
    static = tuple(t.clone() for t in inputs)
    cur = torch.cuda.current_stream(inputs[0].device)
    side = torch.cuda.Stream(inputs[0].device)
    side.wait_stream(cur)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        forward(*static)  # warm-up on the capture stream (lazy initializations happen outside the graph)
        g.capture_begin(pool=pool)
        try:
            out = forward(*static)
        finally:
            g.capture_end()
    cur.wait_stream(side)
    e.graph, e.inputs, e.outputs = g, static, out


def clear(module: torch.nn.Module) -> None:
    """Drop ``module``'s graphs (and their memory pool)."""
    module.__dict__.pop(_ATTR, None)


def count(module: torch.nn.Module) -> int:
    """Captured graphs held by ``module``."""
    cache = module.__dict__.get(_ATTR, {})
    return sum(1 for k, v in cache.items() if k != "pool" and v.graph is not None)
