"""MoE layers.

- ``config``: ``RoutingConfig`` (the routing options, declared once) and ``MoEArgs``;
- ``functional``: the MetaShuffling forward as a function of tensors (``moe_forward``, ``route``);
- ``experts``: the routed-expert pipelines (``run_experts``, ``choose_path``);
- ``weights``: ``ScaledParameter``, ``RoutedExperts``, ``SharedExperts``;
- ``base``: ``MoEBase``, the state and checks both layer modules share;
- ``baseline``: ``BaselineMoE``, the plain PyTorch oracle;
- ``moe``: ``MetaShufflingMoE`` (and re-exports of all of the above, the historical import path).

The names below load their module on first use, so that ``moekit.layers.config`` (imported by
``moekit.testing`` when ``import moekit`` runs) does not pull in the kernels.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BaselineMoE": "baseline",
    "MetaShufflingMoE": "moe",
    "MoEArgs": "config",
    "MoEBase": "base",
    "RoutedExperts": "weights",
    "RoutingConfig": "config",
    "ScaledParameter": "weights",
    "SharedExperts": "weights",
    "moe_forward": "functional",
    "route": "functional",
}
_SUBMODULES = ("base", "baseline", "config", "experts", "functional", "moe", "weights")

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))
