"""A real MLflow tracking server for the tests: the project's ``make mlflow-ui`` (``mlflow ui``: the REST API and the
UI over HTTP) on a free port of 127.0.0.1 and its own sqlite store, started, killed and restarted as a process group,
like a tracking server that goes away.

The project's environment has mlflow-skinny, a client without the server (``mlflow server`` there stops at ``import
flask``). The server is the ``ui`` extra of pyproject.toml (the full ``mlflow`` of the pinned version), installed once
into ``<repo>/.venv-mlflow-server``: a venv whose ``.pth`` file puts the running interpreter's packages behind its own,
so pip adds only what full mlflow has beyond them (flask, gunicorn, graphene, huey, scipy, scikit-learn, pyarrow, ...;
``--no-compile``: about 15 s of CPU, 370 MB) and the project's venv stays the skinny client the trainer runs with.
It is rebuilt when the requirement or the running interpreter's packages folder changes; ``make clean`` removes it.
make runs with that venv as ``VENV`` and its install stamps taken as done (``-o``): it runs the target's UI line only,
which starts one worker without mlflow's job runner (the Makefile says why).
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import tomllib
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-mlflow-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_python() -> Path:
    """The python of the server venv, built on first use (under a lock: one build at a time); RuntimeError with
    pip's last lines when the install fails."""
    requirement = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["ui"]
    packages = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    want = {"requirement": requirement, "packages": packages, "python": sys.version}
    python, marker = VENV / "bin" / "python", VENV / "fp4moe-server.json"
    with open(f"{VENV}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.is_file() and json.loads(marker.read_text()) == want:
            return python
        shutil.rmtree(VENV, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(VENV)], check=True, capture_output=True)
        site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   check=True, capture_output=True, text=True).stdout.strip())
        (site / "fp4moe-project-venv.pth").write_text("".join(f"{p}\n" for p in packages))
        pip = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-compile", *requirement],
                             capture_output=True, text=True)
        if pip.returncode != 0:
            raise RuntimeError(f"installing {requirement} into {VENV} failed: {pip.stderr[-3000:]}")
        marker.write_text(json.dumps(want))
    return python


class Server:
    """``make mlflow-ui`` with the store ``sqlite:///<db>`` on ``127.0.0.1:<port>`` (a free port unless given); its
    output goes to ``log``. ``start`` (``launch`` + ``wait``) waits until ``/health`` answers; ``kill`` is SIGKILL to its process group (make,
    the ``mlflow ui`` process and its uvicorn worker)."""

    def __init__(self, db: Path, log: Path, port: int | None = None) -> None:
        self.db, self.log, self.port = db, log, port or free_port()
        self.proc: subprocess.Popen | None = None
        self.launched = 0.0

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        venv = server_python().parents[1]
        return ["make", "--no-print-directory", "-C", str(ROOT), "-o", f"{venv}/.installed", "-o",
                f"{venv}/.installed-ui", "mlflow-ui", f"VENV={venv}", f"UI_PORT={self.port}"]

    def launch(self) -> None:
        """Start it without waiting (``wait`` waits until it answers)."""
        command = self.command()
        env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
        env["MLFLOW_TRACKING_URI"] = f"sqlite:///{self.db}"  # the store the UI serves
        self.launched = time.monotonic()
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def wait(self, timeout_s: float = 180) -> float:
        """Wait until ``/health`` answers; returns the seconds since ``launch``. RuntimeError with the log's end when
        it exits or does not answer in ``timeout_s``."""
        while time.monotonic() - self.launched < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"make mlflow-ui exited with {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - self.launched
            except OSError:
                time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"make mlflow-ui did not answer in {timeout_s} s: {self.log.read_text()[-3000:]}")

    def start(self, timeout_s: float = 180) -> float:
        """``launch``, then ``wait``."""
        self.launch()
        return self.wait(timeout_s)

    def kill(self) -> None:
        """SIGKILL to the whole server (no goodbye: a host or a network that goes away)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
        self.proc = None
