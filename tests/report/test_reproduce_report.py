"""make reproduce-table's report step (fp4moe.reproduce.pipeline.run_report)."""
from fp4moe.reproduce import pipeline


def test_reproduce_writes_the_report(monkeypatch, tmp_path, report_store, capsys):
    monkeypatch.setenv("FP4MOE_HOME", str(tmp_path))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", report_store)
    assert pipeline.run_report()
    text = (tmp_path / "results/report/report.md").read_text()
    assert "| attention + layernorm + MoE experts | bf16 | 1122 | 68.29 % |" in text
    assert "| attention + layernorm + MoE experts | 5000 (4900-5100); 90.5 GiB (64.6 % of the GPU) |" in text
    assert "report: see results/report/report.md" in capsys.readouterr().out


def test_reproduce_without_mlflow_skips_the_report(monkeypatch, capsys):
    real = pipeline.importlib.util.find_spec
    monkeypatch.setattr(pipeline.importlib.util, "find_spec",
                        lambda name, *a: None if name == "mlflow" else real(name, *a))
    assert pipeline.run_report()
    assert "report: skipped, mlflow is not installed" in capsys.readouterr().out
