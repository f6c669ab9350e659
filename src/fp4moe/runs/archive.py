"""Trainer runs measured elsewhere (a GPU machine, a cluster) kept in the repository as JSON and loaded into any
MLflow store, so that ``make reproduce-table`` on a fresh machine reports them beside the paper's numbers.

    python -m fp4moe.runs.archive export STORE [STORE ...] OUT.json --note "what, where, command" [--experiment NAME ...]
    python -m fp4moe.runs.archive import results/train_proxy/ [more files or folders] [--uri URI]
    python -m fp4moe.runs.archive withdraw ARCHIVE.json --metric KEY [--metric KEY ...] --reason "why"

An archive (``format: fp4moe-runs/1``) holds, per run: experiment name, run name, status, start/end time (ms), every
param and tag, and every metric's full history ``[[step, value, timestamp_ms], ...]``; plus ``note`` (free text:
hardware, commit, command) and ``exported_utc``. STORE is a tracking URI, a ``.db`` file or a folder holding
``mlflow.db``; several stores go into one archive (runs that shared a machine but not a store, e.g. one seed's
recipes run at once). Export refuses a store with no runs (nothing would be archived) and writes atomically.
Archives go into results/, so export writes the param and tag values and the note with the machine's folders
named portably (``fp4moe.tracking.mlflow_store.portable``: ``/path/to/checkout/data/...`` -> ``<repo>/data/...``,
``$OUT``, ``~``); the store keeps what the trainer logged. Metrics are copied as they are.

OUT ending in ``.json.xz`` is written xz-compressed (compact JSON): a 300 M-token run logs ~40 series of 2289 steps,
9 MB as indented JSON and 0.5 MB compressed. Every command here reads both kinds; a folder stands for both.

Withdrawn metrics: an archive may name metrics found to be wrong after the fact (``withdrawn_metrics``: ``keys`` and
``reason``, written by ``withdraw``; the measured values stay in the file, untouched). Import leaves those metrics
out and tags each run that had them ``fp4moe.withdrawn_metrics`` = "KEY: reason; ...", so a report shows them as not
measured.

Import is idempotent: each run carries the tag ``fp4moe.archived_run_id`` (its id in the store where it was measured,
kept when an imported run is archived again; plus ``fp4moe.archive`` = the file name); a run whose archived id is
already in the target experiment is skipped, so
rerunning ``make reproduce-table`` never duplicates runs. A folder stands for its ``*.json`` files that are archives
(other JSON files are left alone). Import never needs torch.

One run, one archive: the report compares runs within an archive (one seed's recipes, one session's cells), so a run
held by two archives would be read under one of them only. Export refuses a run that two of its stores hold (a store
and a store that imported its runs, or one store named twice); import refuses archives that share a run, naming both
files, before it imports anything. When an archive replaces another (runs merged into a new file, the old file
removed), importing it into a store that holds the old file's runs moves their ``fp4moe.archive`` tag to the new
name, so the store reports them with the runs they were merged with.
"""
from __future__ import annotations

import argparse
import json
import lzma
import os
import sys
import time
from pathlib import Path
from typing import Iterable, Sequence

from fp4moe.tracking import mlflow_store
from fp4moe.atomic_write import write_bytes_atomic
from fp4moe.tracking.bench_log import expand as files_of

FORMAT = "fp4moe-runs/1"
ARCHIVED_ID = "fp4moe.archived_run_id"
ARCHIVE_FILE = "fp4moe.archive"
WITHDRAWN = "fp4moe.withdrawn_metrics"
SUFFIXES = (".json", ".json.xz")  # plain, or xz-compressed (chosen by the name given to export)


class ArchiveError(ValueError):
    """A file is not a runs archive, or a store cannot be exported; the message names the file and the fix."""


def export(store: str | os.PathLike | Sequence[str | os.PathLike], out: str | os.PathLike, note: str,
           experiments: Sequence[str] | None = None) -> int:
    """Write every run of ``store`` (one, or a sequence of stores; only ``experiments`` when given) to ``out``;
    returns the number of runs. Every store must hold runs: a missing or empty one is an error, nothing written.
    Param and tag values and ``note`` name folders portably (``<repo>/...``; fp4moe.tracking.mlflow_store.portable)."""
    if not Path(out).name.endswith(SUFFIXES):  # a folder's archives are found by these names only
        raise ArchiveError(f"{out}: an archive's name ends in .json, or .json.xz to write it xz-compressed")
    stores = [store] if isinstance(store, (str, os.PathLike)) else list(store)
    if not stores:
        raise ArchiveError("no store to export: name at least one tracking URI, .db file or folder")
    per_store = [(s, _runs_of(s, experiments)) for s in stores]
    _one_archive_per_run(((s, run) for s, runs in per_store for run in runs),
                         "name each store once, and not both a store and one that imported its runs")
    runs = [run for _, runs in per_store for run in runs]
    runs.sort(key=lambda r: (r["experiment"], r["start_time"] or 0, r["run_id"]))
    portable = mlflow_store.portable_paths()
    for run in runs:
        for kind in ("params", "tags"):
            run[kind] = {k: portable(v) for k, v in run[kind].items()}
    doc = {"format": FORMAT, "exported_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "note": portable(note), "runs": runs}
    _write(doc, Path(out))
    return len(runs)


def _origin(run: dict) -> str:
    """The id of ``run`` (an archive record) in the store where it was measured, kept through re-archiving."""
    return run["tags"].get(ARCHIVED_ID, run["run_id"])


def _one_archive_per_run(held: Iterable[tuple[object, dict]], fix: str) -> None:
    """ArchiveError naming the run, both places and ``fix`` when one run (by ``_origin``) comes from two places of
    ``held`` ((store or archive file, run record) pairs)."""
    first: dict[str, object] = {}
    for where, run in held:
        origin = _origin(run)
        if origin in first:
            raise ArchiveError(f"run {origin} ({run.get('name') or 'unnamed'}) is in both {first[origin]} and "
                               f"{where}: one run, one archive; {fix}")
        first[origin] = where


def _runs_of(store: str | os.PathLike, experiments: Sequence[str] | None) -> list[dict]:
    """Every run of one store (only ``experiments`` when given) as archive records; ArchiveError when none."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow import MlflowClient
    from mlflow.entities import ViewType

    uri = mlflow_store.normalize_uri(store)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        raise ArchiveError(f"{store}: no MLflow store there (looked for {uri.removeprefix('sqlite:///')})")
    try:  # a file that is not an MLflow store, a server that does not answer: one line, not SQLAlchemy's traceback
        mlflow_store.check_readable(uri)
    except mlflow_store.TrackingUnavailable as e:
        raise ArchiveError(f"{store}: {e}") from None
    client = MlflowClient(tracking_uri=uri)
    runs = []
    for exp in client.search_experiments(view_type=ViewType.ACTIVE_ONLY):
        if experiments and exp.name not in experiments:
            continue
        for r in mlflow_store.search_all_runs(client, [exp.experiment_id]):
            hist = {key: [[m.step, m.value, m.timestamp] for m in
                          sorted(client.get_metric_history(r.info.run_id, key), key=lambda m: (m.step, m.timestamp))]
                    for key in r.data.metrics}
            runs.append({"run_id": r.info.run_id, "experiment": exp.name, "name": r.info.run_name or "",
                         "status": r.info.status, "start_time": r.info.start_time, "end_time": r.info.end_time,
                         "params": dict(r.data.params), "tags": dict(r.data.tags), "metrics": hist})
    if not runs:
        which = f" in experiments {list(experiments)}" if experiments else ""
        raise ArchiveError(f"{store}: no runs{which} to export")
    return runs


def _write(doc: dict, out: Path) -> None:
    """Write ``doc`` to ``out`` atomically (fp4moe.atomic_write): indented JSON, or compact JSON xz-compressed when
    the name ends in ``.xz``."""
    if out.name.endswith(".xz"):
        data = lzma.compress(json.dumps(doc, separators=(",", ":"), sort_keys=True).encode(), preset=6)
    else:
        data = json.dumps(doc, indent=1, sort_keys=True).encode()
    write_bytes_atomic(out, data)


def _read_text(p: Path) -> str:
    """The JSON text of ``p``, decompressed when it is an xz file (told by its magic bytes, not its name)."""
    raw = p.read_bytes()
    return (lzma.decompress(raw) if raw[:6] == b"\xfd7zXZ\x00" else raw).decode()


def withdraw(path: str | os.PathLike, keys: Sequence[str], reason: str) -> int:
    """Mark metrics ``keys`` of every run in the archive ``path`` as withdrawn for ``reason`` (added to those already
    withdrawn); the values stay in the file. Returns how many runs hold at least one of them. ArchiveError for a key
    no run has (a typo) or an empty reason."""
    if not reason.strip():
        raise ArchiveError("withdraw needs --reason: say why the metrics are wrong")
    p = Path(path)
    doc = load(p)
    present = {k for run in doc["runs"] for k in run["metrics"]}
    unknown = [k for k in keys if k not in present]
    if unknown:
        raise ArchiveError(f"{p}: no run has metric(s) {unknown}; known: {sorted(present)}")
    w = doc.get("withdrawn_metrics") or []
    w.append({"keys": list(keys), "reason": reason})
    doc["withdrawn_metrics"] = w
    _write(doc, p)
    return sum(1 for run in doc["runs"] if any(k in run["metrics"] for k in keys))


def withdrawn(doc: dict) -> dict[str, str]:
    """{metric key: reason} of the archive's withdrawn metrics."""
    return {k: entry["reason"] for entry in doc.get("withdrawn_metrics") or [] for k in entry["keys"]}


def load(path: str | os.PathLike) -> dict:
    """The archive at ``path``; ArchiveError when it is not one."""
    p = Path(path)
    try:
        doc = json.loads(_read_text(p))
    except (OSError, lzma.LZMAError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArchiveError(f"{p}: cannot read a JSON document ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ArchiveError(f"{p}: not a runs archive (no 'format: {FORMAT}'); write one with "
                           "python -m fp4moe.runs.archive export")
    for i, run in enumerate(doc.get("runs") or []):
        missing = [k for k in ("run_id", "experiment", "params", "tags", "metrics") if k not in run]
        if missing:
            raise ArchiveError(f"{p}: run {i} lacks {missing}")
    for entry in doc.get("withdrawn_metrics") or []:
        if not (isinstance(entry, dict) and isinstance(entry.get("keys"), list) and entry.get("reason")):
            raise ArchiveError(f"{p}: withdrawn_metrics entries need 'keys' (a list) and 'reason'; write them with "
                               "python -m fp4moe.runs.archive withdraw")
    return doc


def _is_archive(path: Path) -> bool:
    try:
        return json.loads(_read_text(path)).get("format") == FORMAT
    except (OSError, lzma.LZMAError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return False


def expand(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Files as given (each must be an archive); a folder stands for the archives among its ``*.json`` and
    every ``*.json.xz``, in name order (``fp4moe.tracking.bench_log.expand``'s walk; other JSON files there are left
    alone)."""
    out: list[Path] = []
    for given in map(Path, paths):
        try:
            found = sorted({f for pattern in ("*.json", "*.json.xz")  # a file given is found by both: once
                            for f in files_of([given], pattern, allow_empty=True)})
        except FileNotFoundError as exc:
            raise ArchiveError(str(exc)) from None
        # a .json.xz is only ever written as an archive: one that does not read is an error (at load), not skipped
        out += [f for f in found if not given.is_dir() or f.name.endswith(".xz") or _is_archive(f)]
    return out


def import_files(paths: Sequence[str | os.PathLike], uri: str | None = None, log=print) -> tuple[int, int]:
    """Load every run of the archives ``paths`` into the store ``uri`` (a tracking URI, a ``.db`` file or a folder
    holding ``mlflow.db``, as for ``export``; default fp4moe.tracking.mlflow_store's); returns
    (runs added, runs already there). ArchiveError, before anything is imported, when two archives share a run; a run
    already there from an archive of another name takes this one's name (the archive that replaced it)."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param, RunTag

    uri = mlflow_store.normalize_uri(uri)  # a bare folder would be MLflow's file store, which refuses to open
    mlflow_store.check_reachable(uri)
    paths = list({Path(p).resolve(): Path(p) for p in paths}.values())  # a file named twice is imported once
    # every archive read once here for the check (only the run ids kept), then again below, one at a time; before the
    # store is opened, which creates it: a file that is not an archive leaves no new empty store behind
    _one_archive_per_run(((p, run) for p in paths for run in load(p)["runs"]),
                         "the report would read it under one of them only: remove the archive that the other "
                         "replaces, or export the stores into one")
    client = MlflowClient(tracking_uri=uri)
    added = skipped = 0
    for path in paths:
        doc = load(path)
        gone = withdrawn(doc)
        for run in doc["runs"]:
            exp_id = mlflow_store._experiment_id(client, run["experiment"], uri)
            origin = _origin(run)
            found = client.search_runs([exp_id], filter_string=f"tags.`{ARCHIVED_ID}` = '{origin}'", max_results=1)
            if found:
                before = found[0].data.tags.get(ARCHIVE_FILE)
                if before != Path(path).name:  # the archive that replaced the one it came from
                    client.set_tag(found[0].info.run_id, ARCHIVE_FILE, Path(path).name)
                    log(f"{path}: run {origin} was imported from {before}; now reported as this archive's")
                skipped += 1
                continue
            new = client.create_run(exp_id, start_time=run.get("start_time"), run_name=run.get("name") or None)
            rid = new.info.run_id
            try:
                tags = {**run["tags"], ARCHIVED_ID: origin, ARCHIVE_FILE: Path(path).name}
                held = sorted(k for k in run["metrics"] if k in gone)
                if held:
                    tags[WITHDRAWN] = "; ".join(f"{k}: {gone[k]}" for k in held)[:5000]
                tags.pop("mlflow.runName", None)
                mlflow_store.log_batched(client, rid, params=[Param(k, str(v)) for k, v in run["params"].items()],
                                         tags=[RunTag(k, str(v)) for k, v in tags.items()],
                                         metrics=[Metric(k, float(v), int(ts), int(step))
                                                  for k, hist in run["metrics"].items() if k not in gone
                                                  for step, v, ts in hist])
            except BaseException:
                client.delete_run(rid)  # nothing half-imported stays (a later import retries the run)
                raise
            client.set_terminated(rid, status=run.get("status") or "FINISHED", end_time=run.get("end_time"))
            added += 1
        log(f"{path}: {len(doc['runs'])} runs")
    return added, skipped


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fp4moe.runs.archive", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="write the runs of one or more stores to a JSON archive")
    e.add_argument("store", nargs="+", help="tracking URI, .db file, or folder holding mlflow.db (several: one archive)")
    e.add_argument("out", help="the archive to write (.json, or .json.xz: compressed)")
    e.add_argument("--note", required=True, help="what the runs are: hardware, commit, date, command")
    e.add_argument("--experiment", action="append", help="only this MLflow experiment (repeatable)")
    i = sub.add_parser("import", help="load archives into a store (idempotent)")
    i.add_argument("paths", nargs="+", help="archive files, or folders holding them")
    i.add_argument("--uri", help="target: tracking URI, .db file, or folder holding mlflow.db (default: "
                                  "MLFLOW_TRACKING_URI or <repo>/mlruns/mlflow.db)")
    w = sub.add_parser("withdraw", help="mark metrics of an archive as wrong (import leaves them out)")
    w.add_argument("archive", help="the archive (.json or .json.xz), rewritten atomically")
    w.add_argument("--metric", action="append", required=True, help="metric key (repeatable)")
    w.add_argument("--reason", required=True, help="why the values are wrong (kept in the archive and as a tag)")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "export":
            n = export(a.store, a.out, a.note, a.experiment)
            print(f"{a.out}: {n} runs")
        elif a.cmd == "withdraw":
            n = withdraw(a.archive, a.metric, a.reason)
            print(f"{a.archive}: {', '.join(a.metric)} withdrawn in {n} runs")
        else:
            added, skipped = import_files(expand(a.paths), a.uri)
            print(f"imported {added} runs, {skipped} already there")
    except ArchiveError as exc:
        print(f"fp4moe.runs.archive: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
