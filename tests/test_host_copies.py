"""No pageable host-to-device copy in the code a training step runs: a host table sent as ``torch.tensor(...,
device=cuda)`` or ``torch.tensor(...).to(cuda)`` is a copy from pageable memory, which waits for the stream to drain
and leaves the GPU idle while the host issues what follows (the fused wgrad's offsets table did so, 5.6 ms per
iteration of DeepSeek-V3's layer on an H100: results/moe_layer/README.md, "Where the host time goes"). Such tables go
through ``fp4moe_kernels.formats.host_to_device`` (pinned memory, a copy queued on the stream). The GPU tests check
the behaviour under torch's sync debug mode (tests/ops/test_grouped_experts.py, tests/moe/test_layer.py); this scan
keeps the pattern out of the source on any machine."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the packages whose code runs inside a training step
SCANNED = [ROOT / "src/fp4moe/ops", ROOT / "src/fp4moe/moe", ROOT / "src/fp4moe/model", ROOT / "kernels/fp4moe_kernels"]
# the CPU reference (the spec), test helpers and benchmarks: not on a GPU step's path
SKIPPED = {"reference.py", "selfcheck.py"}
SKIPPED_DIRS = {"bench"}
# (file, function): copies that are allowed, with why
ALLOWED = {("src/fp4moe/ops/all_to_all.py", "_check_output_splits"):
           "a debug check that synchronises anyway (it reads the peers' splits back)"}


def _is_tensor_ctor(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in
            ("tensor", "as_tensor") and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch")


def _may_be_device(arg: ast.AST) -> bool:
    """An argument of ``.to(...)`` that may name a device: not a ``torch.<dtype>`` attribute, not the string 'cpu'."""
    if isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name) and arg.value.id == "torch":
        return False
    return not (isinstance(arg, ast.Constant) and arg.value == "cpu")


def pageable_copies(source: str) -> list[tuple[int, str]]:
    """(line, enclosing function) of each ``torch.tensor`` / ``torch.as_tensor`` made on a device (``device=``) or
    moved there at once (``.to(...)`` / ``.cuda()`` on it), outside ``host_to_device(...)``."""
    tree = ast.parse(source)
    found = []

    def visit(node: ast.AST, func: str, wrapped: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            func = node.name
        if isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if name == "host_to_device":
                wrapped = True
            elif not wrapped and _is_tensor_ctor(node) and any(k.arg == "device" for k in node.keywords):
                found.append((node.lineno, func))
            elif (not wrapped and isinstance(node.func, ast.Attribute) and node.func.attr in ("to", "cuda")
                  and _is_tensor_ctor(node.func.value)
                  and (node.func.attr == "cuda" or any(_may_be_device(a) for a in node.args)
                       or any(k.arg == "device" for k in node.keywords))):
                found.append((node.lineno, func))
        for child in ast.iter_child_nodes(node):
            visit(child, func, wrapped)
    visit(tree, "<module>", False)
    return found


def test_no_pageable_host_to_device_copy_in_a_training_steps_code():
    bad = []
    for folder in SCANNED:
        for path in sorted(folder.rglob("*.py")):
            if path.name in SKIPPED or SKIPPED_DIRS & set(path.relative_to(folder).parts[:-1]):
                continue
            rel = path.relative_to(ROOT).as_posix()
            bad += [f"{rel}:{line} in {func}" for line, func in pageable_copies(path.read_text())
                    if (rel, func) not in ALLOWED]
    assert not bad, ("host tables sent from pageable memory (each waits for the stream to drain): build them on the "
                     "host and send them with fp4moe_kernels.formats.host_to_device:\n  " + "\n  ".join(bad))


def test_the_scan_sees_each_form_and_lets_host_to_device_through():
    src = '''
def f(xs, device):
    a = torch.tensor(xs, dtype=torch.int64, device=device)
    b = torch.tensor(xs).to(device)
    c = torch.as_tensor(xs).cuda()
    d = host_to_device(torch.tensor(xs, dtype=torch.int64), device)
    e = torch.tensor(xs, dtype=torch.int64)
    g = torch.tensor(xs).to(torch.float32)
    h = torch.tensor(xs).to("cpu")
    i = torch.tensor(xs).to(x.device)
    return a, b, c, d, e, g, h, i
'''
    assert pageable_copies(src) == [(3, "f"), (4, "f"), (5, "f"), (10, "f")]
