"""Shared test set-up.

Without an NVIDIA GPU the Triton kernels run under the Triton interpreter (CPU), which must be switched
on before triton is first imported. On a GPU machine ``make test-gpu`` sets TRITON_INTERPRET=0.

tests/ goes on ``PYTHONPATH`` (first), so that every process a test starts imports the hooks the tests inject faults
with (tests/faults.py, named in ``train.hooks``): subprocesses, torchrun's workers and Slurm jobs, which inherit the
environment they are submitted from (tests/test_slurm.py). This process has it on ``sys.path`` already (pytest's
"prepend" import mode puts this file's folder there).
"""
import os
import shutil
from pathlib import Path

import pytest

if not (os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi")):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One OpenMP / BLAS thread per process, set before torch and numpy load: this process (each of `make test`'s
# workers) and every process a test starts, which inherit it (torchrun sets the same for its workers; the Slurm jobs
# get it from tests/test_slurm.py). torch's default is one thread per core; each parallel region's second thread then
# spin-waits for the next one and takes the core the other worker's processes need: on the 2-core CI machine, with
# other processes running, tests/train/test_train.py took 68 CPU-seconds with the default instead of 40 (wall 85 s
# instead of 71). The tiny models' tensors are too small for a second thread to gain anything.
os.environ.setdefault("OMP_NUM_THREADS", "1")

TESTS = str(Path(__file__).resolve().parent)
if TESTS not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)


CHECKOUT_STORE = Path(__file__).resolve().parents[1] / "mlruns"


@pytest.fixture(scope="session", autouse=True)
def _no_store_made_in_the_checkout():
    """The tests' MLflow stores live under tmp_path. A test that asks for the default store (``tracking_uri()``
    without ``MLFLOW_TRACKING_URI`` or ``FP4MOE_HOME``) creates ``<checkout>/mlruns``: an error at the end, not a
    folder left behind (each xdist worker checks; one whose session started after the folder appeared cannot tell)."""
    existed = CHECKOUT_STORE.exists()
    yield
    if not existed and CHECKOUT_STORE.exists():
        pytest.fail(f"a test created {CHECKOUT_STORE}: point it at tmp_path (monkeypatch FP4MOE_HOME or "
                    "MLFLOW_TRACKING_URI) before it asks for the default store", pytrace=False)
