"""``MetaShufflingMoE``, the sort-based, padding-free, host-sync-free MoE layer (DESIGN §1.1),
and the historical home of the layer API (re-exported here, so imports and pickles that name
``moekit.layers.moe`` keep working).

One rank: ``moekit.layers.functional.moe_forward`` (CUDA-graph capturable, ``torch.compile``-able),
with the shared expert on a side CUDA stream. With ``ep_size > 1`` the static-shape
expert-parallel path (all-gather tokens, local experts, reduce-scatter back) or, with
``ep_comm="dynamic"``, the all-to-all path (only routed rows travel; one host sync per layer); the
collectives are ``moekit.comm.ep``'s.

Where the rest lives: ``MoEArgs`` / ``RoutingConfig`` in ``moekit.layers.config``;
``ScaledParameter``, ``RoutedExperts``, ``SharedExperts`` in ``moekit.layers.weights`` (weights
follow DESIGN §3: ``router_DE [D, E]``; routed ``w13_e2FD [e, 2F, D]`` (gate rows over up rows)
and ``w2_eDF [e, D, F]``; shared ``w13_2FD [2Fs, D]`` and ``w2_DF [D, Fs]``; FP8 row-wise weights
with float32 scales per output row); the shared layer state in ``moekit.layers.base.MoEBase``;
the PyTorch oracle ``BaselineMoE`` in ``moekit.layers.baseline``. The layers are inference-only:
parameters are frozen.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from moekit.layers.base import MoEBase
from moekit.layers.baseline import BaselineMoE
from moekit.layers.config import EP_COMMS, PRECISIONS, MoEArgs
from moekit.layers.experts import choose_path, run_experts
from moekit.layers.functional import moe_forward
from moekit.layers.weights import RoutedExperts, ScaledParameter, SharedExperts
from moekit.layers.weights import _rebuild_scaled_parameter  # noqa: F401  (named by pickles made before the split)

__all__ = [
    "PRECISIONS",
    "EP_COMMS",
    "MoEArgs",
    "ScaledParameter",
    "RoutedExperts",
    "SharedExperts",
    "MoEBase",
    "BaselineMoE",
    "MetaShufflingMoE",
]


class MetaShufflingMoE(MoEBase):
    """Sort-based, dropless, padding-free MoE layer with no host synchronization.

    One rank: ``moekit.layers.functional.moe_forward`` (index_shuffling -> gather (+FP8 quant) ->
    grouped GEMM -> SwiGLU (+quant) -> grouped GEMM with the fused scatter-add). On CUDA, with a
    shared expert and ``overlap_shared_expert`` (default True), the shared expert runs on a side
    stream concurrently with the whole routed path and is added at the end; otherwise it runs
    first and the routed rows are scatter-added into its output. CUDA-graph capturable;
    ``torch.compile(fullgraph=True)``-clean (on CUDA the side stream is skipped while compiling).

    ``ep_size > 1``: the static-shape expert-parallel path (``args.ep_comm == "static"``, see
    ``_ep_forward``) or the dynamic all-to-all path (``"dynamic"``, see ``_ep_dynamic_forward``),
    their collectives in ``moekit.comm.ep.ExpertParallelComm``.

    State, constructor and ``from_weights``: ``MoEBase``.
    """

    _ep: Optional[Any] = None  # the ExpertParallelComm with ep_size > 1 (class default: older pickles)

    def __init__(self, args: MoEArgs, **kwargs: Any) -> None:
        super().__init__(args, **kwargs)
        for name, v in (("dim", args.dim), ("hidden_dim // tp_size", args.local_hidden_dim),
                        ("shared_hidden_dim // tp_size", args.local_shared_hidden_dim)):  # fmt: skip
            if v % 8:
                raise ValueError(f"MetaShufflingMoE needs {name} to be a multiple of 8 (grouped GEMM), got {v}")
        self.overlap_shared_expert = True
        self._streams: dict[torch.device, tuple[Any, Any, Any]] = {}
        if args.ep_size > 1:  # imported here: one-rank layers do not load moekit.comm
            from moekit.comm.ep import ExpertParallelComm

            self._ep = ExpertParallelComm(args, self.ep_group, self.tp_group)

    def __getstate__(self) -> dict:  # CUDA streams/events are per process: not copied or pickled
        state = super().__getstate__()
        state["_streams"] = {}
        return state

    def _side_stream(self, device: torch.device):
        key = torch.device(device.type, device.index if device.index is not None else torch.cuda.current_device())
        got = self._streams.get(key)
        if got is None:
            got = (torch.cuda.Stream(device=key), torch.cuda.Event(), torch.cuda.Event())
            self._streams[key] = got
        return got

    def shared_forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        """The shared expert ``[T, D]`` with moekit ops (dense GEMMs; FP8 row-wise when asked)."""
        from moekit.ops import f8f8bf16_rowwise, quantize_fp8_row, silu_mul, silu_mul_quant

        se = self.shared_experts
        F = se.hidden_dim
        if se.is_fp8_rowwise:
            xq, xs = quantize_fp8_row(x_TD)
            h = f8f8bf16_rowwise(xq, se.w13.data, xs, se.w13_scale, use_fast_accum=self.args.use_fast_accum)
            zq, zs = silu_mul_quant(h[:, :F], h[:, F:])
            return f8f8bf16_rowwise(zq, se.w2.data, zs, se.w2_scale, use_fast_accum=self.args.use_fast_accum)
        h = x_TD @ se.w13.data.T
        z = silu_mul(h[:, :F], h[:, F:])
        return z @ se.w2.data.T

    def _routed(self, x_TD: torch.Tensor, logits_TE: torch.Tensor, shared: Optional[torch.Tensor]) -> torch.Tensor:
        re = self.routed_experts
        return moe_forward(
            x_TD, None, re.w13.data, re.w2.data, self.cfg, e_score_correction_bias=self.e_score_correction_bias_E,
            logits_TE=logits_TE, shared_out_TD=shared, w13_scale_e2F=re.w13_scale, w2_scale_eD=re.w2_scale,
            deterministic=self.args.deterministic, use_fast_accum=self.args.use_fast_accum,
        )  # fmt: skip

    def _route(
        self, logits_TE: torch.Tensor, start: int, end: int, zero_buffer: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, ...]:
        """``route_and_shuffle`` with this layer's routing, experts ``[start, end)`` kept."""
        from moekit.ops import route_and_shuffle

        c = self.cfg
        return route_and_shuffle(
            logits_TE, c.top_k, c.score_func, c.renormalize, n_group=c.n_group, topk_group=c.topk_group,
            e_score_correction_bias=self.e_score_correction_bias_E, routed_scaling_factor=c.routed_scaling_factor,
            expert_index_start=start, expert_index_end=end, zero_buffer=zero_buffer,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_TD = self._flatten(x)
        if self.args.ep_size > 1:
            if self.args.ep_comm == "dynamic":
                return self._ep_dynamic_forward(x_TD).reshape(x.shape)
            return self._ep_forward(x_TD).reshape(x.shape)
        if x_TD.shape[0] == 0:  # static shape: nothing to route
            return torch.zeros_like(x)
        has_shared = self.shared_experts is not None
        overlap = has_shared and x_TD.is_cuda and self.overlap_shared_expert and not torch.compiler.is_compiling()
        if not overlap:
            shared = self.shared_forward(x_TD) if has_shared else None
            return self._routed(x_TD, self.router_logits(x_TD), shared).reshape(x.shape)

        main = torch.cuda.current_stream(x_TD.device)
        side, x_ready, shared_done = self._side_stream(x_TD.device)
        x_ready.record(main)
        with torch.cuda.stream(side):
            side.wait_event(x_ready)
            shared = self.shared_forward(x_TD)
            shared_done.record(side)
        x_TD.record_stream(side)  # x_TD is read on the side stream
        out = self._routed(x_TD, self.router_logits(x_TD), None)
        main.wait_event(shared_done)
        shared.record_stream(main)  # allocated on the side stream, consumed on the main one
        return out.add_(shared).reshape(x.shape)

    # Expert parallelism -------------------------------------------------------------------------
    def _ep_forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        """Static-shape expert parallelism (every rank holds T tokens; no host sync).

        1. all-gather the tokens ``[R*T, D]`` and router logits ``[R*T, E]`` of the EP group;
        2. route all ``R*T`` tokens; ``index_shuffling`` keeps only this rank's experts
           ``[expert_start, expert_start + e)`` (the other rows come last as -1 and are skipped);
        3. gather (+ FP8 quant) -> grouped GEMM -> SwiGLU -> grouped GEMM scatter-added into a
           zero ``[R*T, D]`` partial output;
        4. reduce-scatter (sum over ranks) back to this rank's ``[T, D]``, + the shared expert.

        ``dedup_comm`` (EP x TP): step 1 all-gathers only this TP rank's column slice over the EP
        group, then the slices over the TP group; step 4 reduce-scatters the partial rows over the
        TP group (this rank's columns) before the EP group. 1 / tp_size of the bytes cross EP.
        """
        a, re = self.args, self.routed_experts
        R, (T, D), E, e, K = a.ep_size, x_TD.shape, a.num_experts, a.num_local_experts, a.top_k
        e0 = a.expert_start
        x_all, logits_all = self._ep.all_gather(x_TD, self.router_logits(x_TD).contiguous())
        shared = self.shared_forward(x_TD) if self.shared_experts is not None else None

        out_dtype = torch.bfloat16 if re.is_fp8_rowwise else x_TD.dtype
        partial = torch.empty(R * T, D, dtype=out_dtype, device=x_TD.device)  # zeroed by the routing launch
        counts, expert_ids, token_ids, row_weights, selection_rows = self._route(
            logits_all, e0, e0 + e, zero_buffer=partial
        )
        # The pipeline the single-GPU layer would take for all R * T tokens (same numerics).
        run_experts(
            x_all, re.w13.data, re.w2.data, counts[e0 : e0 + e], token_ids=token_ids, expert_ids=expert_ids,
            row_weights=row_weights, selection_rows=selection_rows, weight_on_input=a.apply_router_weight_on_input,
            w13_scale=re.w13_scale, w2_scale=re.w2_scale, out=partial, deterministic=a.deterministic,
            use_fast_accum=a.use_fast_accum, path=choose_path(R * T * K, E, fp8=re.is_fp8_rowwise, top_k=K),
        )  # fmt: skip
        out = self._ep.reduce_scatter(partial, T)
        if shared is not None:
            out = out + shared
        return out.to(a.dtype)

    def _ep_dynamic_forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        """Dynamic-shape expert parallelism: every rank sends only the rows its tokens routed to
        each other rank (``args.ep_comm == "dynamic"``; T may differ between ranks, even be 0).

        1. route this rank's T tokens over all E experts; ``index_shuffling`` sorts the T*K rows
           by expert, hence by destination rank (rank r holds experts ``[r*e, (r+1)*e)``);
        2. ``ExpertParallelComm.dispatch``: counts all-to-all, **one host sync** (the documented
           exception, DESIGN §4), the rows (scaled by the router weight when
           ``apply_router_weight_on_input``; FP8: quantized row-wise, as on one GPU) all-to-all
           while the shared expert runs, received expert-major;
        3. grouped GEMM -> SwiGLU (+ quant) -> grouped GEMM (router weight in its epilogue when on
           the output) on the received rows;
        4. ``ExpertParallelComm.combine``: back to their ranks and scatter-added onto their tokens,
           into the shared expert's output (or zeros).

        ``dedup_comm`` (EP x TP): the rows cross the EP group as this TP rank's column slice (see
        ``moekit.comm.ep``). The TP ranks route identically (same tokens, deterministic ops), so no
        routing broadcast is needed.

        Not CUDA-graph capturable and not ``torch.compile(fullgraph=True)``-clean (the host sync and
        the data-dependent buffer sizes are the point of this path); use ``ep_comm="static"`` there.
        """
        a, re = self.args, self.routed_experts
        T, E, e = x_TD.shape[0], a.num_experts, a.num_local_experts
        dev = x_TD.device
        x_TD = x_TD.contiguous()
        # Local routing: rows sorted by global expert (all E in range: every row is valid).
        if T:
            counts, expert_ids, token_ids, row_weights, _ = self._route(self.router_logits(x_TD), 0, E)
            send_counts_E = counts[:E]
        else:  # a rank without tokens still takes part in every collective
            send_counts_E = torch.zeros(E, dtype=torch.int32, device=dev)
            expert_ids = token_ids = torch.zeros(0, dtype=torch.int32, device=dev)
            row_weights = torch.zeros(0, dtype=torch.float32, device=dev)
        shared_fn = (lambda: self.shared_forward(x_TD)) if self.shared_experts is not None and T else None
        rows, shared = self._ep.dispatch(
            x_TD, send_counts_E, expert_ids, token_ids, row_weights, fp8=re.is_fp8_rowwise, overlap=shared_fn
        )
        y = None
        if rows.num_rows:
            y = run_experts(
                rows.x, re.w13.data, re.w2.data, rows.counts[:e], row_weights=rows.row_weights,
                weight_on_input=a.apply_router_weight_on_input, x_scale=rows.x_scale,
                w13_scale=re.w13_scale, w2_scale=re.w2_scale, use_fast_accum=a.use_fast_accum,
            )  # fmt: skip
        return self._ep.combine(y, rows, shared).to(a.dtype)
