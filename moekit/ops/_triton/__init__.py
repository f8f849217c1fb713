"""Private Triton kernels and their launchers, one file per op family (see moekit/ops)."""
