"""MLflow helpers for benchmarks and the trainer: where runs go; one call logs a run or a table.

Where: ``$MLFLOW_TRACKING_URI`` if set, else an embedded SQLite store at ``<repo>/mlruns/mlflow.db``
with artifacts beside it in ``<repo>/mlruns/artifacts/`` (``<repo>``: fp4moe.paths.repo_root, ``$FP4MOE_HOME`` if
set, else the checkout; fp4moe.paths.mlruns_dir). No server is needed; ``mlflow ui`` (from the full ``mlflow``
package) can browse the same store.

mlflow is imported inside the functions, so ``import fp4moe.tracking.mlflow_store`` stays cheap.
"""

from __future__ import annotations

import math
import os
import platform
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlparse, urlsplit, urlunsplit

from fp4moe.atomic_write import writable_ancestor
from fp4moe.paths import mlruns_dir, repo_root

HTTP_TIMEOUT_S = 3.0
# mlflow's HTTP client retries a failed request 7 times (backoff factor 2, up to 120 s between tries) and waits up to
# 120 s for each answer: a write to a tracking server that went away failed only after about 4 minutes (measured:
# 240 s, with one urllib3 warning line per retry), and the trainer's flush before a checkpoint waited that long.
# A writer that can keep what the store could not take (fp4moe.train.metrics.Tracker) gives a write 3 retries after
# 0, 2 and 4 s (plus up to 1 s of jitter each) and 10 s per answer: about 8 s when the connection is refused, at most
# about 50 s when the server accepts and never answers.
HTTP_WRITE_LIMITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                     "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


class TrackingUnavailable(RuntimeError):
    """The MLflow tracking store cannot be used; the message names the URI and the fix."""

    def _render_traceback_(self) -> list[str]:
        """IPython/Jupyter show this instead of a traceback: the one line is the whole story (notebooks)."""
        return [f"{type(self).__name__}: {self}"]


def portable(text: str) -> str:
    """``text`` (a path, command line, URI or note) with this machine's folders named the same on every machine: the
    repository root as ``<repo>``, ``$OUT`` (the device tools' output folder, when set) as ``$OUT``, the home folder as
    ``~`` (the longest first: a checkout under the home folder is ``<repo>``). Whatever goes into results/
    (benchmark commands, runs archives, the report) goes through this; tests/test_docs.py checks results/."""
    return portable_paths()(text)


def portable_paths() -> Callable[[str], str]:
    """``portable`` with the machine's folders looked up once (for many values: an archive's params and tags)."""
    roots: dict[str, str] = {}
    for folder, label in ((os.path.expanduser("~"), "~"), (os.environ.get("OUT", ""), "$OUT"),
                          (str(repo_root()), "<repo>")):
        if os.path.isabs(folder):  # a relative $OUT names no folder of this machine
            for form in {os.path.abspath(folder), os.path.realpath(folder)}:
                if form != os.sep:
                    roots[form.rstrip(os.sep)] = label
    # a whole folder only (not /srv/repo inside /srv/repo2 or /x/srv/repo), the longest first
    pattern = re.compile("|".join(rf"(?<![\w.-]){re.escape(root)}(?![\w.-])"
                                  for root in sorted(roots, key=len, reverse=True)))
    return lambda text: pattern.sub(lambda m: roots[m.group(0)], text) if roots else text


def tracking_uri() -> str:
    """``$MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<repo>/mlruns/mlflow.db`` (dir created where it can be)."""
    if uri := os.environ.get("MLFLOW_TRACKING_URI"):
        return uri
    store = mlruns_dir()
    try:
        store.mkdir(parents=True, exist_ok=True)
    except OSError:  # under a file, or not writable: check_reachable says so in one line, with the fix
        pass
    return f"sqlite:///{store / 'mlflow.db'}"


def config_uri(cfg: Any) -> str:
    """The store of a composed run config: its ``tracking.uri`` as given (conf/train.yaml defaults it to
    ``$MLFLOW_TRACKING_URI``, so an override ``tracking.uri=...`` wins over the variable), else ``tracking_uri()``.
    The one rule for the trainer (fp4moe.train) and the launching process (fp4moe.launch.slurm.SlurmCallback): both
    must name the same store. No normalisation: a relative sqlite path stays relative to the working directory."""
    from omegaconf import OmegaConf

    uri = OmegaConf.select(cfg, "tracking.uri", default=None)
    return str(uri) if uri else tracking_uri()


def normalize_uri(where: str | os.PathLike | None) -> str:
    """A tracking URI from a URI, a ``.db`` file or a folder holding ``mlflow.db``; None: ``tracking_uri()``."""
    if where is None:
        return tracking_uri()
    text = str(where)
    if "://" in text or text.startswith("sqlite:"):
        return text
    path = Path(text).expanduser().resolve()
    return f"sqlite:///{path if path.suffix == '.db' else path / 'mlflow.db'}"


def without_credentials(uri: str) -> str:
    """``uri`` without a ``user:password@`` part (what logs and MLflow params may show)."""
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def sqlite_file(uri: str) -> Path | None:
    """The database file of a ``sqlite:///<file>`` store (``~`` expanded); None for an in-memory one and for every
    other kind of store."""
    if not uri.startswith("sqlite:///"):
        return None
    db = uri.removeprefix("sqlite:///")
    return None if db in ("", ":memory:") else Path(db).expanduser()


def _local_store_dir(uri: str) -> Path | None:
    """The folder a local store (sqlite file or file store) lives in; None for remote stores."""
    if uri.startswith("sqlite:///"):
        db = sqlite_file(uri)
        return None if db is None else db.resolve().parent
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return Path(parsed.path).resolve()
    if parsed.scheme == "" or len(parsed.scheme) == 1:  # a plain path (or a Windows drive letter)
        return Path(uri).expanduser().resolve()
    return None


def check_reachable(uri: str, hint: str = "") -> None:
    """Raise TrackingUnavailable unless ``uri`` can take runs.

    http(s): the server answers ``GET <uri>/health`` within HTTP_TIMEOUT_S seconds.
    sqlite: the store's folder (or its nearest existing parent) is writable, and an existing file is an MLflow store
    (:func:`check_readable`'s look). file / plain path: MLflow's file store, which MLflow 3 refuses unless
    ``MLFLOW_ALLOW_FILE_STORE`` is true (then: writable, as sqlite).
    Other schemes (databricks, ...) are left to mlflow. ``hint``: a sentence appended to the message (another fix).
    """
    if urlparse(uri).scheme in ("http", "https"):
        url = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S):
                return
        except urllib.error.HTTPError as err:
            if err.code < 500:  # something answered; auth or routing is mlflow's business
                return
            reason = f"HTTP {err.code}"
        except (urllib.error.URLError, OSError) as err:
            reason = str(getattr(err, "reason", err))
        raise TrackingUnavailable(
            f"MLflow tracking server {uri} is not reachable ({reason} on GET {url}). "
            f"Start it (e.g. `make mlflow-ui` for the local store at http://127.0.0.1:5000, or `mlflow server "
            f"--backend-store-uri sqlite:///mlruns/mlflow.db --host 127.0.0.1 --port 5000`; both need the full "
            f"`mlflow` package: pip install -e '.[ui]') or unset "
            f"MLFLOW_TRACKING_URI to use the local store under {mlruns_dir()}.{hint and ' ' + hint}"
        )
    folder = _local_store_dir(uri)
    if folder is None:
        return
    if not uri.startswith("sqlite:") and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("1", "true"):
        # MLflow 3 (mlflow-skinny 3.17, pinned) refuses to open a file store: an MlflowException at the first call
        raise TrackingUnavailable(
            f"MLflow store {uri} is a file store (a folder of files), which MLflow 3 no longer opens: point "
            f"MLFLOW_TRACKING_URI (or tracking.uri) at sqlite:///{folder / 'mlflow.db'}, an SQLite store in that "
            f"folder (`mlflow migrate-filestore` moves an old file store's runs into one), or at a server; "
            f"MLFLOW_ALLOW_FILE_STORE=true opens it anyway.{hint and ' ' + hint}")
    existing, writable = writable_ancestor(folder)
    if not writable:
        raise TrackingUnavailable(
            f"MLflow store {uri} is not writable: {existing} is not a writable folder. "
            f"Fix its permissions, or point MLFLOW_TRACKING_URI (or FP4MOE_HOME) elsewhere."
        )
    _check_sqlite_store(uri, hint)


def limit_http_retries() -> dict[str, str]:
    """Set the variables of HTTP_WRITE_LIMITS that this process's environment leaves unset (one the user set wins; mlflow
    reads them at each request); returns the values in force."""
    for name, value in HTTP_WRITE_LIMITS.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in HTTP_WRITE_LIMITS}


def check_readable(uri: str, hint: str = "") -> None:
    """Raise TrackingUnavailable (one line: the URI, what is wrong, the fix) unless runs can be read from ``uri``, in
    at most HTTP_TIMEOUT_S seconds (mlflow itself retries an unreachable server for minutes).

    http(s): as :func:`check_reachable`. ``sqlite:///<file>``: an existing file must be an SQLite database that is an
    MLflow store (an ``experiments`` table) or still empty; a missing one is the caller's case (an empty store).
    Other schemes are left to mlflow. ``hint``: a sentence appended to the message (e.g. the option that sets it).
    """
    if urlparse(uri).scheme in ("http", "https"):
        check_reachable(uri, hint)
        return
    _check_sqlite_store(uri, hint)


def _check_sqlite_store(uri: str, hint: str) -> None:
    """TrackingUnavailable unless the file of a ``sqlite:///<file>`` store is missing (a new, empty store), empty, or
    an SQLite database with MLflow's ``experiments`` table; other URIs pass."""
    db = sqlite_file(uri)
    if db is None or not db.is_file():
        return
    fix = ("Point MLFLOW_TRACKING_URI at an MLflow store (sqlite:///<folder>/mlflow.db or an http(s) server)."
           f"{hint and ' ' + hint}")
    import sqlite3

    try:
        con = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)
        try:
            tables = {row[0] for row in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        finally:
            con.close()
    except sqlite3.Error as e:
        raise TrackingUnavailable(
            f"MLflow store {uri}: {db} cannot be read as an SQLite database ({e}). {fix}") from None
    if tables and "experiments" not in tables:
        raise TrackingUnavailable(f"MLflow store {uri}: {db} is an SQLite database but not an MLflow store (no "
                                  f"'experiments' table among {len(tables)}). {fix}")


def _git(*args: str, where: Path | None = None) -> str | None:
    """``git -C where args`` (default: the repo root) stripped output, or None where git fails."""
    try:
        out = subprocess.run(
            ["git", "-C", str(where or repo_root()), *args],
            capture_output=True, text=True, timeout=10, check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def code_commit(short: bool = False) -> str | None:
    """The commit of this code: $FP4MOE_COMMIT where set (a copy of the tree without its history, e.g. the lent GPU
    machines), else the HEAD of the git work tree holding this package (``short``: abbreviated), else None (an
    installed wheel). What the benchmarks record and ``fp4moe.reproduce`` matches their results against."""
    if named := os.environ.get("FP4MOE_COMMIT"):
        return named
    return _git("rev-parse", *(["--short"] if short else []), "HEAD", where=Path(__file__).resolve().parent) or None


MAX_TAG_CHARS = 5000  # MLflow's limit on a tag value
# environment variables that change what a run measures, recorded as ``env.NAME`` tags: fp4moe's switches and the
# threading / compile / allocator settings of torch (an fp8 cell's host stalls on an H200 followed the inductor
# compile workers: results/train_proxy/README.md section 17)
ENV_TAG_PREFIXES = ("FP4MOE_", "TORCHINDUCTOR_", "PYTORCH_CUDA_ALLOC_CONF", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
                    "NCCL_")


def environment_tags() -> dict[str, str]:
    """Tags every run carries: git commit ($FP4MOE_COMMIT where set) and whether the tree was dirty, host, Python,
    torch, and every
    ``FP4MOE_*`` environment variable as ``env.FP4MOE_*`` (switches such as ``FP4MOE_FUSED_SWIGLU_FP4`` and
    ``FP4MOE_TILES`` change which kernels run without changing the config)."""
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    named = os.environ.get("FP4MOE_COMMIT")  # a copy of the tree without its history names its commit
    status = None if named else _git("status", "--porcelain", "--untracked-files=no")
    return {
        "mlflow.source.git.commit": named or _git("rev-parse", "HEAD") or "unknown",
        "git_dirty": "unknown" if status is None else str(bool(status)).lower(),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch_version,
        **{f"env.{k}": v[:MAX_TAG_CHARS] for k, v in sorted(os.environ.items()) if k.startswith(ENV_TAG_PREFIXES)},
    }


def _client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def search_all_runs(client, experiment_ids: Sequence[str], filter_string: str = ""):
    """Every run of ``experiment_ids`` matching ``filter_string`` (MLflow's search syntax), page after page
    (``search_runs`` returns at most 1000 a call); yields ``mlflow.entities.Run``."""
    token = None
    while True:
        page = client.search_runs(list(experiment_ids), filter_string=filter_string, max_results=1000,
                                  page_token=token)
        yield from page
        token = page.token
        if not token:
            return


def _experiment_id(client, experiment: str, uri: str) -> str:
    """Id of ``experiment``, created if new; a local store keeps artifacts beside its database."""
    found = client.get_experiment_by_name(experiment)
    if found is not None:
        return found.experiment_id
    folder = _local_store_dir(uri) if uri.startswith("sqlite:") else None
    location = (folder / "artifacts" / experiment).as_uri() if folder else None
    return client.create_experiment(experiment, artifact_location=location)


# MLflow's log_batch limits per call (its REST API's; the sqlite store enforces the same)
BATCH_LIMITS = {"metrics": 1000, "params": 100, "tags": 100}


def log_batched(client: Any, run_id: str, *, metrics: Sequence[Any] = (), params: Sequence[Any] = (),
                tags: Sequence[Any] = ()) -> None:
    """``client.log_batch`` of any number of mlflow ``Metric`` / ``Param`` / ``RunTag`` entities, in as few calls as
    :data:`BATCH_LIMITS` allow (one call when everything fits). The one place that knows those limits."""
    metrics, params, tags = list(metrics), list(params), list(tags)
    while metrics or params or tags:
        m, p, t = (metrics[:BATCH_LIMITS["metrics"]], params[:BATCH_LIMITS["params"]], tags[:BATCH_LIMITS["tags"]])
        client.log_batch(run_id, metrics=m, params=p, tags=t)
        metrics, params, tags = (metrics[len(m):], params[len(p):], tags[len(t):])


def log_run(
    experiment: str,
    run_name: str,
    params: Mapping[str, object],
    metrics: Mapping[str, float | None],
    tags: Mapping[str, str] | None = None,
    artifacts: Iterable[str | os.PathLike] = (),
    *,
    uri: str | None = None,
) -> str:
    """Log one finished run and return its run id.

    Params are stored as strings; metrics as floats at step 0, a None metric is skipped (e.g. the
    throughput of an out-of-memory cell). ``environment_tags()`` are added; ``tags`` override them.
    ``uri`` defaults to ``tracking_uri()``; it is checked with ``check_reachable`` first.
    """
    from mlflow.entities import Metric, Param, RunTag

    uri = uri or tracking_uri()
    check_reachable(uri)
    client = _client(uri)
    run = client.create_run(_experiment_id(client, experiment, uri), run_name=run_name)
    run_id = run.info.run_id
    try:
        now_ms = int(time.time() * 1000)
        all_tags = {**environment_tags(), **(tags or {})}
        log_batched(client, run_id,
                    metrics=[Metric(k, float(v), now_ms, 0) for k, v in metrics.items() if v is not None],
                    params=[Param(k, str(v)) for k, v in params.items()],
                    tags=[RunTag(k, str(v)) for k, v in all_tags.items()])
        for path in artifacts:
            client.log_artifact(run_id, str(path))
    except BaseException:
        client.set_terminated(run_id, status="FAILED")
        raise
    client.set_terminated(run_id, status="FINISHED")
    return run_id


def log_table(
    experiment: str,
    rows: Sequence[Mapping[str, object]],
    key_cols: Sequence[str],
    metric_cols: Sequence[str],
    common_params: Mapping[str, object] | None = None,
    tags: Mapping[str, str] | None = None,
    *,
    uri: str | None = None,
) -> list[str]:
    """Log one run per row and return the run ids, in row order.

    A row's params are ``common_params`` plus its ``key_cols`` (which win on a clash); its metrics
    are its ``metric_cols`` (None or NaN skipped). The run is named ``key=value/...`` from the key
    columns. Other columns are ignored. A row missing a key or metric column raises KeyError before
    anything is logged.
    """
    for i, row in enumerate(rows):
        missing = [c for c in (*key_cols, *metric_cols) if c not in row]
        if missing:
            raise KeyError(f"log_table: row {i} lacks columns {missing}: {dict(row)}")
    uri = uri or tracking_uri()
    run_ids = []
    for row in rows:
        metrics = {}
        for col in metric_cols:
            value = row[col]
            if value is not None and not (isinstance(value, float) and math.isnan(value)):
                metrics[col] = value
        run_ids.append(
            log_run(
                experiment,
                run_name="/".join(f"{c}={row[c]}" for c in key_cols),
                params={**(common_params or {}), **{c: row[c] for c in key_cols}},
                metrics=metrics,
                tags=tags,
                uri=uri,
            )
        )
    return run_ids
