"""Where fp4moe's folders are: the one module that knows the repository's layout (no torch, no Hydra, stdlib only).

Every folder the code finds by itself comes from here; the environment variables are read here and nowhere else.

- :func:`source_root`: the checkout this code runs from, which holds ``conf/`` and the committed ``results/``: the
  nearest folder holding a ``pyproject.toml`` above this file (``src/fp4moe/``: a source checkout, an editable
  install, or a package installed into a virtual environment inside the checkout), else above the working
  directory, else the working directory. A package installed outside any checkout has neither ``conf/`` nor
  ``results/``: run it from a checkout, or set ``FP4MOE_CONF_DIR`` (and ``FP4MOE_HOME`` for the stores).
- :func:`repo_root`: where the outputs and stores go: ``$FP4MOE_HOME``, else :func:`source_root`.
- :func:`conf_dir`: the Hydra config folder: ``$FP4MOE_CONF_DIR``, else ``<source_root>/conf``.
- :func:`results_dir`: ``<repo_root>/results`` (benchmark results, run archives, the report).
- :func:`committed_results_dir`: ``<source_root>/results``, the results committed with the code (the manifest and
  the files the analysis reads), whatever ``$FP4MOE_HOME`` says.
- :func:`mlruns_dir`: the default MLflow store, ``<repo_root>/mlruns`` (``mlflow.db`` and ``artifacts/`` in it);
  ``$MLFLOW_TRACKING_URI`` chooses another store (fp4moe.tracking.mlflow_store.tracking_uri).
- :func:`logs_dir`: ``<repo_root>/logs``, the logs of ``python -m fp4moe.reproduce.train_runs``.
- :func:`package_parent`: the folder the ``fp4moe`` package is imported from (``src/`` in a checkout), put on a
  child process's ``PYTHONPATH`` so that it runs this same code.

A training run's own folders are the Hydra ``paths`` group (conf/paths/default.yaml): ``paths.root``
(``$FP4MOE_ROOT``, else the working directory), ``paths.log_dir`` (``<root>/logs``: run folders), ``paths.data_dir``
(``$FP4MOE_DATA_DIR``, else ``data``) and ``paths.checkpoint_dir`` (``$FP4MOE_CKPT_DIR``, else ``checkpoints`` in
the run folder).

The functions read the environment on each call; a module that keeps one in a constant reads it at import.
"""
from __future__ import annotations

import os
from pathlib import Path

HOME_VAR = "FP4MOE_HOME"          # the root of outputs and stores (tests point it at a temporary folder)
CONF_VAR = "FP4MOE_CONF_DIR"      # the Hydra config folder


def _nearest_project(start: Path) -> Path | None:
    """The nearest of ``start`` and its parents holding a ``pyproject.toml``; None if none does."""
    return next((folder for folder in (start, *start.parents) if (folder / "pyproject.toml").is_file()), None)


def source_root() -> Path:
    """The checkout this code runs from (see the module docstring), absolute."""
    here = Path(__file__).resolve().parent
    return _nearest_project(here) or _nearest_project(Path.cwd().resolve()) or Path.cwd().resolve()


def repo_root() -> Path:
    """``$FP4MOE_HOME`` (user folder expanded), else :func:`source_root`: the root of outputs and stores."""
    if home := os.environ.get(HOME_VAR):
        return Path(home).expanduser().resolve()
    return source_root()


def conf_dir() -> Path:
    """``$FP4MOE_CONF_DIR`` (user folder expanded), else ``<source_root>/conf``."""
    if conf := os.environ.get(CONF_VAR):
        return Path(conf).expanduser().resolve()
    return source_root() / "conf"


def results_dir() -> Path:
    """``<repo_root>/results``."""
    return repo_root() / "results"


def committed_results_dir() -> Path:
    """``<source_root>/results``: the committed results (results/manifest.yaml and what it lists)."""
    return source_root() / "results"


def mlruns_dir() -> Path:
    """``<repo_root>/mlruns``: the default MLflow store's folder (not created here)."""
    return repo_root() / "mlruns"


def logs_dir() -> Path:
    """``<repo_root>/logs``."""
    return repo_root() / "logs"


def package_parent() -> Path:
    """The folder holding the imported ``fp4moe`` package: ``src/`` in a checkout, ``site-packages`` installed."""
    return Path(__file__).resolve().parents[1]


__all__ = ["CONF_VAR", "HOME_VAR", "committed_results_dir", "conf_dir", "logs_dir", "mlruns_dir", "package_parent",
           "repo_root", "results_dir", "source_root"]
