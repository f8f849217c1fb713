"""Expert-parallel dispatch and combine of ``MetaShufflingMoE`` (``MoEArgs.ep_size > 1``).

``ExpertParallelComm`` moves the tokens between the EP ranks around the layer's local experts
(the layer routes and runs the experts; this moves the rows):

- static shapes (``ep_comm="static"``; no host sync, CUDA-graph capturable): ``all_gather``
  the tokens ``[R*T, D]`` and router logits ``[R*T, E]`` of the EP group, and after the local
  experts ``reduce_scatter`` the partial ``[R*T, D]`` output back to this rank's ``[T, D]``;
- dynamic shapes (``ep_comm="dynamic"``; one host sync per layer, T may differ per rank):
  ``dispatch`` all-to-alls only the rows this rank's tokens routed to each rank (FP8: quantized
  row-wise first, half the bytes) and returns them expert-major; ``combine`` sends the expert
  outputs back and scatter-adds them onto their tokens.

``dedup_comm`` (EP x TP, ``MoEArgs.uses_dedup_comm``): the TP ranks of an EP rank hold the same
tokens, so only this TP rank's ``dim // tp_size`` column slice of each row crosses the EP group
and the TP group all-gathers the slices; on the way back the TP group reduce-scatters the partial
rows along ``dim`` first. The result is this TP rank's column slice of the routed output in a zero
``[T, D]`` (the caller's TP all-reduce adds the other slices).

Rows travel as raw bytes (``uint8`` views) where FP8 may travel, so any backend carries them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from moekit._validate import FP8_DTYPE

__all__ = ["ExpertParallelComm", "DispatchedRows"]


def _all_gather() -> Callable:
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter() -> Callable:
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_to_all_rows(
    out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any
) -> Any:
    """Asynchronous ``all_to_all_single`` of row blocks (``in_splits[r]`` rows of ``inp`` to rank
    r, ``out_splits[r]`` rows from rank r into ``out``), moved as raw bytes so that FP8 and bf16
    travel on any backend. Returns the work handle."""
    return dist.all_to_all_single(
        out.view(torch.uint8), inp.contiguous().view(torch.uint8), out_splits, in_splits, group=group, async_op=True
    )


@dataclass
class DispatchedRows:
    """What ``ExpertParallelComm.dispatch`` received for this rank's local experts, expert-major
    (``num_rows`` rows; the tensors are None when it is 0), and what ``combine`` needs to send the
    expert outputs back.

    ``x [num_rows, D]`` (FP8 rows with their dequant ``x_scale`` when the experts are FP8),
    ``counts`` (rows per local expert, ``combine_shuffling``'s counts: ``counts[:e]``),
    ``row_weights`` (router weight of each row; the experts apply it on their input or output).
    """

    num_rows: int
    x: Optional[torch.Tensor]
    counts: Optional[torch.Tensor]
    row_weights: Optional[torch.Tensor]
    x_scale: Optional[torch.Tensor]
    # For combine:
    recv_counts_Re: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    token_ids: torch.Tensor
    T: int
    D: int
    out_dtype: torch.dtype


class ExpertParallelComm:
    """The EP (and, with ``dedup_comm``, TP) collectives of one ``MetaShufflingMoE``: built from
    its ``MoEArgs`` and the process groups it validated."""

    def __init__(self, args: Any, ep_group: Any, tp_group: Optional[Any] = None) -> None:
        self.args = args
        self.ep_group = ep_group
        self.tp_group = tp_group
        self.dedup = args.uses_dedup_comm

    # Static shapes ------------------------------------------------------------------------------
    def all_gather(self, x_TD: torch.Tensor, logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Static dispatch: the EP group's tokens ``[R*T, D]`` and router logits ``[R*T, E]``
        (float32), in rank order (every rank holds the same T)."""
        R, (T, D) = self.args.ep_size, x_TD.shape
        all_gather = _all_gather()
        if self.dedup:
            x_all = self._gather_columns(x_TD.contiguous(), R * T, all_gather)
        else:
            x_all = torch.empty(R * T, D, dtype=x_TD.dtype, device=x_TD.device)
            all_gather(x_all, x_TD.contiguous(), group=self.ep_group)
        logits_all = torch.empty(R * T, logits_TE.shape[1], dtype=torch.float32, device=x_TD.device)
        all_gather(logits_all, logits_TE, group=self.ep_group)
        return x_all, logits_all

    def reduce_scatter(self, partial_ND: torch.Tensor, T: int) -> torch.Tensor:
        """Static combine: the partial outputs ``[R*T, D]`` of every rank summed, this rank's
        ``[T, D]`` (``dedup_comm``: summed over the TP group first, this TP rank's column slice
        crosses the EP group: 1 / tp_size of the bytes)."""
        D = partial_ND.shape[1]
        reduce_scatter = _reduce_scatter()
        if self.dedup:
            mine = self._reduce_columns(partial_ND, reduce_scatter)
            out_slice = torch.empty(T, mine.shape[1], dtype=partial_ND.dtype, device=partial_ND.device)
            reduce_scatter(out_slice, mine, group=self.ep_group)
            return self._place(out_slice, D)
        out = torch.empty(T, D, dtype=partial_ND.dtype, device=partial_ND.device)
        reduce_scatter(out, partial_ND, group=self.ep_group)
        return out

    # Dynamic shapes -----------------------------------------------------------------------------
    def dispatch(
        self,
        x_TD: torch.Tensor,
        send_counts_E: torch.Tensor,
        expert_ids: torch.Tensor,
        token_ids: torch.Tensor,
        row_weights: torch.Tensor,
        *,
        fp8: bool,
        overlap: Optional[Callable[[], torch.Tensor]] = None,
    ) -> tuple[DispatchedRows, Optional[torch.Tensor]]:
        """Dynamic dispatch of this rank's ``T * K`` routed rows, sorted by global expert
        (``send_counts_E [E]``, ``expert_ids`` / ``token_ids`` / ``row_weights`` of
        ``route_and_shuffle`` over all E experts; rank r holds experts ``[r*e, (r+1)*e)``).

        1. all-to-all of the per-expert counts (``[E]`` -> ``[R, e]`` received), then **one host
           sync** (the documented exception, DESIGN §4) to size the receive buffers;
        2. gather the rows (FP8: quantized row-wise here, exactly as on one GPU) and all-to-all
           them with a float32 side band per row (FP8 dequant scale, router weight); ``overlap()``
           (the shared expert) runs while they travel and its result is returned;
        3. ``combine_shuffling`` rank-major -> expert-major.
        """
        from moekit.ops import combine_shuffling, gather_scale_dense_tokens, gather_scale_quant_dense_tokens

        R, e, group = self.args.ep_size, self.args.num_local_experts, self.ep_group
        (T, D), N, dev = x_TD.shape, token_ids.shape[0], x_TD.device
        # Counts: send_counts_E[r*e + j] rows go to rank r's local expert j; recv_counts_Re[r, j]
        # rows come from rank r for this rank's local expert j. Then the one host sync.
        recv_counts_E = torch.empty_like(send_counts_E)
        dist.all_to_all_single(recv_counts_E, send_counts_E, group=group)
        recv_counts_Re = recv_counts_E.view(R, e)
        per_rank = torch.stack([send_counts_E.view(R, e), recv_counts_Re]).sum(dim=-1)
        send_splits, recv_splits = per_rank.cpu().tolist()  # host sync (the documented exception)
        N_recv = sum(recv_splits)

        # Send rows (FP8: quantized row-wise, half the bytes) with a float32 side band per row
        # (FP8 dequant scale, router weight: the receiver applies it on the expert's input or
        # output), all-to-all; ``overlap`` runs during the exchange.
        meta_N8 = torch.zeros(N, 8, dtype=torch.float32, device=dev)
        meta_N8[:, 1] = row_weights
        if fp8:
            if T:
                send_x, x_scale = gather_scale_quant_dense_tokens(x_TD, token_ids, expert_ids, None)
                meta_N8[:, 0] = x_scale
            else:
                send_x = torch.empty(0, D, dtype=FP8_DTYPE, device=dev)
        else:
            send_x = gather_scale_dense_tokens(x_TD, token_ids, expert_ids, None) if T else x_TD[:0]
        if self.dedup:  # only this TP rank's column slice crosses the EP group
            Ds, c0 = self._slice(D)
            recv_x = torch.empty(N_recv, Ds, dtype=send_x.dtype, device=dev)
            works = [_all_to_all_rows(recv_x, send_x[:, c0 : c0 + Ds], recv_splits, send_splits, group)]
        else:
            recv_x = torch.empty(N_recv, D, dtype=send_x.dtype, device=dev)
            works = [_all_to_all_rows(recv_x, send_x, recv_splits, send_splits, group)]
        recv_meta = torch.empty(N_recv, 8, dtype=torch.float32, device=dev)
        works.append(_all_to_all_rows(recv_meta, meta_N8, recv_splits, send_splits, group))
        overlapped = overlap() if overlap is not None else None
        for w in works:
            w.wait()
        if self.dedup:
            recv_x = self._join_columns(recv_x)

        rows = DispatchedRows(
            N_recv, None, None, None, None, recv_counts_Re, send_splits, recv_splits, token_ids, T, D,
            torch.bfloat16 if fp8 else x_TD.dtype,
        )  # fmt: skip
        if N_recv:  # expert-major
            rows.x, rows.counts = combine_shuffling(recv_x, recv_counts_Re)
            me = combine_shuffling(recv_meta, recv_counts_Re)[0]
            rows.row_weights = me[:, 1].contiguous()
            rows.x_scale = me[:, 0].contiguous() if fp8 else None
        return rows, overlapped

    def combine(
        self, y: Optional[torch.Tensor], rows: DispatchedRows, shared_TD: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Dynamic combine: the local experts' outputs ``y`` (expert-major, as ``dispatch``
        returned the rows; None when it returned none) back to the ranks whose tokens they are,
        scatter-added onto those tokens (``deterministic``: the atomics-free, bitwise-reproducible
        sum) into ``shared_TD`` (or zeros). Returns ``[T, D]`` in the experts' output dtype."""
        from moekit.ops import scatter_add_dense_tokens, split_shuffling

        T, D, out_dtype, token_ids = rows.T, rows.D, rows.out_dtype, rows.token_ids
        N, dev, det = token_ids.shape[0], token_ids.device, self.args.deterministic
        if rows.num_rows:
            back = split_shuffling(y, rows.recv_counts_Re)  # back to rank-major
        else:
            back = torch.empty(0, D, dtype=out_dtype, device=dev)
        if self.dedup:  # sum the TP shards' partial rows inside the TP group; only a slice goes back
            back = self._reduce_columns(back, _reduce_scatter())
        y_N = torch.empty(N, back.shape[1], dtype=out_dtype, device=dev)
        _all_to_all_rows(y_N, back, rows.send_splits, rows.recv_splits, self.ep_group).wait()

        # Rows back onto their tokens (same row order as this rank's routing).
        if self.dedup:
            routed = torch.zeros(T, y_N.shape[1], dtype=out_dtype, device=dev)
            if N:
                scatter_add_dense_tokens(routed, y_N, token_ids, deterministic=det)
            out = self._place(routed, D)
            return out if shared_TD is None else out + shared_TD
        out = shared_TD if shared_TD is not None else torch.zeros(T, D, dtype=out_dtype, device=dev)
        if N:
            scatter_add_dense_tokens(out, y_N, token_ids, deterministic=det)
        return out

    # Deduplicated communication across the TP group (``dedup_comm``) ---------------------------
    def _slice(self, D: int) -> tuple[int, int]:
        """(columns per TP rank, this rank's first column)."""
        Ds = D // self.args.tp_size
        return Ds, self.args.tp_rank * Ds

    def _gather_columns(self, x_TD: torch.Tensor, rows: int, all_gather: Callable) -> torch.Tensor:
        """Static path: ``[T, D]`` (the same on every TP rank) -> the EP group's ``[R*T, D]``. Each
        TP rank all-gathers only its column slice over the EP group, then the TP group all-gathers
        the slices and the columns are put back in order."""
        T, D = x_TD.shape
        Ds, c0 = self._slice(D)
        part = torch.empty(rows, Ds, dtype=x_TD.dtype, device=x_TD.device)
        all_gather(part, x_TD[:, c0 : c0 + Ds].contiguous(), group=self.ep_group)
        return self._join_columns(part)

    def _join_columns(self, part_ND: torch.Tensor) -> torch.Tensor:
        """``[N, D / tp]`` column slices (this TP rank's) -> ``[N, D]`` after an all-gather over the
        TP group (raw bytes: FP8 rows travel on any backend)."""
        N, Ds = part_ND.shape
        tp = self.args.tp_size
        full = torch.empty(tp * N, Ds, dtype=part_ND.dtype, device=part_ND.device)
        if N:  # every TP rank has the same N (same tokens, same deterministic routing)
            _all_gather()(full.view(torch.uint8), part_ND.contiguous().view(torch.uint8), group=self.tp_group)
        return full.view(tp, N, Ds).permute(1, 0, 2).reshape(N, tp * Ds)

    def _reduce_columns(self, partial_ND: torch.Tensor, reduce_scatter: Callable) -> torch.Tensor:
        """``[N, D]`` partial rows (this TP rank's hidden-dim shard) -> their sum over the TP group,
        this rank's column slice ``[N, D / tp]``."""
        N, D = partial_ND.shape
        tp = self.args.tp_size
        Ds = D // tp
        mine = torch.empty(N, Ds, dtype=partial_ND.dtype, device=partial_ND.device)
        if N:
            src = partial_ND.view(N, tp, Ds).transpose(0, 1).reshape(tp * N, Ds)  # block j: columns of rank j
            reduce_scatter(mine, src, group=self.tp_group)
        return mine

    def _place(self, slice_TDs: torch.Tensor, D: int) -> torch.Tensor:
        """This TP rank's column slice in a zero ``[T, D]``: the caller's TP all-reduce adds the
        slices of the other ranks."""
        Ds, c0 = self._slice(D)
        out = torch.zeros(slice_TDs.shape[0], D, dtype=slice_TDs.dtype, device=slice_TDs.device)
        out[:, c0 : c0 + Ds] = slice_TDs
        return out
