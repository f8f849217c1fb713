"""Programmatic dependent launch, the kernel side (see ``moekit.ops._common`` and ``moekit.settings``)."""

import triton
import triton.language as tl


@triton.jit
def pdl_prologue(USE_PDL: tl.constexpr):
    """First statement of every kernel. ``USE_PDL`` (set by the launcher): 0 off; 1 (launched with
    ``launch_pdl``) wait until the previous grid on the stream has completed and its writes are
    visible, then let the next grid be scheduled at once (its programs wait in their own
    prologue); 2 wait only: the next grid is scheduled as this one's programs exit (for grids
    that stay resident for the whole kernel, whose waiting successors would otherwise sit beside
    them). Nothing may touch global memory before the wait: reads would see stale data, writes
    could race with the previous grid's reads."""
    if USE_PDL > 0:
        tl.extra.cuda.gdc_wait()
    if USE_PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
