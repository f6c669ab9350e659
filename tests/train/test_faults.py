"""Fault injection on the tiny CPU model (issue 30, never lose a run): ``kill -9`` at a seeded random step, the
preemption signal three times in a row, an MLflow store that goes away mid-run, a checkpoint folder that fills up.
Nothing trained is lost beyond the last checkpoint, the losses are the uninterrupted run's bit for bit, the MLflow
run stays one run, and a failure is one line that names the fix. (SIGINT: test_cli.py; SIGTERM and an exception:
test_train.py; damaged checkpoints: test_checkpoint_damage.py; a folder that cannot be written at the start:
test_train.py; hostile launcher strings: tests/test_slurm_helpers.py and fp4moe.launch.shell's tests.)"""
from __future__ import annotations

import json
import logging
import os
import random
import resource
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import byte_data
from fp4moe.config import ConfigError

pytest.importorskip("megatron.core")

HERE = Path(__file__).resolve().parent
CONF = HERE.parents[1] / "conf"
STEPS = 6
# sequences of 64 tokens (2 micro-batches of 2 per step, as train=short_cpu): what is asserted does not depend on them
COMMON = ["train=short_cpu", "train.progress_bar=false", f"train.steps={STEPS}", "train.eval_interval=null",
          "parallel.seq_length=64"]
SEED = 30  # the kill step of test_kill_9 follows from it
# a run slowed down by the tests' after-step hook (tests/faults.py, through train.hooks), so that a test acts mid-run
SLOW = "+train.hooks.slow={{factory: faults:sleep_after_step, seconds: {seconds}}}"


def _overrides(tmp_path: Path, task: str, *more: str) -> list[str]:
    return [*COMMON, f"task_name={task}", f"train.checkpoint_dir={tmp_path / 'ckpt'}", *more]


def _compose(overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def _client(uri):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _history(uri, run_id, key="loss"):
    """step -> value; a step logged twice (redone after a kill) must have had the same value both times."""
    out: dict[int, float] = {}
    for m in _client(uri).get_metric_history(run_id, key):
        assert out.setdefault(m.step, m.value) == m.value, f"step {m.step} logged as {out[m.step]} and {m.value}"
    return out


def _only_run(uri, experiment):
    client = _client(uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]  # every restart continued the same MLflow run
    return runs[0]


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory) -> str:
    """One MLflow store for the tests that leave it intact (each test its own experiment, its task_name)."""
    return f"sqlite:///{tmp_path_factory.mktemp('faults_store') / 'mlflow.db'}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, shared_store) -> dict[int, float]:
    """The uninterrupted run's losses, step -> loss."""
    from fp4moe.train.loop import train

    with pytest.MonkeyPatch.context() as mp:
        byte_data.install(mp)  # the autouse fixture of conftest.py is per test; this runs before it
        mp.setenv("MLFLOW_TRACKING_URI", shared_store)
        r = train(_compose(_overrides(tmp_path_factory.mktemp("reference"), "reference",
                                      "train.checkpoint_interval=null")))
    assert sorted(r.losses) == list(range(1, STEPS + 1))
    return r.losses


@pytest.fixture
def in_store(shared_store, monkeypatch) -> str:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", shared_store)
    return shared_store


def test_kill_9_at_a_random_step_resumes_from_the_newest_whole_checkpoint(tmp_path, in_store, reference):
    """``python -m fp4moe.train`` checkpointing every step gets SIGKILL the moment it starts writing the checkpoint
    of a seeded random step (or, when that save is over before the test sees it, just after). The kill leaves at most
    a hidden unfinished folder, which the rerun does not take: it resumes from the newest whole checkpoint, redoes at
    most the one step since it, reproduces the uninterrupted losses bit for bit and finishes the killed process's
    MLflow run; the unfinished folder is gone after its next save."""
    from fp4moe.train import checkpoint as ckpt
    from fp4moe.train.loop import train

    kill_at = random.Random(SEED).randint(2, STEPS - 1)
    why = f"(seed {SEED}: SIGKILL at the save of step {kill_at})"
    overrides = _overrides(tmp_path, "kill9", "train.checkpoint_interval=1")
    root = tmp_path / "ckpt" / "kill9"
    # common.pt: the first file of a sharded checkpoint (megatron writes it before the shards)
    started, done = root / f".step_{kill_at:07d}.tmp" / "common.pt", root / f"step_{kill_at:07d}"
    proc = subprocess.Popen([sys.executable, str(HERE / "cli.py"), *overrides, f"hydra.run.dir={tmp_path / 'out'}"],
                            cwd=tmp_path, env={**os.environ, "MLFLOW_TRACKING_URI": in_store},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not (started.exists() or done.exists()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.kill()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f"{why} the run ended by itself: {err[-3000:]}"
    mid_save = not done.exists()
    why = f"{why[:-1]}, {'mid-save' if mid_save else 'after it'})"
    whole, damaged = ckpt.scan(root)
    assert whole and not damaged, (why, whole, damaged)
    assert not mid_save or started.parent.is_dir(), why      # the half-written save is there, hidden
    newest = int(whole[0][1]["step"])
    assert newest == kill_at - 1 if mid_save else newest >= kill_at, (why, newest)
    run_id = whole[0][1]["mlflow_run_id"]
    logged = _history(in_store, run_id)
    assert _client(in_store).get_run(run_id).info.status == "RUNNING"  # killed: nobody could end it
    assert logged == {s: reference[s] for s in logged} and newest in logged, why  # the subprocess's losses too

    r = train(_compose(overrides))
    assert r.start_step == newest and r.run_id == run_id, why
    assert max(logged) - newest <= 1, why                    # checkpoint_interval=1: at most one step redone
    assert r.losses == {s: reference[s] for s in range(newest + 1, STEPS + 1)}, why
    run = _only_run(in_store, "kill9")
    assert run.info.status == "FINISHED" and run.data.tags["resume.count"] == "1"
    assert _history(in_store, run_id) == reference, why
    assert not list(root.glob(".step_*")), f"{why} unfinished save folders left: {list(root.glob('.step_*'))}"


@pytest.fixture
def filling_folder(tmp_path):
    """A checkpoint folder whose room can be taken away mid-run. Where this process may mount: a real file system
    of its own (tmpfs, 256 MiB) at ``tmp_path / 'disk'``, which ``fill_up()`` shrinks to 8 MiB more than it holds
    (the next checkpoint's write fails with ENOSPC) and ``make_room()`` grows back. Elsewhere (not root, no
    CAP_SYS_ADMIN) the stand-in: ``fill_up()`` sets RLIMIT_FSIZE to 8 MiB, below a shard file's ~13 MB (the write
    fails with EFBIG; both reach torch.save as an OSError). Yields (folder, fill_up, make_room, the error's words);
    unmounted, and the limit restored, afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "fp4moe-test", str(disk)],
                           capture_output=True, text=True)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    if mount.returncode == 0:
        def resize(size_bytes: int) -> None:
            subprocess.run(["mount", "-o", f"remount,size={size_bytes}", str(disk)], check=True,
                           capture_output=True)

        def fill_up() -> None:
            used = os.statvfs(disk)
            resize((used.f_blocks - used.f_bfree) * used.f_frsize + (8 << 20))

        words = "No space left"
    else:
        assert signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN  # Python's default: a write past the limit fails

        def fill_up() -> None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 20, limits[1]))

        words = "(OSError: [Errno 27] File too large"

    def make_room() -> None:
        if mount.returncode == 0:
            resize(256 << 20)
        else:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)

    try:
        yield disk, fill_up, make_room, words
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        if mount.returncode == 0:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_a_full_checkpoint_folder_stops_the_run_with_one_line_and_a_rerun_with_room_resumes(filling_folder, in_store,
                                                                                           reference):
    """The checkpoint folder fills up after the step-2 checkpoint (a real full disk where a tmpfs can be mounted,
    else RLIMIT_FSIZE: fixture filling_folder), so the step-4 save fails. The run stops with one line naming the
    folder, the cause, the newest complete checkpoint and the fix; the unfinished folder is removed (on the real
    disk its space is free again); with room again the same command resumes from step 2 to the uninterrupted
    losses, in the same MLflow run."""
    from fp4moe.train import checkpoint as ckpt
    from fp4moe.train.loop import train

    disk, fill_up, make_room, words = filling_folder
    cfg = _compose([*COMMON, "task_name=full", f"train.checkpoint_dir={disk / 'ckpt'}", "train.checkpoint_interval=2"])
    root = disk / "ckpt" / "full"

    def at_step_3(step, metrics):
        if step == 3:
            fill_up()

    try:
        with pytest.raises(ConfigError) as e:
            train(cfg, after_step=at_step_3)
        st = os.statvfs(disk)  # still full but for what the failed save left
    finally:
        make_room()
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert msg.startswith(f"checkpoint of step 4 could not be written to {root} (") and words in msg, msg
    assert f"newest complete checkpoint: {root / 'step_0000002'}" in msg
    assert "free space there, or point train.checkpoint_dir (or FP4MOE_CKPT_DIR)" in msg and "to resume" in msg
    # no unfinished folder left (beside the step folders: the attempt's lock and record, fp4moe.train.attempt)
    assert sorted(p.name for p in root.iterdir() if "step_" in p.name) == ["step_0000002"]
    if words == "No space left":
        assert st.f_bfree * st.f_frsize > 6 << 20  # the unfinished save's space is free again
    failed = _only_run(in_store, "full")
    assert failed.info.status == "FAILED"

    r = train(cfg)
    assert r.start_step == 2 and r.losses == {s: reference[s] for s in range(3, STEPS + 1)}
    assert _client(in_store).get_run(r.run_id).info.status == "FINISHED" and r.run_id == failed.info.run_id
    assert [f.name for f, _ in ckpt.scan(root)[0]] == ["step_0000006", "step_0000004"]


def test_a_second_command_on_a_busy_folder_stops_and_a_run_killed_before_its_first_checkpoint_is_marked_lost(
        tmp_path, in_store, reference):
    """``python -m fp4moe.train`` (slowed down: tests/faults.py's ``sleep_after_step`` hook) runs with no periodic checkpoints. While it runs,
    the same command (its checkpoint folder) in this process stops before building the model with one line naming
    the process that holds the folder (fp4moe.train.attempt.Busy). Then the first process gets SIGKILL before any
    checkpoint: its MLflow run is left RUNNING. The next command starts over from step 0 (nothing to resume), trains
    the uninterrupted losses, ends the killed run FAILED with a ``lost`` tag naming the new run, and tags the new run
    ``earlier_attempt``: both runs stay in the store, neither looks alive."""
    from fp4moe.train import attempt
    from fp4moe.train.loop import train

    overrides = _overrides(tmp_path, "lost", "train.checkpoint_interval=null")
    root = tmp_path / "ckpt" / "lost"
    proc = subprocess.Popen([sys.executable, str(HERE / "cli.py"), *overrides, SLOW.format(seconds=1.0),
                             f"hydra.run.dir={tmp_path / 'out'}"],
                            cwd=tmp_path, env={**os.environ, "MLFLOW_TRACKING_URI": in_store},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline, first = time.monotonic() + 180, None
        while proc.poll() is None and time.monotonic() < deadline:  # its run exists and has logged a step
            rec = json.loads((root / attempt.RECORD).read_text()) if (root / attempt.RECORD).exists() else {}
            if rec.get("mlflow_run_id") and _client(in_store).get_metric_history(rec["mlflow_run_id"], "loss"):
                first = rec["mlflow_run_id"]
                break
            time.sleep(0.05)
        assert first, f"the first process logged no step: {proc.poll()} {proc.stderr.read()[-3000:] if proc.poll() is not None else ''}"
        with pytest.raises(attempt.Busy) as e:
            train(_compose(overrides))
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"{root} is being trained by pid {proc.pid} on "), msg
        assert "hydra.run.dir=<new folder>" in msg, msg
    finally:
        proc.kill()
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not ckpt_steps(root) and _client(in_store).get_run(first).info.status == "RUNNING"

    r = train(_compose(overrides))
    assert r.start_step == 0 and r.run_id != first and r.losses == reference
    client = _client(in_store)
    lost, new = client.get_run(first), client.get_run(r.run_id)
    assert lost.info.status == "FAILED" and r.run_id in lost.data.tags["lost"], lost.data.tags
    assert "ended without a checkpoint" in lost.data.tags["lost"]
    assert new.info.status == "FINISHED" and new.data.tags["earlier_attempt"] == first
    runs = client.search_runs([client.get_experiment_by_name("lost").experiment_id])
    assert sorted(x.info.run_id for x in runs) == sorted([first, r.run_id])
    assert json.loads((root / attempt.RECORD).read_text())["mlflow_run_id"] == r.run_id


def ckpt_steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("step_*"))


def test_preempted_three_times_in_a_row_then_finished_equals_uninterrupted(tmp_path, in_store, reference,
                                                                          monkeypatch):
    """The preemption signal (SIGUSR2; outside Slurm it stops the run: exit 140) after steps 1, 2 and 3, each the
    first step of its process, with no periodic checkpoints: each stop writes its checkpoint, each restart resumes
    it, and the fourth process finishes. The losses are the uninterrupted run's bit for bit and the MLflow run is
    one run, resumed three times, FINISHED."""
    from fp4moe.launch import slurm
    from fp4moe.train.loop import train

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)  # a requeue would call scontrol
    sig = slurm.preempt_signal()
    cfg = _compose(_overrides(tmp_path, "preempt3", "train.checkpoint_interval=null"))
    losses: dict[int, float] = {}
    for stop_at in (1, 2, 3):
        def preempt(step, metrics, stop_at=stop_at):
            if step == stop_at:
                os.kill(os.getpid(), sig)

        r = train(cfg, after_step=preempt)
        assert (r.start_step, r.step, r.stopped_by) == (stop_at - 1, stop_at, sig)
        assert r.checkpoint.name == f"step_{stop_at:07d}"
        losses.update(r.losses)
    r = train(cfg)
    assert r.start_step == 3 and r.stopped_by == 0 and r.step == STEPS
    losses.update(r.losses)
    assert losses == reference
    run = _only_run(in_store, "preempt3")
    assert run.info.status == "FINISHED" and run.data.tags["resume.count"] == "3"
    assert run.data.tags["resume.stopped_by_signals"] == ",".join([str(int(sig))] * 3)
    assert "stopped_by_signal" not in run.data.tags
    assert _history(in_store, r.run_id) == reference


def test_a_store_that_goes_away_mid_run_loses_no_metrics(tmp_path, store, reference, caplog):
    """The MLflow store's folder disappears after step 3 (a network file system gone; SQLite refuses to write to a
    moved database) and comes back after the run. Training goes on to the end with the same losses; one warning
    line names the store and the file that keeps what could not be logged, and one at the end says how to log it
    later. Rerunning the same command once the store is back logs it into the run, which then holds every step and
    ends FINISHED."""
    from fp4moe.train.loop import train
    from fp4moe.train.metrics import PENDING_FILE

    folder, away = tmp_path / "mlruns", tmp_path / "mlruns.away"

    def store_goes_away(step, metrics):
        if step == 3:
            folder.rename(away)

    cfg = _compose(_overrides(tmp_path, "store_gone", "train.checkpoint_interval=2"))
    with caplog.at_level(logging.WARNING, logger="fp4moe.train"):
        r = train(cfg, after_step=store_goes_away)
    assert r.step == STEPS and r.losses == reference               # nothing stopped
    pending = tmp_path / "ckpt" / "store_gone" / PENDING_FILE
    said = [rec.getMessage() for rec in caplog.records if rec.name == "fp4moe.train" and "MLflow" in rec.getMessage()]
    assert len(said) == 2 and all("\n" not in s for s in said), said
    assert f"MLflow store {store}" in said[0] and "failed" in said[0] and "training goes on" in said[0]
    assert str(pending) in said[0] and str(pending) in said[1] and "rerun the same command" in said[1]
    assert f"python -m fp4moe.train.metrics {pending}" in said[1]
    kept = [json.loads(line) for line in pending.read_text().splitlines()]
    assert {rec["kind"] for rec in kept} == {"store", "metrics", "status"} and kept[-1]["status"] == "FINISHED"
    assert max(rec["step"] for rec in kept if rec["kind"] == "metrics") == STEPS  # the summary: at the last step

    away.rename(folder)                                            # the store is back
    with caplog.at_level(logging.INFO, logger="fp4moe.train"):
        again = train(cfg)
    assert again.already_finished and not pending.exists()
    run = _client(store).get_run(r.run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["summary/final_loss"] == reference[STEPS]
    assert _history(store, r.run_id) == reference


@pytest.fixture
def mlflow_server(tmp_path):
    """A real MLflow tracking server, the project's ``make mlflow-ui`` (tests/mlflow_server.py), with its own sqlite
    store; killed at the end."""
    import shutil

    from mlflow_server import Server

    if shutil.which("make") is None:
        pytest.skip("needs make")
    server = Server(tmp_path / "server" / "mlflow.db", tmp_path / "server.log")
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def environ_kept():
    """This process's environment as it was, after the test (the tracker bounds mlflow's HTTP retries in it)."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


def test_an_http_tracking_server_killed_mid_run_loses_no_metrics(tmp_path, mlflow_server, reference, monkeypatch,
                                                                 environ_kept):
    """``python -m fp4moe.train`` logs over HTTP to a real MLflow tracking server (``make mlflow-ui``, the UI the README
    opens); the server gets SIGKILL once the run has logged its first step. The run trains to the end (no minutes of retries: fp4moe.tracking.mlflow_store.HTTP_WRITE_LIMITS),
    exits 0, and says so in one warning line naming the server and the pending file (and one at the end saying how to
    log it; no urllib3 retry lines); the pending file holds every step the server missed and the run's end. With the
    server back (same port, same backend), the same command logs them into the same MLflow run: the run holds the
    uninterrupted losses at every step and ends FINISHED."""
    from fp4moe.train.loop import train
    from fp4moe.train.metrics import PENDING_FILE

    mlflow_server.start()
    uri = mlflow_server.uri
    overrides = _overrides(tmp_path, "http_gone", "train.checkpoint_interval=2")
    pending = tmp_path / "ckpt" / "http_gone" / PENDING_FILE
    proc = subprocess.Popen([sys.executable, str(HERE / "cli.py"), *overrides, SLOW.format(seconds=0.5),
                             f"hydra.run.dir={tmp_path / 'out'}"],
                            cwd=tmp_path, env={**os.environ, "MLFLOW_TRACKING_URI": uri},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        client, deadline, logged = _client(uri), time.monotonic() + 180, {}
        while not logged and proc.poll() is None and time.monotonic() < deadline:
            exp = client.get_experiment_by_name("http_gone")
            runs = client.search_runs([exp.experiment_id]) if exp else []
            logged = _history(uri, runs[0].info.run_id) if runs else {}
            time.sleep(0.1)
        assert logged, f"no step reached the server: {proc.poll()} {mlflow_server.log.read_text()[-2000:]}"
        run_id = runs[0].info.run_id
        mlflow_server.kill()
        killed = time.monotonic()
        while not pending.exists() and proc.poll() is None and time.monotonic() - killed < 120:
            time.sleep(0.1)
        # the tracker has failed over: this process writes to the file only from here on, so the server may come back
        # while it finishes (its start overlaps the run's last steps)
        mlflow_server.launch()
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert pending.exists() and time.monotonic() - killed < 90  # mlflow's own retries took 4 minutes
    assert max(logged) < STEPS and logged == {s: reference[s] for s in logged}
    said = [line for line in (out + err).splitlines() if f"MLflow store {uri}" in line]
    assert len(said) == 2, said
    assert "failed" in said[0] and "training goes on" in said[0] and str(pending) in said[0]
    assert "rerun the same command" in said[1] and f"python -m fp4moe.train.metrics {pending}" in said[1]
    assert "Retrying" not in out + err and "Traceback" not in out + err
    kept = [json.loads(line) for line in pending.read_text().splitlines()]
    assert kept[0]["kind"] == "store" and kept[0]["uri"] == uri and kept[-1]["status"] == "FINISHED"
    steps = sorted({rec["step"] for rec in kept if rec["kind"] == "metrics"})
    assert steps[-1] == STEPS and set(logged) | set(steps) == set(range(1, STEPS + 1)), (sorted(logged), steps)

    mlflow_server.wait()                                           # the server is back
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    again = train(_compose(overrides))
    assert again.already_finished and again.run_id == run_id and not pending.exists()
    run = _only_run(uri, "http_gone")
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    assert run.data.metrics["summary/final_loss"] == reference[STEPS]
    assert _history(uri, run_id) == reference
    with urllib.request.urlopen(f"{uri}/", timeout=30) as page:  # and the UI's page is served
        assert page.status == 200 and b"static-files/" in page.read()
