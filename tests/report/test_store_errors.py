"""An unreachable or wrong MLflow store is one line naming it and the fix, within seconds, for the report and the
notebooks (fp4moe.report.store.load; before: mlflow retried a closed port for 248 s and printed five tracebacks)."""
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from fp4moe.report import store
from fp4moe.tracking.mlflow_store import TrackingUnavailable


@pytest.mark.parametrize("server, reason", [("closed", "Connection refused"), ("silent", "timed out")])
def test_report_on_an_unreachable_server_is_one_line_in_seconds(tmp_path, server, reason):
    """A closed port, or a port that accepts connections and never answers (mlflow itself would wait 120 s for each
    of 7 retries)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        if server == "silent":
            s.listen(8)
        uri = f"http://127.0.0.1:{s.getsockname()[1]}"
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "fp4moe.report", "--tracking-uri", uri, "--out",
                               str(tmp_path / "r")], capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert time.monotonic() - start < 30  # the imports and the 3 s probe, on a loaded CI machine (mlflow: minutes)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"fp4moe.report: MLflow tracking server {uri} is not reachable (")
    assert f"{reason} on GET {uri}/health)" in line
    assert "--tracking-uri" in line and "mlflow server" in line  # the fixes
    assert not (tmp_path / "r").exists()


class _NotMlflow(BaseHTTPRequestHandler):
    """A web server that is not MLflow: 404 for everything (its /health too)."""

    def _404(self):
        self.send_response(404)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(b"<!DOCTYPE html>\n<html><body>Not Found</body></html>\n")

    do_GET = do_POST = _404

    def log_message(self, *args):
        pass


def test_a_wrong_store_is_one_line(tmp_path):
    not_a_db = tmp_path / "notes.db"
    not_a_db.write_text("not a database")
    with pytest.raises(TrackingUnavailable, match=r"notes\.db cannot be read as an SQLite database .* --tracking-uri"):
        store.load(not_a_db)
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as con:
        con.execute("CREATE TABLE things (x)")
    with pytest.raises(TrackingUnavailable, match=r"other\.db is an SQLite database but not an MLflow store"):
        store.load(other)
    assert [r[0] for r in sqlite3.connect(other).execute("SELECT name FROM sqlite_master")] == ["things"]  # untouched

    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotMlflow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    uri = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        start = time.monotonic()
        with pytest.raises(TrackingUnavailable) as err:
            store.load(uri)
        assert time.monotonic() - start < 30  # ~2 s alone, 11 s seen under a loaded CI machine (mlflow: minutes)
    finally:
        server.shutdown()
    (line,) = str(err.value).splitlines()
    assert line.startswith(f"MLflow store {uri} could not be read (MlflowException: ") and "tracking_uri" in line
    # what Jupyter shows in place of a traceback (IPython's _render_traceback_): that one line
    assert err.value._render_traceback_() == [f"TrackingUnavailable: {line}"]


@pytest.mark.parametrize("where", ["mlrun", "notes.txt", "gone.db"])
def test_a_store_named_that_does_not_exist_is_refused_not_read_as_empty(tmp_path, monkeypatch, capsys, where):
    """--tracking-uri with a misspelled folder or file used to give an empty store: a report without a single run,
    written over the output folder."""
    from fp4moe.report.__main__ import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("a file, not a folder holding mlflow.db")
    out = tmp_path / "r"
    out.mkdir()
    (out / "report.md").write_text("the last report")
    assert main(["--tracking-uri", where, "--out", str(out)]) == 2
    got = capsys.readouterr()
    assert got.out == ""
    (line,) = got.err.splitlines()
    assert line.startswith(f"fp4moe.report: --tracking-uri {where}: no MLflow store there (") and "does not exist" in line
    assert [p.name for p in out.iterdir()] == ["report.md"] and (out / "report.md").read_text() == "the last report"


def test_an_output_folder_that_cannot_be_made_is_refused_before_the_report_is_built(tmp_path, capsys):
    """--out under a file: one line naming it, exit 2, before the store is read or the model run (it used to build the
    whole report, then stop in mkdir with FileExistsError's traceback)."""
    from fp4moe.report.__main__ import main

    blocker = tmp_path / "report.md"
    blocker.write_text("a file where a folder was meant")
    assert main(["--out", str(blocker / "r")]) == 2
    got = capsys.readouterr()
    assert got.out == ""
    assert got.err == (f"fp4moe.report: --out {blocker / 'r'}: {blocker} is not a folder; give a folder this process "
                       "can create or write (default: <repo>/results/report)\n")
    assert blocker.read_text() == "a file where a folder was meant"
