"""``moekit bench --hf ARCH``: a whole Hugging Face transformers model, transformers' own experts
vs moekit's, in one process, on the same random weights.

The model is built from the architecture's full-size config (hidden size, expert count, top-k,
intermediate sizes, attention shapes of the released model) with a few decoder layers, a reduced
vocabulary and random weights: nothing is downloaded. It then runs prefill and greedy decode
with ``generate`` twice, once with the baseline experts implementation (transformers' default:
``grouped_mm`` for the ``ExpertsInterface`` models, the model's own forward for Llama 4) and once
after ``moekit.integrations.transformers.enable(model)``, and reports prefill tokens/s, decode
ms per step and the speed-ups.

The results are checked, and the check can fail:

* the prompt's logits at every position, moekit against the baseline: the median per-position
  relative error must be within the dtype's rounding (``LOGITS_TOL``; a wrong expert, weight or
  routing shows up at every position, far above it);
* the decode steps' logits: moekit is made to follow the baseline's greedy tokens (teacher
  forcing through ``generate``), and the median per-step relative error against the baseline's
  logits must be within the same bound (this covers the decode kernels, which differ from the
  prefill ones);
* the greedy tokens of the two free runs are compared: in float32 they must be identical. In
  bf16 two correct implementations round differently; on a random model's flat logits that can
  flip a near-tie or a router choice, after which the runs drift apart. The table then says for
  how many steps they were identical, a note gives the forced run's argmax agreement, and
  ``--strict`` turns any difference into a failure.

On a CPU-only machine (``--size auto``) the configs are scaled down (``tiny``) and everything
runs in float32 on moekit's PyTorch reference ops: the times are CPU wall-clock times of that
job, not kernel timings.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch

from moekit.hfarchs import ARCHS, Arch, build_config, build_model, expert_dims, parse_archs, resolve_arch  # noqa: F401


#: ``moekit bench`` on a CPU-only machine without arguments runs these, tiny, against eager.
CPU_DEFAULT_ARCHS = ("qwen3-moe", "gpt-oss", "llama4")

#: Median (over positions / steps) relative error of the logits, moekit vs the baseline, by
#: dtype: the rounding of two correct implementations (bf16 ~1e-2 on 2 layers), well below what
#: a wrong expert, weight or routing gives (~1e-1 and more, at every position).
LOGITS_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 2e-2}

BASELINES = ("default", "eager", "grouped_mm", "batched_mm")


# ----------------------------------------------------------------------------------------------
# Progress
# ----------------------------------------------------------------------------------------------


class Progress:
    """Progress on stderr: a bar (tqdm when installed, else one self-rewriting line) on a
    terminal; one line per new stage otherwise (logs, CI)."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.n, self.enabled, self._bar = total, 0, enabled, None
        self._t0 = time.perf_counter()
        self._tty = enabled and sys.stderr.isatty()
        self._last = ""
        if not self._tty:
            return
        try:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, file=sys.stderr, leave=False, dynamic_ncols=True,
                             bar_format="{desc} |{bar}| {n_fmt}/{total_fmt} [{elapsed}]")  # fmt: skip
        except Exception:  # noqa: BLE001 - tqdm missing or broken: the plain line
            self._bar = None

    def step(self, desc: str, n: int = 0) -> None:
        """Show ``desc`` and advance by ``n`` steps."""
        self.n += n
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self._t0
        if not self._tty:
            stage = desc.split(":")[0]
            if stage != self._last:  # one line per architecture
                self._last = stage
                sys.stderr.write(f"[{elapsed:5.0f}s] {desc}\n")
                sys.stderr.flush()
            return
        if self._bar is not None:
            self._bar.set_description_str(desc, refresh=False)
            self._bar.update(n) if n else self._bar.refresh()
            return
        width = 24
        done = int(width * min(self.n, self.total) / max(self.total, 1))
        sys.stderr.write(f"\r{desc[:48]:<48} |{'#' * done}{'.' * (width - done)}| {self.n}/{self.total} "
                         f"[{elapsed:.0f}s]")  # fmt: skip
        sys.stderr.flush()

    def close(self) -> None:
        if not self._tty:
            return
        if self._bar is not None:
            self._bar.close()
        else:
            sys.stderr.write("\r" + " " * 90 + "\r")
            sys.stderr.flush()


# ----------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------


class _Clock:
    """A ``generate`` streamer that only records when each put arrives: once with the prompt
    (before the prefill), then once per new token (its ``.cpu()`` has synchronized)."""

    def __init__(self, sync: Callable[[], None]):
        self.sync, self.times = sync, []

    def put(self, value) -> None:
        self.sync()
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def _set_impl(model, impl: str, baseline: str) -> None:
    """Switch ``model``'s experts to ``impl`` (moekit's repacked weights and CUDA graphs kept
    across switches: the timed runs alternate between the two)."""
    from moekit.integrations import transformers as mt

    if impl == "moekit":
        mt.enable(model)
    else:
        mt.disable(model, baseline, release=False)


def _default_impl(model) -> str:
    """What transformers picked for ``model`` (``grouped_mm`` where supported, else eager)."""
    from moekit.integrations import transformers as mt

    if all(type(m).__name__ == "Llama4TextMoe" for _, m in mt.experts_modules(model)):
        return "eager"  # Llama 4: its experts are no ExpertsInterface class; the model's own forward
    return getattr(model.config, "_experts_implementation", None) or "eager"


class _Force:
    """A logits processor that makes ``generate`` pick ``tokens [B, N]`` (teacher forcing); the
    raw logits ``generate`` returns are still the model's own."""

    def __init__(self, tokens: torch.Tensor, start: int):
        self.tokens, self.start = tokens, start

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        i = input_ids.shape[1] - self.start
        pick = self.tokens[:, i : i + 1].to(scores.device)
        return torch.full_like(scores, float("-inf")).scatter_(1, pick, 0.0)


def _generate(model, ids, mask, new_tokens: int, device, logits: bool = False, force: Optional[torch.Tensor] = None):
    """Greedy ``generate``: (new tokens [B, N] on the CPU, per-step logits or None, prefill s,
    decode s per step)."""
    from transformers import LogitsProcessorList

    clock = _Clock(_sync(device))
    extra = {"logits_processor": LogitsProcessorList([_Force(force, ids.shape[1])])} if force is not None else {}
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, streamer=clock,
            return_dict_in_generate=logits, output_logits=logits, **extra,
        )  # fmt: skip
    seq = out.sequences if logits else out
    steps = torch.stack([x.float() for x in out.logits]) if logits else None  # [N, B, V]
    t = clock.times
    prefill_s = t[1] - t[0]
    decode_s = (t[-1] - t[1]) / (len(t) - 2) if len(t) > 2 else float("nan")
    return seq[:, ids.shape[1] :].cpu(), steps, prefill_s, decode_s


def _median_position_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Median over positions of the per-position relative L2 error of ``[..., V]`` logits."""
    num = (out.float() - ref.float()).norm(dim=-1)
    den = ref.float().norm(dim=-1).clamp_min(1e-30)
    return (num / den).flatten().median().item()


def compare(base_tokens: torch.Tensor, base_steps: torch.Tensor, ours_tokens: torch.Tensor,
            ours_forced_steps: torch.Tensor) -> dict:  # fmt: skip
    """The token and decode-logits check of two greedy runs.

    ``base_tokens`` / ``ours_tokens`` ``[B, N]``: each implementation's own greedy tokens;
    ``base_steps`` ``[N, B, V]``: the baseline's logits at each step; ``ours_forced_steps``:
    moekit's logits at each step when made to follow the baseline's tokens. Returns
    ``tokens`` ("identical" or "same K/N": the first K steps agree in every row),
    ``decode_err`` (median over steps and rows of the relative error of moekit's forced logits)
    and ``argmax_agree`` (the fraction of forced steps where moekit's argmax is the baseline's
    token)."""
    N = base_tokens.shape[1]
    same = (base_tokens == ours_tokens).all(dim=0)
    k = N if bool(same.all()) else int((~same).nonzero().flatten()[0])
    forced_argmax = ours_forced_steps.argmax(dim=-1).transpose(0, 1).cpu()  # [B, N]
    return {
        "tokens": "identical" if k == N else f"same {k}/{N}",
        "same_steps": k,
        "decode_err": _median_position_error(ours_forced_steps, base_steps),
        "argmax_agree": (forced_argmax == base_tokens).float().mean().item(),
    }


def run_arch(arch: str, *, size: str, layers: int, vocab: int, batch: int, prompt_len: int, new_tokens: int,
             reps: int, baseline: str, device: torch.device, dtype: torch.dtype, seed: int,
             progress: Optional[Progress] = None) -> dict:  # fmt: skip
    """One row: ``arch`` with the baseline experts and with moekit (see the module docstring)."""
    from moekit.integrations import transformers as mt

    prog = progress or Progress(0, enabled=False)
    prog.step(f"{arch}: build the {size} model")
    model = build_model(arch, size=size, layers=layers, vocab=vocab, dtype=dtype, device=device, seed=seed)
    base_impl = _default_impl(model) if baseline == "default" else baseline
    g = torch.Generator().manual_seed(seed + 2)
    ids = torch.randint(1, vocab, (batch, prompt_len), generator=g).to(device)
    mask = torch.ones_like(ids)
    prog.step(f"{arch}: build the {size} model", 1)
    res: dict[str, dict] = {}
    for impl in (base_impl, "moekit"):
        _set_impl(model, impl, base_impl)
        r: dict[str, Any] = {}
        with torch.no_grad():  # the prompt's logits at every position (and the first warm-up)
            r["prompt_logits"] = model(input_ids=ids, attention_mask=mask).logits.float()
        r["tokens"], r["steps"], _, _ = _generate(model, ids, mask, new_tokens, device, logits=True)
        if impl == "moekit":  # moekit made to follow the baseline's tokens
            _, r["forced_steps"], _, _ = _generate(model, ids, mask, new_tokens, device, logits=True,
                                                   force=res["baseline"]["tokens"])  # fmt: skip
        prog.step(f"{arch}: {impl} warm-up + check", 1)
        res["moekit" if impl == "moekit" else "baseline"] = r
    # Timed runs alternate (baseline, moekit, baseline, ...): a shared host's speed drifts between
    # runs, and both sides see the same drift.
    times: dict[str, tuple[list, list]] = {"baseline": ([], []), "moekit": ([], [])}
    for i in range(reps):
        for impl in (base_impl, "moekit"):
            _set_impl(model, impl, base_impl)
            _, _, p, d = _generate(model, ids, mask, new_tokens, device)
            side = "moekit" if impl == "moekit" else "baseline"
            times[side][0].append(p)
            times[side][1].append(d)
            prog.step(f"{arch}: {impl} timed run {i + 1}/{reps}", 1)
    for side, (pre, dec) in times.items():
        res[side]["prefill_s"], res[side]["decode_s"] = statistics.median(pre), statistics.median(dec)
    dims = expert_dims(model)
    mt.disable(model, base_impl)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    b, m = res["baseline"], res["moekit"]
    ntok = batch * prompt_len
    tol = LOGITS_TOL[dtype]
    row = {
        "arch": arch, "model": ARCHS[arch].model if size == "full" else "tiny", "size": size, **dims,
        "shape": f"D={dims['D']} F={dims['F']} E={dims['E']} k={dims['top_k']} L={dims['layers']}",
        "device": device.type,
        "dtype": str(dtype).replace("torch.", ""), "batch": batch, "prompt_len": prompt_len,
        "new_tokens": new_tokens, "reps": reps,
        "baseline": "eager (model's own)" if arch == "llama4" and base_impl == "eager" else base_impl,
        "prefill_tok_s_baseline": ntok / b["prefill_s"], "prefill_tok_s_moekit": ntok / m["prefill_s"],
        "prefill_speedup": b["prefill_s"] / m["prefill_s"],
        "decode_ms_baseline": b["decode_s"] * 1e3, "decode_ms_moekit": m["decode_s"] * 1e3,
        "decode_speedup": b["decode_s"] / m["decode_s"],
        "prompt_err": _median_position_error(m["prompt_logits"], b["prompt_logits"]),
        **compare(b["tokens"], b["steps"], m["tokens"], m["forced_steps"]), "tol": tol,
    }  # fmt: skip
    row["logits_err"] = f"{row['prompt_err']:.1e} / {row['decode_err']:.1e}"
    return row


def failures(row: dict, strict: bool = False) -> list[str]:
    """What is wrong with ``row``: logits beyond the dtype's rounding (prompt or decode), or
    tokens that are not identical in float32 (or with ``strict``)."""
    if "error" in row:
        return [f"{row['arch']}: {row['error']}"]
    bad = []
    for key, what in (("prompt_err", "the prompt's logits (every position)"),
                      ("decode_err", "the decode steps' logits (moekit following the baseline's tokens)")):  # fmt: skip
        if not row[key] <= row["tol"]:
            bad.append(f"{row['arch']}: {what} differ from the baseline's: median relative error {row[key]:.2e} > "
                       f"{row['tol']:.0e}")  # fmt: skip
    if row["tokens"] != "identical" and (strict or row["dtype"] == "float32"):
        bad.append(f"{row['arch']}: greedy tokens differ from the baseline's from step {row['same_steps']} of "
                   f"{row['new_tokens']} ({row['dtype']}{', --strict' if strict else ''})")  # fmt: skip
    return bad


# ----------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------

COLUMNS = [
    ("arch", "arch"), ("model", "model"), ("shape", "dims"), ("baseline", "baseline"),
    ("prefill_tok_s_baseline", "prefill tok/s base"), ("prefill_tok_s_moekit", "prefill tok/s moekit"),
    ("prefill_speedup", "prefill x"), ("decode_ms_baseline", "decode ms/step base"),
    ("decode_ms_moekit", "decode ms/step moekit"), ("decode_speedup", "decode x"), ("tokens", "tokens vs base"),
    ("logits_err", "logits err prompt / decode"),
]  # fmt: skip


def format_table(rows: list[dict]) -> str:
    from moekit.benchmarking import markdown_table

    shown = [{label: r.get(key) for key, label in COLUMNS} for r in rows]
    return markdown_table(shown, [label for _, label in COLUMNS])


def _device_and_dtype(size: str) -> tuple[torch.device, torch.dtype, str]:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if size == "auto":
        size = "full" if cuda else "tiny"
    return device, (torch.bfloat16 if cuda else torch.float32), size


def options(args: argparse.Namespace) -> dict:
    """The run's settings: the command-line values, the rest from the size and the device."""
    device, dtype, size = _device_and_dtype(getattr(args, "size", None) or "auto")
    quick = bool(getattr(args, "quick", False))
    full = size == "full"

    def get(name: str, default: Any) -> Any:
        v = getattr(args, name, None)
        return default if v is None else v

    o = dict(
        device=device, dtype=dtype, size=size, layers=get("layers", 2), batch=get("batch", 1),
        vocab=get("vocab", 32000 if full else 512), prompt_len=get("prompt_len", 512 if full else 64),
        new_tokens=get("new_tokens", (16 if quick else 32) if full else 16),
        reps=get("reps", 1 if quick else 5),
        baseline=get("baseline", "default"), seed=get("seed", 0),
    )  # fmt: skip
    for k in ("layers", "batch", "prompt_len", "new_tokens", "reps"):
        if o[k] < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 1, got {o[k]}")
    if o["new_tokens"] < 2:
        raise ValueError(f"--new-tokens must be >= 2 (one prefill token, then decode steps), got {o['new_tokens']}")
    if o["vocab"] < 2:
        raise ValueError(f"--vocab must be >= 2, got {o['vocab']}")
    if o["baseline"] not in BASELINES:
        raise ValueError(f"--baseline must be one of {', '.join(BASELINES)}, got {o['baseline']!r}")
    return o


def main(args: argparse.Namespace, archs: Optional[list[str]] = None) -> int:
    """``moekit bench --hf``; ``archs`` overrides ``args.hf`` (the CPU default job)."""
    try:
        names = list(archs) if archs else parse_archs(getattr(args, "hf", None) or "")
        o = options(args)
    except ValueError as e:
        print(e)
        return 2
    try:
        import transformers
        from transformers.integrations.moe import ExpertsInterface  # noqa: F401
    except ImportError:
        print("moekit bench --hf needs transformers >= 5: pip install 'moekit[hf]'")
        return 2
    device, dtype = o["device"], o["dtype"]
    where = (f"CUDA ({torch.cuda.get_device_name()})" if device.type == "cuda"
             else "CPU (moekit runs its float32 PyTorch reference ops here)")  # fmt: skip
    print(f"moekit bench --hf {','.join(names)}: {o['size']} config, {o['layers']} layers, vocab {o['vocab']}, "
          f"{str(dtype).replace('torch.', '')}, batch {o['batch']}, prompt {o['prompt_len']} tokens, "
          f"{o['new_tokens']} new tokens (greedy), median of {o['reps']} runs; baseline experts: {o['baseline']}; "
          f"on {where}", flush=True)  # fmt: skip
    # transformers warns about the random weights' generation config etc.: keep the output to ours.
    transformers.logging.set_verbosity_error()
    prog = Progress(len(names) * (1 + 2 * (1 + o["reps"])), enabled=not getattr(args, "no_progress", False))
    rows = []
    run_kw = {k: o[k] for k in ("size", "layers", "vocab", "batch", "prompt_len", "new_tokens", "reps", "baseline",
                                "device", "dtype", "seed")}  # fmt: skip
    meta = None
    try:
        for arch in names:
            try:
                rows.append(run_arch(arch, progress=prog, **run_kw))
            except Exception as e:  # noqa: BLE001 - one architecture's failure must not lose the others
                import traceback

                traceback.print_exc()
                rows.append({"arch": arch, "model": ARCHS[arch].model, "error": f"{type(e).__name__}: {e}"[:300]})
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            if getattr(args, "json", None):  # after every architecture: a run cut short keeps its rows
                if meta is None:
                    from moekit.benchmarking import environment

                    meta = {**environment(), "transformers": transformers.__version__,
                            "options": {k: str(v).replace("torch.", "") for k, v in o.items()}}  # fmt: skip
                with open(args.json, "w") as f:
                    json.dump({"meta": meta, "rows": rows}, f, indent=1)
    finally:
        prog.close()
    print(format_table(rows))
    strict = bool(getattr(args, "strict", False))
    bad = [f for r in rows for f in failures(r, strict)]
    for r in rows:
        failed = any(f.startswith(r["arch"] + ": greedy") for f in bad)
        if "error" not in r and r["tokens"] != "identical" and not failed:
            print(f"note: {r['arch']}: the greedy tokens are identical for the first {r['same_steps']} of "
                  f"{r['new_tokens']} steps, then differ. In {r['dtype']} two correct implementations round "
                  f"differently, which can flip a near-tie or a router choice, and a random model's flat logits "
                  f"have many; made to follow the baseline's tokens, moekit's logits agree to "
                  f"{r['decode_err']:.1e} (median) and its argmax is the baseline's token at "
                  f"{100 * r['argmax_agree']:.0f}% of the steps (--strict fails on any difference)")  # fmt: skip
    for f in bad:
        print("FAIL " + f)
    return 1 if bad else 0


CPU_NOTE = (
    "These are CPU wall-clock times of a tiny random model (moekit's float32 PyTorch reference ops vs "
    "transformers' eager experts): they check moekit end to end, they do not measure its kernels. GPU kernel "
    "timings need a CUDA GPU: there `moekit bench` times the MoE layer against its roofline floor and its peers, "
    "and `moekit bench --hf ARCH` a whole transformers model."
)


def cpu_default(args: argparse.Namespace) -> int:
    """``moekit bench`` on a machine without CUDA: tiny random models of a few architectures
    generate with moekit and with transformers' eager experts, tokens checked."""
    if getattr(args, "baseline", None) is None:
        args.baseline = "eager"
    rc = main(args, archs=list(CPU_DEFAULT_ARCHS))
    print(CPU_NOTE)
    return rc
