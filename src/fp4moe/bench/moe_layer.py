"""MoE layer benchmark (issue 3, the paper's F4): every recipe side by side, one command, one results file.

    python -m fp4moe.bench.moe_layer [--out results/moe_layer] [--commit SHA]                  # 1 GPU (EP=1)
    python -m torch.distributed.run --nproc-per-node 2 -m fp4moe.bench.moe_layer --commit SHA  # EP=2 (NCCL)

Default shape: DeepSeek-V3's MoE layer as one EP rank holds it: hidden 7168, expert ffn 2048, top-8 of
32 local experts per GPU (32 x W global, sigmoid scores), 4096 tokens per GPU per micro-batch, one shared
expert of ffn 2048. Per recipe (bf16, fp8, mxfp4, each on the same layer weights and tokens):

* ``tokens_per_s``: tokens of this GPU per second of forward + backward (CUDA-event timing of ``--iters``
  iterations after ``--warmup``; the slowest rank's time for EP > 1);
* ``peak_gib`` / ``peak_over_base_gib``: ``torch.cuda.max_memory_allocated`` over one forward + backward
  (stats reset right before it), absolute and above what was allocated before it (weights, inputs);
* ``saved_bytes``: bytes autograd holds for backward after the forward, counted with
  ``saved_tensors_hooks`` over distinct storages, parameters excluded (the whole layer: router, dispatch,
  experts, combine, shared expert); ``expert_saved_bytes``: the routed experts' part;
* ``dispatch_*_bytes`` / ``combine_*_bytes``: payload bytes of the two all-to-alls (``A2AStats``) for one
  forward + backward; ``dispatch_ms`` / ``combine_ms``: time of the same ``quantized_all_to_all`` calls alone
  (encode + exchange + decode, forward + backward, same splits and codecs);
* the expert GEMMs run on ``gemm_backend`` (the grouped Triton kernel on CUDA; ``FP4MOE_GROUPED_GEMM=loop``
  selects the per-expert ``F.scaled_mm`` loop, ``deepgemm`` DeepGEMM's fprop / dgrad); a ``--recipes`` entry
  ``fp8@deepgemm`` runs that recipe under that switch value, beside the others in the same run (its row is labelled
  so, with ``tokens_per_s <entry>/<recipe>`` and ``/bf16`` ratios); ``+wloop`` (e.g. ``fp8@deepgemm+wloop``) runs
  the experts' wgrad as one cuBLAS ``F.scaled_mm`` per expert (the ``wgrad_gemm`` switch, ``FP4MOE_WGRAD_GEMM=loop``),
  with its ratio to the same entry without it; ``+rowcol``, ``+swq`` and ``+gsum`` likewise set ``fp8_row_col`` /
  ``fused_swiglu_fp8`` to 1, ``gather_sum`` to triton; ``+tsum`` sets ``gather_sum`` to torch;
* ``profile``: CUDA kernel time per iteration by category (``_category``: FP8/BF16 GEMMs, fp4moe's own included;
  fp4moe's other kernels; NCCL; copies; index/sort; elementwise/other) and the top kernels, from ``torch.profiler``
  over one optimizer step's ``--micro-batches`` iterations (the timed loop's mix; before 2026-12-06 its first two,
  which counted the weight quantizer of the first in half of them); its total is ``gpu_ms_per_iter``, beside the
  wall time, with ``gpu_time`` ratios wherever there are ``tokens_per_s`` ratios (``--no-profile`` skips it).
* ``memory_peak`` (``--memtrace``, CUDA): what is live at the peak above the base, by allocation site, from the
  allocator's history (``fp4moe.tracking.memtrace``); ``fp4moe.scale.memory.standalone_moe_layer_peak`` models it.
* ``--main-grads fp32`` (or ``bf16``): the gradients go where the trainer's go, into one main-gradient buffer as
  megatron DDP's backward hook adds them (zeroed at each optimizer step of ``--micro-batches`` iterations); a
  ``--recipes`` entry ``fp8+fused`` (also ``fp8@deepgemm+fused``) adds the routed experts' wgrad into it inside the
  GEMM instead (``train.wgrad_accumulation_fusion``).

And once: ``gemm``: the fp8 expert GEMMs over the routed counts (weights pre-quantized), as the grouped Triton
kernel, as the per-expert ``F.scaled_mm`` loop and (fprop / dgrad, where it loads) as DeepGEMM's m-grouped kernel on
rows padded to 128 per expert (the padding not timed), against one dense ``F.scaled_mm`` of the same total size
(M = all routed rows): TFLOP/s and ratios, for fc1/fc2 fprop, dgrad and wgrad.

Output: ``<out>/moe_layer_<gpu>_ep<W>[<shape>]_<date>_<commit>.{json,md}`` (rank 0 writes; ``<shape>`` names what
differs from the default shape, e.g. ``_t8192_e16``), rewritten after each recipe with ``complete`` false until the
end, so a run cut short keeps the recipes it measured. On CPU (``--device cpu``
and small ``--hidden/--ffn``) the same code runs as a smoke test; times are then meaningless and memory is
not measured (null).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from fp4moe_kernels.bench.timing import out_problem

from ..atomic_write import write_bytes_atomic
from ..tracking.layer_bench_log import DEFAULT_SHAPE
from ..ops.accounting import saved_bytes_during
from ..ops.all_to_all import quantized_all_to_all
from ..ops.fp8_gemm import fp8_mm
from ..ops.grouped_experts import expert_saved_bytes, gemm_backend, quantize_experts_128x128
from ..ops.weight_cache import CACHE as WEIGHT_CACHE
from ..ops.weight_cache import enabled_for
from ..recipe import Recipe, RecipeError
from ..tracking.mlflow_store import portable
from ..moe.layer import MoELayer

RECIPES = ("bf16", "fp8", "mxfp4")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fp4moe.bench.moe_layer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = DEFAULT_SHAPE
    p.add_argument("--hidden", type=int, default=d["hidden"])
    p.add_argument("--ffn", type=int, default=d["ffn"], help="routed expert ffn size")
    p.add_argument("--local-experts", type=int, default=d["local_experts"],
                   help="experts per GPU (global = this x world size)")
    p.add_argument("--top-k", type=int, default=d["top_k"])
    p.add_argument("--tokens", type=int, default=d["tokens"], help="tokens per GPU per micro-batch")
    p.add_argument("--shared-ffn", type=int, default=d["shared_ffn"], help="shared expert ffn size (0: none)")
    p.add_argument("--recipes", default=",".join(RECIPES),
                   help="comma-separated recipe presets, each optionally @ a grouped_gemm switch value, e.g. "
                        "bf16,fp8,mxfp4,fp8@deepgemm,mxfp4@deepgemm (that recipe again with those expert GEMMs), "
                        "and +fused (with --main-grads: the experts' wgrad added into the main gradients by the GEMM) "
                        "or +wloop (the experts' wgrad as one cuBLAS GEMM per expert), e.g. fp8@deepgemm+wloop, or "
                        "+rowcol (FP8 rows and columns of an operand from one kernel) or +swq (the experts' SwiGLU "
                        "writes the FP8 copies of its output and of its input's gradient itself) or +gsum / +tsum "
                        "(the permutation's per-token sums in one kernel, the default / as a gather then a sum)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cuda (default when present) or cpu (smoke test)")
    p.add_argument("--no-profile", action="store_true", help="skip the torch.profiler kernel breakdown")
    p.add_argument("--no-gemm", action="store_true", help="skip the grouped-vs-dense GEMM comparison")
    p.add_argument("--host-profile", action="store_true",
                   help="where each recipe's host (Python) time goes: one optimizer step's iterations issued "
                        "without a sync (their issue time), then again under cProfile (the functions' own time)")
    p.add_argument("--sweep-gemm", action="store_true",
                   help="first time the grouped Triton GEMMs under several tile configs and use the fastest")
    p.add_argument("--memtrace", action="store_true",
                   help="record the CUDA allocator's history over the memory measurement and list what is live at "
                        "each recipe's peak, by allocation site (fp4moe.tracking.memtrace; CUDA only)")
    p.add_argument("--fp8-weight-cache", action="store_true",
                   help="FP8 weight copies made once per optimizer step (fp4moe.ops.weight_cache, as the trainer "
                        "with train.fp8_weight_cache=true); a step is --micro-batches iterations")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="iterations per optimizer step under --fp8-weight-cache or --main-grads (gradient "
                        "accumulation: the FP8 weights are quantized in the first and reused by the others, the main "
                        "gradients zeroed before the first; default 1)")
    p.add_argument("--main-grads", choices=("fp32", "bf16"), default=None,
                   help="accumulate the gradients into one main-gradient buffer of this dtype as megatron DDP's hook "
                        "does (the trainer's path; zeroed every --micro-batches iterations); default: plain .grad")
    p.add_argument("--out", default="results/moe_layer", help="output folder")
    p.add_argument("--commit", default=None,
                   help="commit to record (default: $FP4MOE_COMMIT, else git rev-parse --short HEAD)")
    return p


# ------------------------------------------------------------------------------------------------ helpers


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class _Timer:
    """Wall time of a block in ms: CUDA events on a GPU, perf_counter on CPU."""

    def __init__(self, dev):
        self.dev = dev

    def __enter__(self):
        _sync(self.dev)
        if self.dev.type == "cuda":
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            import time

            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.dev.type == "cuda":
            self.b.record()
            self.b.synchronize()
            self.ms = self.a.elapsed_time(self.b)
        else:
            import time

            self.ms = (time.perf_counter() - self.t0) * 1e3


def _max_over_ranks(v: float, dev) -> float:
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([v], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())
    return v


OWN_OTHER = "fp4moe (non-GEMM)"   # the profile's category of fp4moe_kernels' kernels that are not GEMMs


def _category(name: str) -> str:
    """The profile's category of a CUDA kernel by the name the profiler gives it: ``gemm`` (cuBLAS, DeepGEMM,
    CUTLASS and fp4moe's own grouped FP8 GEMMs), ``OWN_OTHER`` (fp4moe's other kernels: conversions, SwiGLU,
    permutation sums, the weight quantizer; ``fp4moe_kernels.kernel_names``), ``nccl``, ``triton_other`` (inductor),
    ``copy``, ``index/sort``, else ``elementwise/other``."""
    from fp4moe_kernels.kernel_names import kernel_kind

    own = kernel_kind(name)
    if own is not None:
        return "gemm" if own == "gemm" else OWN_OTHER
    n = name.lower()
    if "nccl" in n:
        return "nccl"
    if any(s in n for s in ("gemm", "nvjet", "cutlass", "xmma", "sm90", "wgmma", "matmul")):
        return "gemm"
    if n.startswith("triton"):  # torch.compile / inductor
        return "triton_other"
    if any(s in n for s in ("copy", "memcpy", "memset")):
        return "copy"
    if any(s in n for s in ("index", "gather", "scatter", "sort", "cumsum", "bincount", "topk")):
        return "index/sort"
    return "elementwise/other"


def _profile(step, dev, iters: int) -> dict:
    """CUDA kernel time per iteration by category and the 12 longest kernels (us per iteration), over ``iters``
    iterations from the start of an optimizer step (``step(i)``: iteration i; the first quantizes the cached
    weights): given a whole step, the same mix of iterations as the timed loop, so ``total_us`` is the GPU time
    beside its wall time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            step(i)
        _sync(dev)
    per_kernel: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            per_kernel[ev.name] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            counts[ev.name] += 1
    cats: dict[str, float] = defaultdict(float)
    for k, v in per_kernel.items():
        cats[_category(k)] += v / iters
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:12]
    return {
        "iterations": iters,
        "total_us": sum(cats.values()),
        "by_category_us": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
        "top_kernels": [{"name": k[:120], "us": v / iters, "calls": counts[k] // iters, "category": _category(k)}
                        for k, v in top],
    }


# --------------------------------------------------------------------------------------------- the cases


# the --recipes modifiers that set kernel switches (``+fused`` is the benchmark's own: the wgrad into main gradients)
MODIFIER_SWITCHES = {"wloop": {"wgrad_gemm": "loop"}, "rowcol": {"fp8_row_col": "1"},
                     "swq": {"fused_swiglu_fp8": "1"}, "gsum": {"gather_sum": "triton"},
                     "tsum": {"gather_sum": "torch"}}


def _recipe_entries(text: str, main_grads: str | None = None) -> list[tuple[str, Recipe, dict, bool]]:
    """``--recipes`` -> [(label, Recipe, kernel switches to set (e.g. {"grouped_gemm": "deepgemm"}), fused wgrad)]:
    ``RECIPE[@GROUPED_GEMM][+MODIFIER...]``, e.g. ``fp8``, ``fp8@deepgemm``, ``fp8@deepgemm+fused`` (``+fused``
    only with ``--main-grads``), ``fp8@deepgemm+wloop`` (the wgrad as one cuBLAS GEMM per expert: ``wgrad_gemm``
    loop), ``+rowcol`` (an operand's FP8 rows and columns from one kernel: ``fp8_row_col`` 1), ``+swq`` (the experts'
    SwiGLU writes z's and dH's FP8 copies itself: ``fused_swiglu_fp8`` 1), ``+gsum`` / ``+tsum`` (the permutation's
    per-token sums in one kernel, the default / as a gather then a sum: ``gather_sum`` triton / torch)."""
    from fp4moe_kernels.switches import CHOICES

    modifiers = {"fused", *MODIFIER_SWITCHES}
    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        base, *mods = item.split("+")
        bad = sorted(set(mods) - modifiers)
        if bad:
            raise SystemExit(f"--recipes {item}: unknown modifier(s) {bad}; after + come "
                             f"{' / '.join(sorted(modifiers))}")
        fused = "fused" in mods
        if fused and main_grads is None:
            raise SystemExit(f"--recipes {item}: +fused adds the wgrad into main gradients: give --main-grads fp32 "
                             "(or bf16)")
        name, _, backend = base.partition("@")
        if backend and backend not in CHOICES["grouped_gemm"][0]:
            raise SystemExit(f"--recipes {item}: the part after @ is a grouped_gemm value, "
                             f"{' / '.join(CHOICES['grouped_gemm'][0])}")
        switch = {"grouped_gemm": backend} if backend else {}
        for m in mods:
            switch |= MODIFIER_SWITCHES.get(m, {})
        try:
            recipe = Recipe.preset(name)
        except RecipeError:
            raise SystemExit(f"--recipes {item}: {name!r} is not a recipe; the part before @ / + is one of "
                             f"{' / '.join(RECIPES)}") from None
        out.append((item, recipe, switch, fused))
    return out


def _check_shape(args: argparse.Namespace, recipes: list[Recipe], world: int) -> None:
    """Refuse a shape the layer cannot run, before any GPU work: sizes >= 1, top-k <= experts, and the FP8
    recipes' 128-wide scale blocks along hidden, ffn (and the shared expert's ffn when a recipe covers it)."""
    for flag, value, lowest in (("--hidden", args.hidden, 1), ("--ffn", args.ffn, 1), ("--tokens", args.tokens, 1),
                                ("--local-experts", args.local_experts, 1), ("--top-k", args.top_k, 1),
                                ("--shared-ffn", args.shared_ffn, 0), ("--iters", args.iters, 1),
                                ("--warmup", args.warmup, 0)):
        if value < lowest:
            raise SystemExit(f"{flag} {value}: give a whole number >= {lowest}")
    if args.top_k > args.local_experts * world:
        raise SystemExit(f"--top-k {args.top_k} > {args.local_experts * world} experts (--local-experts x ranks): a "
                         "token cannot pick more experts than there are")
    fp8 = [r for r in recipes if r.fp8_compute]
    sizes = [("--hidden", args.hidden), ("--ffn", args.ffn)]
    if args.shared_ffn and any(r.applies_to("shared_expert") for r in fp8):
        sizes.append(("--shared-ffn", args.shared_ffn))
    for flag, value in sizes if fp8 else ():
        if value % 128:
            raise SystemExit(f"{flag} {value}: the {fp8[0].name} recipe's FP8 GEMMs need a multiple of 128 (their "
                             "1x128 / 128x128 scale blocks)")


class MainGrads:
    """megatron DDP's gradient path for a module's parameters, in one process: one ``dtype`` buffer holding every
    parameter's ``main_grad`` (laid out backwards, as DDP does), ``grad_added_to_main_grad``, and DDP's backward
    hook (megatron-core's ``DistributedDataParallel._make_backward_post_hook``: add ``.grad`` into ``main_grad``
    unless the GEMM already did, then drop it); ``fused`` parameters are registered for gradient-accumulation fusion
    (``fp4moe.ops.grouped_experts.fuse_wgrad_accumulation``). ``zero()`` starts an optimizer step (DDP's
    ``zero_grad_buffer``); ``close()`` undoes everything."""

    def __init__(self, params, dtype: torch.dtype, fused=()):
        from ..ops.grouped_experts import fuse_wgrad_accumulation

        self.params, self.fused = list(params), list(fused)
        self.buf = torch.zeros(sum(p.numel() for p in self.params), dtype=dtype, device=self.params[0].device)
        off = 0
        for p in reversed(self.params):
            p.main_grad = self.buf[off:off + p.numel()].view(p.shape)
            p.grad_added_to_main_grad = False
            off += p.numel()
        self.handles = [p.register_post_accumulate_grad_hook(_ddp_hook) for p in self.params]
        fuse_wgrad_accumulation(self.fused)

    def zero(self) -> None:
        self.buf.zero_()
        for p in self.params:
            p.grad_added_to_main_grad = False

    def close(self) -> None:
        from ..ops.grouped_experts import fuse_wgrad_accumulation

        fuse_wgrad_accumulation(self.fused, enabled=False)
        for h in self.handles:
            h.remove()
        for p in self.params:
            del p.main_grad, p.grad_added_to_main_grad


def _ddp_hook(p: torch.Tensor) -> None:
    if p.grad is not None and not p.grad_added_to_main_grad:
        p.main_grad.add_(p.grad)
    p.grad = None


def _switched(values: dict):
    """A context with the kernel switches ``values`` (e.g. {"grouped_gemm": "deepgemm"}) set over the current ones."""
    import contextlib
    import dataclasses

    from fp4moe_kernels import switches

    if not values:
        return contextlib.nullcontext()
    return switches.use(dataclasses.replace(switches.current(), **values))


def _bench_recipe(layer: MoELayer, recipe: Recipe, x, dy, args, dev, fused: bool = False) -> dict:
    layer.recipe = recipe
    params = list(layer.parameters())
    mg = None
    if args.main_grads:
        dtype = torch.float32 if args.main_grads == "fp32" else torch.bfloat16
        mg = MainGrads(params, dtype, fused=[layer.w1, layer.w2] if fused else ())
    try:
        with enabled_for(params if args.fp8_weight_cache else None):
            return _bench_recipe_in(layer, recipe, x, dy, args, dev, params, mg)
    finally:
        if mg is not None:
            mg.close()


def _bench_recipe_in(layer: MoELayer, recipe: Recipe, x, dy, args, dev, params, mg: MainGrads | None) -> dict:
    def step(i: int):
        if i % args.micro_batches == 0:  # an optimizer step begins (a no-op without --fp8-weight-cache)
            WEIGHT_CACHE.new_step()
            if mg is not None:
                mg.zero()
        for p in params:
            p.grad = None
        xx = x.detach().requires_grad_()
        y = layer(xx)
        y.backward(dy)

    for i in range(args.warmup):
        step(i)
    misses = WEIGHT_CACHE.stats.misses
    with _Timer(dev) as t:  # whole optimizer steps: the first iteration of each quantizes the weights
        for i in range(args.iters):
            step(i)
    ms = _max_over_ranks(t.ms / args.iters, dev)
    res = {"recipe": recipe.name, "ms_per_iter": ms, "tokens_per_s": x.shape[0] / ms * 1e3,
           "fp8_weight_quantizations_per_iter": (WEIGHT_CACHE.stats.misses - misses) / args.iters}
    # memory and saved bytes over one forward + backward
    for p in params:
        p.grad = None
    _sync(dev)
    trace = args.memtrace and dev.type == "cuda"
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        if trace:
            torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python")
    layer.dispatch_stats.reset()
    layer.combine_stats.reset()
    WEIGHT_CACHE.new_step()
    xx = x.detach().requires_grad_()
    saved, y = saved_bytes_during(lambda: layer(xx), params)
    idx, _ = layer.last_routing
    y.backward(dy)
    _sync(dev)
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated(dev)
        res.update(peak_gib=peak / 2**30, peak_over_base_gib=(peak - base) / 2**30)
        if trace:
            res["memory_peak"] = _memory_peak(dev, base)
    else:
        res.update(peak_gib=None, peak_over_base_gib=None)
    counts = _local_counts(layer, idx)
    res["fp8_weight_cache_bytes"] = WEIGHT_CACHE.bytes()  # the copies this forward + backward made (0: off)
    res.update(saved_bytes=saved, saved_bytes_per_token=saved / x.shape[0],
               expert_saved_bytes=expert_saved_bytes(counts, layer.hidden, layer.ffn, recipe),
               routed_rows=sum(counts), expert_counts=counts)
    for name, st in (("dispatch", layer.dispatch_stats), ("combine", layer.combine_stats)):
        d = st.as_dict()
        res[f"{name}_fwd_bytes"] = d["forward_sent_bytes"]
        res[f"{name}_bwd_bytes"] = d["backward_sent_bytes"]
        res[f"{name}_fwd_remote_bytes"] = d["forward_sent_remote_bytes"]
        res[f"{name}_bwd_remote_bytes"] = d["backward_sent_remote_bytes"]
    res.update(_a2a_times(layer, recipe, idx, x, args, dev))
    if not args.no_profile and dev.type == "cuda":
        res["profile"] = _profile(step, dev, iters=args.micro_batches)
        res["gpu_ms_per_iter"] = res["profile"]["total_us"] / 1e3
    if args.host_profile:
        res["host_profile"] = _host_profile(step, dev, iters=args.micro_batches)
    return res


HOST_PROFILE_ROWS = 25  # functions listed per recipe, by their own time


def _host_profile(step, dev, iters: int) -> dict:
    """The host's side of ``iters`` iterations from the start of an optimizer step. ``issue_ms_per_iter``: wall time
    of the Python that issues them, after a sync and without one between iterations (where the GPU is ahead, as in
    a host-bound entry, this is the host's own work plus any synchronisation the code makes: a ``.tolist()`` of a
    device tensor waits for the GPU). Then the same iterations under cProfile: ``top``, the functions with the most
    own time (``own_ms`` / ``cum_ms`` / ``calls``, per iteration; cProfile's per-call overhead inflates call-heavy
    Python, so compare rows, not totals), ``ours_cumulative``, fp4moe's and fp4moe_kernels' functions with the most
    time including their callees (where in our code the host time accrues), and ``profiled_ms_per_iter``, the total
    under cProfile."""
    import cProfile
    import pstats
    import time

    _sync(dev)
    t0 = time.perf_counter()
    for i in range(iters):
        step(i)
    issue = (time.perf_counter() - t0) * 1e3 / iters
    _sync(dev)
    prof = cProfile.Profile()
    prof.enable()
    for i in range(iters):
        step(i)
    _sync(dev)
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (path, line, func), (_, calls, own, cum, _) in stats.stats.items():
        where = func if path == "~" else f"{portable(_short_path(path))}:{line}({func})"
        rows.append({"function": where, "calls": calls / iters, "own_ms": own * 1e3 / iters,
                     "cum_ms": cum * 1e3 / iters})
    ours = sorted((r for r in rows if r["function"].startswith(("fp4moe/", "fp4moe_kernels/"))),
                  key=lambda r: -r["cum_ms"])
    rows.sort(key=lambda r: -r["own_ms"])
    return {"iterations": iters, "issue_ms_per_iter": issue, "profiled_ms_per_iter": stats.total_tt * 1e3 / iters,
            "top": rows[:HOST_PROFILE_ROWS], "ours_cumulative": ours[:HOST_PROFILE_ROWS]}


def _short_path(path: str) -> str:
    """A source path as its import name's file: from a ``site-packages`` / ``src`` / ``kernels`` folder on (this
    repository's two packages, installed ones), else relative to the longest ``sys.path`` entry holding it
    (``/tmp/site/triton/runtime/jit.py`` -> ``triton/runtime/jit.py`` with ``/tmp/site`` on the path); other paths
    as they are."""
    parts = Path(path).parts
    for anchor in ("site-packages", "dist-packages", "src", "kernels"):
        if anchor in parts[:-1]:
            i = len(parts) - 1 - parts[::-1].index(anchor)
            return "/".join(parts[i + 1:])
    roots = [r for r in (os.path.abspath(e) for e in sys.path if e) if path.startswith(r.rstrip("/") + "/")]
    return path[len(max(roots, key=len).rstrip("/")) + 1:] if roots else path


MEMTRACE_SITES = 16  # allocation sites listed per recipe (then one <other> row)


def _memory_peak(dev, base: int) -> dict:
    """What was live at the peak of the forward + backward just recorded (``--memtrace``), above ``base`` (the
    bytes allocated before it: weights, inputs): ``fp4moe.tracking.memtrace.peak_breakdown`` of the allocator
    history, its by-site rows (bytes, blocks, innermost fp4moe frame). Stops the recording."""
    from fp4moe.tracking.memtrace import peak_breakdown

    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    traces = snapshot.get("device_traces") or []
    b = peak_breakdown(traces[dev.index] if dev.index is not None and dev.index < len(traces) else [], base,
                       top=MEMTRACE_SITES)
    return {"traced_at_peak_bytes": b["traced_at_peak_bytes"], "peak_event": b["peak_event"], "events": b["events"],
            "by_site": b["by_site"]}


def _local_counts(layer: MoELayer, idx: torch.Tensor) -> list[int]:
    """Rows each local expert received in the last forward (summed over source ranks)."""
    recv, _, _ = layer.split_sizes(idx)
    return [int(c) for c in recv.sum(0).tolist()]


def _a2a_times(layer: MoELayer, recipe: Recipe, idx, x, args, dev) -> dict:
    """ms of the dispatch and combine all-to-alls alone (forward + backward), splits of the last routing."""
    _, ins, outs = layer.split_sizes(idx)
    h = layer.hidden
    rows_in = torch.randn(sum(ins), h, device=dev, dtype=torch.bfloat16)
    rows_out = torch.randn(sum(outs), h, device=dev, dtype=torch.bfloat16)
    keep = recipe.dispatch_fp4 and recipe.expert_input_fp4
    fwd = "mxfp4" if recipe.dispatch_fp4 else "bf16"
    res = {}
    for name, rows, a, b, codec, kf in (("dispatch", rows_in, ins, outs, fwd, keep),
                                        ("combine", rows_out, outs, ins, "bf16", False)):
        def once():
            r = rows.detach().requires_grad_()
            out = quantized_all_to_all(r, a, b, layer.group, codec, recipe.backward_a2a, keep_fp4=kf,
                                       rule=recipe.scale_rule)
            anchor = out.grad_anchor if kf else out
            g = torch.ones(anchor.shape, dtype=anchor.dtype, device=dev) if kf else torch.ones_like(out)
            anchor.backward(g)

        for _ in range(2):
            once()
        n = max(1, args.iters)
        with _Timer(dev) as t:
            for _ in range(n):
                once()
        res[f"{name}_ms"] = _max_over_ranks(t.ms / n, dev)
    return res


def _gemm_compare(layer: MoELayer, counts: list[int], args, dev, only: str | None = None) -> list[dict]:
    """The expert GEMMs three ways over the routed counts: ``triton`` (one grouped launch,
    ``fp4moe_kernels.triton_kernels.gemm``), ``loop`` (one ``fp8_mm`` = ``F.scaled_mm`` per expert) and
    ``dense`` (one ``fp8_mm`` of the same total size, M = all routed rows). Weights and activations are quantized
    beforehand (not timed)."""
    from fp4moe_kernels import convert as kops, deepgemm
    from fp4moe_kernels.formats import Segments
    from fp4moe_kernels.triton_kernels import launchers
    from fp4moe_kernels.triton_kernels.common import INTERPRET

    from ..ops.grouped_experts import padded_rows

    h, f = layer.hidden, layer.ffn
    t = sum(counts)
    seg = Segments.of(counts, t)
    g = torch.Generator(device=dev).manual_seed(5)
    x = torch.randn(t, h, device=dev, generator=g).to(torch.bfloat16)
    dy2 = torch.randn(t, 2 * f, device=dev, generator=g).to(torch.bfloat16)
    use_triton = dev.type == "cuda" or INTERPRET
    cases = []
    for name, a_src, w, n, k, kind in (
        ("fc1 fprop", x, layer.w1, 2 * f, h, "fprop"),
        ("fc2 fprop", x[:, :f].contiguous(), layer.w2, h, f, "fprop"),
        ("fc1 dgrad", dy2, layer.w1, h, 2 * f, "dgrad"),
        ("fc1 wgrad", None, layer.w1, 2 * f, h, "wgrad"),
    ):
        if kind == "wgrad":
            a_col, b_col = kops.bf16_to_fp8_col(dy2, seg), kops.bf16_to_fp8_col(x, seg)
            ops = [(a_col.segment(e), b_col.segment(e)) for e in range(seg.num) if counts[e]]
            fns = {
                "triton": lambda a_col=a_col, b_col=b_col: launchers.grouped_fp8_wgrad(a_col, b_col),
                "loop": lambda ops=ops: [fp8_mm(*a, *b, "wgrad", check=False) for a, b in ops],
            }
            dense_a, dense_b = kops.bf16_to_fp8_col(dy2), kops.bf16_to_fp8_col(x)
            fns["dense"] = lambda: fp8_mm(*dense_a.segment(0), *dense_b.segment(0), "wgrad", check=False)  # noqa: E731
        else:
            row = kops.bf16_to_fp8_row(a_src, seg)
            wd, ws = quantize_experts_128x128(w, transpose=kind == "dgrad")
            ops = [(row.segment(e), wd[e], ws[e]) for e in range(seg.num) if counts[e]]
            drow = kops.bf16_to_fp8_row(a_src)
            fns = {
                "triton": lambda row=row, wd=wd, ws=ws: launchers.grouped_fp8_rows(row, wd, ws),
                "loop": lambda ops=ops, kind=kind: [fp8_mm(*a, bw, bs, kind, check=False) for a, bw, bs in ops],
                "dense": lambda drow=drow, wd=wd, ws=ws, kind=kind: fp8_mm(*drow.segment(0), wd[0], ws[0], kind,
                                                                           check=False),
            }
            if dev.type == "cuda" and deepgemm.available():  # on rows padded to 128 per expert (padding not timed)
                rp = padded_rows(seg, deepgemm.ALIGN, dev)
                row_p = kops.bf16_to_fp8_row(rp.rows(a_src), rp.padded)
                fns["deepgemm"] = lambda row_p=row_p, wd=wd, ws=ws: deepgemm.m_grouped_rows(row_p, wd, ws)
        if not use_triton:
            del fns["triton"]
        if only:
            fns = {only: fns[only]}
        flops = 2 * t * n * k
        out = {"gemm": name, "M": t, "N": n, "K": k, "experts": sum(1 for c in counts if c)}
        for label, fn in fns.items():
            fn()
            with _Timer(dev) as tm:
                for _ in range(max(1, args.iters)):
                    fn()
            ms = tm.ms / max(1, args.iters)
            out[f"{label}_ms"] = ms
            out[f"{label}_tflops"] = flops / ms / 1e9
        if "loop_tflops" in out:
            out["loop_over_dense"] = out["loop_tflops"] / out["dense_tflops"]
        for label in ("triton", "deepgemm"):
            if f"{label}_tflops" in out and "dense_tflops" in out:
                out[f"{label}_over_dense"] = out[f"{label}_tflops"] / out["dense_tflops"]
        cases.append(out)
    return cases


ROWS_TILES = [(128, 128, 8, 8, 4), (128, 128, 8, 8, 3), (128, 256, 8, 8, 3), (256, 128, 8, 8, 3),
              (128, 128, 8, 4, 4), (64, 128, 8, 4, 4)]
WGRAD_TILES = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 4), (64, 128, 4, 3), (128, 256, 8, 3)]


def _sweep_gemm(layer: MoELayer, counts: list[int], args, dev) -> dict:
    """Time the grouped Triton GEMMs under each tile config (rows: fc1/fc2 fprop + fc1 dgrad, wgrad: fc1 wgrad),
    adopt the fastest into ``launchers.GEMM_TILES`` for the rest of the run, and return every time."""
    from fp4moe_kernels.triton_kernels import launchers

    out = {"rows": [], "wgrad": []}
    for key, configs, names in (("rows", ROWS_TILES, ("fc1 fprop", "fc2 fprop", "fc1 dgrad")),
                                ("wgrad", WGRAD_TILES, ("fc1 wgrad",))):
        default = launchers.GEMM_TILES[key]
        for cfg in configs:
            launchers.GEMM_TILES[key] = cfg
            launchers._row_tiles.cache_clear()
            try:
                rows = [r for r in _gemm_compare(layer, counts, args, dev, only="triton") if r["gemm"] in names]
                out[key].append({"tiles": list(cfg), "ms": sum(r["triton_ms"] for r in rows)})
            except Exception as exc:  # a config that does not compile or fit: recorded, skipped
                out[key].append({"tiles": list(cfg), "ms": None, "error": str(exc)[:200]})
        ok = [r for r in out[key] if r["ms"] is not None]
        launchers.GEMM_TILES[key] = tuple(min(ok, key=lambda r: r["ms"])["tiles"]) if ok else default
        launchers._row_tiles.cache_clear()
        out[f"best_{key}"] = list(launchers.GEMM_TILES[key])
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"sweep {key}: " + ", ".join(f"{r['tiles']}={r['ms']}" for r in out[key]) +
                  f" -> {launchers.GEMM_TILES[key]}", flush=True)
    return out


# ---------------------------------------------------------------------------------------------- reporting


def _tiles() -> dict:
    from fp4moe_kernels.triton_kernels import launchers

    return {k: list(v) for k, v in launchers.GEMM_TILES.items()}


def _commit(arg):
    """``--commit``, else ``fp4moe.tracking.mlflow_store.code_commit`` (short), else 'unknown'."""
    from ..tracking.mlflow_store import code_commit

    return arg or code_commit(short=True) or "unknown"


def gpu_slug(name: str) -> str:
    """The short GPU name of result files (``h200``) from torch's device name (``NVIDIA H200``)."""
    n = name.lower()
    for key in ("gh200", "h200", "h100", "h800", "h20", "a100"):
        if key in n:
            return key
    return n.replace(" ", "-")[:24]


def _gpu_name(dev) -> str:
    return gpu_slug(torch.cuda.get_device_name(dev)) if dev.type == "cuda" else "cpu"


def _markdown(doc: dict) -> str:
    env, rows = doc["env"], doc["recipes"]
    steps = f"{env.get('micro_batches_per_step', 1)} iteration(s)"
    cache = f"on, {steps} per optimizer step" if env.get("fp8_weight_cache") else "off"
    grads = (f"into {env['main_grads']} main gradients as megatron DDP adds them (+fused: the experts' wgrad adds "
             f"itself), zeroed every {steps}" if env.get("main_grads") else "plain .grad, fresh every iteration")
    L = [f"# MoE layer benchmark: {env['gpu']} x{env['world_size']} (EP={env['world_size']}), {env['date']}, "
         f"commit {env['commit']}", "",
         f"Command: `{env['command']}`", "",
         *([f"**Incomplete**: the run stopped after the {len(rows)} recipe(s) below (the files are rewritten after "
            "each recipe).", ""] if doc.get("complete") is False else []),
         f"Shape (per GPU): hidden {doc['shape']['hidden']}, expert ffn {doc['shape']['ffn']}, top-"
         f"{doc['shape']['top_k']} of {doc['shape']['experts']} experts ({doc['shape']['local_experts']} local), "
         f"{doc['shape']['tokens']} tokens, shared ffn {doc['shape']['shared_ffn']}. torch {env['torch']}, "
         f"timing: {'CUDA events' if env['gpu'] != 'cpu' else 'perf_counter'}, {env['iters']} iterations after {env['warmup']} warm-up. Expert GEMMs: "
         f"{env.get('grouped_gemm')}, tiles {env.get('gemm_tiles')}. FP8 weight cache: {cache}. Gradients: {grads}.",
         "",
         "| recipe | ms/iter | GPU ms/iter | tokens/s | vs fp8 | peak GiB | peak over base GiB | saved MiB "
         "| saved B/token | expert saved MiB | dispatch fwd MiB | dispatch ms | combine ms |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fp8 = next((r for r in rows if r["recipe"] == "fp8"), None)
    for r in rows:
        vs = f"{r['tokens_per_s'] / fp8['tokens_per_s']:.3f}" if fp8 else "-"
        pk = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        po = "-" if r["peak_over_base_gib"] is None else f"{r['peak_over_base_gib']:.2f}"
        gpu = f"{r['gpu_ms_per_iter']:.2f}" if r.get("gpu_ms_per_iter") is not None else "-"
        L.append(f"| {r['recipe']} | {r['ms_per_iter']:.2f} | {gpu} | {r['tokens_per_s']:.0f} | {vs} | {pk} | {po} | "
                 f"{r['saved_bytes'] / 2**20:.1f} | {r['saved_bytes_per_token']:.0f} | "
                 f"{r['expert_saved_bytes'] / 2**20:.1f} | {r['dispatch_fwd_bytes'] / 2**20:.1f} | "
                 f"{r['dispatch_ms']:.3f} | {r['combine_ms']:.3f} |")
    if any(r.get("gpu_ms_per_iter") is not None for r in rows):
        L += ["", "GPU ms/iter: CUDA kernel time per iteration over one optimizer step (the profiles below); wall "
              "time well above it means the host, not the GPU, set that entry's pace (`gpu_time` ratios compare "
              "the GPU's work alone)."]
    if doc.get("ratios"):
        L += ["", "Ratios: " + ", ".join(f"{k} = {v:.3f}" for k, v in doc["ratios"].items())]
    for r in rows:
        mp = r.get("memory_peak")
        if mp:
            L += ["", f"## Live at {r['recipe']}'s peak, above the base (`--memtrace`): "
                  f"{mp['traced_at_peak_bytes'] / 2**30:.3f} GiB at allocator event {mp['peak_event']} of {mp['events']}",
                  "", "| MiB | blocks | allocated at |", "|---:|---:|---|"]
            L += [f"| {x['bytes'] / 2**20:.1f} | {x['blocks']} | `{x['where']}` |" for x in mp["by_site"]]
    if doc.get("gemm"):
        L += ["", "## FP8 expert GEMMs: grouped Triton kernel, DeepGEMM (rows padded to 128) and per-expert "
              "F.scaled_mm loop vs one dense F.scaled_mm", "",
              "| GEMM | M | N | K | experts | triton TFLOP/s | deepgemm TFLOP/s | loop TFLOP/s | dense TFLOP/s "
              "| triton / dense | deepgemm / dense | loop / dense |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]

        def cell(g, key, fmt):
            return format(g[key], fmt) if key in g else "-"
        for g in doc["gemm"]:
            L.append(f"| {g['gemm']} | {g['M']} | {g['N']} | {g['K']} | {g['experts']} | "
                     f"{cell(g, 'triton_tflops', '.0f')} | {cell(g, 'deepgemm_tflops', '.0f')} | "
                     f"{g['loop_tflops']:.0f} | {g['dense_tflops']:.0f} | {cell(g, 'triton_over_dense', '.3f')} | "
                     f"{cell(g, 'deepgemm_over_dense', '.3f')} | {g['loop_over_dense']:.3f} |")
    for r in rows:
        pr = r.get("profile")
        if not pr:
            continue
        L += ["", f"## Profile {r['recipe']}: CUDA kernel time per iteration {pr['total_us'] / 1e3:.2f} ms", "",
              "| category | ms |", "|---|---|"]
        L += [f"| {k} | {v / 1e3:.3f} |" for k, v in pr["by_category_us"].items()]
        L += ["", "| kernel | category | calls | ms |", "|---|---|---|---|"]
        L += [f"| `{k['name'][:80]}` | {k['category']} | {k['calls']} | {k['us'] / 1e3:.3f} |" for k in pr["top_kernels"]]
    for r in rows:
        hp = r.get("host_profile")
        if not hp:
            continue
        L += ["", f"## Host {r['recipe']}: {hp['issue_ms_per_iter']:.2f} ms per iteration to issue (`--host-profile`, "
              f"{hp['iterations']} iterations); under cProfile {hp['profiled_ms_per_iter']:.2f}", "",
              "| function | calls/iter | own ms/iter | cumulative ms/iter |", "|---|---:|---:|---:|"]
        L += [f"| `{f['function'][:100]}` | {f['calls']:.1f} | {f['own_ms']:.3f} | {f['cum_ms']:.3f} |"
              for f in hp["top"]]
        L += ["", f"fp4moe's functions in {r['recipe']}'s iterations by cumulative time (with their callees):", "",
              "| function | calls/iter | own ms/iter | cumulative ms/iter |", "|---|---:|---:|---:|"]
        L += [f"| `{f['function'][:100]}` | {f['calls']:.1f} | {f['own_ms']:.3f} | {f['cum_ms']:.3f} |"
              for f in hp["ours_cumulative"]]
    return "\n".join(L) + "\n"


def _shape_tag(args) -> str:
    """``_t<tokens>_e<local experts>...`` for each of tokens / local experts / hidden / ffn / top-k / shared ffn that
    differs from DEFAULT_SHAPE (DeepSeek-V3's), so that runs of several shapes keep apart; '' for the default."""
    return "".join(f"_{tag}{getattr(args, k)}" for tag, k in (("t", "tokens"), ("e", "local_experts"),
                                                             ("h", "hidden"), ("f", "ffn"), ("k", "top_k"),
                                                             ("s", "shared_ffn"))
                   if getattr(args, k) != DEFAULT_SHAPE[k])


def _gpu_time_ratio(by: dict, label: str, base: str) -> dict:
    """``{"gpu_time label/base": base's GPU ms / label's}`` (a speed-up, as the tokens/s ratios) when both entries
    were profiled, else {}."""
    a, b = by[label].get("gpu_ms_per_iter"), by[base].get("gpu_ms_per_iter")
    return {f"gpu_time {label}/{base}": b / a} if a and b else {}


def _ratios(entries, rows: list[dict]) -> dict:
    """Throughput (and bytes) ratios among the recipes measured so far (``rows``, in ``entries``' order)."""
    by = {r["recipe"]: r for r in rows}
    ratios = {}
    for label, r, switched, fused in entries:
        if label not in by:
            continue
        # an entry with switches or +fused against bf16, the recipe itself, the entry without its + modifiers, and
        # without each one of them
        head, *mods = label.split("+")
        for base in dict.fromkeys(("bf16", r.name, head, *(label.replace(f"+{m}", "") for m in mods))):
            if (switched or fused) and base in by and base != label:
                ratios[f"tokens_per_s {label}/{base}"] = by[label]["tokens_per_s"] / by[base]["tokens_per_s"]
                ratios.update(_gpu_time_ratio(by, label, base))
    if "fp8" in by and "mxfp4" in by:
        ratios["tokens_per_s mxfp4/fp8"] = by["mxfp4"]["tokens_per_s"] / by["fp8"]["tokens_per_s"]
        ratios.update(_gpu_time_ratio(by, "mxfp4", "fp8"))
        ratios["saved_bytes mxfp4/fp8"] = by["mxfp4"]["saved_bytes"] / by["fp8"]["saved_bytes"]
        ratios["expert_saved_bytes mxfp4/fp8"] = by["mxfp4"]["expert_saved_bytes"] / by["fp8"]["expert_saved_bytes"]
        if by["mxfp4"]["peak_over_base_gib"] is not None:
            ratios["peak_over_base mxfp4/fp8"] = by["mxfp4"]["peak_over_base_gib"] / by["fp8"]["peak_over_base_gib"]
    for name in ("fp8", "mxfp4"):
        if "bf16" in by and name in by:
            ratios[f"tokens_per_s {name}/bf16"] = by[name]["tokens_per_s"] / by["bf16"]["tokens_per_s"]
            ratios.update(_gpu_time_ratio(by, name, "bf16"))
    if "bf16" in by and "mxfp4" in by:
        ratios["dispatch_fwd_bytes mxfp4/bf16"] = by["mxfp4"]["dispatch_fwd_bytes"] / by["bf16"]["dispatch_fwd_bytes"]
    return ratios


def main(argv=None) -> dict:
    args = _parser().parse_args(argv)
    why = out_problem(args.out)
    if why:  # before any work: a run whose results cannot be written is not started
        raise SystemExit(why)
    if args.device not in (None, "cpu") and not (args.device.split(":")[0] == "cuda" and torch.cuda.is_available()):
        raise SystemExit(f"--device {args.device}: " + ("no CUDA GPU here" if args.device.startswith("cuda") else
                         "not a device this benchmark runs on") + "; give --device cpu, or leave it out (cuda when "
                         "there is a GPU, else cpu)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    own_group = world > 1 and not dist.is_initialized()   # set up here, so torn down here (after the last barrier)
    if own_group:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())
    entries = _recipe_entries(args.recipes, args.main_grads)
    if args.micro_batches < 1 or args.iters % args.micro_batches:
        raise SystemExit(f"--micro-batches {args.micro_batches}: give a count >= 1 that divides --iters {args.iters} "
                         "(the timing covers whole optimizer steps)")
    recipes = [r for _, r, _, _ in entries]
    _check_shape(args, recipes, world)
    experts = args.local_experts * world
    layer = MoELayer(args.hidden, args.ffn, experts, args.top_k, recipes[0], shared_ffn=args.shared_ffn,
                     score="sigmoid", seed=args.seed, init_device=dev)
    g = torch.Generator(device=dev).manual_seed(args.seed + 1 + rank)
    x = torch.randn(args.tokens, args.hidden, device=dev, generator=g).to(torch.bfloat16)
    dy = (torch.randn(args.tokens, args.hidden, device=dev, generator=g) * 1e-3).to(torch.bfloat16)
    sweep = None
    if args.sweep_gemm:
        with torch.no_grad():
            layer(x)
        sweep = _sweep_gemm(layer, _local_counts(layer, layer.last_routing[0]), args, dev)
    from fp4moe_kernels import switches

    cmd = " ".join(["python -m fp4moe.bench.moe_layer"] + list(sys.argv[1:] if argv is None else argv))
    if world > 1:
        cmd = f"python -m torch.distributed.run --nproc-per-node {world} -m fp4moe.bench.moe_layer " + cmd.split(" ", 3)[-1]
    cmd = portable(cmd)  # <repo>/..., $OUT/...: no machine's folders in results/
    doc = {
        "env": {"date": datetime.date.today().isoformat(), "commit": _commit(args.commit), "gpu": _gpu_name(dev),
                # when it was measured (UTC, ISO, to the millisecond): two runs of one day and commit are two benchmarks
                "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")
                .replace("+00:00", "Z"),
                "world_size": world, "torch": torch.__version__, "python": platform.python_version(),
                "command": cmd, "warmup": args.warmup, "iters": args.iters, "device": str(dev),
                "grouped_gemm": gemm_backend(dev), "gemm_tiles": _tiles(), "fp8_weight_cache": args.fp8_weight_cache,
                "micro_batches_per_step": args.micro_batches, "main_grads": args.main_grads},
        "shape": {"hidden": args.hidden, "ffn": args.ffn, "local_experts": args.local_experts, "experts": experts,
                  "top_k": args.top_k, "tokens": args.tokens, "shared_ffn": args.shared_ffn},
        "complete": False, "recipes": [], "ratios": {}, "gemm": None, "gemm_sweep": sweep,
    }
    out = Path(args.out)
    cache = ("_wcache" + (f"_mb{args.micro_batches}" if args.micro_batches > 1 else "")) if args.fp8_weight_cache else ""
    cache += f"_mg{args.main_grads}" if args.main_grads else ""
    stem = f"moe_layer_{doc['env']['gpu']}_ep{world}{_shape_tag(args)}{cache}_{doc['env']['date']}_{doc['env']['commit']}"
    if (out / (stem + ".json")).exists():  # measured again the same day at the same commit: keep both
        stem += datetime.datetime.now().strftime("_%H%M%S")

    def write() -> None:  # rank 0, after each recipe and at the end: a run cut short keeps the recipes it measured
        if rank == 0:
            for suffix, text in ((".json", json.dumps(doc, indent=1)), (".md", _markdown(doc))):
                write_bytes_atomic(out / (stem + suffix), text.encode())

    rows = doc["recipes"]
    for label, r, switched, fused in entries:
        with _switched(switched):
            rows.append(_bench_recipe(layer, r, x, dy, args, dev, fused))
            rows[-1].update(recipe=label, grouped_gemm=gemm_backend(dev), fused_wgrad=fused,
                            **{k: getattr(switches.current(), k) for m in MODIFIER_SWITCHES.values() for k in m})
        if rank == 0:
            print(f"{label}: {rows[-1]['tokens_per_s']:.0f} tokens/s, saved {rows[-1]['saved_bytes'] / 2**20:.1f} MiB",
                  flush=True)
        doc["ratios"] = _ratios(entries, rows)
        write()
    if not args.no_gemm:
        layer.recipe = recipes[0]
        with torch.no_grad():
            layer(x)
        doc["gemm"] = _gemm_compare(layer, _local_counts(layer, layer.last_routing[0]), args, dev)
    doc["complete"] = True
    write()
    if rank == 0:
        print(_markdown(doc))
        doc["files"] = [str(out / (stem + s)) for s in (".json", ".md")]
    if world > 1:
        dist.barrier()
    if own_group:   # torch's rule (NCCL warns otherwise): left to interpreter exit, the group's connections are
        dist.destroy_process_group()   # torn down in whatever order the ranks happen to exit
    return doc


if __name__ == "__main__":
    main()
