"""P4 on a real Slurm (marker ``slurm``): the trainer ``python -m fp4moe.train`` submitted by Hydra multiruns through
hydra-submitit-launcher (and once through slurm/train.sbatch), no mocks.

Needs a running Slurm with accounting, e.g. ``sudo tools/local_slurm.sh up`` (``.ci/run`` starts one where it can);
without one every test here skips and says so. Every job trains the tiny CPU model on the real Shakespeare data
(``experiment=tiny_cpu cluster=slurm_local hydra/launcher=slurm_local``, with the experiment's own recompute scope,
``attn_ln_experts``). The data is built once, before
anything is submitted (``python -m fp4moe.data prepare``). All jobs log to one MLflow sqlite store, whose schema the
first launcher creates before anything else starts (parallel jobs race in its migrations).

- a 3-cell sweep (bf16/fp8/mxfp4) runs as one Slurm array, every cell logs to the shared store, its result comes back;
- a job of two tasks trains EP2 x DP2, its ranks from Slurm's environment;
- ``make reproduce-table SLURM=slurm_local`` submits its cells as jobs, waits, and reuses them on the next call;
- a cell that raises ends FAILED in ``sacct``, and the launcher exits 1 with the cell's traceback;
- on a cluster of several nodes (``NODES=3 tools/local_slurm.sh up``, CI's: hosts with their own names and
  addresses; these tests skip on one node), a job of one task on each of two nodes trains EP2 x DP2 across the
  hosts, each rank on its own host, with the losses of one process (to 1e-5): through slurm/train.sbatch
  (``--nodes=2 --ntasks-per-node=1``) and as a multirun cell of the Hydra launcher with ``cluster.nodes=2``, into
  the shared MLflow store;
- on the same nodes, one 2-node job (slurm/train.sbatch) is requeued by its time limit, then by ``scontrol
  requeue``, then by Slurm when the host of its rank 0 fails during a checkpoint save (``tools/local_slurm.sh
  node-stop``: NODE_FAIL); with a third node the requeue lands on the other two, rank 0 on another host (each
  attempt's hosts per rank from the run folder's attempts.jsonl); it ends with the losses of the same run
  uninterrupted bit for bit (PreemptedJob; the node comes back at the end, also on a failure);
- a cell that runs past its 2-minute limit gets Slurm's signal, checkpoints, is requeued, and resumes from its
  checkpoint into the same MLflow run: through the Hydra launcher (submitit requeues) and through the plain
  template slurm/train.sbatch (the trainer runs `scontrol requeue`). The signal comes 80-110 s after the start
  (slurmctld checks time limits every 30 s), so both start first, in the background, and the other tests run
  meanwhile.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
APP = [sys.executable, "-m", "fp4moe.train"]
BASE = ["experiment=tiny_cpu", "cluster=slurm_local", "hydra/launcher=slurm_local"]
FAST = ["train.progress_bar=false", "train.eval_interval=null"]
DATA_DIR = os.environ.get("FP4MOE_DATA_DIR") or str(REPO / "data")
# The time-limit cell: 2-minute limit, signal 10 s before it (it comes 80-110 s after the start), 10 s of sleep per
# step on the first attempt so that it cannot finish (12 steps > 120 s), full speed after the requeue: the second
# attempt must finish within ~80 s of starting (start-up, imports, restore, the steps left, MLflow), or it is
# signalled and requeued again (max_num_timeout bounds that). A 1-minute limit left the second attempt ~20 s, which
# a loaded 2-core CI machine overran once (both requeue tests ended TIMEOUT after training had finished).
# Checkpoints: on the signal, and at the end.
STEPS = 12
REQUEUE = [f"train.steps={STEPS}", f"train.checkpoint_interval={STEPS}", "cluster.time_limit_min=2",
           "cluster.signal_delay_s=10", "+train.hooks.slow={factory: faults:sleep_after_step, seconds: 10}"]
LAUNCH_TIMEOUT_S = 360


def _slurm_missing() -> str | None:
    if shutil.which("sbatch") is None:
        return "no Slurm here (sbatch not on PATH); `sudo tools/local_slurm.sh up` starts a local one (.ci/run does)"
    try:  # sinfo retries an absent controller for ~10 s: give up sooner
        p = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=4)
    except subprocess.TimeoutExpired:
        return "Slurm does not answer (sinfo, 4 s); `sudo tools/local_slurm.sh up` starts a local one"
    if p.returncode != 0 or not p.stdout.strip():
        return f"Slurm does not answer (sinfo: {(p.stderr or p.stdout).strip()[:200]}); `sudo tools/local_slurm.sh up`"
    p = subprocess.run(["sacct", "-n", "-X", "-S", "now-1minutes"], capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        return f"Slurm has no accounting (sacct: {p.stderr.strip()[:200]}); tools/local_slurm.sh starts slurmdbd"
    return None


_MISSING = _slurm_missing()
pytestmark = [pytest.mark.slurm, pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")]


def _nodes() -> list[str]:
    """The cluster's compute nodes (sinfo), none without a Slurm."""
    if _MISSING is not None:
        return []
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, timeout=30).stdout
    return sorted(set(out.split()))


NODES = _nodes()
two_nodes = pytest.mark.skipif(
    len(NODES) < 2, reason=f"one Slurm node ({NODES}): `sudo NODES=3 tools/local_slurm.sh up` starts three (.ci/run does)")
# The 2-node job: EP2 x DP2 over 2 tasks, one per node; fp32 parameters, mxfp4 (the dispatch quantizes and crosses the
# hosts). One process with 2 accumulation steps computes the same losses to ~3e-7 (fp32 sums in another order), 2 gloo
# processes on one host (torchrun) bit for bit.
TWO_NODE_COMMON = ["precision=mxfp4", "train.params_dtype=fp32", "train.steps=3", "train.checkpoint_interval=3"]
TWO_NODE_LAYOUT = ["cluster.nodes=2", "parallel.world_size=2", "parallel.data=2", "parallel.expert=2"]
# The preempted 2-node job (PreemptedJob): the same model and layout, a checkpoint every step, 3 s of sleep per step on
# attempts 0-2 (the test acts between two checkpoints) and full speed on attempt 3. Attempt 0 may train ~8 steps
# before its time-limit signal (10-40 s after its start), the others 1-2 each: 16 steps leave attempt 3 some.
PREEMPT_STEPS = 16
PREEMPT_COMMON = ["precision=mxfp4", "train.params_dtype=fp32", f"train.steps={PREEMPT_STEPS}",
                  "train.checkpoint_interval=1"]
# tests/faults.py's hooks (train.hooks), imported in the jobs through PYTHONPATH (tests/conftest.py puts tests/ there;
# sbatch passes the submitting environment on, _env below)
PREEMPT_FAULTS = ["+train.hooks.slow={factory: faults:sleep_after_step, seconds: 3, attempts: 3}"]
PREEMPT_LIMIT_MIN = 6   # the job's time limit after attempt 0's (2 minutes)
LOCAL_SLURM = REPO / "tools" / "local_slurm.sh"


def _node_stop_missing() -> str | None:
    """Why a node cannot be stopped and started here (tools/local_slurm.sh node-stop), or None."""
    if len(NODES) < 2:
        return "fewer than two nodes"
    if os.geteuid() != 0:
        return "not root: tools/local_slurm.sh node-stop needs root"
    p = subprocess.run([str(LOCAL_SLURM), "status"], capture_output=True, text=True)
    if p.returncode != 0 or not all(f"slurmd-{n} running" in p.stdout for n in NODES):
        return f"not the cluster of tools/local_slurm.sh (NODES=3 up), one of whose nodes this test stops: {p.stdout}"
    return None


_NODE_STOP_MISSING = _node_stop_missing() if len(NODES) >= 2 else "one Slurm node"


class Launch:
    """One multirun of APP in its own folder (cwd, logs), logging to the shared store."""

    def __init__(self, root: Path, name: str, overrides: list[str], uri: str):
        self.dir = root / name
        self.dir.mkdir(parents=True)
        self.log = open(self.dir / "launcher.log", "w+")
        self.proc = subprocess.Popen([*APP, "-m", *BASE, *FAST, f"tracking.experiment={name}", *overrides],
                                     cwd=self.dir, env=_env(uri, self.dir),
                                     stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)

    def wait(self, timeout: float = LAUNCH_TIMEOUT_S) -> tuple[int, str]:
        rc = self.proc.wait(timeout=timeout)
        self.log.seek(0)
        return rc, self.log.read()

    def finish(self, timeout: float = LAUNCH_TIMEOUT_S) -> tuple[int, str, str]:
        """Wait, stop whatever is left, and return (exit code, launcher output, the first job's sbatch script)."""
        try:
            rc, out = self.wait(timeout)
        finally:
            self.stop()
        scripts = sorted(self.dir.glob("logs/*/multiruns/*/.submitit/*/*_submission.sh"))
        return rc, out, scripts[0].read_text() if scripts else ""

    def submitit_dirs(self) -> list[Path]:
        """One folder per job (array task), named by its id: the ones holding a pickled job."""
        return sorted({p.parent for p in self.dir.glob("logs/*/multiruns/*/.submitit/*/*_submitted.pkl")})

    def job_ids(self) -> list[str]:
        return [d.name for d in self.submitit_dirs()]

    def results(self) -> list[tuple[str, object]]:
        """Each job's (outcome, JobReturn or traceback), as submitit handed it to the launcher."""
        return [pickle.loads(p.read_bytes()) for d in self.submitit_dirs() for p in sorted(d.glob("*_result.pkl"))]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
            ids = self.job_ids()
            if ids:  # its jobs would outlive it
                subprocess.run(["scancel", *{i.split("_")[0] for i in ids}], check=False)
        self.log.close()


def _env(uri: str, root: Path) -> dict[str, str]:
    env = dict(os.environ, MLFLOW_TRACKING_URI=uri, MLFLOW_DISABLE_TELEMETRY="true", FP4MOE_ROOT=str(root),
               FP4MOE_DATA_DIR=DATA_DIR, OMP_NUM_THREADS="1")
    env.pop("FP4MOE_CKPT_DIR", None)  # checkpoints in each Hydra job folder
    return env


def _sacct(job_id: str, duplicates: bool = False) -> list[str]:
    """States of ``job_id``'s allocation, oldest first (with ``duplicates``: one per attempt of a requeued job)."""
    cmd = ["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", job_id] + (["-D"] if duplicates else [])
    # slurmctld hands a finished job to slurmdbd a moment later: on a loaded 2-core CI machine more than 10 s
    # (a CI run saw RUNNING after the job's tasks had exited), so wait up to a minute for a final state
    deadline = time.monotonic() + 60
    while True:
        rows = [ln.split("|") for ln in subprocess.run(cmd, capture_output=True, text=True, check=True)
                .stdout.splitlines() if ln.strip()]
        states = [state.split()[0] for jid, state in rows if jid == job_id]
        if (states and states[-1] not in ("RUNNING", "PENDING", "COMPLETING")) or time.monotonic() > deadline:
            return states
        time.sleep(0.5)


def _attempts(job_id: str) -> list[tuple[str, str]]:
    """(state, node list) of each attempt of ``job_id`` so far, oldest first (sacct -D, one query)."""
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-D", "-o", "JobID,State,NodeList", "-j", job_id],
                         capture_output=True, text=True, check=True).stdout
    return [(state.split()[0], nodes) for jid, state, nodes in (ln.split("|") for ln in out.splitlines() if ln.strip())
            if jid == job_id]


def _hostnames(nodelist: str) -> list[str]:
    """The hosts of a Slurm node list (``node[1-2]``), in Slurm's order: task k of a job of one task per node on the
    k-th (rank 0 on the first, the template's rendezvous host)."""
    return subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                          check=True).stdout.split()


def _forensics(job_id: str, folder: Path) -> str:
    """What the job's logs, Slurm and the kernel said about ``job_id``, for a failure message (pytest shows a string
    message whole, where it cuts a tuple's repr to one line): each of the job's logs/slurm files under ``folder``
    (its last 6000 characters, and 6000 from each ``Fatal Python error``: faulthandler's stacks of a rank that
    crashed), slurmctld's and every slurmd's log lines naming the job (log paths from ``scontrol show config``;
    unreadable ones say so; slurmd's say how each task ended, e.g. ``task 0 died by signal: 11``), slurmctld's last
    lines about nodes going down or drained, and the kernel's OOM-killer lines (``dmesg``, where readable). A task
    that ends ``Killed`` with no word of its own is explained only by these: in the one CI failure so far the other
    rank had crashed (SIGSEGV), srun cancelled the step and Slurm killed this one after KillWait, its SIGTERM being
    kept by the trainer's start-up handler (fp4moe.launch.slurm.catch_early)."""
    import re

    parts = [f"--- forensics of job {job_id}"]
    for f in sorted((folder / "logs" / "slurm").glob("*")):
        text = f.read_text(errors="replace")
        # a rank's native crash: faulthandler's stacks (the trainer enables it), which a long log's tail can miss
        for k, at in enumerate(m.start() for m in re.finditer("Fatal Python error", text)):
            parts.append(f"--- {f.name}: fatal error {k + 1}\n{text[at:at + 6000]}")
        parts.append(f"--- {f.name} (last 6000 characters)\n{text[-6000:]}")
    config = {k.strip(): v.strip() for k, _, v in (ln.partition("=") for ln in subprocess.run(
        ["scontrol", "show", "config"], capture_output=True, text=True).stdout.splitlines())}
    logs = [config.get("SlurmctldLogFile", "")] + [config.get("SlurmdLogFile", "").replace("%n", n) for n in NODES]
    names_job = re.compile(rf"(?:JobId=|StepId=|job_id=|\[|[Jj]ob |JOB |STEP ){job_id}(?![0-9])")
    # a node that went down or was drained kills or strands what runs there without naming the job (a task ended
    # by SIGKILL with no word of its own: tools/local_slurm.sh node-stop kills every process of its node)
    names_node_event = re.compile(r"not responding|state set to (?:DOWN|DRAIN)|NODE_FAIL|node_did_resp")
    for i, log in enumerate(filter(None, logs)):
        try:
            text = Path(log).read_text(errors="replace").splitlines()
        except OSError as e:
            parts.append(f"--- {log}: unreadable: {e}")
            continue
        lines = [ln for ln in text if names_job.search(ln)]
        parts.append(f"--- {log}: the lines naming job {job_id}\n" + "\n".join(lines[-80:]))
        if i == 0:   # slurmctld's
            events = [ln for ln in text if names_node_event.search(ln)]
            parts.append(f"--- {log}: its last lines about nodes down or drained\n" + "\n".join(events[-20:]))
    if shutil.which("dmesg"):
        dmesg = subprocess.run(["dmesg"], capture_output=True, text=True)
        oom = [ln for ln in dmesg.stdout.splitlines() if re.search(r"oom|out of memory|killed process", ln, re.I)]
        parts.append("--- dmesg: OOM-killer lines\n" + ("\n".join(oom[-20:]) if dmesg.returncode == 0 else
                                                         f"(not readable: {dmesg.stderr.strip()})"))
    return "\n".join(parts)


def _runs(uri: str, experiment: str):
    import mlflow

    mlflow.set_tracking_uri(uri)
    return mlflow.search_runs(experiment_names=[experiment])


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The shared MLflow store; first the tokenized data, built once here so that the jobs only read it."""
    p = subprocess.run([sys.executable, "-m", "fp4moe.data", "prepare", "model=tiny_cpu", "data=shakespeare"],
                       env=dict(os.environ, FP4MOE_DATA_DIR=DATA_DIR), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    root = tmp_path_factory.mktemp("slurm")
    return root, f"sqlite:///{root / 'mlflow.db'}"


@pytest.fixture(scope="module")
def time_limit_run(store):
    """The time-limit multirun (REQUEUE), started in the background by the first test that asks for it."""
    root, uri = store
    launch = Launch(root, "slurm_requeue", ["precision=mxfp4", *REQUEUE], uri)
    try:
        # The first launcher creates the store's schema (SlurmCallback.on_multirun_start) before it submits; the
        # other launchers start after that, so no two processes create it at once.
        for _ in range(600):
            if launch.submitit_dirs() or launch.proc.poll() is not None:
                break
            time.sleep(0.2)
        assert launch.submitit_dirs(), launch.wait(timeout=5)[1][-4000:]
        assert (root / "mlflow.db").is_file()
        yield launch
    finally:
        launch.stop()


@pytest.fixture(scope="module")
def sbatch_run(store, time_limit_run):
    """The same time-limit cell through slurm/train.sbatch (no Hydra launcher, no submitit): the trainer requeues
    its job with `scontrol requeue`. Submitted once the store's schema exists; returns (job id, its folder)."""
    root, uri = store
    folder = root / "slurm_sbatch"
    folder.mkdir()   # no logs/slurm/: slurm/submit.sh creates it
    env = dict(_env(uri, folder), PYTHON=sys.executable)
    job_id = subprocess.run(
        [str(REPO / "slurm" / "submit.sh"), "--parsable", "--job-name=sbatch", "--nodes=1", "--ntasks-per-node=1",
         "--gpus-per-node=0", "--cpus-per-task=1", "--mem=1G", "--time=2", "--signal=USR2@10",
         str(REPO / "slurm" / "train.sbatch"),
         *BASE[:2], *FAST, "precision=fp8", "tracking.experiment=slurm_sbatch", *REQUEUE],
        cwd=folder, env=env, capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
    yield job_id, folder
    subprocess.run(["scancel", job_id], check=False)


def _submit_two_nodes(uri: str, folder: Path, sbatch: list[str], overrides: list[str]) -> str:
    """Submit slurm/train.sbatch through slurm/submit.sh (a user's command line) as a 2-node job of one CPU task per
    node from a new ``folder``, with ``sbatch`` options and the trainer's ``overrides``; returns the job id."""
    folder.mkdir()
    env = dict(_env(uri, folder), PYTHON=sys.executable)
    return subprocess.run(
        [str(REPO / "slurm" / "submit.sh"), "--parsable", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=0",
         "--cpus-per-task=1", "--mem=2G", *sbatch, str(REPO / "slurm" / "train.sbatch"), *BASE[:2], *FAST,
         *overrides],
        cwd=folder, env=env, capture_output=True, text=True, check=True).stdout.strip().split(";")[0]


@pytest.fixture(scope="module")
def two_node_run(store, time_limit_run):
    """The 2-node job through slurm/train.sbatch (a user's command line), submitted once the store's schema exists;
    returns (job id, its folder), or None on a one-node cluster."""
    if len(NODES) < 2:
        yield None
        return
    root, uri = store
    folder = root / "slurm_2nodes"
    job_id = _submit_two_nodes(uri, folder, ["--job-name=two_nodes", "--time=5"],
                               ["tracking.experiment=slurm_2nodes", *TWO_NODE_COMMON, *TWO_NODE_LAYOUT])
    yield job_id, folder
    subprocess.run(["scancel", job_id], check=False)


@pytest.fixture(scope="module")
def two_node_launch(store, time_limit_run):
    """The same 2-node job as a Hydra multirun cell (the submitit launcher, `nodes: ${cluster.nodes}`), started in the
    background; None on a one-node cluster."""
    if len(NODES) < 2:
        yield None
        return
    root, uri = store
    launch = Launch(root, "slurm_2nodes_hydra", [*TWO_NODE_COMMON, *TWO_NODE_LAYOUT, "cluster.mem_gb=2"], uri)
    try:
        yield launch
    finally:
        launch.stop()


def _scontrol_job(job_id: str) -> dict[str, str]:
    """``scontrol show job -o``: the job's fields (JobState, Restarts, TimeLimit, NodeList, ...)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=True).stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def _squeue(*args: str) -> list[str]:
    """The ids of the jobs ``squeue <args>`` lists (by default the pending, running and completing ones)."""
    return subprocess.run(["squeue", "-h", "-o", "%A", *args], capture_output=True, text=True,
                          check=True).stdout.split()


def _newest_step(root: Path | None) -> int:
    """The newest step folder under ``root`` that holds a meta.json (0: none)."""
    steps = [int(p.parent.name.split("_")[1]) for p in root.glob("step_*/meta.json")] if root else []
    return max(steps, default=0)


class PreemptedJob:
    """The preempted 2-node job, driven from a background thread while the other tests run: slurm/train.sbatch on
    2 nodes x 1 task (PREEMPT_COMMON, DP2 x EP2), stopped three ways, one per attempt:

    - attempt 0: its time limit, 2 minutes (USR2 80 s before it, which Slurm sends 10-40 s after the start, mostly
      during the set-up, where ``fp4moe.launch.slurm.catch_early`` keeps it: the trainer checkpoints after a step and runs
      ``scontrol requeue`` itself, well before the limit); the limit is raised to PREEMPT_LIMIT_MIN while the job
      waits to start again;
    - attempt 1: ``scontrol requeue`` from here after its first checkpoint (Slurm sends SIGTERM: the trainer finishes
      the step, checkpoints, exits; Slurm requeues the job);
    - attempt 2: the host of its rank 0 (the first of its nodes, node1: where the batch script runs too) fails once
      a save after the attempt's first checkpoint has begun (``tools/local_slurm.sh node-stop``: off the network,
      then every process on it killed), at a moment when no other test's job runs there (the node is drained once
      attempt 2 runs, so no new job starts there; until the jobs already there have ended the job is suspended;
      one-node jobs fill node2 first, so node1 mostly runs multi-node jobs only; on a cluster of two, the other
      node of the job will do too; the drain is cleared before the node comes back). slurmctld finds the node not
      responding (SlurmdTimeout), ends the attempt NODE_FAIL and requeues the job (``--requeue``). Once the ranks on
      the other node are gone too (the ``.attempt.lock`` free, the job no longer completing), the checkpoint folder
      is read (``scan``); then, on a cluster of three nodes or more, the node stays down until attempt 3 runs (on
      the other nodes, rank 0 on another host: ``moved``), and comes back (``node-start``); on two nodes it comes
      back at once (attempt 3 needs it);
    - attempt 3 trains the rest at full speed.

    ``resumable``: the newest whole checkpoint's step when each of attempts 0-2 ended, which the next must resume from
    (read when the next one runs, or, after the node failure, once the failed attempt's ranks are gone);
    ``after_failure``: (whole steps, newest first; damaged folders; hidden unfinished folders) just after the node
    failure; ``watched``: the step whose save had begun when ``failed_node`` failed. The first failure of the driver
    is kept in ``error`` (the test raises it); ``close`` brings the node it stopped back, whatever happened."""

    def __init__(self, job_id: str, folder: Path):
        self.id, self.folder = job_id, folder
        self.resumable: list[int] = []
        self.after_failure: tuple[list[int], list[tuple[Path, str]], list[str]] | None = None
        self.watched: int | None = None
        self.failed_node: str | None = None
        self.node_down: str | None = None
        self.drained: list[str] = []
        self.moved = len(NODES) >= 3   # the requeue after the node failure runs on other nodes
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"preempt-{job_id}", daemon=True)
        self.thread.start()

    def root(self) -> Path | None:
        found = list(self.folder.glob("logs/*/runs/*/checkpoints"))
        return found[0] if found else None

    def _wait(self, what: str, cond, timeout: float, poll: float = 0.1):
        deadline = time.time() + timeout
        while not self._stop.is_set():
            got = cond()
            if got:
                return got
            if time.time() > deadline:
                raise AssertionError(f"{what}: not within {timeout} s; job {_scontrol_job(self.id)}")
            time.sleep(poll)
        raise AssertionError(f"{what}: the test ended first")

    def _running(self, attempt: int) -> bool:
        job = _scontrol_job(self.id)
        return job.get("JobState") == "RUNNING" and job.get("Restarts") == str(attempt)

    def _pending(self, restarts: int) -> bool:
        """Requeued ``restarts`` times and waiting to start again (the attempt before is over)."""
        job = _scontrol_job(self.id)
        return job.get("JobState") == "PENDING" and int(job.get("Restarts", "0")) >= restarts

    def _scontrol(self, *args: str) -> None:
        subprocess.run(["scontrol", *args], check=True, capture_output=True, text=True, timeout=60)

    def _node(self, verb: str, node: str) -> None:
        if verb == "node-stop":
            self.node_down = node   # before the stop: close() brings it back even after a stop that failed halfway
        p = subprocess.run([str(LOCAL_SLURM), verb, node], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, (verb, node, p.stdout, p.stderr)
        if verb == "node-start":
            self.node_down = None

    def _drain(self) -> None:
        """No new job from now on on the nodes of the running attempt that may be failed (``drained``): rank 0's host
        (the first of the attempt's nodes); on a cluster of two also the other one (the requeue comes back to both
        anyway). Running jobs go on. Without it a one-node job of another test could start there between the check
        that the node runs only this job and its failure, or in the seconds before slurmctld finds it down, and end
        NODE_FAIL (seen once in CI: the failed-job test's job)."""
        hosts = _hostnames(_scontrol_job(self.id)["NodeList"])
        for n in hosts[:1] if self.moved else hosts:
            self.drained.append(n)
            self._scontrol("update", f"NodeName={n}", "State=DRAIN", "Reason=fp4moe-test-node-stop")

    def _undrain(self) -> None:
        """Clear the drain; a node that is down stays down until its slurmd registers again (ReturnToService=2)."""
        while self.drained:
            self._scontrol("update", f"NodeName={self.drained.pop()}", "State=UNDRAIN")

    def _free_node(self) -> str | None:
        """A drained node of the running attempt (the one to fail) if it runs no other job, else None."""
        return next((n for n in self.drained if _squeue("-w", n) == [self.id]), None)

    def _rank0_gone(self) -> bool:
        """The killed attempt's rank 0 has let go of the run folder's lock (fp4moe.train.attempt)."""
        import fcntl

        fd = os.open(self.root() / ".attempt.lock", os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        finally:
            os.close(fd)   # releases the lock, if taken

    def _run(self) -> None:
        try:
            self._drive()
        except BaseException as e:  # noqa: BLE001
            self.error = e

    def _drive(self) -> None:
        from fp4moe.train import checkpoint as ckpt

        # attempt 0: its time limit
        self._wait("attempt 0's time-limit requeue", lambda: self._pending(1), 300)
        self._scontrol("update", f"JobId={self.id}", f"TimeLimit={PREEMPT_LIMIT_MIN}")
        # attempt 1: scontrol requeue after its first checkpoint
        self._wait("attempt 1", lambda: self._running(1), 120)
        first = _newest_step(self.root())
        self.resumable.append(first)
        self._wait("attempt 1's first checkpoint", lambda: _newest_step(self.root()) > first, 180)
        self._scontrol("requeue", self.id)
        # attempt 2: a node fails during a save
        self._wait("attempt 2", lambda: self._running(2), 120)
        self._drain()
        first = _newest_step(self.root())
        self.resumable.append(first)
        self._wait("attempt 2's first checkpoint", lambda: _newest_step(self.root()) > first, 180)
        root = self.root()
        while True:   # at the start of a save, a node of the job that runs no other test's job fails
            step = _newest_step(root) + 1
            tmp, final = root / f".step_{step:07d}.tmp", root / f"step_{step:07d}"
            self._wait(f"attempt 2's save of step {step}", lambda: tmp.exists() or final.exists(), 60, poll=0.005)
            self.failed_node = self._free_node()
            if self.failed_node:
                break
            # one-node jobs fill node2 first (Weight, tools/local_slurm.sh), but take node1 while node2 is full or
            # still completes a job: the job waits, suspended (it must not run out of steps), until the jobs that were
            # there before the drain have ended
            self._scontrol("suspend", self.id)
            try:
                self._wait("a node of the job without other jobs", self._free_node, 300, poll=1)
            finally:
                self._scontrol("resume", self.id)
        self.watched = step
        self._node("node-stop", self.failed_node)
        self._wait("NODE_FAIL in sacct", lambda: "NODE_FAIL" in [a[0] for a in _attempts(self.id)], 90, poll=0.5)
        self._wait("attempt 2's ranks gone", lambda: self._rank0_gone() and not _squeue("-j", self.id, "-t", "CG"), 60)
        whole, damaged = ckpt.scan(root)
        self.after_failure = ([int(m["step"]) for _, m in whole], damaged, sorted(p.name for p in root.glob(".step_*")))
        self.resumable.append(int(whole[0][1]["step"]) if whole else 0)
        if self.moved:   # the requeue runs on the nodes left (rank 0 on another host), then the node comes back
            self._wait("attempt 3 on the nodes left", lambda: self._running(3), 300, poll=0.5)
        self._undrain()
        self._node("node-start", self.failed_node)

    def close(self) -> None:
        """Stop driving; the job cancelled if it still runs; the node the driver stopped up again (also when the
        test failed before the driver brought it back)."""
        self._stop.set()
        self.thread.join(timeout=30)
        subprocess.run(["scancel", self.id], check=False)
        self._undrain()
        if self.node_down is not None:
            p = subprocess.run([str(LOCAL_SLURM), "node-start", self.node_down], capture_output=True, text=True,
                               timeout=120)
            assert p.returncode == 0, ("node-start", self.node_down, p.stdout, p.stderr)


@pytest.fixture(scope="module")
def preempted_two_node_run(store, time_limit_run):
    """The PreemptedJob, submitted once the store's schema exists; None where no node can be stopped."""
    if _NODE_STOP_MISSING is not None:
        yield None
        return
    root, uri = store
    folder = root / "slurm_2nodes_preempted"
    job_id = _submit_two_nodes(uri, folder, ["--job-name=preempted", "--time=2", "--signal=USR2@80"],
                               ["tracking.experiment=slurm_2nodes_preempted", *PREEMPT_COMMON, *PREEMPT_FAULTS,
                                *TWO_NODE_LAYOUT])
    job = PreemptedJob(job_id, folder)
    try:
        yield job
    finally:
        job.close()


@pytest.fixture(scope="module")
def preempted_reference(store, tmp_path_factory):
    """The preempted job's run uninterrupted, in the same layout (EP2 x DP2: 2 gloo processes under torchrun on
    this host, which compute what the 2-node job computes bit for bit; one process differs by ~3e-7, fp32 sums in
    another order: tests/train/test_cli.py), started in the background; yields a function that waits for it and
    returns its loss per step (None where the preempted job does not run). It saves no checkpoint (the losses do not
    depend on them)."""
    if _NODE_STOP_MISSING is not None:
        yield None
        return
    tmp = tmp_path_factory.mktemp("preempted_reference")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    log = open(tmp / "torchrun.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *APP[1:],
         "hydra.mode=RUN", f"hydra.run.dir={tmp / 'out'}", BASE[0], *FAST, *PREEMPT_COMMON[:-1],
         "train.checkpoint_interval=null", "parallel.world_size=2", "cluster.gpus_per_node=2", "parallel.data=2",
         "parallel.expert=2", "tracking.experiment=reference"],
        cwd=tmp, env=_env(uri, tmp), stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def losses() -> dict[int, float]:
        import mlflow

        rc = proc.wait(timeout=LAUNCH_TIMEOUT_S)
        log.seek(0)
        assert rc == 0, log.read()[-4000:]
        (run_id,) = _runs(uri, "reference")["run_id"]
        return {m.step: m.value for m in mlflow.MlflowClient(uri).get_metric_history(run_id, "loss")}

    try:
        yield losses
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=30)
        log.close()


def _one_process(tmp_path_factory, overrides: list[str]) -> dict[int, float]:
    """The tiny model trained in this process, one process (2 accumulation steps stand for DP2): its loss per step."""
    from hydra import compose, initialize_config_dir

    from fp4moe.train.loop import train

    tmp = tmp_path_factory.mktemp("one_process")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp / 'one.db'}")
        mp.setenv("FP4MOE_DATA_DIR", DATA_DIR)
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose("train", overrides=[BASE[0], *FAST, *overrides, f"train.checkpoint_dir={tmp}"])
        return train(cfg).losses


@pytest.fixture(scope="module")
def one_process_losses(store, tmp_path_factory) -> dict[int, float]:
    """The 2-node jobs' run in one process."""
    return _one_process(tmp_path_factory, TWO_NODE_COMMON)


def _assert_two_hosts_like_one_process(uri: str, experiment: str, launcher: str, losses: dict[int, float]) -> None:
    """The 2-node job's one MLflow run: finished, a rank on each node, tokens sent to the other host's experts, and
    the losses of one process (to 1e-5)."""
    import mlflow

    (run,) = [r for _, r in _runs(uri, experiment).iterrows()]
    assert run["status"] == "FINISHED" and run["tags.world_size"] == "2" and run["tags.launcher"] == launcher
    # each rank's own host name: the two nodes of the job's SLURM_JOB_NODELIST, one rank on each
    allocated = subprocess.run(["scontrol", "show", "hostnames", run["tags.slurm_nodelist"]], capture_output=True,
                               text=True, check=True).stdout.split()
    assert run["tags.num_hosts"] == "2" and sorted(run["tags.hosts"].split(",")) == sorted(allocated)
    assert run["metrics.a2a/dispatch_forward_sent_remote_bytes"] > 0   # EP2: tokens went to the other host
    got = {m.step: m.value for m in mlflow.MlflowClient(uri).get_metric_history(run["run_id"], "loss")}
    # EP2: an expert's GEMMs see both ranks' tokens at once instead of one micro-batch after the other, so fp32 sums
    # run in another order (3e-7 relative at step 3 here; tests/train/test_cli.py). Bit for bit against the same
    # layout: the preempted job's test below
    assert sorted(got) == [1, 2, 3] and got == pytest.approx(losses, rel=1e-5, abs=0)


def test_sweep_runs_as_slurm_array_into_one_mlflow_store(store, time_limit_run, preempted_two_node_run, sbatch_run,
                                                          two_node_run, two_node_launch, preempted_reference):
    root, uri = store
    launch = Launch(root, "slurm_sweep", ["train.steps=3"], uri)
    rc, out, script = launch.finish()
    assert rc == 0, out[-4000:]
    for line in ("#SBATCH --array=0-2%3", "#SBATCH --mem=1GB", "#SBATCH --requeue", "#SBATCH --partition=debug",
                 "#SBATCH --signal=USR2@30"):
        assert line in script, line
    ids = launch.job_ids()
    assert len(ids) == 3 and len({i.split("_")[0] for i in ids}) == 1  # one array
    results = launch.results()
    assert [outcome for outcome, _ in results] == ["success"] * 3
    values = [ret.return_value for _, ret in results]
    assert len({v["slurm_job_id"] for v in values}) == 3  # array tasks are jobs of their own
    assert all(v["outcome"] == "done" and v["step"] == 3 and v["start_step"] == 0 for v in values)
    assert sorted(v["recipe"] for v in values) == ["bf16", "fp8", "mxfp4"]
    # each cell checkpointed at its end into its own Hydra job folder
    assert len({Path(v["checkpoint"]).parent for v in values}) == 3
    assert all(launch.dir / "logs" in Path(v["checkpoint"]).parents for v in values)
    assert all(_sacct(i) == ["COMPLETED"] for i in ids)
    runs = _runs(uri, "slurm_sweep")
    assert len(runs) == 3 and set(runs["status"]) == {"FINISHED"}
    assert sorted(runs["params.recipe"]) == ["bf16", "fp8", "mxfp4"]
    assert set(runs["params.data.tokenizer_path"].map(lambda p: str(Path(p).parents[1]))) == {f"{DATA_DIR}/shakespeare"}
    assert set(runs["run_id"]) == {v["run_id"] for v in values}
    assert sorted(runs["tags.slurm_array_task_id"]) == ["0", "1", "2"]
    assert set(runs["tags.slurm_array_job_id"]) == {ids[0].split("_")[0]}
    assert runs["metrics.loss"].notna().all()


def _one_job_completed(launch, steps: int) -> str:
    """The launcher's multirun finished (exit 0) with one job: its cell succeeded after ``steps`` steps and sacct
    says COMPLETED. Returns the job's sbatch script."""
    rc, out, script = launch.finish()
    assert rc == 0, out[-4000:]
    (outcome, ret), = launch.results()[:1]
    assert outcome == "success" and ret.return_value["step"] == steps
    (job,) = launch.job_ids()
    assert _sacct(job) == ["COMPLETED"]
    return script


def test_two_tasks_of_one_job_train_as_ep2_x_dp2(store, time_limit_run, sbatch_run):
    """A job of 2 Slurm tasks (the multi-GPU job shape, one task per device): each task takes its rank from Slurm's
    environment (submitit's helpers, no rank arithmetic of ours), they form one gloo group and train EP2 x DP2, the
    mxfp4 dispatch sending rows from one task to the other; one MLflow run (rank 0's)."""
    root, uri = store
    launch = Launch(root, "slurm_tasks2", ["precision=mxfp4", "train.steps=3", "cluster.tasks_per_node=2",
                                           "cluster.gpus_per_node=2", "cluster.cpus_per_task=1", "cluster.mem_gb=3",
                                           "parallel.world_size=2", "parallel.data=2", "parallel.expert=2"], uri)
    script = _one_job_completed(launch, steps=3)
    assert "#SBATCH --ntasks-per-node=2" in script and "#SBATCH --nodes=1" in script
    runs = _runs(uri, "slurm_tasks2")
    assert len(runs) == 1 and set(runs["status"]) == {"FINISHED"}
    assert runs["tags.world_size"].tolist() == ["2"] and runs["tags.launcher"].tolist() == ["slurm"]
    assert (runs["metrics.a2a/dispatch_forward_sent_remote_bytes"] > 0).all()


def test_reproduce_runs_its_cells_as_slurm_jobs_then_reuses_them(store, time_limit_run, sbatch_run, tmp_path,
                                                                   monkeypatch):
    """``make reproduce-table SLURM=slurm_local`` (fp4moe.reproduce.train_runs --slurm): the profile has no GPU, so the CPU
    plan's cells, each submitted at once as a one-cell multirun of the Hydra Slurm launcher; the jobs log into the
    shared store; a second call finds them there and submits nothing."""
    from fp4moe.reproduce import train_runs

    root, uri = store
    cells, notes = train_runs.slurm_plan("slurm_local")
    assert notes == [] and len(cells) == 12 and all(c.overrides[0] == "-m" for c in cells)
    assert all("hydra/launcher=slurm_local" in c.overrides and "cluster=slurm_local" in c.overrides for c in cells)
    short = ("train.steps=2", "train.eval_interval=2")   # two of them, shortened
    picked = [train_runs.Cell(c.label, c.experiment, c.overrides + short) for c in cells
              if c.label in ("T1 tiny mxfp4 attn_ln_mlp", "F5 tiny fp8")]
    for k, v in _env(uri, root).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("FP4MOE_CKPT_DIR", str(tmp_path / "ckpt"))
    ran, reused, failures = train_runs.run(picked, uri, log_dir=tmp_path / "logs", log=lambda s: None,
                                           at_once=True)
    assert (ran, reused, failures) == (2, 0, []), [p.read_text()[-2000:] for p in (tmp_path / "logs").iterdir()]
    for exp in ("reproduce_tiny_t1", "reproduce_tiny_f5"):
        runs = _runs(uri, exp)
        mine = runs[runs[f"tags.{train_runs.KEY_TAG}"].isin([c.key for c in picked])]
        assert len(mine) == 1 and set(mine["status"]) == {"FINISHED"} and mine["tags.slurm_job_id"].notna().all()
    assert train_runs.run(picked, uri, log_dir=tmp_path / "logs", log=lambda s: None, at_once=True) == (0, 2, [])


def test_failed_job_is_failed_in_sacct_and_in_the_launcher(store, time_limit_run, sbatch_run):
    root, uri = store
    launch = Launch(root, "slurm_fail", ["precision=fp8", "train.steps=3",
                                         "+train.hooks.fail={factory: faults:fail_at_step, step: 1}"], uri)
    try:
        rc, out = launch.wait()
    finally:
        launch.stop()
    assert rc == 1, out[-4000:]
    assert "FailedJobError" in out and "RuntimeError: faults.fail_at_step: step=1" in out
    (job_id,) = launch.job_ids()
    assert _sacct(job_id) == ["FAILED"]  # not COMPLETED, which Slurm reports without fp4moe.launch.slurm.SlurmCallback
    (outcome, _), = launch.results()
    assert outcome == "error"
    runs = _runs(uri, "slurm_fail")
    assert list(runs["status"]) == ["FAILED"] and list(runs["tags.slurm_job_id"]) == [job_id]


def test_a_job_slurm_refuses_is_one_line_naming_sbatchs_reason(tmp_path):
    """sbatch refusing the launcher's script (here a partition the cluster does not have) used to end the multirun in
    submitit's traceback; the trainer says sbatch's reason and where the profile sets it, exit 2, no job queued."""
    before = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30).stdout.split()
    r = subprocess.run([*APP, "-m", *BASE, "cluster.partition=fp4moe_no_such_partition", "train.steps=1",
                        f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=REPO, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"})
    assert r.returncode == 2, r.stderr[-3000:]
    last = r.stderr.splitlines()[-1]
    assert last.startswith("fp4moe.train: Slurm refused the job: sbatch: error: "), last
    assert "fp4moe_no_such_partition" in last and "the cluster profile sets it (cluster=<profile>" in last, last
    assert "Traceback" not in r.stderr + r.stdout
    after = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30).stdout.split()
    assert set(after) <= set(before)


@two_nodes
def test_two_nodes_train_ep2_x_dp2_through_the_sbatch_template_like_one_process(store, two_node_run,
                                                                                one_process_losses):
    """`slurm/submit.sh --nodes=2 --ntasks-per-node=1 slurm/train.sbatch ...`: two tasks on two hosts (each rank
    reports its own host name; the rendezvous is the first node of SLURM_JOB_NODELIST), EP2 x DP2 with the mxfp4
    dispatch crossing the hosts, one checkpoint folder holding both ranks' files, one MLflow run: the same losses as
    one process (to 1e-5: EP2 sums in another order)."""
    root, uri = store
    job_id, folder = two_node_run
    state = _wait_done(job_id, timeout_s=LAUNCH_TIMEOUT_S)
    log = "".join(p.read_text() for p in sorted((folder / "logs" / "slurm").glob("*")))
    assert state == "COMPLETED", (state, log[-4000:])
    (_, nodes), = _attempts(job_id)
    assert f"2 nodes, 2 tasks, master {_hostnames(nodes)[0]}:" in log   # the template's rendezvous: the first node
    (ckpt,) = folder.glob("logs/*/runs/*/checkpoints")
    # one sharded checkpoint (dist_checkpointing) written by the ranks on both hosts (__<rank>_<k>.distcp shards)
    meta = json.loads((ckpt / "step_0000003" / "meta.json").read_text())
    assert meta["format"] == "torch_dist" and meta["world_size"] == 2
    assert {n.split("_")[2] for n in meta["files"] if n.endswith(".distcp")} == {"0", "1"}
    assert all((ckpt / "step_0000003" / n).is_file() for n in meta["files"])
    _assert_two_hosts_like_one_process(uri, "slurm_2nodes", "torchrun", one_process_losses)


@two_nodes
def test_two_node_multirun_cell_through_the_hydra_launcher_like_one_process(store, two_node_launch,
                                                                            one_process_losses):
    """The same job as a multirun cell of the submitit launcher (`hydra/launcher=slurm_local cluster.nodes=2`): one
    `#SBATCH --nodes=2` job, ranks from Slurm's environment through submitit, rank 0's result back to the launcher,
    the run in the shared store with the losses of one process."""
    root, uri = store
    script = _one_job_completed(two_node_launch, steps=3)
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=1" in script
    _assert_two_hosts_like_one_process(uri, "slurm_2nodes_hydra", "slurm", one_process_losses)


def test_time_limit_requeues_and_resumes_into_the_same_run(store, time_limit_run):
    root, uri = store
    rc, out = time_limit_run.wait()
    assert rc == 0, out[-4000:]
    (job_id,) = time_limit_run.job_ids()
    states = _sacct(job_id, duplicates=True)
    assert states[-1] == "COMPLETED" and "REQUEUED" in states[:-1], states
    (outcome, ret), = time_limit_run.results()
    value = ret.return_value
    assert outcome == "success" and value["step"] == STEPS
    assert 0 < value["start_step"] < STEPS          # the last attempt started from a checkpoint...
    assert Path(value["checkpoint"]).name == f"step_{STEPS:07d}"
    assert time_limit_run.dir in Path(value["checkpoint"]).parents   # in the cell's Hydra job folder
    runs = _runs(uri, "slurm_requeue")
    assert len(runs) == 1 and runs["run_id"][0] == value["run_id"]   # ...and continued the same MLflow run
    run = runs.iloc[0]
    assert run["status"] == "FINISHED" and int(run["tags.slurm_restart_count"]) >= 1 and run["tags.requeued"] == "true"
    assert int(run["tags.resume.count"]) >= 1
    import mlflow

    history = mlflow.MlflowClient(uri).get_metric_history(value["run_id"], "loss")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))   # every step once: none lost or repeated


def test_plain_sbatch_template_requeues_at_the_time_limit_and_resumes(store, sbatch_run):
    root, uri = store
    job_id, folder = sbatch_run
    deadline = time.time() + LAUNCH_TIMEOUT_S
    while time.time() < deadline:
        states = _sacct(job_id, duplicates=True)
        if states and states[-1] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL"):
            break
        time.sleep(2)
    log = "".join(p.read_text() for p in sorted((folder / "logs" / "slurm").glob("*")))
    assert states[-1] == "COMPLETED" and "REQUEUED" in states[:-1], (states, log[-4000:])
    runs = _runs(uri, "slurm_sbatch")
    assert len(runs) == 1, runs
    run = runs.iloc[0]
    assert run["status"] == "FINISHED" and run["tags.slurm_job_id"] == job_id and int(run["tags.slurm_restart_count"]) >= 1
    import mlflow

    history = mlflow.MlflowClient(uri).get_metric_history(run["run_id"], "loss")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))
    # the run folder is the config's (fp4moe.runs.folder), so every attempt used one checkpoint folder
    (ckpt,) = folder.glob("logs/*/runs/*/checkpoints")
    meta = json.loads((ckpt / f"step_{STEPS:07d}" / "meta.json").read_text())
    assert meta["mlflow_run_id"] == run["run_id"] and meta["step"] == STEPS


@two_nodes
def test_two_node_job_requeued_timed_out_and_node_failed_resumes_on_the_nodes_left_like_an_uninterrupted_run(
        store, preempted_two_node_run, preempted_reference):
    """The PreemptedJob: a 2-node job requeued by its time limit, then by ``scontrol requeue``, then NODE_FAIL when
    the host of its rank 0 fails mid-save (and Slurm's own requeue, ``--requeue``), each attempt resuming from the
    newest whole checkpoint, ends COMPLETED with one MLflow run and the losses of the same run uninterrupted bit for
    bit. The node failure leaves no step folder that is not whole (the unfinished save stays hidden, and is not
    taken).

    Node order: Slurm lays a job's tasks out in node order (the order of slurm.conf's node lines) whatever the
    request (``srun -N2 -w node2,node1``, ``-m cyclic`` and a lower Weight for node2 all put task 0 on node1; only
    ``-m arbitrary`` with a SLURM_HOSTFILE moves it, which the template's first-node rendezvous does not support), so
    rank 0 moves only when the job lands on other nodes. With a third node, the attempt after the node failure runs
    on the two nodes left, rank 0 (the rendezvous) on another host than before: each attempt's host per rank, from
    the run folder's attempts.jsonl (fp4moe.train.attempt), is the attempt's node list in sacct, and the template's
    line names the attempt's first node as the rendezvous. On a cluster of two every attempt runs on both nodes."""
    import re

    import mlflow

    from fp4moe.train import attempt

    if preempted_two_node_run is None:
        pytest.skip(_NODE_STOP_MISSING or "")
    root, uri = store
    job = preempted_two_node_run
    deadline, attempts = time.time() + LAUNCH_TIMEOUT_S, []
    while time.time() < deadline and job.error is None:
        attempts = _attempts(job.id)
        if attempts and attempts[-1][0] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY"):
            break
        time.sleep(1)
    job.thread.join(timeout=60)
    out = "".join(p.read_text() for p in (job.folder / "logs" / "slurm").glob("*.out"))
    err = "".join(p.read_text() for p in (job.folder / "logs" / "slurm").glob("*.err"))
    if job.error is not None:
        raise AssertionError(f"{job.error}\n{_forensics(job.id, job.folder)}") from job.error
    assert [a[0] for a in attempts] == ["REQUEUED", "REQUEUED", "NODE_FAIL", "COMPLETED"], (
        f"attempts {attempts}\n{_forensics(job.id, job.folder)}")
    (ckpt,) = job.folder.glob("logs/*/runs/*/checkpoints")
    # where each attempt ran, rank by rank: the run folder's record (rank 0 appends a line per attempt), the
    # attempt's nodes in sacct, and the template's rendezvous line (the log is appended to: --open-mode=append)
    ranks = [(h["slurm_job_id"], h["slurm_restart_count"], h["rank_hosts"]) for h in attempt.history(ckpt)]
    assert ranks == [(job.id, str(k), _hostnames(nodes)) for k, (_, nodes) in enumerate(attempts)], (ranks, attempts)
    assert re.findall(r"restart (\d): 2 nodes, 2 tasks, master (\w+):", out) == [
        (str(k), hosts[0]) for k, (_, _, hosts) in enumerate(ranks)]
    if job.moved:   # attempt 2's rank 0 lost its host; attempt 3 ran on the nodes left, rank 0 on another host
        assert job.failed_node == ranks[2][2][0] and job.failed_node not in ranks[3][2], (job.failed_node, ranks)
        assert ranks[3][2][0] != ranks[2][2][0], ranks
    else:   # two nodes: every attempt on both
        assert {tuple(h) for _, _, h in ranks} == {tuple(NODES[:2])}, ranks
    assert "got SIGUSR2: checkpoint after this step, then requeue" in err  # attempt 0: its time limit
    assert "DUE TO JOB REQUEUE" in err and "got SIGTERM" in err            # attempt 1: scontrol requeue
    if job.failed_node != ranks[2][2][0]:   # attempt 2: the other node lost (the batch host says so)
        assert "DUE TO NODE FAILURE" in err
    # each attempt resumed from the newest whole checkpoint the one before left
    resumed = [int(m) for m in re.findall(r"resumed from \S+ \(step (\d+),", out)]
    assert resumed == job.resumable and 0 < resumed[0] < resumed[1] < resumed[2] < PREEMPT_STEPS, job.resumable
    whole, damaged, hidden = job.after_failure
    assert damaged == [] and whole[0] == resumed[2], job.after_failure
    if job.watched not in whole:   # the node failed mid-save: the save is a hidden folder, which the rerun did not take
        assert hidden == [f".step_{job.watched:07d}.tmp"], (job.watched, job.after_failure)
    assert not list(ckpt.glob(".step_*")) and _newest_step(ckpt) == PREEMPT_STEPS
    runs = _runs(uri, "slurm_2nodes_preempted")
    assert len(runs) == 1, runs
    run = runs.iloc[0]
    assert run["status"] == "FINISHED" and run["tags.slurm_restart_count"] == "3" and run["tags.resume.count"] == "3"
    assert run["tags.hosts"] == ",".join(ranks[3][2])   # the last attempt's
    history: dict[int, float] = {}
    for m in mlflow.MlflowClient(uri).get_metric_history(run["run_id"], "loss"):
        # a step logged twice (redone after the node failure) had the same value both times
        assert history.setdefault(m.step, m.value) == m.value, (m.step, history[m.step], m.value)
    assert history == preempted_reference()   # bit for bit


def _wait_done(job_id: str, timeout_s: float = 60) -> str:
    """The final state of ``job_id`` in sacct, waiting up to ``timeout_s``."""
    deadline, states = time.time() + timeout_s, []
    while time.time() < deadline:
        states = _sacct(job_id)
        if states and states[-1] not in ("RUNNING", "PENDING", "COMPLETING", "REQUEUED"):
            return states[-1]
        time.sleep(0.5)
    return f"not done after {timeout_s} s: {states}"


def test_submit_helper_creates_the_log_folder_before_slurm_opens_it(tmp_path):
    """slurm/train.sbatch logs to logs/slurm/, which Slurm opens before the script runs (a missing folder fails the
    job at once, 0:53, without a log): slurm/submit.sh, the documented way to submit it, creates the folder first.
    From a fresh folder, the template's own echo lines and the Python command (``TRAIN``) land in the log."""
    assert not (tmp_path / "logs").exists()
    env = dict(os.environ, PYTHON=sys.executable, TRAIN="-c print('trainer-ran')")
    env.pop("FP4MOE_ROOT", None)   # the template's default: the submit directory
    job_id = subprocess.run(
        [str(REPO / "slurm" / "submit.sh"), "--parsable", "--job-name=logdir", "--nodes=1", "--ntasks-per-node=1",
         "--gpus-per-node=0", "--cpus-per-task=1", "--mem=200M", "--time=1", str(REPO / "slurm" / "train.sbatch"),
         "experiment=tiny_cpu"],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
    state = _wait_done(job_id)
    out = tmp_path / "logs" / "slurm" / f"logdir-{job_id}.out"
    assert state == "COMPLETED" and out.is_file(), (state, sorted(p.name for p in tmp_path.rglob("*")))
    text = out.read_text()
    assert f"job {job_id} restart 0" in text and "overrides: experiment=tiny_cpu" in text and "trainer-ran" in text
