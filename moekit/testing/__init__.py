"""Test helpers shared by moekit's tests and benchmarks (and usable by downstream projects)."""

from moekit.testing.compare import TOLERANCES, assert_close, assert_fp8_close, assert_poisoned, poison, rel_error
from moekit.testing.data import (
    MODEL_SHAPES,
    ModelShape,
    random_expert_weights,
    random_routing,
    random_m_sizes,
    tie_free_scores,
)

__all__ = [
    "MODEL_SHAPES",
    "ModelShape",
    "TOLERANCES",
    "assert_close",
    "assert_fp8_close",
    "assert_poisoned",
    "poison",
    "random_expert_weights",
    "random_m_sizes",
    "random_routing",
    "rel_error",
    "tie_free_scores",
]
