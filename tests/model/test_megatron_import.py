"""fp4moe.model.megatron_import in a fresh interpreter (megatron-core is imported once per process)."""
import subprocess
import sys

PROBE = """
import torch
from fp4moe.model.megatron_import import import_megatron_core
eager = import_megatron_core(eager_fusions={eager})
import megatron.core.jit as jit
from megatron.core.fusions import fused_bias_swiglu as f
from torch._dynamo.eval_frame import OptimizedModule
wrapped = type(f.bias_swiglu).__module__.startswith("torch._dynamo") or hasattr(f.bias_swiglu, "_torchdynamo_orig_callable")
x, b = torch.randn(4, 8), torch.randn(8)
y = f.bias_swiglu(x, b)
a, g = torch.chunk(x + b, 2, -1)
print(eager, wrapped, jit.jit_fuser is jit.noop_decorator, torch.compile.__module__, torch.equal(y, torch.nn.functional.silu(a) * g))
"""


def _probe(eager: bool) -> str:
    r = subprocess.run([sys.executable, "-c", PROBE.format(eager=eager)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.split()


def test_eager_fusions_leave_megatrons_functions_plain_and_torch_compile_untouched():
    """eager: megatron's fused functions are the plain Python functions (same values), its jit_fuser is the no-op for
    later imports, and torch.compile itself is restored afterwards (an import without the switch wraps them in
    torch.compile: the GPU path, run by the GPU tests)."""
    assert _probe(True) == ["True", "False", "True", "torch", "True"]
