"""MoE layers. ``functional`` holds the MetaShuffling forward as a function of tensors; ``moe``
the modules (``MoEArgs``, ``ScaledParameter``, ``RoutedExperts``, ``SharedExperts``,
``BaselineMoE``, ``MetaShufflingMoE``)."""

from moekit.layers.functional import RoutingConfig, moe_forward, route
from moekit.layers.moe import (
    BaselineMoE,
    MetaShufflingMoE,
    MoEArgs,
    RoutedExperts,
    ScaledParameter,
    SharedExperts,
)

__all__ = [
    "BaselineMoE",
    "MetaShufflingMoE",
    "MoEArgs",
    "RoutedExperts",
    "RoutingConfig",
    "ScaledParameter",
    "SharedExperts",
    "moe_forward",
    "route",
]
