"""The scaled-down experiments this machine can run, as a step of ``make reproduce-table`` (issue 6).

    python -m fp4moe.reproduce.train_runs [--list] [--rerun] [--slurm PROFILE]   # also run by python -m fp4moe.reproduce

What runs where (``plan()``):

* **CPU** (no CUDA GPU): the tiny model (conf/model/tiny_cpu.yaml) on the Shakespeare corpus: the T1 shape (bf16 /
  fp8 / mxfp4 x the paper's three recompute scopes, 6 steps each; throughput on a CPU is not the paper's quantity,
  the cells show that every recipe runs under every scope) and an F5 shape (the three recipes, 40 steps from the
  same seed and data order, evaluation loss at 20 and 40).
* **One or more CUDA GPUs** (Hopper: the FP8/FP4 kernels need sm_90): on GPU 0 the H200 proxy's T1 twin
  (experiment proxy_t1_1gpu, micro-batch 64: 9 cells) and, when the code+docs corpus is there
  (``data/code_docs/code_docs.jsonl``, or ``FP4MOE_CORPUS``; built by tools/corpus_code_docs.py), its F5 twin
  (experiment proxy_f5_1gpu: 3 runs of 380 steps, about 20 minutes).

* **A Slurm cluster** (``--slurm PROFILE``, a conf/cluster/ profile with a launcher of the same name in
  conf/hydra/launcher/, e.g. slurm_h100): the same cells as Slurm jobs, one GPU (or one CPU process) each, the GPU
  plan when the profile has GPUs (``cluster.gpu``), else the CPU plan (slurm_local, the CPU node of
  tools/local_slurm.sh). Every cell is submitted at once (``python -m fp4moe.train -m hydra/launcher=PROFILE
  cluster=PROFILE ...``, which waits for its job); the jobs log into the same MLflow store, so it must be one they
  reach (a server, or a path on a shared file system).

Each cell is ``python -m fp4moe.train hydra.mode=RUN <overrides>`` in its own process (the peak memory of a cell is
its own), tagged ``fp4moe_reproduce_key`` = a hash of its overrides and ``PLAN_VERSION``. A rerun reuses every cell
whose key already has a finished run (or an OOM outcome) measured into the MLflow store (runs loaded from an archive
do not count), so an interrupted ``make reproduce-table`` continues where it stopped (the run it left RUNNING is
marked KILLED, and its cell runs again); ``--rerun`` runs everything again. The GPU is asked for in a child process
(``gpu_probe``): this process never holds GPU memory while the cells run. A progress bar counts the cells; each
cell's output goes to ``logs/reproduce/<key>.log``. A cell that fails (not OOM) is reported with its log and the
step fails; the others still run.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

PLAN_VERSION = "3"  # 2: the cells name their experiment files; the GPU twins measure 16 steps, 10 warm-up;
# 3: the F5 twin runs 380 steps (conf/train/proxy_f5.yaml)
KEY_TAG = "fp4moe_reproduce_key"  # no dot: it travels as the Hydra override +tracking.tags.<KEY_TAG>=...
RECIPES = ("bf16", "fp8", "mxfp4")
T1_SCOPES = ("attn_ln_experts", "attn_ln_mlp", "mla_up_proj")


@dataclass(frozen=True)
class Cell:
    """One trainer run: a label for the progress display and the Hydra overrides of ``python -m fp4moe.train``."""

    label: str
    experiment: str          # the MLflow experiment (= task_name) it logs to
    overrides: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = field(default=())

    @property
    def key(self) -> str:
        text = "\n".join((PLAN_VERSION, self.experiment, *sorted(self.overrides)))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _cpu_plan() -> list[Cell]:
    """The CPU twins of T1 and F5 (conf/experiment/tiny_t1_cpu.yaml, tiny_f5_cpu.yaml), one cell per process."""
    common = ("hydra.mode=RUN", "hydra/launcher=local", "train.progress_bar=false")
    cells = [Cell(f"T1 tiny {r} {s}", "reproduce_tiny_t1",
                  ("experiment=tiny_t1_cpu", *common, "task_name=reproduce_tiny_t1", f"precision={r}",
                   f"recompute={s}"))
             for s in T1_SCOPES for r in RECIPES]
    cells += [Cell(f"F5 tiny {r}", "reproduce_tiny_f5",
                   ("experiment=tiny_f5_cpu", *common, "task_name=reproduce_tiny_f5", f"precision={r}"))
              for r in RECIPES]
    return cells


def _gpu_plan(root: Path) -> tuple[list[Cell], list[str]]:
    notes = []
    gpu0 = (("CUDA_VISIBLE_DEVICES", "0"),)
    common = ("hydra/launcher=local", "train.progress_bar=false")
    cells = [Cell(f"T1 twin {r} {s}", "proxy_t1_1gpu", ("experiment=proxy_t1_1gpu", "hydra.mode=RUN", *common,
                                                          f"precision={r}", f"recompute={s}"), gpu0)
             for s in T1_SCOPES for r in RECIPES]
    corpus = Path(os.environ.get("FP4MOE_CORPUS") or root / "data/code_docs/code_docs.jsonl")
    if corpus.is_file():
        cells += [Cell(f"F5 twin {r}", "proxy_f5_1gpu", ("experiment=proxy_f5_1gpu", "hydra.mode=RUN", *common,
                                                         f"precision={r}", f"data.path={corpus}"), gpu0)
                  for r in RECIPES]
    else:
        notes.append(f"F5 twin skipped: no corpus at {corpus} (build it with `python tools/corpus_code_docs.py "
                     f"--out data/code_docs/code_docs.jsonl`, or set FP4MOE_CORPUS)")
    return cells, notes


# Run in a child: a process that initialises CUDA keeps its context (and whatever its caching allocator holds) on the
# GPU until it exits, which the trainer cells started after it would lose (12.3 GiB on an H200 after the benchmarks).
_PROBE = ("import json, torch\n"
          "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
          "p = torch.cuda.get_device_properties(0) if n else None\n"
          "print(json.dumps({'count': n, 'name': p.name if p else None,\n"
          "                  'capability': [p.major, p.minor] if p else None,\n"
          "                  'memory_gib': round(p.total_memory / 2**30, 1) if p else None}))")


def child_env(**extra: str) -> dict[str, str]:
    """``os.environ`` and ``extra`` with the folders that fp4moe and fp4moe_kernels are imported from put first on
    PYTHONPATH, so that a child ``python -m ...`` runs this same code, installed or from a checkout."""
    import importlib.util

    from fp4moe.paths import package_parent

    folders = [str(package_parent())]
    spec = importlib.util.find_spec("fp4moe_kernels")
    if spec is not None and spec.origin:
        folders.append(str(Path(spec.origin).resolve().parents[1]))
    folders += os.environ.get("PYTHONPATH", "").split(os.pathsep)
    return {**os.environ, **extra, "PYTHONPATH": os.pathsep.join(dict.fromkeys(folders)).strip(os.pathsep)}


@functools.lru_cache(maxsize=1)
def gpu_probe() -> dict[str, Any]:
    """The CUDA GPUs here, asked in a child process so that this one never holds GPU memory: ``count``, and of GPU 0
    ``name``, ``capability`` [major, minor] and ``memory_gib`` (None without a GPU)."""
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300,
                          env=child_env())
    if proc.returncode != 0:
        raise RuntimeError(f"asking torch for the GPUs failed ({sys.executable} -c ...; exit {proc.returncode}): "
                           f"{proc.stderr.strip()[-800:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def plan(root: Path | None = None) -> tuple[list[Cell], list[str]]:
    """(cells, notes) for this machine: the GPU plan with a CUDA GPU of compute capability >= 9.0, else the CPU
    plan; notes say what is left out and why."""
    from fp4moe.paths import repo_root

    root = root or repo_root()
    gpu = gpu_probe()
    if gpu["count"]:
        if tuple(gpu["capability"]) >= (9, 0):
            return _gpu_plan(root)
        return _cpu_plan(), [f"{gpu['name']} is not a Hopper GPU: the FP8/FP4 kernels need sm_90, so this machine "
                             "runs the CPU plan"]
    return _cpu_plan(), []


LOCAL = ("hydra.mode=RUN", "hydra/launcher=local")


def slurm_cells(cells: Sequence[Cell], profile: str) -> list[Cell]:
    """``cells`` as Slurm jobs of the launcher and cluster ``profile``: a one-cell multirun (``-m``) each, one
    process on one node; the profile is part of each cell's overrides, so of its key (a cell measured on a cluster
    is not the one measured on this machine)."""
    out = []
    for c in cells:
        over = tuple(o for o in c.overrides if o not in LOCAL)
        out.append(Cell(c.label, c.experiment, ("-m", *over, f"hydra/launcher={profile}", f"cluster={profile}",
                                                "cluster.nodes=1", "cluster.gpus_per_node=1",
                                                "cluster.tasks_per_node=1")))
    return out


def slurm_plan(profile: str, root: Path | None = None) -> tuple[list[Cell], list[str]]:
    """(cells, notes) for the Slurm cluster ``profile`` (conf/cluster/<profile>.yaml): the GPU plan when the profile
    names a GPU, else the CPU plan, as Slurm jobs (:func:`slurm_cells`)."""
    from omegaconf import OmegaConf

    from fp4moe.config import ConfigError
    from fp4moe.paths import conf_dir, repo_root

    root, conf = root or repo_root(), conf_dir()   # the profiles the trainer composes
    path = conf / "cluster" / f"{profile}.yaml"
    launcher = conf / "hydra" / "launcher" / f"{profile}.yaml"
    if not path.is_file() or not launcher.is_file():
        known = sorted(q.stem for q in (conf / "hydra" / "launcher").glob("slurm*.yaml"))
        raise ConfigError(f"--slurm {profile}: needs conf/cluster/{profile}.yaml and conf/hydra/launcher/"
                          f"{profile}.yaml; Slurm profiles here: {', '.join(known)}")
    cluster = OmegaConf.load(path)
    if str(cluster.get("kind")) != "slurm":
        raise ConfigError(f"--slurm {profile}: conf/cluster/{profile}.yaml is kind {cluster.get('kind')!r}, not slurm")
    if OmegaConf.select(cluster, "gpu", default=None, throw_on_resolution_failure=False) is None:
        cells, notes = _cpu_plan(), []
    else:
        cells, notes = _gpu_plan(root)
    return slurm_cells(cells, profile), notes


def _keyed_runs(client, experiments: set[str]) -> list:
    """The runs of ``experiments`` (names; missing ones skipped) that carry a cell key (``KEY_TAG``)."""
    from fp4moe.tracking.mlflow_store import search_all_runs

    ids = [e.experiment_id for e in map(client.get_experiment_by_name, sorted(experiments)) if e is not None]
    return search_all_runs(client, ids, f"tags.`{KEY_TAG}` != ''") if ids else []


def finished_keys(uri: str, experiments: set[str]) -> set[str]:
    """Keys of cells with a finished run or an OOM outcome in the store, measured into it: a run loaded from an
    archive (``runs_archive`` tag ``fp4moe.archive``, e.g. results/train_proxy/'s reproduce runs) was another
    machine's and does not stand in for this one's."""
    from mlflow import MlflowClient

    from fp4moe.runs.archive import ARCHIVE_FILE

    return {r.data.tags[KEY_TAG] for r in _keyed_runs(MlflowClient(tracking_uri=uri), experiments)
            if (r.info.status == "FINISHED" or r.data.tags.get("outcome") == "OOM") and ARCHIVE_FILE not in r.data.tags}


def mark_interrupted(uri: str, cells: Sequence[Cell], say=print) -> int:
    """Mark KILLED the runs of ``cells`` that the store still shows RUNNING: an earlier reproduce was stopped with its
    cell (a timeout, a lost machine) before the trainer could end its run. Called only for cells about to run again
    here, one at a time, so none of them is running now. Returns how many were marked."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    keys = {c.key: c for c in cells}
    marked = 0
    for r in _keyed_runs(client, {c.experiment for c in cells}):
        if r.info.status == "RUNNING" and r.data.tags.get(KEY_TAG) in keys:
            client.set_tag(r.info.run_id, "fp4moe_interrupted", "left RUNNING by an earlier reproduce; run again")
            client.set_terminated(r.info.run_id, status="KILLED")
            say(f"reproduce: {keys[r.data.tags[KEY_TAG]].label}: an earlier, interrupted run ({r.info.run_id}) "
                "marked KILLED; running it again")
            marked += 1
    return marked


def _start(cell: Cell, uri: str, trainer: Sequence[str], log_dir: Path) -> tuple[Path, Any, subprocess.Popen]:
    """Start ``cell`` (its command first in its log ``log_dir/<key>.log``): (log path, open log file, process)."""
    from fp4moe.paths import repo_root

    path = log_dir / f"{cell.key}.log"
    cmd = [*trainer, *cell.overrides, f"+tracking.tags.{KEY_TAG}={cell.key}"]
    out = open(path, "w")
    out.write(" ".join(cmd) + "\n")
    out.flush()
    env = child_env(**dict(cell.env), MLFLOW_TRACKING_URI=uri)
    return path, out, subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=repo_root())


def _last_line(log: Path, width: int = 240) -> str:
    """The last non-empty line of a cell's log (the trainer's one-line error, or the last line of a traceback), cut to
    ``width`` characters: what a failure line shows of why, beside the log's path."""
    with open(log, "rb") as fh:  # its end only: a trainer's log can be long
        fh.seek(max(0, fh.seek(0, os.SEEK_END) - 16384))
        tail = fh.read().decode(errors="replace")
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    last = lines[-1] if lines else "(the log is empty)"
    return last if len(last) <= width else last[:width - 3] + "..."


def run(cells: Sequence[Cell], uri: str, *, rerun: bool = False, trainer: Sequence[str] | None = None,
        log_dir: Path | None = None, log=print, at_once: bool = False) -> tuple[int, int, list[str]]:
    """Run the cells not yet in the store ``uri``; returns (ran, reused, failures: 'label (log path)'). One after
    the other (a cell fails when its process exits other than 0 or 3, out of GPU memory), or with ``at_once`` all
    started together (Slurm cells: each process waits for its job; a cell fails when the store holds neither its
    finished run nor its OOM outcome afterwards)."""
    from tqdm import tqdm

    from fp4moe.paths import logs_dir

    trainer = list(trainer or [sys.executable, "-m", "fp4moe.train"])
    log_dir = Path(log_dir or logs_dir() / "reproduce")
    log_dir.mkdir(parents=True, exist_ok=True)
    done = set() if rerun else finished_keys(uri, {c.experiment for c in cells})
    todo = [c for c in cells if c.key not in done]
    failures: list[str] = []
    if at_once:
        started = [(c, *_start(c, uri, trainer, log_dir)) for c in todo]
        bar = tqdm(total=len(started), desc="reproduce: jobs", unit="job", dynamic_ncols=True)
        say = bar.write if log is print else log  # printed above the bar, not through it
        for cell, path, out, proc in started:
            rc = proc.wait()
            out.close()
            bar.update(1)
            say(f"reproduce: {cell.label}: launcher exit {rc}")
        bar.close()
        finished = finished_keys(uri, {c.experiment for c in cells})
        failures = [f"{c.label} (not finished in MLflow: {_last_line(path)}; {path})" for c, path, _, _ in started
                    if c.key not in finished]
        return len(todo), len(cells) - len(todo), failures
    bar = tqdm(cells, desc="reproduce: trainer runs", unit="run", dynamic_ncols=True)
    say = bar.write if log is print else log
    if todo:
        mark_interrupted(uri, todo, say)
    for cell in bar:
        bar.set_postfix_str(cell.label)
        if cell.key in done:
            continue
        t0 = time.time()
        path, out, proc = _start(cell, uri, trainer, log_dir)
        rc = proc.wait()
        out.close()
        if rc not in (0, 3):  # 3: out of GPU memory, recorded as an OOM cell
            failures.append(f"{cell.label} (exit {rc}: {_last_line(path)}; {path})")
        say(f"reproduce: {cell.label}: {'OOM' if rc == 3 else 'done' if rc == 0 else 'FAILED'} in {time.time() - t0:.0f} s")
    return len(todo), len(cells) - len(todo), failures


def run_here(uri: str, *, rerun: bool = False, say=print, slurm: str | None = None) -> bool:
    """This machine's plan (``plan()``), or with ``slurm`` the cluster profile's (``slurm_plan``), run into the
    store ``uri``: its notes, the cells, one summary line and one line per failed cell through ``say``; True when
    no cell failed."""
    cells, notes = slurm_plan(slurm) if slurm else plan()
    return run_plan(cells, notes, uri, rerun=rerun, say=say, slurm=slurm)


def run_plan(cells: Sequence[Cell], notes: Sequence[str], uri: str, *, rerun: bool = False, say=print,
             slurm: str | None = None) -> bool:
    """:func:`run_here`'s work for a plan already made."""
    for n in notes:
        say(n)
    say(f"{len(cells)} cells{f' as Slurm jobs ({slurm})' if slurm else ''} "
        "(python -m fp4moe.reproduce.train_runs --list)")
    ran, reused, failures = run(cells, uri, rerun=rerun, at_once=bool(slurm))
    say(f"{ran} ran, {reused} reused from MLflow, {len(failures)} failed")
    for f in failures:
        say(f"FAILED {f}")
    return not failures


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fp4moe.reproduce.train_runs", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="print this machine's cells and whether each is done")
    ap.add_argument("--rerun", action="store_true", help="run every cell again, even those already in MLflow")
    ap.add_argument("--tracking-uri", default=None, help="MLflow store (default: MLFLOW_TRACKING_URI or mlruns/)")
    ap.add_argument("--slurm", default=None, metavar="PROFILE",
                    help="submit the cells as Slurm jobs of this cluster/launcher profile (e.g. slurm_h100) and wait")
    a = ap.parse_args(argv)
    from fp4moe.tracking import mlflow_store

    from fp4moe.config import ConfigError

    uri = a.tracking_uri or mlflow_store.tracking_uri()
    mlflow_store.check_reachable(uri)
    try:
        cells, notes = slurm_plan(a.slurm) if a.slurm else plan()
    except ConfigError as e:
        print(f"fp4moe.reproduce.train_runs: {e}", file=sys.stderr)
        return 2
    if a.list:
        for n in notes:
            print(f"reproduce: {n}")
        done = finished_keys(uri, {c.experiment for c in cells})
        for c in cells:
            print(f"{'done' if c.key in done else 'todo'}  {c.key}  {c.label}")
        return 0
    return 0 if run_plan(cells, notes, uri, rerun=a.rerun, say=lambda s: print(f"reproduce: {s}"),
                         slurm=a.slurm) else 1


if __name__ == "__main__":
    sys.exit(main())
