"""MoE layers. ``functional`` holds the MetaShuffling forward as a function of tensors."""

from moekit.layers.functional import RoutingConfig, moe_forward, route

__all__ = ["RoutingConfig", "moe_forward", "route"]
