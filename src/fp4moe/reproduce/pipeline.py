"""``python -m fp4moe.reproduce`` (``make reproduce-table``): run what exists of the reproduction.

Steps, in order:
  1. print the hardware found (CUDA GPU name and capability, or CPU);
  2. kernel self-check: ``python -m fp4moe_kernels.selfcheck`` (kernels against the reference on the
     hardware present), when that module exists;
  3. on a CUDA GPU, the kernel benchmark ``python -m fp4moe_kernels.bench.conversions argv``, which writes
     ``results/kernels/kernels_<gpu>_<date>_<commit>.{json,csv,md}``; the JSON it wrote is then logged to
     MLflow by ``fp4moe.tracking.bench_log`` (the same code as ``make log-bench``), or, where mlflow is not
     installed (the GPU image), the command that logs it elsewhere is printed; on CPU, the
     benchmark files already in results/kernels/ are listed (or their absence said); then the MoE layer
     benchmark (``fp4moe.bench.moe_layer``, EP=1) into results/moe_layer/ the same way. A benchmark of its default
     command that this GPU already ran at this commit is reused, not measured again (``--rerun`` measures again);
  4. the trainer runs measured on GPUs and archived in ``results/train_proxy/*.json`` (``fp4moe.runs.archive``)
     loaded into MLflow (idempotent); then the scaled-down experiments this machine can run
     (``fp4moe.reproduce.train_runs``: the tiny model on CPU, the H200 proxy's T1 and F5 twins on a Hopper GPU), each
     cell once, reusing the cells MLflow already holds (``--no-train`` skips them, ``--rerun`` repeats them);
  5. the report (``fp4moe.report``): every run in the MLflow store, beside the paper's numbers
     (conf/paper/numbers.yaml) and the paper-scale model's prediction for experiment=paper_t1 (its allocated
     peak checked on 1-2 H200s, not at paper scale), written to
     ``results/report/`` (Markdown, CSV, PNG); skipped, and said, where mlflow is not installed;
  6. a list of what is NOT YET IMPLEMENTED, by issue (P1 = issue 2 ... P6 = issue 7), and where the paper-scale
     model and the paper disagree (results, not missing work).

Every step that uses the GPU runs in a child process (the GPU is asked for in one too): a process that has used CUDA
holds GPU memory until it exits, which the trainer cells would lose. ``FP4MOE_COMMIT`` names the commit where the
tree's git cannot (a copy without its history); results are matched against it.

Exit status: 0 when every part that exists passes, 1 when one fails. Parts that do not exist yet are
reported, never counted as passed, and never stand in with made-up numbers.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import shlex
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from fp4moe.tracking import bench_log

RESULTS_KERNELS = "results/kernels"
RESULTS_LAYER = "results/moe_layer"
RESULTS_TRAIN = "results/train_proxy"
RESULTS_REPORT = "results/report"

# What is open, by issue: (label, issue number, what). Keep in step with README.md "Issues" (one line per open issue)
# and docs/results.md "By issue". P1 (issue 2: foundation, formats, reference, kernels, benchmark), P2 (issue 3: the
# recipe, the MoE layer), P3 (issue 4: model, trainer, H200 runs), P4 (issue 5: configs, Slurm launch), P5 (issue 6:
# this command, the report, the paper-scale model, the notebooks), P9 (issue 29), P10 (issue 30) and P11 (issue 31) are
# done; P1's measured table is reported by the benchmark step, not here.
NOT_YET_IMPLEMENTED = (
    ("P6", 7, "eight-GPU runs on one host (EP8 MoE layer, EP8 proxy model, the memory model checked against them); "
              "no 8-GPU machine lent"),
    ("P7", 27, "NCCL's per-peer buffers, measured on two GPUs; the paper-scale memory model's accuracy (part C: "
               "7 of 9 T1 fit / OOM outcomes, 1 of 5 cells within 3 points)"),
    ("P8", 28, "the grouped FP8 weight-gradient GEMM at the dense rate; the MoE layer's fp8 at >= 1.3x bf16; the "
               "proxy's fp8 and mxfp4 at >= 1.2x bf16 on fp4moe's own BF16 experts (1.03x / 1.07x on an H100, at most "
               "1.19x / 1.24x by its profiles; met only against megatron-core's); the conversion kernels' bandwidth "
               "targets"),
)
# Where the paper-scale model and the paper disagree: results, not missing work (P5, issue 6).
KNOWN_DISAGREEMENTS = (
    "the paper-scale model, for T1 as experiment=paper_t1 runs it (the lab's setup, modelled as the lab's code "
    "keeps its tensors), does not give every one of the paper's fit / OOM outcomes and puts most of the cells the "
    "paper fits more than 3 points from it; the lab's own measurements of the same setup sit above the model "
    "(results/scale/paper_t1.md: the table, why, what would have to be true for each cell it misses, and how each "
    "assumption moves each cell). Its allocated peak (of fp4moe's code) is within 5 % of every H200 run, one GPU and "
    "two over NCCL, and P2's layer's within 0.1 % (results/scale/calibration.md)",
    "the 236B ablation's summarised numbers match no reading of the model (results/scale/paper_t2.md): as "
    "summarised, T2 is consistent with the paper's own T1 only at a recompute scope that keeps the routed experts' "
    "activations, not at the config's",
)


def _find(label: str, module: str) -> bool | None:
    """Whether ``module`` exists: True; False when it or its package is missing (said, not a failure);
    None when its package fails to import (a bug or a missing dependency: a failure, traceback printed)."""
    try:
        if importlib.util.find_spec(module) is not None:
            return True
        missing = True
    except ModuleNotFoundError as exc:
        missing = bool(exc.name) and (module == exc.name or module.startswith(exc.name + "."))
        if not missing:
            traceback.print_exc()
    except Exception:
        missing = False
        traceback.print_exc()
    if missing:
        print(f"{label}: not available yet ({module} is missing)")
        return False
    print(f"{label}: FAILED, {module.rsplit('.', 1)[0]} does not import (traceback above)")
    return None


def _passed(result: object) -> bool:
    """Read a ``main()`` outcome: None, 0 or True pass; a non-zero code or False fails."""
    return result is None or result is True or result == 0


def _call(fn: Callable[[], object]) -> tuple[bool, object]:
    """Call ``fn``; a raised exception (traceback printed) or a non-zero exit is a failure."""
    try:
        result = fn()
    except SystemExit as exc:
        result = exc.code
    except Exception:  # report and carry on, so the summary lists every part
        traceback.print_exc()
        return False, None
    return _passed(result), result


def _run_module(module: str, argv: Sequence[str]) -> bool:
    """``python -m module argv`` in a child process (its output inline); True when it exits 0. Every GPU step runs
    so: the CUDA context and the caching allocator of a process hold GPU memory until it exits (12.3 GiB after the
    benchmarks on an H200), which the trainer cells started afterwards would lose."""
    import subprocess

    from fp4moe.reproduce.train_runs import child_env
    from fp4moe.paths import repo_root

    sys.stdout.flush()
    sys.stderr.flush()
    return subprocess.run([sys.executable, "-m", module, *argv], env=child_env(), cwd=repo_root()).returncode == 0


def print_hardware() -> str | None:
    """Print the accelerator found (asked in a child process: ``reproduce_runs.gpu_probe``); return the name of
    CUDA GPU 0, or None without one."""
    import platform

    import torch

    from fp4moe.reproduce.train_runs import gpu_probe

    print(f"torch {torch.__version__}, Python {platform.python_version()}")
    gpu = gpu_probe()
    if gpu["count"]:
        major, minor = gpu["capability"]
        print(f"hardware: CUDA GPU {gpu['name']} (sm_{major}{minor}, {gpu['memory_gib']} GiB), {gpu['count']} visible")
        return gpu["name"]
    print(f"hardware: CPU only ({platform.machine()}, {torch.get_num_threads()} threads); "
          f"no CUDA GPU")
    return None


def run_selfcheck() -> bool:
    """Run ``python -m fp4moe_kernels.selfcheck`` if it exists; return False only on a failure."""
    found = _find("kernel self-check", "fp4moe_kernels.selfcheck")
    if not found:
        return found is False  # missing: reported, nothing failed; None: it failed to import
    print("kernel self-check: running python -m fp4moe_kernels.selfcheck")
    ok = _run_module("fp4moe_kernels.selfcheck", [])
    print(f"kernel self-check: {'passed' if ok else 'FAILED'}")
    return ok


def _same_commit(recorded: str, head: str) -> bool:
    """Whether a commit recorded in a result file and ``head`` (each full or abbreviated, >= 7 hex digits) agree."""
    return min(len(recorded), len(head)) >= 7 and (head.startswith(recorded) or recorded.startswith(head))


def _default_args(args: Sequence[str]) -> bool:
    """Whether a benchmark's arguments are its defaults: no option other than ``--out`` and ``--commit``, which say
    where it writes and what it records, not what it measures."""
    rest = list(args)
    while rest[:1] and rest[0].split("=", 1)[0] in ("--out", "--commit"):
        rest = rest[1:] if "=" in rest[0] else rest[2:]
    return not rest


def _default_command(command: str, module: str) -> bool:
    """Whether ``command`` (as a benchmark records it) ran ``module`` with its default arguments."""
    words = shlex.split(command)
    return module in words and _default_args(words[words.index(module) + 1:])


def reusable_result(out_dir: Path, pattern: str, module: str, head: str | None, shape: dict | None = None,
                    **env_match: object) -> Path | None:
    """The newest ``out_dir/pattern`` JSON file whose ``env`` records ``head`` as its commit, ``module``'s default
    command and each ``env_match`` item (e.g. gpu, world_size), and whose ``shape`` holds each ``shape`` item (the
    layer benchmark's default shape): a result this machine would measure again at this commit. None without a
    commit, or when there is none; unreadable files are passed over."""
    if head is None or not out_dir.is_dir():
        return None
    for path in sorted(out_dir.glob(pattern), key=lambda q: q.stat().st_mtime, reverse=True):
        try:
            doc = json.loads(path.read_text())
            env = doc["env"]
            if (_same_commit(str(env["commit"]), head) and _default_command(str(env["command"]), module)
                    and all(env.get(k) == v for k, v in env_match.items())
                    and all(doc.get("shape", {}).get(k) == v for k, v in (shape or {}).items())):
                return path
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return None


def run_bench(bench_argv: Sequence[str], track: bool, rerun: bool = False, gpu: str | None = None,
              module: str = "fp4moe_kernels.bench.conversions") -> bool:
    """Run ``python -m fp4moe_kernels.bench.conversions argv`` (``module``) on the GPU, then log the JSON files it wrote under
    ``--out`` (default ``<repo>/results/kernels``) to MLflow; return False only on a failure. With no argument but
    ``--out`` and without ``rerun``, a result of this GPU (``gpu``, torch's device name) at this commit already there
    is logged instead of measuring again."""
    found = _find("kernel benchmark", module)
    if not found:
        return found is False  # missing: reported, nothing failed; None: it failed to import
    argv = list(bench_argv)
    out = next((a.split("=", 1)[1] for a in argv if a.startswith("--out=")), None)
    if "--out" in argv[:-1]:
        out = argv[argv.index("--out") + 1]
    if out is None:
        from fp4moe.paths import repo_root

        out = str(repo_root() / RESULTS_KERNELS)
        argv += ["--out", out]
    out_dir = Path(out)
    reused = None
    if not rerun and gpu and _default_args(argv):
        from fp4moe.tracking.mlflow_store import code_commit

        reused = reusable_result(out_dir, bench_log.GLOB, module, code_commit(), gpu=gpu)
    if reused is not None:
        print(f"kernel benchmark: reused {reused}, measured on this GPU at this commit (--rerun measures again)")
        written = [reused]
    else:
        started = time.time()
        print(f"kernel benchmark: running python -m {module} {shlex.join(argv)}")
        if not _run_module(module, argv):
            print("kernel benchmark: FAILED")
            return False
        written = sorted(p for p in out_dir.glob(bench_log.GLOB)
                         if p.stat().st_mtime >= started - 1)
    if not written:
        print(f"kernel benchmark: FAILED, it wrote no JSON results under {out_dir}")
        return False
    if not track:
        print(f"kernel benchmark: wrote {[str(p) for p in written]} (MLflow logging off)")
        return True
    if importlib.util.find_spec("mlflow") is None:
        print(f"kernel benchmark: wrote {[str(p) for p in written]}; NOT logged to MLflow: mlflow "
              f"is not installed here. Copy {out_dir}/ to a machine with the venv and run "
              f"`make log-bench` there, or: {bench_log.command_for(written)}")
        return True
    return _log_to_mlflow(written, "measured, but logging to MLflow FAILED")


def _log_to_mlflow(files: Sequence[Path], failure: str) -> bool:
    """bench_log.log_files, reporting each line; False (traceback printed) on any failure."""
    try:
        return bench_log.log_files(files, log=lambda line: print(f"kernel benchmark: {line}"))
    except Exception:
        traceback.print_exc()
        print(f"kernel benchmark: {failure} (traceback above)")
        return False


def report_results_on_disk(track: bool) -> bool:
    """Without a GPU: list the benchmark results already in the repo (measured on a GPU, each file
    naming its GPU, date and commit) and log them to MLflow (idempotent), or say there are none yet."""
    from fp4moe.paths import repo_root

    found = sorted((repo_root() / RESULTS_KERNELS).glob(bench_log.GLOB))
    if not found:
        print(f"kernel benchmark: skipped, it needs a Hopper GPU (sm_90); no measured results in "
              f"{RESULTS_KERNELS}/ yet (P1, issue 2)")
        return True
    names = ", ".join(p.name for p in found)
    print(f"kernel benchmark: skipped, it needs a Hopper GPU (sm_90); results measured on a GPU are in "
          f"{RESULTS_KERNELS}/: {names} (summary: {RESULTS_KERNELS}/README.md)")
    if not track:
        return True
    return _log_to_mlflow(found, "logging the measured results to MLflow FAILED")


def run_layer_bench(gpu: str | None, track: bool, rerun: bool = False, module: str = "fp4moe.bench.moe_layer") -> bool:
    """The MoE layer benchmark (P2): with a GPU (``gpu``, torch's device name), ``python -m fp4moe.bench.moe_layer``
    (``module``; EP=1, DeepSeek-V3 shape) into results/moe_layer/, unless (without ``rerun``) this GPU's result of that
    command at this commit is there; then log every results/moe_layer/*.json to MLflow (idempotent). Without a GPU
    only the second part (files measured on an H200 are in the repo)."""
    from fp4moe.tracking import layer_bench_log
    from fp4moe.bench.moe_layer import gpu_slug
    from fp4moe.paths import repo_root
    from fp4moe.tracking.mlflow_store import code_commit

    out = repo_root() / RESULTS_LAYER
    reused = None
    if gpu and not rerun:
        reused = reusable_result(out, layer_bench_log.GLOB, module, code_commit(), shape=layer_bench_log.DEFAULT_SHAPE,
                                 gpu=gpu_slug(gpu), world_size=1)
    if reused is not None:
        print(f"MoE layer benchmark: reused {reused}, measured on this GPU at this commit (--rerun measures again)")
    elif gpu:
        print(f"MoE layer benchmark: running python -m {module} (EP=1) into {RESULTS_LAYER}/")
        if not _run_module(module, ["--out", str(out)]):
            print("MoE layer benchmark: FAILED")
            return False
    else:
        print(f"MoE layer benchmark: skipped, it needs a Hopper GPU; results measured on H200s are in "
              f"{RESULTS_LAYER}/ (summary: {RESULTS_LAYER}/README.md)")
    if not track or not out.is_dir():
        return True
    try:
        return layer_bench_log.log_files([out], log=lambda line: print(f"MoE layer benchmark: {line}"))
    except Exception:
        traceback.print_exc()
        print("MoE layer benchmark: logging to MLflow FAILED (traceback above)")
        return False


def load_trainer_archives(track: bool) -> bool:
    """Trainer runs measured on GPUs (the H200 proxy's T1 twin, its memory probe, the F5 twin) are archived in
    results/train_proxy/*.json (``fp4moe.runs.archive``); load them into the MLflow store (idempotent) so that the
    report shows them, labelled with their hardware and setup."""
    from fp4moe.runs import archive
    from fp4moe.paths import repo_root

    folder = repo_root() / RESULTS_TRAIN
    if not track:
        print(f"trainer runs: not loaded (--no-tracking); archives in {RESULTS_TRAIN}/")
        return True
    if importlib.util.find_spec("mlflow") is None:
        print(f"trainer runs: skipped, mlflow is not installed for {sys.executable}")
        return True
    try:
        files = archive.expand([folder]) if folder.is_dir() else []
        if not files:
            print(f"trainer runs: no archives in {RESULTS_TRAIN}/")
            return True
        added, skipped = archive.import_files(files, log=lambda line: print(f"trainer runs: {line}"))
        print(f"trainer runs: {added} loaded into MLflow, {skipped} already there")
        return True
    except archive.ArchiveError as exc:  # a file that is not an archive, two archives sharing a run: the message says
        print(f"trainer runs: loading into MLflow FAILED: {exc}")
        return False
    except Exception:
        traceback.print_exc()
        print("trainer runs: loading into MLflow FAILED (traceback above)")
        return False


def run_trainer_cells(rerun: bool, slurm: str | None = None) -> bool:
    """The scaled-down experiments this machine can run (``fp4moe.reproduce.train_runs``: the tiny model on CPU, the
    H200 proxy's T1 and F5 twins on a Hopper GPU), or with ``slurm`` those of that cluster profile as Slurm jobs, each
    cell once: those already in MLflow are reused."""
    if importlib.util.find_spec("mlflow") is None or importlib.util.find_spec("megatron") is None:
        print(f"trainer runs (this machine): skipped, mlflow and megatron-core are needed for {sys.executable}")
        return True
    from fp4moe.reproduce import train_runs
    from fp4moe.tracking import mlflow_store
    from fp4moe.config import ConfigError

    try:
        where = f"Slurm {slurm}" if slurm else "this machine"
        return train_runs.run_here(mlflow_store.tracking_uri(), rerun=rerun, slurm=slurm,
                                   say=lambda s: print(f"trainer runs ({where}): {s}"))
    except ConfigError as e:
        print(f"trainer runs: {e}")
        return False
    except Exception:
        traceback.print_exc()
        print("trainer runs (this machine): FAILED (traceback above)")
        return False


def run_report() -> bool:
    """Write results/report/ from the MLflow store (``fp4moe.tracking.mlflow_store.tracking_uri()``, the store the
    steps above logged to) with ``fp4moe.report``; without mlflow, say so (not a failure)."""
    if importlib.util.find_spec("mlflow") is None:
        print(f"report: skipped, mlflow is not installed for {sys.executable}; run `make reproduce-table` "
              f"(or `.venv/bin/python -m fp4moe.report`) on a machine with the venv")
        return True
    found = _find("report", "fp4moe.report.__main__")
    if not found:
        return found is False
    print(f"report: writing {RESULTS_REPORT}/ (python -m fp4moe.report)")
    ok, _ = _call(lambda: importlib.import_module("fp4moe.report.__main__").main([]))
    if ok:
        print(f"report: see {RESULTS_REPORT}/report.md")
    else:
        print("report: FAILED")
    return ok


def print_not_yet_implemented() -> None:
    print("\nNOT YET IMPLEMENTED (no numbers are shown for these, measured or made up):")
    for label, issue, what in NOT_YET_IMPLEMENTED:
        print(f"  - [{label}, issue {issue}] {what}")
    print("KNOWN DISAGREEMENTS with the paper (what the model and the runs say, not missing work):")
    for what in KNOWN_DISAGREEMENTS:
        print(f"  - {what}")
    print("  Paper numbers to compare with: conf/paper/numbers.yaml")


def store_unusable(uses_store: bool = True) -> str | None:
    """Why the MLflow store that the logging steps write and the report reads cannot be used (a server that does not
    answer, a folder that is not writable, a file that is not an MLflow store), in one line with the fix; None when it
    can be, or when no step will use it (``uses_store`` False: --no-tracking and --no-report)."""
    if not uses_store:
        return None
    from fp4moe.tracking import mlflow_store

    uri = mlflow_store.tracking_uri()
    hint = "--tracking-uri (or $MLFLOW_TRACKING_URI) names the store; --no-tracking --no-report run without one."
    try:
        mlflow_store.check_reachable(uri, hint)
    except mlflow_store.TrackingUnavailable as e:
        return str(e)
    return None


def slurm_unusable(profile: str) -> str | None:
    """Why the trainer cells cannot go to Slurm as ``profile`` (no such cluster / launcher profile, or no ``sbatch`` /
    ``srun`` on this machine to submit with), in one line with the fix; None when they can."""
    import shutil

    from fp4moe.config import ConfigError
    from fp4moe.reproduce import train_runs

    try:
        train_runs.slurm_plan(profile)
    except ConfigError as e:
        return f"{e} (make reproduce-table SLURM=<profile>)"
    if shutil.which("sbatch") is None or shutil.which("srun") is None:
        return (f"--slurm {profile}: Slurm's commands (sbatch, srun) are not on PATH, so no job can be submitted from "
                "this machine; run it on a Slurm login node, or leave out --slurm (SLURM=) to run the cells here")
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fp4moe.reproduce",
        description="Run what exists of the fp4moe reproduction (hardware, kernel self-check, "
                    "kernel and MoE layer benchmarks on a GPU, their measured results logged to MLflow, "
                    "the report in results/report/) and list what is not implemented yet. Exits 0 "
                    "when every existing part passes.",
    )
    parser.add_argument("--bench-args", default="", metavar="ARGS",
                        help="arguments for python -m fp4moe_kernels.bench.conversions, one shell-quoted string "
                             "(default: its own defaults, with --out results/kernels)")
    parser.add_argument("--skip-bench", action="store_true",
                        help="do not run (or log) the kernel and layer benchmarks even on a GPU")
    parser.add_argument("--no-tracking", action="store_true",
                        help="do not log benchmark rows to MLflow")
    parser.add_argument("--no-train", action="store_true",
                        help="do not run the scaled-down trainer experiments of this machine "
                             "(fp4moe.reproduce.train_runs)")
    parser.add_argument("--rerun", action="store_true",
                        help="run the trainer experiments again even where MLflow already has them, and the "
                             "benchmarks even where this GPU's results at this commit are in results/")
    parser.add_argument("--slurm", default=None, metavar="PROFILE",
                        help="run the trainer experiments as Slurm jobs of this cluster/launcher profile (e.g. "
                             "slurm_h100; the MLflow store must be one the jobs reach) and wait for them")
    parser.add_argument("--no-report", action="store_true",
                        help=f"do not write the report ({RESULTS_REPORT}/) at the end")
    parser.add_argument("--tracking-uri", default=None, metavar="URI",
                        help="MLflow store (URI, .db file or folder) that the logging steps write and the "
                             "report reads (default: $MLFLOW_TRACKING_URI, else mlruns/mlflow.db)")
    args = parser.parse_args(argv)
    if args.tracking_uri:
        from fp4moe.tracking.mlflow_store import normalize_uri

        os.environ["MLFLOW_TRACKING_URI"] = normalize_uri(args.tracking_uri)
    unusable = store_unusable(uses_store=not (args.no_tracking and args.no_report))
    if unusable:  # before any part runs: each would fail on the store, after the self-check's minute
        print(f"reproduce: {unusable}", file=sys.stderr)
        return 2
    if args.slurm and not (args.no_train or args.no_tracking):
        unusable = slurm_unusable(args.slurm)
        if unusable:  # before the self-check and the archives' minutes: the Slurm step would fail on it
            print(f"reproduce: {unusable}", file=sys.stderr)
            return 2

    gpu = print_hardware()
    results: dict[str, bool] = {}
    took: dict[str, float] = {}

    def step(name: str, fn: Callable[[], bool]) -> None:
        started = time.monotonic()
        results[name] = fn()
        took[name] = time.monotonic() - started

    track = not args.no_tracking
    step("kernel self-check", run_selfcheck)
    if args.skip_bench:
        print("kernel benchmark: skipped (--skip-bench)")
    elif gpu:
        step("kernel benchmark", lambda: run_bench(shlex.split(args.bench_args), track=track, rerun=args.rerun,
                                                   gpu=gpu))
    else:
        step("logging measured kernel results", lambda: report_results_on_disk(track=track))
    if not args.skip_bench:
        step("MoE layer benchmark", lambda: run_layer_bench(gpu, track=track, rerun=args.rerun))
    step("trainer runs (archives)", lambda: load_trainer_archives(track=track))
    if args.no_train or args.no_tracking:
        print("trainer runs (this machine): skipped (--no-train / --no-tracking)")
    else:
        key = f"trainer runs (Slurm {args.slurm})" if args.slurm else "trainer runs (this machine)"
        step(key, lambda: run_trainer_cells(args.rerun, args.slurm))
    if args.no_report:
        print("report: skipped (--no-report)")
    else:
        step("report", run_report)
    print_not_yet_implemented()

    failed = [name for name, ok in results.items() if not ok]
    verdict = f"FAILED: {', '.join(failed)}" if failed else "all existing parts passed"
    print("\nreproduce: wall time per step: " + ", ".join(f"{k} {v:.0f} s" for k, v in took.items()))
    print(f"reproduce: {verdict}")
    return 1 if failed else 0
