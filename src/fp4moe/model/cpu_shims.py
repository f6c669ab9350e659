"""Every patch fp4moe makes to megatron-core 0.16.1 and torch, in one scope: what fp4moe's GPTModel needs to build and
run without Transformer Engine, and without a GPU.

``with active(): ...`` applies them on entry and puts every original back on exit (the attribute's own object, or no
attribute where there was none). Reference-counted: nested and repeated entries (one ``active()`` object or several,
from one thread or several) patch on the first entry and restore on the last exit; the patches are process-wide
while any entry holds them, since megatron looks them up at call time. Who holds them: ``fp4moe.train`` for the run
(``fp4moe.train.loop``), ``fp4moe.model.gpt_model.prepare()`` / ``fp4moe.model.api.prepare()`` for a model you build and
train yourself (``with api.prepare(): ...``), the model tests for each test (tests/model/conftest.py).
``fp4moe.model.gpt_model.build_gpt_model`` refuses to build without them. Nothing is patched process-wide for good.

Without Transformer Engine (on any machine, CPU or GPU):

0. ``megatron.core.transformer.multi_latent_attention.HAVE_TE`` -> the real TE availability. Without TE,
   megatron/core/extensions/transformer_engine.py:74-77 replaces ``transformer_engine`` by a ``MagicMock``, so
   multi_latent_attention.py:54-62 imports ``TELinear`` (a MagicMock, not a class) successfully and sets
   ``HAVE_TE = True``; then multi_latent_attention.py:183-185 ``isinstance(self.linear_proj, TELinear)`` raises
   ``TypeError: isinstance() arg 2 must be a type`` when MLA is built.
0b. ``megatron.core.transformer.moe.moe_utils.te_general_gemm`` -> ``None``. moe_utils.py:22-39 imports it only
   when TE is present, but ``RouterGatingLinearFunction`` (moe_utils.py:1192, :1225, used whenever
   ``moe_router_dtype`` is set, e.g. fp32) tests ``te_general_gemm is not None`` -> ``NameError`` without TE.
0c. ``is_te_min_version`` as megatron's optimizer package sees it (optimizer/optimizer_config.py:383 and
   optimizer/__init__.py) -> False. megatron/core/utils.py ``is_te_min_version`` compares ``get_te_version()``,
   None without TE, with a version: ``OptimizerConfig(use_precision_aware_optimizer=True)`` raises TypeError.
   "TE is at least version x" is False when TE is absent.
0d. ``DistributedOptimizer._set_main_param_and_optimizer_states`` (optimizer/distrib_optimizer.py:937, the load of
   the ``fully_reshardable`` checkpoint format, fp4moe.train.checkpoint) copies into every entry of the parameter's
   optimizer state; torch's AdamW (the optimizer without TE / apex) keeps a ``step`` there, which the checkpoint's
   tensors do not have (megatron restores it from the param groups): KeyError. Only the entries the checkpoint
   gives are copied.
0e. ``megatron.core.tensor_parallel.CheckpointWithoutOutput`` and ``megatron.core.tensor_parallel.checkpoint`` (looked
   up at call time by transformer_layer.py, transformer_block.py, attention.py, multi_latent_attention.py,
   experts.py) -> fp4moe's (:mod:`fp4moe.model.recompute`): the output-discarding checkpoint of the ``layernorm``
   recompute module crashes without TE (its fp8 flag), and both store their cache MXFP4 inside a layer that asks
   for it (the mxfp4 recipe's ``recompute_cache_fp4``); elsewhere they are megatron's. Applied with TE too (the
   MXFP4 cache).
0f. ``megatron.core.tensor_parallel.layers.fused_weight_gradient_mlp_cuda`` -> :mod:`fp4moe.ops.wgrad_accumulation`
   and ``_grad_accum_fusion_available`` -> True, when apex's extension is absent (layers.py:44-48 imports it).
   megatron's linears under ``gradient_accumulation_fusion`` (layers.py:561-580) add their weight gradient into
   DDP's ``main_grad`` through its ``wgrad_gemm_accum_fp32`` / ``_fp16``; without apex the flag is refused at
   construction (layers.py:924) and the functions are missing. fp4moe's stand-ins do the same arithmetic
   (cuBLAS's ``C = A B + C`` on CUDA; the product, then the add, on CPU), so ``train.wgrad_accumulation_fusion``
   covers megatron's own linears too (``fp4moe.train.optim.fuse_wgrads``). With them,
   ``LinearWithGradAccumulationAndAsyncCommunication``'s forward and backward (with apex too): the backward finds
   the weight in ``ctx.saved_tensors``, which under any ``saved_tensors_hooks`` (fp4moe's saved-bytes accounting,
   the MXFP4 store) is a new tensor object without the Parameter's attributes, so megatron's fused path
   (layers.py:582-612) sees no ``grad_added_to_main_grad`` and returns no weight gradient: DDP's hook then fails
   under ``overlap_grad_reduce`` ("param.grad being None is not safe"). The forward keeps the Parameter in ctx, and
   where megatron returned None after adding into ``main_grad`` the backward returns its stand-in gradient and sets
   ``grad_added_to_main_grad`` on the Parameter, as megatron does when it sees it.

0g. ``DistributedOptimizer.state_dict`` of an optimizer that holds no parameter on this rank: the expert optimizer of
   a pipeline stage without MoE layers at EP > 1 (the paper's layouts: an embedding-only first stage). Without apex
   and TE (distrib_optimizer.py:640-642, the ``not HAVE_APEX_OR_TE`` branch) it asserts that its parameters' states
   hold exactly one ``step``, and it has no state: every checkpoint save failed with a bare AssertionError, and so
   would the load (megatron's ``sharded_state_dict`` starts with ``load_state_dict(state_dict())``). Such an
   optimizer's state dict records step 0 (it steps nothing; its load then gives that step to none of its zero
   states); TE's branch records None, which the no-apex load could not take. Every other optimizer: megatron's.

0h. ``megatron.core.optimizer.clip_grads.l2_norm_impl`` (the gradient norm of ``get_grad_norm_fp32``: megatron's
   global norm, logged and used for clipping) -> :func:`l2_norm_fp32`, where neither apex nor TE provides
   ``multi_tensor_l2norm``. megatron's stand-in (utils.py ``local_multi_tensor_l2_norm``) returns each tensor's
   ``torch.norm`` in the tensor's dtype: with BF16 main grads (optimizer=distributed_bf16_grads / offload, the
   lab's setup) every per-tensor norm is rounded to BF16 (one process: 2.390625 where the FP32 sum is 2.3877), and
   it copies each norm to the host (one device sync per gradient tensor). apex's kernel sums BF16 gradients in
   FP32 on the device; so does :func:`l2_norm_fp32`.

Only when CUDA is absent (CPU machine, gloo):

1. ``torch.cuda.current_device`` -> ``"cpu"``. MLA builds its RotaryEmbedding / YarnRotaryEmbedding without
   passing ``use_cpu_initialization`` (megatron/core/transformer/multi_latent_attention.py:130-148), so
   megatron/core/models/common/embeddings/rotary_pos_embedding.py:78 (and :162, :297) ask for the current CUDA
   device; megatron/core/tensor_parallel/mappings.py (``_AllToAll``, gathers) and the global memory buffer
   allocate on ``torch.cuda.current_device()`` too.
2. ``torch.cuda.Stream`` / ``torch.cuda.stream`` / ``torch.cuda.current_stream`` -> no-op stand-ins.
   ``MoEAlltoAllTokenDispatcher.__init__`` creates ``torch.cuda.Stream()`` (megatron/core/transformer/moe/
   token_dispatcher.py:444-445) and its device-to-host sync uses the stream/events.
3. megatron/core/tensor_parallel/random.py CUDA RNG: ``get_cuda_rng_tracker()`` (random.py:346) gets a
   :class:`CPURNGStatesTracker` (named CPU RNG states; ``fork`` of an unknown name is a null context) in place of
   ``CudaRNGStatesTracker`` (random.py:159-278, ``torch.cuda.get_rng_state``/``manual_seed``), and
   ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` (random.py:41, :72) use the CPU generator. Activation
   recompute needs both: ``CheckpointFunction.forward`` saves ``_get_all_rng_states()`` (random.py:514 -> :447
   -> :55 ``torch.cuda.random.get_rng_state``) and restores them in backward (recompute ``full`` and
   ``mla_up_proj`` fail with "Torch not compiled with CUDA enabled" without this).

4. ``maybe_move_tensor_to_cpu`` as the token dispatcher sees it (megatron/core/transformer/moe/token_dispatcher.py
   ``_maybe_dtoh_and_synchronize``): upstream (moe_utils.py:1078) converts only CUDA tensors, so on CPU the
   ``as_numpy=True`` split sizes stay tensors and gloo's ``all_to_all_single`` in ``tensor_parallel.mappings``
   rejects them (EP > 1). The shim returns ``.numpy()`` for CPU tensors when ``as_numpy`` is asked.

5. megatron/core/pipeline_parallel/schedules.py (the 1F1B and no-pipelining schedules fp4moe.train uses for
   PP > 1) counts tokens in ``torch.zeros([], dtype=torch.int, device="cuda")``: the module's ``torch`` becomes a
   view of torch whose ``zeros`` puts a ``device="cuda"`` tensor on the CPU (nothing else changes).
   p2p_communication.py's ``torch.cuda.synchronize()`` after a batched send/receive is switched off by the config
   (``batch_p2p_sync=False`` on CPU, fp4moe.model.gpt_model).
6. ``LanguageModule.setup_embeddings_and_output_layer`` (megatron/core/models/common/language_module/
   language_module.py:244) moves the embedding copy of the last pipeline stage (tied embeddings or MTP, PP > 1)
   with ``weight.data.cuda()`` before all-reducing it from the first stage: on CPU it stays on the CPU.

7. megatron's DDP and optimizer modules (distributed/param_and_grad_buffer.py, distributed_data_parallel.py,
   finalize_model_grads.py, optimizer/optimizer.py, distrib_optimizer.py, clip_grads.py,
   cpu_offloading/hybrid_optimizer.py, utils.py's ``local_multi_tensor_l2_norm``) allocate with
   ``device='cuda'`` / ``pin_memory=True``: each module's ``torch`` becomes a view of torch whose tensor
   factories put such tensors in ordinary CPU memory (as shim 5).
8. ``Tensor.type()`` without arguments names a CPU floating tensor as its CUDA type ('torch.cuda.BFloat16Tensor'):
   megatron's optimizers accept parameters by that string (optimizer.py:671, distrib_optimizer.py:361/:420/:582,
   clip_grads.py:167). Only the no-argument form changes; ``t.type(dtype)`` casts as before.
9. ``HybridDeviceOptimizer`` (the offloading optimizer) decides what to copy to the host by ``param.is_cuda``
   (hybrid_optimizer.py:_get_sub_optimizer_param_groups, which pins its host copies) and moves loaded state back
   with ``.to("cuda")`` (_move_new_state_to_right_device): while it splits its groups, a tensor counts as a device
   tensor unless it was made by ``.cpu()`` (a copy) or from such a copy (``detach`` / ``clone`` / ``float``), and
   pinning is a no-op, so on the CPU it builds and runs its real host path
   (gradients copied to host copies, torch's CPU AdamW, parameters copied back); "cuda" in the move is the CPU.
10. ``DistributedOptimizer.get_parameter_state_dp_zero`` (distrib_optimizer.py:1089, the gather of the
   ``fully_reshardable`` checkpoint format, fp4moe.train.checkpoint) moves each shard with ``.cuda()`` before
   all-gathering it over the data-parallel group: on CPU it stays on the CPU (as shim 6).
11. ``FileSystemWriterAsync.preload_tensors`` (dist_checkpointing/strategies/filesystem_async.py:231, the
   torch_dist writer of fp4moe.train.checkpoint's sharded format) is called with ``non_blocking=True`` and then
   calls ``torch.cuda.synchronize()``: on CPU it copies blocking (the same bytes) and does not synchronize.

Only what the tests in tests/model and tests/train exercise is patched; tests/model/test_cpu_shims.py checks that
after the scope every attribute of torch, torch.cuda, torch.Tensor and every megatron module and class is the
object it was before.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

_LOCK = threading.RLock()
_DEPTH = 0  # entries of active() now holding the patches
_SAVED: list[tuple[Any, str, bool, Any]] = []  # (owner, name, had its own attribute, that attribute), in patch order


def _set(owner: Any, name: str, value: Any) -> None:
    """``setattr(owner, name, value)``, remembering what ``owner`` itself held under ``name`` (its ``__dict__``
    entry: a class's raw descriptor, e.g. a staticmethod; nothing when it was inherited or absent)."""
    own = vars(owner)
    _SAVED.append((owner, name, name in own, own.get(name)))
    setattr(owner, name, value)


def _restore() -> None:
    """Undo every ``_set`` of the scope, last first."""
    while _SAVED:
        owner, name, had, old = _SAVED.pop()
        if had:
            setattr(owner, name, old)
        else:
            delattr(owner, name)


class _NullStream:
    """Stand-in for ``torch.cuda.Stream`` on CPU (token_dispatcher.py:445)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> Any:
        return _NullEvent()

    def synchronize(self) -> None:
        pass


class _NullEvent:
    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass


class CPURNGStatesTracker:
    """CPU stand-in for megatron's ``CudaRNGStatesTracker`` (tensor_parallel/random.py:159): named CPU RNG
    states; ``fork`` runs the block under the named state (a null context for unknown names)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def reset(self) -> None:
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)
        self.seeds_.add(seed)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            yield
            return
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def _on_cpu(factory: Any) -> Any:
    """``factory`` (torch.zeros, ...) with ``device="cuda"`` mapped to the CPU and ``pin_memory`` dropped."""

    def make(*args: Any, device: Any = None, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        return factory(*args, device=device, **kwargs)

    return make


class _TorchOnCPU:
    """What a patched megatron module sees as ``torch`` on CPU (shims 5 and 7): torch itself, except that its
    tensor factories put ``device="cuda"`` tensors on the CPU, unpinned."""

    zeros = staticmethod(_on_cpu(torch.zeros))
    empty = staticmethod(_on_cpu(torch.empty))
    ones = staticmethod(_on_cpu(torch.ones))
    full = staticmethod(_on_cpu(torch.full))
    tensor = staticmethod(_on_cpu(torch.tensor))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


# shim 7: megatron modules whose tensors are made on device='cuda' (or pinned) by their own code
_CUDA_ALLOCATING_MODULES = (
    "megatron.core.distributed.param_and_grad_buffer", "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads", "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer", "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.cpu_offloading.hybrid_optimizer", "megatron.core.utils")
_CUDA_TYPE_NAMES = {torch.float32: "torch.cuda.FloatTensor", torch.bfloat16: "torch.cuda.BFloat16Tensor",
                    torch.float16: "torch.cuda.HalfTensor"}


# shim 9: tensor methods whose result stays where their input is (HybridDeviceOptimizer's host copies)
_HOST_PROPAGATING = ("detach", "clone", "float")


def _apply_optimizer_shims() -> None:
    """Shims 7-11 (module docstring)."""
    import importlib

    for name in _CUDA_ALLOCATING_MODULES:
        _set(importlib.import_module(name), "torch", _TorchOnCPU())
    # 8. the no-argument Tensor.type() of a CPU floating tensor names its CUDA type
    tensor_type = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu" and self.dtype in _CUDA_TYPE_NAMES:
            return _CUDA_TYPE_NAMES[self.dtype]
        return tensor_type(self) if dtype is None else tensor_type(self, dtype, non_blocking, **kwargs)

    _set(torch.Tensor, "type", type_)
    # 9. HybridDeviceOptimizer: the parameters it is given are device tensors while it splits them
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer as HDO

    split = HDO._get_sub_optimizer_param_groups

    def split_groups(self, offload_fraction):
        # On a GPU the host copies are the results of .cpu() (pinned), and tensors made from them stay on the host.
        host: set[int] = set()
        saved = {name: getattr(torch.Tensor, name) for name in ("is_cuda", "cpu", "pin_memory", *_HOST_PROPAGATING)}

        def host_copy(t, *args, **kwargs):
            out = t.clone()
            host.add(id(out))
            return out

        def propagating(name):
            method = saved[name]

            def call(t, *args, **kwargs):
                out = method(t, *args, **kwargs)
                if id(t) in host:
                    host.add(id(out))
                return out

            return call

        torch.Tensor.is_cuda = property(lambda t: id(t) not in host)  # type: ignore[assignment,method-assign]
        torch.Tensor.cpu = host_copy  # type: ignore[method-assign]
        torch.Tensor.pin_memory = lambda t, *args, **kwargs: t  # type: ignore[method-assign] # no pinned memory
        for name in _HOST_PROPAGATING:
            setattr(torch.Tensor, name, propagating(name))
        try:
            return split(self, offload_fraction)
        finally:
            for name, method in saved.items():
                setattr(torch.Tensor, name, method)

    move = HDO._move_new_state_to_right_device

    def move_state(self):
        to = torch.Tensor.to

        def to_cpu(t, *args, **kwargs):
            return to(t, *("cpu" if a == "cuda" else a for a in args), **kwargs)

        torch.Tensor.to = to_cpu  # type: ignore[method-assign]
        try:
            return move(self)
        finally:
            torch.Tensor.to = to  # type: ignore[method-assign]

    _set(HDO, "_get_sub_optimizer_param_groups", split_groups)
    _set(HDO, "_move_new_state_to_right_device", move_state)
    # 10. distrib_optimizer.py:1089 send_tensor.cuda() in the gather of the fully_reshardable checkpoint format
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    gather = DistributedOptimizer.get_parameter_state_dp_zero

    def gather_on_cpu(self, *args, **kwargs):
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *a, **k: t  # type: ignore[assignment,method-assign]
        try:
            return gather(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = cuda  # type: ignore[method-assign]

    _set(DistributedOptimizer, "get_parameter_state_dp_zero", gather_on_cpu)
    # 11. filesystem_async.py:231 torch.cuda.synchronize() after the non-blocking copies of the torch_dist writer
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    preload = FileSystemWriterAsync.preload_tensors
    _set(FileSystemWriterAsync, "preload_tensors",
         staticmethod(lambda write_buckets, non_blocking=True: preload(write_buckets, False)))


def needed() -> bool:
    """Whether the CPU shims (1-11) are needed: CUDA is absent."""
    return not torch.cuda.is_available()


def _apply_no_te() -> None:
    """Shims 0-0d and 0g (module docstring): needed whenever Transformer Engine is absent (0g: and apex)."""
    from megatron.core.extensions import transformer_engine as mte

    if mte.HAVE_TE:
        return
    from megatron.core.transformer import multi_latent_attention as mla
    from megatron.core.transformer.moe import moe_utils

    _set(mla, "HAVE_TE", False)  # multi_latent_attention.py:62 sets True from a MagicMock TELinear
    if not hasattr(moe_utils, "te_general_gemm"):  # moe_utils.py:1192/:1225 NameError without TE
        _set(moe_utils, "te_general_gemm", None)
    import megatron.core.optimizer as mopt
    from megatron.core.optimizer import optimizer_config

    for module in (mopt, optimizer_config):  # 0c: is_te_min_version raises TypeError without TE
        _set(module, "is_te_min_version", lambda *args, **kwargs: False)
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE, DistributedOptimizer

    upstream_set = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):  # 0d: torch AdamW's `step` is not among the loaded tensors
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return upstream_set(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        dst = {"param": main_param, **self.optimizer.state[main_param]}
        for key, value in tensors.items():
            dst[key].copy_(value)

    _set(DistributedOptimizer, "_set_main_param_and_optimizer_states", set_states)
    if not HAVE_APEX_OR_TE:
        upstream_state_dict = DistributedOptimizer.state_dict

        def state_dict(self):  # 0g: no parameter here, no state: megatron's no-apex branch asserts one step
            inner = self.optimizer
            if inner is None or inner.state or any(group["params"] for group in inner.param_groups):
                return upstream_state_dict(self)
            real = inner.state_dict
            inner.state_dict = lambda: {**real(), "state": {0: {"step": torch.tensor(0.0)}}}  # the step it reads
            try:
                return upstream_state_dict(self)
            finally:
                del inner.state_dict

        _set(DistributedOptimizer, "state_dict", state_dict)


def l2_norm_fp32(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Shim 0h: apex's ``multi_tensor_l2norm`` as megatron calls it (``multi_tensor_applier``; ``chunk_size``,
    ``noop_flag`` and ``per_tensor=False`` as there): the L2 norm over every tensor of ``tensor_lists[0]``, each
    read in FP32, as a ``[1]`` float32 tensor on the first tensor's device, and None (no per-tensor norms)."""
    tensors = tensor_lists[0]
    device = tensors[0].device
    norms = [torch.linalg.vector_norm(t, dtype=torch.float32).to(device) for t in tensors]
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def _apply_no_apex() -> None:
    """Shims 0f and 0h (module docstring): apex's gradient-accumulation GEMMs for megatron's linears, where apex is
    absent, and the Parameter their fused backward loses behind saved-tensor hooks; the gradient norm in FP32."""
    from megatron.core import utils as mutils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is mutils.local_multi_tensor_l2_norm:  # 0h: neither apex's nor TE's kernel
        _set(clip_grads, "l2_norm_impl", l2_norm_fp32)
    from megatron.core.tensor_parallel import layers

    if not layers._grad_accum_fusion_available:
        from fp4moe.ops import wgrad_accumulation

        _set(layers, "fused_weight_gradient_mlp_cuda", wgrad_accumulation)
        _set(layers, "_grad_accum_fusion_available", True)
    fn = layers.LinearWithGradAccumulationAndAsyncCommunication
    upstream_forward, upstream_backward = fn.forward, fn.backward

    def forward(ctx, input, weight, *args):
        ctx.fp4moe_param, ctx.fp4moe_input_dtype = weight, input.dtype   # ctx.saved_tensors' weight may be a copy
        return upstream_forward(ctx, input, weight, *args)

    def backward(ctx, *grads):
        out = upstream_backward(ctx, *grads)
        param = ctx.fp4moe_param
        if (ctx.gradient_accumulation_fusion and out[1] is None and ctx.main_grad is not None
                and hasattr(param, "grad_added_to_main_grad")):   # megatron added into main_grad, then lost param
            make = torch.zeros if getattr(param, "zero_out_wgrad", False) else torch.empty
            stand_in = make(ctx.main_grad.shape, dtype=ctx.fp4moe_input_dtype, device=ctx.main_grad.device)
            param.grad_added_to_main_grad = True
            out = (out[0], stand_in, *out[2:])
        return out

    _set(fn, "forward", staticmethod(forward))
    _set(fn, "backward", staticmethod(backward))


def _apply_checkpoints() -> None:
    """Shim 0e: megatron's checkpoint functions as fp4moe.model.recompute's."""
    from megatron.core import tensor_parallel

    from fp4moe.model import recompute

    _set(tensor_parallel, "CheckpointWithoutOutput", recompute.FP4CacheCheckpointWithoutOutput)
    _set(tensor_parallel, "checkpoint", recompute.checkpoint)


def _apply_cpu() -> None:
    """Shims 1-11 (module docstring): CUDA is absent."""
    # 1. rotary_pos_embedding.py:78/:162/:297, tensor_parallel/mappings.py device=torch.cuda.current_device()
    _set(torch.cuda, "current_device", lambda: "cpu")
    # 2. transformer/moe/token_dispatcher.py:445 torch.cuda.Stream() in MoEAlltoAllTokenDispatcher.__init__
    _set(torch.cuda, "Stream", _NullStream)
    _set(torch.cuda, "Event", _NullEvent)
    _set(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext())
    _set(torch.cuda, "current_stream", lambda *a, **k: _NullStream())
    # 3. tensor_parallel/random.py:346 get_cuda_rng_tracker, :41/:72 _get/_set_cuda_rng_state (recompute, :514); a
    # fresh tracker per scope (megatron's model_parallel_cuda_manual_seed fills it; fp4moe.train seeds every run)
    from megatron.core.tensor_parallel import random as mrandom

    _set(mrandom, "_CUDA_RNG_STATE_TRACKER", CPURNGStatesTracker())
    _set(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True)
    _set(mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    _set(mrandom, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
    # 4. token_dispatcher.py _maybe_dtoh_and_synchronize: split sizes as numpy on CPU too (EP > 1 on gloo)
    from megatron.core.transformer.moe import token_dispatcher

    upstream = token_dispatcher.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return upstream(tensor, as_numpy=as_numpy, record_stream=record_stream)

    _set(token_dispatcher, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)
    # 5. pipeline_parallel/schedules.py total_num_tokens = torch.zeros([], ..., device="cuda")
    from megatron.core.pipeline_parallel import schedules

    _set(schedules, "torch", _TorchOnCPU())
    # 6. language_module.py:244 weight.data.cuda() of the last stage's embedding copy (tied / MTP, PP > 1)
    from megatron.core.models.common.language_module.language_module import LanguageModule

    upstream_setup = LanguageModule.setup_embeddings_and_output_layer

    def setup_embeddings_and_output_layer(self) -> None:
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *a, **k: t  # type: ignore[assignment,method-assign]
        try:
            upstream_setup(self)
        finally:
            torch.Tensor.cuda = cuda  # type: ignore[method-assign]

    _set(LanguageModule, "setup_embeddings_and_output_layer", setup_embeddings_and_output_layer)
    _apply_optimizer_shims()  # 7-11: megatron's DDP, optimizers and checkpoint writer


def _apply_all() -> None:
    try:
        _apply_no_te()
        _apply_no_apex()
        _apply_checkpoints()
        if needed():
            _apply_cpu()
    except BaseException:
        _restore()
        raise


class active:  # noqa: N801 (used as a function: ``with cpu_shims.active():``)
    """Context manager: the shims (module docstring) held from entry to exit; every original back when the last
    holder exits. ``__enter__`` returns whether the CPU shims are among them (CUDA absent). One object may be
    entered again, also while it is entered (each entry needs its exit)."""

    def __enter__(self) -> bool:
        global _DEPTH
        with _LOCK:
            if _DEPTH == 0:
                _apply_all()
            _DEPTH += 1
        return needed()

    def __exit__(self, *exc: Any) -> None:
        global _DEPTH
        with _LOCK:
            if _DEPTH <= 0:
                raise RuntimeError("cpu_shims.active(): exit without a matching entry")
            _DEPTH -= 1
            if _DEPTH == 0:
                _restore()


def depth() -> int:
    """How many entries of :class:`active` hold the shims now (0: torch and megatron are as they came)."""
    return _DEPTH


def patched() -> list[tuple[Any, str]]:
    """(owner, attribute name) of every attribute the shims hold patched now, in patch order (empty outside)."""
    with _LOCK:
        return [(owner, name) for owner, name, _, _ in _SAVED]


__all__ = ["active", "depth", "needed", "patched", "l2_norm_fp32", "CPURNGStatesTracker"]
