"""fp4moe.analysis.output: where a study writes its Markdown, and a ``--out`` it could not write refused before the
study computes anything (before, each study read its runs and ran the model, then ended in FileExistsError's
traceback)."""
import pytest

from fp4moe.analysis import calibration
from fp4moe.analysis.output import markdown_cli, out_problem, target


def test_a_study_writes_its_file_atomically_where_out_says(tmp_path, capsys):
    out = tmp_path / "new" / "t1.md"
    assert markdown_cli(["--out", str(out)], "doc", "paper_t1", lambda: "# T1\n") == 0
    assert out.read_text() == "# T1\n" and sorted(p.name for p in out.parent.iterdir()) == ["t1.md"]
    assert capsys.readouterr().out == f"wrote {out}\n"
    assert target(None, "paper_t1").name == "paper_t1.md"   # the manifest's output


@pytest.mark.parametrize("where, said", [
    (lambda tmp: tmp / "a_file" / "t1.md", "{tmp}/a_file is not a folder; give a file in a folder this process can "
                                           "create or write"),
    (lambda tmp: tmp, "{tmp} is a folder; give the Markdown file to write"),
])
def test_an_out_it_could_not_write_is_refused_before_the_study_runs(tmp_path, capsys, where, said):
    (tmp_path / "a_file").write_text("")
    out = where(tmp_path)

    def study():
        raise AssertionError("the study ran before --out was checked")

    with pytest.raises(SystemExit) as err:
        markdown_cli(["--out", str(out)], "doc", "paper_t1", study)
    assert err.value.code == 2
    line = capsys.readouterr().err.splitlines()[-1]
    assert line == f"python -m fp4moe.analysis.paper_t1: error: --out {out}: {said.format(tmp=tmp_path)}"
    assert out_problem(tmp_path / "fine.md", "paper_t1") is None


def test_calibration_checks_out_first(tmp_path, capsys, monkeypatch):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setattr(calibration, "document", lambda *a: pytest.fail("the study ran before --out was checked"))
    with pytest.raises(SystemExit) as err:
        calibration.main(["--out", str(tmp_path / "a_file" / "c.md")])
    assert err.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(
        f"python -m fp4moe.analysis.calibration: error: --out {tmp_path / 'a_file' / 'c.md'}: ")
