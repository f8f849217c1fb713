"""Simulated peers for the interpreter tier: run one rank's Lamport kernel on CPU tensors with
the other ranks' fragments pre-published into its workspace, and check what it published into
the peers' workspaces (scratch buffers standing in for them)."""

from __future__ import annotations

from typing import Optional

import torch

from moekit.comm._triton_tail import NUM_BUFFERS, SENTINEL16, TailLayout
from moekit.comm.symm import create_local_state
from moekit.reference import norm as ref


def bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """float -> bf16 bit pattern (int16) with -0.0 published as +0.0."""
    b = x.float().to(torch.bfloat16).view(torch.int16).clone()
    b[b == SENTINEL16] = 0
    return b


def f32_bits(x: torch.Tensor) -> torch.Tensor:
    """float32 words as int16 pairs, 0x80008000 published as 0."""
    w = x.float().contiguous().view(torch.int32).clone()
    w[w == -2147450880] = 0
    return w.view(torch.int16)


def bits_f32(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.bfloat16).float()


class Sim:
    """Rank ``rank`` of ``R`` simulated ranks: a sentinel-filled local workspace, one scratch
    workspace per peer, and a kernel state pointing at them."""

    def __init__(
        self,
        layout: TailLayout,
        timeout_s: float = 5.0,
        max_programs: int = 1 << 30,
        max_block_l: Optional[int] = None,
        host_errors: bool = True,
    ):
        self.layout = layout
        n = layout.workspace_elems
        self.ws = [torch.full((n,), SENTINEL16, dtype=torch.int16) for _ in range(layout.tp_size)]
        self.host_errors = torch.zeros(layout.tp_size, dtype=torch.int32) if host_errors else None
        self.state = create_local_state(
            layout,
            self.ws[layout.rank],
            [w.data_ptr() for w in self.ws],
            timeout_s=timeout_s,
            max_programs=max_programs,
            host_errors=self.host_errors,
            max_block_l=max_block_l,
        )

    def buf(self, p: int, b: int) -> torch.Tensor:
        lay = self.layout
        return self.ws[p].view(NUM_BUFFERS, lay.max_m, lay.foot)[b]

    @property
    def current(self) -> int:
        return int(self.state.flags[0])

    def reset_peers(self) -> None:
        for p, w in enumerate(self.ws):
            if p != self.layout.rank:
                w.fill_(SENTINEL16)

    # what each rank publishes --------------------------------------------------------------
    def contributions(self, latents: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per rank: its routed contribution as published bf16 bits ``[m, L]``."""
        return [bf16_bits(x) for x in latents]

    def prefill(
        self,
        m: int,
        routed_bits: Optional[list[torch.Tensor]],
        shared: Optional[list[torch.Tensor]],
        two_shot: bool = False,
        skip: tuple[int, ...] = (),
    ) -> None:
        """Publish every rank's fragments (except ranks in ``skip``) into the local current buffer."""
        lay, me = self.layout, self.layout.rank
        R, L, S, rt0 = lay.tp_size, lay.latent_dim, lay.shard_dim, lay.rt0
        B = self.buf(me, self.current)
        for s in range(R):
            if s in skip:
                continue
            if lay.shared:
                sb = bf16_bits(shared[s])
                B[:m, s * S : (s + 1) * S] = sb[:, me * S : (me + 1) * S]
            if lay.routed:
                if two_shot:
                    CH = L // R
                    B[:m, rt0 + s * CH : rt0 + (s + 1) * CH] = routed_bits[s][:, me * CH : (me + 1) * CH]
                else:
                    B[:m, rt0 + s * L : rt0 + (s + 1) * L] = routed_bits[s]
        if lay.routed and two_shot:
            CH = L // R
            total = ref.rank_sum([bits_f32(b) for b in routed_bits])
            for c in range(R):
                if c in skip:
                    continue
                chunk = total[:, c * CH : (c + 1) * CH]
                if lay.gathers_f32:
                    B[:m, rt0 + L + 2 * c * CH : rt0 + L + 2 * (c + 1) * CH] = f32_bits(chunk).view(m, -1)
                else:
                    B[:m, rt0 + L + c * CH : rt0 + L + (c + 1) * CH] = bf16_bits(chunk)

    def expected_peer_writes(self, m: int, routed_bits, shared, two_shot: bool = False) -> dict:
        """``{(peer, lo, hi): bits [m, hi-lo]}``: what this rank must have written per token into
        each peer's buffer (columns lo:hi of the token block)."""
        lay, me = self.layout, self.layout.rank
        R, L, S, rt0 = lay.tp_size, lay.latent_dim, lay.shard_dim, lay.rt0
        out = {}
        for p in range(R):
            if p == me:
                continue
            if lay.shared:
                out[(p, me * S, (me + 1) * S)] = bf16_bits(shared[me])[:, p * S : (p + 1) * S]
            if lay.routed:
                if two_shot:
                    CH = L // R
                    out[(p, rt0 + me * CH, rt0 + (me + 1) * CH)] = routed_bits[me][:, p * CH : (p + 1) * CH]
                    total = ref.rank_sum([bits_f32(b) for b in routed_bits])[:, me * CH : (me + 1) * CH]
                    if lay.gathers_f32:
                        out[(p, rt0 + L + 2 * me * CH, rt0 + L + 2 * (me + 1) * CH)] = f32_bits(total).view(m, -1)
                    else:
                        out[(p, rt0 + L + me * CH, rt0 + L + (me + 1) * CH)] = bf16_bits(total)
                else:
                    out[(p, rt0 + me * L, rt0 + (me + 1) * L)] = routed_bits[me]
        return out

    def check_peer_writes(self, b: int, m: int, expected: dict) -> None:
        """Every expected region holds exactly the expected bits; everything else in the peers'
        buffers still holds the sentinel."""
        lay = self.layout
        for p in range(lay.tp_size):
            if p == lay.rank:
                continue
            B = self.buf(p, b)
            touched = torch.zeros_like(B, dtype=torch.bool)
            for (q, lo, hi), bits in expected.items():
                if q != p:
                    continue
                got = B[:m, lo:hi]
                assert torch.equal(got, bits), f"peer {p} columns {lo}:{hi}: published bits differ"
                touched[:m, lo:hi] = True
            assert bool((B[~touched] == SENTINEL16).all()), f"peer {p}: a write outside the expected slots"
            for b2 in range(NUM_BUFFERS):
                if b2 != b:
                    assert bool((self.buf(p, b2) == SENTINEL16).all()), f"peer {p}: wrote into buffer {b2}"
