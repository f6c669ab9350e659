"""Measure the GPU memory a training process holds beyond PyTorch's allocated bytes (issue 27, part C), in one call
on one GPU (two: also NCCL with a peer), and write ``OUT/outside_torch_h200.json`` for ``fp4moe.analysis.outside_torch_measured``
(copy it to results/scale/outside_torch_h200.json and update its entry in results/manifest.yaml: the studies then give
its terms to the memory model).

    bash tools/device/h200_p3.sh setup && bash tools/device/h200_p3.sh outside      # on the device (OUT set)
    python3 tools/device/measure_outside_torch.py --out DIR [--cells "bf16:attn_block_ln_experts ..."]
                                                  [--micro-batches 16] [--steps 4] [--budget-s 520]
    python3 tools/device/measure_outside_torch.py --dry-run --out DIR   # no GPU: the plan and an unmeasured document

Every part runs in a fresh child process, so that nothing else lives in it; GPU memory is what nvidia-smi reports for
the GPU (``memory.used``, MiB) less what it reported before the child started (the GPU otherwise idle), and for the
child's own PID when nvidia-smi lists it (``--query-compute-apps``); "outside" = used - ``torch.cuda.memory_reserved``:

- ``context``: after ``torch.cuda.init`` and a 1-element tensor, then after the first cuBLAS GEMM (BF16 and FP8
  ``torch._scaled_mm``), cuDNN (a convolution), flash attention (SDPA forward + backward) and a Triton kernel.
- ``nccl``: a process group of one rank (``world1``), and with two GPUs of two ranks over ``torch.distributed.run``
  (``world2``; ``world2_lab`` with the lab's ``NCCL_MIN_NCHANNELS=32``): outside bytes before the group, after its
  creation, a 1-element all-reduce, an all-reduce and an all-to-all of 64 MiB; ``communicator_bytes`` = after -
  before (largest rank); the model's peer terms are the stages' gains (fp4moe.analysis.outside_torch_measured).
- ``training``: the proxy trainer (``python -m fp4moe.train experiment=proxy_t1_1gpu``) for each cell and micro-batch,
  with ``PYTORCH_CUDA_ALLOC_CONF`` unset and ``expandable_segments:True`` (the lab's setting): its logged peak
  allocated / reserved (MLflow store, read with sqlite3) and nvidia-smi's peak, polled every 0.2 s.
  ``training_process.outside_torch_bytes`` = nvidia-smi peak - peak reserved (largest over the expandable-segments
  runs); ``allocator`` = reserved - allocated at the peak of the expandable-segments run with the largest gap per
  tokens x hidden, and that tokens x hidden (``ref_elements``).

The document carries the date, the commit (``FP4MOE_COMMIT`` or git), the GPU, the driver, torch and NCCL versions
and the command line. ``--dry-run`` writes the same document with every measurement null and ``dry_run: true``
(``fp4moe.analysis.outside_torch_measured.derive`` refuses it).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

FORMAT = "fp4moe-outside-torch/1"   # = fp4moe.analysis.outside_torch_measured.FORMAT (this script runs without the package)
OUT_NAME = "outside_torch_h200.json"
MiB = 2**20
ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CELLS = "bf16:attn_block_ln_experts mxfp4:attn_block_ln_experts"
ALLOC_CONFS = {"default": None, "expandable_segments": "expandable_segments:True"}
LAB_NCCL = {"NCCL_MIN_NCHANNELS": "32"}   # the lab's run_dlc_e2e.sh (sister artifact)


def portable(text: str) -> str:
    """``text`` with the machine's folders as ``<repo>``, ``$OUT`` and ``~`` (fp4moe.tracking.mlflow_store.portable,
    imported from this checkout's src/; the rest of the script needs no package): the document goes into results/scale/."""
    if str(ROOT / "src") not in sys.path:
        sys.path.insert(0, str(ROOT / "src"))
    from fp4moe.tracking.mlflow_store import portable as portable_text

    return portable_text(text)


# ---------------------------------------------------------------------------------------------- nvidia-smi

def _smi(*query: str) -> list[list[str]]:
    out = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         check=True).stdout
    return [[x.strip() for x in line.split(",")] for line in out.strip().splitlines() if line.strip()]


def gpus() -> list[dict]:
    """The visible GPUs: index, uuid, name, memory.total (MiB), driver (from nvidia-smi)."""
    rows = _smi("--query-gpu=index,uuid,name,memory.total,driver_version")
    return [{"index": int(i), "uuid": u, "name": n, "memory_total_mib": int(float(m)), "driver": d}
            for i, u, n, m, d in rows]


def used_mib(uuid: str) -> int:
    """nvidia-smi's memory.used of one GPU, MiB."""
    return int(float(_smi("--query-gpu=memory.used", "-i", uuid)[0][0]))


def process_used_mib(pid: int) -> int | None:
    """nvidia-smi's used memory of one process (MiB), None when it does not list that PID (e.g. another PID
    namespace)."""
    for row in _smi("--query-compute-apps=pid,used_memory"):
        if len(row) == 2 and row[0].isdigit() and int(row[0]) == pid:
            return int(float(row[1]))
    return None


# ---------------------------------------------------------------------------------------------- children

def _own_gpu() -> str:
    """This child's GPU: the UUID at its local rank in CUDA_VISIBLE_DEVICES (set by the parent)."""
    return os.environ["CUDA_VISIBLE_DEVICES"].split(",")[int(os.environ.get("LOCAL_RANK", 0))]


def _snapshot(torch, uuid: str, baseline_mib: int, stage: str) -> dict:
    torch.cuda.synchronize()
    used = (used_mib(uuid) - baseline_mib) * MiB
    proc = process_used_mib(os.getpid())
    reserved = torch.cuda.memory_reserved()
    return {"stage": stage, "used_bytes": used, "process_used_bytes": None if proc is None else proc * MiB,
            "reserved_bytes": reserved, "allocated_bytes": torch.cuda.memory_allocated(),
            "outside_bytes": used - reserved}


def child_context() -> dict:
    """Outside-PyTorch bytes of an otherwise empty process after each library's first use."""
    uuid = _own_gpu()
    baseline_mib = used_mib(uuid)   # before this process touches the GPU
    import torch
    import torch.nn.functional as F

    torch.cuda.init()
    x = torch.ones(1, device="cuda")
    snaps = [_snapshot(torch, uuid, baseline_mib, "cuda_init")]
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    snaps.append(_snapshot(torch, uuid, baseline_mib, "cublas_bf16"))
    try:
        f8 = a.to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        torch._scaled_mm(f8, f8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        snaps.append(_snapshot(torch, uuid, baseline_mib, "cublaslt_fp8"))
    except (RuntimeError, TypeError) as e:   # no FP8 GEMM on this GPU / torch
        snaps.append({"stage": "cublaslt_fp8", "error": str(e).splitlines()[0]})
    img = torch.randn(8, 64, 64, 64, device="cuda", dtype=torch.bfloat16)
    F.conv2d(img, torch.randn(64, 64, 3, 3, device="cuda", dtype=torch.bfloat16)).sum().item()
    snaps.append(_snapshot(torch, uuid, baseline_mib, "cudnn"))
    q = torch.randn(1, 16, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    snaps.append(_snapshot(torch, uuid, baseline_mib, "flash_attention"))
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def _add_one(p, n, BLOCK: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(p + i, tl.load(p + i, mask=i < n) + 1, mask=i < n)

        y = torch.zeros(1024, device="cuda")
        _add_one[(1,)](y, 1024, BLOCK=1024)
        snaps.append(_snapshot(torch, uuid, baseline_mib, "triton"))
    except ImportError as e:
        snaps.append({"stage": "triton", "error": str(e)})
    del x, a, img, q
    torch.cuda.empty_cache()
    snaps.append(_snapshot(torch, uuid, baseline_mib, "after_empty_cache"))
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "baseline_mib": baseline_mib, "stages": snaps}


def child_nccl() -> dict:
    """Outside-PyTorch bytes around one NCCL process group (world size and rank from torch.distributed.run's env)."""
    uuid = _own_gpu()
    baseline_mib = used_mib(uuid)
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    buf = torch.ones(16 * MiB, device="cuda")   # 64 MiB fp32
    snaps = [_snapshot(torch, uuid, baseline_mib, "before_group")]
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    snaps.append(_snapshot(torch, uuid, baseline_mib, "group"))
    small = torch.ones(1, device="cuda")
    dist.all_reduce(small)   # a step's small all-reduces (loss, gradient norm): NCCL's low-latency protocols
    snaps.append(_snapshot(torch, uuid, baseline_mib, "all_reduce_small"))
    dist.all_reduce(buf)     # its large ones (gradients): where NCCL may pick another algorithm (NVLS on NVSwitch)
    snaps.append(_snapshot(torch, uuid, baseline_mib, "all_reduce"))
    out = torch.empty_like(buf)
    dist.all_to_all_single(out, buf)
    snaps.append(_snapshot(torch, uuid, baseline_mib, "all_to_all"))
    v = torch.cuda.nccl.version()
    nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "world_size": world, "nccl": nccl, "stages": snaps,
            "communicator_bytes": snaps[-1]["outside_bytes"] - snaps[0]["outside_bytes"]}


def _run_child(kind: str, gpu_uuids: list[str], env: dict | None = None) -> dict:
    """Run this script as a ``kind`` child on ``gpu_uuids`` (two: under torch.distributed.run, one rank per GPU) and
    return its result (two ranks: both, and the larger communicator_bytes)."""
    nproc = len(gpu_uuids)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "child.json"
        script = [str(Path(__file__).resolve()), "--child", kind, "--child-out", str(out)]
        cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *script]
               if nproc > 1 else [sys.executable, *script])
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(gpu_uuids), **(env or {})}
        if nproc == 1:   # torch.distributed.run sets these for its ranks
            env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": env.get("MASTER_PORT", "29533"), "RANK": "0",
                        "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            return {"error": "timed out after 300 s", "command": portable(shlex.join(cmd))}
        results = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("child.json*"))]
        if r.returncode or not results:
            return {"error": f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1:] or ''}",
                    "command": portable(shlex.join(cmd))}
        if nproc == 1:
            return results[0]
        return {"ranks": results, "communicator_bytes": max(x["communicator_bytes"] for x in results),
                "env": {k: v for k, v in (env or {}).items() if k.startswith("NCCL_")}}


# ---------------------------------------------------------------------------------------------- training runs

def trainer_command(recipe: str, scope: str, micro_batch: int, steps: int, alloc: str | None = None) -> list[str]:
    """The proxy training run of one cell (as tools/device/h200_p3.sh's t1cells runs it, shorter). ``alloc`` None:
    PyTorch's default allocator, which also needs the cluster profile's own default (expandable segments, in
    ``cluster.env``) switched off: ``cluster.env.PYTORCH_CUDA_ALLOC_CONF=null`` (the trainer drops None values)."""
    return [sys.executable, "-m", "fp4moe.train", "experiment=proxy_t1_1gpu", "hydra.mode=RUN",
            "hydra/launcher=local", "train.progress_bar=false", "task_name=outside_torch", f"precision={recipe}",
            f"recompute={scope}", f"parallel.micro_batch={micro_batch}", f"parallel.global_batch={micro_batch}",
            f"train.steps={steps}", "train.measure.warmup_steps=2", f"train.measure.steps={steps - 2}",
            "train.eval_interval=null", "train.checkpoint_interval=null",
            *(["cluster.env.PYTORCH_CUDA_ALLOC_CONF=null"] if alloc is None else [])]


def store_metrics(db: Path) -> dict:
    """The last value of each metric and every param of the one run in an MLflow sqlite store."""
    con = sqlite3.connect(str(db))
    try:
        metrics = dict(con.execute("SELECT key, value FROM latest_metrics").fetchall())
        params = dict(con.execute("SELECT key, value FROM params").fetchall())
    finally:
        con.close()
    return {"metrics": metrics, "params": params}


def training_run(uuid: str, recipe: str, scope: str, micro_batch: int, steps: int, alloc: str | None) -> dict:
    """One proxy run under ``PYTORCH_CUDA_ALLOC_CONF=alloc`` (None: unset) with nvidia-smi polled beside it."""
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "mlflow.db"
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": uuid, "MLFLOW_TRACKING_URI": f"sqlite:///{db}"}
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if alloc:
            env["PYTORCH_CUDA_ALLOC_CONF"] = alloc
        base = used_mib(uuid)
        cmd = trainer_command(recipe, scope, micro_batch, steps, alloc)
        peak = {"device": 0, "process": 0}
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        done = threading.Event()

        def poll():   # at least one sample, then every 0.2 s until the run ends
            while True:
                peak["device"] = max(peak["device"], used_mib(uuid) - base)
                peak["process"] = max(peak["process"], process_used_mib(proc.pid) or 0)
                if done.wait(0.2):
                    return

        t = threading.Thread(target=poll, daemon=True)
        t.start()
        try:
            log, _ = proc.communicate(timeout=480)
        except subprocess.TimeoutExpired:
            proc.kill()
            log, _ = proc.communicate()
        done.set()
        t.join()
        run = {"recipe": recipe, "scope": scope, "micro_batch": micro_batch, "alloc_conf": alloc or "unset",
               "returncode": proc.returncode, "command": portable(shlex.join(cmd)),
               "smi_peak_device_bytes": peak["device"] * MiB,
               "smi_peak_process_bytes": peak["process"] * MiB or None}
        if not db.is_file():
            return {**run, "error": log.strip().splitlines()[-1:] or ["no MLflow store written"]}
        got = store_metrics(db)
    m, p = got["metrics"], got["params"]
    alloc_b, reserved_b = m.get("summary/peak_mem_allocated_gb"), m.get("summary/peak_mem_reserved_gb")
    if alloc_b is None or reserved_b is None:
        return {**run, "error": "no peak memory logged (OOM or an early failure)"}
    alloc_b, reserved_b = round(alloc_b * 2**30), round(reserved_b * 2**30)
    smi = run["smi_peak_process_bytes"] or run["smi_peak_device_bytes"]
    tokens = int(p.get("parallel.micro_batch", micro_batch)) * int(p.get("parallel.seq_length", 4096))
    hidden = int(p.get("model.hidden_size", 0))
    return {**run, "peak_allocated_bytes": alloc_b, "peak_reserved_bytes": reserved_b,
            "gap_bytes": reserved_b - alloc_b, "outside_torch_bytes": smi - reserved_b,
            "tokens": tokens, "hidden": hidden}


# ---------------------------------------------------------------------------------------------- the document

def _commit() -> str:
    if os.environ.get("FP4MOE_COMMIT"):
        return os.environ["FP4MOE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def summarize(doc: dict) -> dict:
    """``training_process`` and ``allocator`` from the training runs under expandable segments (module docstring)."""
    runs = [r for r in doc.get("training") or [] if r.get("alloc_conf") == ALLOC_CONFS["expandable_segments"]
            and "gap_bytes" in r]
    if not runs:
        return {"training_process": {"outside_torch_bytes": None}, "allocator": {"gap_bytes": None}}
    top = max(runs, key=lambda r: r["outside_torch_bytes"])
    gap = max(runs, key=lambda r: r["gap_bytes"] / (r["tokens"] * r["hidden"] or 1))
    return {"training_process": {"outside_torch_bytes": top["outside_torch_bytes"],
                                 "run": f"{top['recipe']} {top['scope']} micro-batch {top['micro_batch']}"},
            "allocator": {"gap_bytes": gap["gap_bytes"], "ref_elements": gap["tokens"] * gap["hidden"],
                          "run": f"{gap['recipe']} {gap['scope']} micro-batch {gap['micro_batch']}"}}


def plan(n_gpus: int, cells: list[tuple[str, str]], micro_batches: list[int], steps: int) -> list[str]:
    """What a full measurement runs, in order (printed by --dry-run)."""
    out = ["child context (1 process, GPU 0)", "child nccl world 1 (GPU 0)"]
    if n_gpus >= 2:
        out += ["child nccl world 2 (torch.distributed.run, GPUs 0-1)",
                "child nccl world 2 with " + " ".join(f"{k}={v}" for k, v in LAB_NCCL.items())]
    for name, conf in ALLOC_CONFS.items():
        for recipe, scope in cells:
            for mb in micro_batches:
                out.append(f"PYTORCH_CUDA_ALLOC_CONF={conf or '(unset)'} "
                           + " ".join(trainer_command(recipe, scope, mb, steps, conf)[1:]))
    return out


def measure(args, cells: list[tuple[str, str]], micro_batches: list[int]) -> dict:
    start = time.monotonic()
    doc: dict = {"format": FORMAT, "date": dt.date.today().isoformat(), "commit": _commit(),
                 "command": portable(shlex.join(sys.argv)), "dry_run": bool(args.dry_run)}
    visible = [] if args.dry_run else gpus()
    doc["gpus"] = visible
    doc["gpu"] = visible[0]["name"] if visible else None
    doc["driver"] = visible[0]["driver"] if visible else None
    doc["plan"] = plan(len(visible) if visible else 2, cells, micro_batches, args.steps)
    if args.dry_run:
        doc.update({"context": None, "nccl": {"world1": None, "world2": None, "world2_lab": None}, "training": [],
                    **summarize({})})
        return doc
    uuid = visible[0]["uuid"]
    doc["context"] = _run_child("context", [uuid])
    doc["nccl"] = {"world1": _run_child("nccl", [uuid])}
    if len(visible) >= 2:
        two = [g["uuid"] for g in visible[:2]]
        doc["nccl"]["world2"] = _run_child("nccl", two)
        doc["nccl"]["world2_lab"] = _run_child("nccl", two, LAB_NCCL)
    doc["training"] = []
    for name, conf in ALLOC_CONFS.items():
        for recipe, scope in cells:
            for mb in micro_batches:
                if time.monotonic() - start > args.budget_s:
                    doc["training"].append({"recipe": recipe, "scope": scope, "micro_batch": mb,
                                            "alloc_conf": conf or "unset", "skipped": "over --budget-s"})
                    continue
                doc["training"].append(training_run(uuid, recipe, scope, mb, args.steps, conf))
                print(f"{name} {recipe} {scope} {mb}: {json.dumps(doc['training'][-1])[:300]}", flush=True)
    doc.update(summarize(doc))
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT"), help=f"folder for {OUT_NAME} (default: $OUT)")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: print the plan, write an unmeasured document")
    ap.add_argument("--cells", default=DEFAULT_CELLS, help="proxy training cells, 'recipe:recompute ...'")
    ap.add_argument("--micro-batches", default="16", help="proxy micro-batches, comma-separated (e.g. 8,16)")
    ap.add_argument("--steps", type=int, default=4, help="steps per proxy run (the first 2 are warm-up)")
    ap.add_argument("--budget-s", type=float, default=520.0, help="skip the training runs left after this time")
    ap.add_argument("--child", choices=("context", "nccl"), help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        result = (child_context if args.child == "context" else child_nccl)()
        rank = os.environ.get("RANK", "0")
        Path(args.child_out + ("" if rank == "0" else f".{rank}")).write_text(json.dumps(result))
        return 0
    if not args.out:
        ap.error("--out DIR (or OUT in the environment): where to write " + OUT_NAME)
    if args.steps < 3:
        ap.error("--steps must be >= 3: 2 warm-up steps, then at least one measured")
    cells = [tuple(c.split(":", 1)) for c in args.cells.split()]
    if any(len(c) != 2 for c in cells):
        ap.error(f"--cells {args.cells!r}: use 'recipe:recompute ...', e.g. {DEFAULT_CELLS!r}")
    micro_batches = [int(x) for x in args.micro_batches.split(",")]
    doc = measure(args, cells, micro_batches)
    out = Path(args.out) / OUT_NAME
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    if args.dry_run:
        print("\n".join(["dry run: no GPU touched; a measurement would run:", *doc["plan"]]))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
