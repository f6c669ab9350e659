"""fp4moe.ops: autograd-level building blocks on plain torch tensors (no megatron), over ``fp4moe_kernels``.

- ``fp8_gemm``: the 128x128 weight quantizer and ``fp8_mm``, the three blockwise FP8 GEMMs of a linear
  (fprop, dgrad, wgrad) over ``F.scaled_mm`` on CUDA, an exact-math emulation on CPU (docs/formats.md).
- ``fp8_linear``: ``FP8Linear`` / ``fp8_linear``, a linear whose GEMMs run in FP8 and whose saved input follows
  the recipe (FP8 row + column copies for fp8, MXFP4 for mxfp4's save_fp4), and ``linear_saved_bytes``.
- ``all_to_all``: ``quantized_all_to_all``, the expert-parallel all-to-all with an MXFP4 / FP8 / BF16 wire
  format forward and BF16 / FP8 backward, and its byte accounting (``A2AStats``, ``a2a_payload_bytes``).
- ``grouped_experts``: ``grouped_expert_mlp``, the routed experts of one rank over ragged per-expert counts
  (FP8 GEMM loop, weighted SwiGLU, saved tensors per recipe) and ``expert_saved_bytes``.
- ``swiglu``: the (unweighted) SwiGLU of dense/shared MLPs, saving its input as BF16 or MXFP4 per recipe.
- ``fp4_store``: ``fp4_saved_tensors()``, a saved-tensors context that keeps eligible saved activations as MXFP4
  (the generic mechanism for FP4 recompute caches).

Which implementation each op runs (fused or not, CUDA C++ or Triton, grouped or looped GEMMs, tiles) is
``fp4moe_kernels.switches``: ``kernel_switches`` reads them from the trainer's ``kernels`` config group,
``use_kernel_switches`` puts them in force.

Status: CPU-tested (gloo for the all-to-all) and GPU-tested on H200s (``F.scaled_mm`` layouts, the grouped
Triton GEMMs, NCCL with 2 GPUs): results/moe_layer/gpu_tests_*.log.
"""
import contextlib

from fp4moe_kernels import switches as _switches
from fp4moe_kernels.switches import SwitchError, Switches

from .fp8_gemm import dequantize_weight_128x128, fp8_mm, quantize_weight_128x128, transpose_weight_128x128
from .fp8_linear import FP8Linear, fp8_linear, linear_saved_bytes, saved_bytes
from .grouped_experts import expert_saved_bytes, grouped_expert_mlp
from .fp4_store import FP4Store, fp4_saved_tensors
from .swiglu import swiglu


def kernel_switches(node=None) -> Switches:
    """The kernel switches of a ``kernels`` config node or of a ``Switches`` (the trainer's: ``Settings.kernels``,
    already typed and checked; None: the environment's), checked now rather than where a kernel first reads one (the
    first backward, the model's build): ``SwitchError`` (a ValueError) naming the key, its environment variable and
    the values. The trainer calls it among its checks.
    ``grouped_gemm=deepgemm`` on a machine with a GPU where DeepGEMM does not load is refused here too (the reason
    and the fix: ``fp4moe_kernels.deepgemm``); without a GPU the experts run the CPU loop whatever the switch says."""
    s = node if isinstance(node, Switches) else Switches.from_env() if node is None else Switches.from_config(node)
    if s.grouped_gemm == "deepgemm":
        import torch

        from fp4moe_kernels import deepgemm

        why = deepgemm.why_unavailable() if torch.cuda.is_available() else None
        if why:
            raise SwitchError(f"kernels.grouped_gemm=deepgemm: {why}", "grouped_gemm", "deepgemm")
    return s


def switches_in_force() -> Switches:
    """The kernel switches in force now: the innermost ``use_kernel_switches`` block's, else the environment's."""
    return _switches.current()


@contextlib.contextmanager
def use_kernel_switches(s: Switches):
    """Run the block with ``s`` in force for every op and kernel (``fp4moe_kernels.switches.use``); on CUDA the tile
    tables are set from this GPU's (``launchers.GPU_TILES``) and ``s.tiles`` / ``s.gemm_tiles`` too (they stay set
    after the block: they are tuning, and the next ``use`` sets them again)."""
    import torch

    if torch.cuda.is_available():  # the tables the run's kernels launch with: s's, whatever was set before
        from fp4moe_kernels.triton_kernels import launchers

        launchers.apply_tiles(s, gpu=torch.cuda.get_device_name())
    with _switches.use(s):
        yield s


__all__ = [
    "FP4Store",
    "FP8Linear",
    "SwitchError",
    "Switches",
    "kernel_switches",
    "switches_in_force",
    "use_kernel_switches",
    "dequantize_weight_128x128",
    "expert_saved_bytes",
    "fp4_saved_tensors",
    "fp8_linear",
    "fp8_mm",
    "grouped_expert_mlp",
    "linear_saved_bytes",
    "quantize_weight_128x128",
    "saved_bytes",
    "swiglu",
    "transpose_weight_128x128",
]
