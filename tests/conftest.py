"""Shared test set-up.

Without an NVIDIA GPU the Triton kernels run under the Triton interpreter (CPU), which must be switched
on before triton is first imported. On a GPU machine ``make test-gpu`` sets TRITON_INTERPRET=0.
"""
import os
import shutil

if not (os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi")):
    os.environ.setdefault("TRITON_INTERPRET", "1")
