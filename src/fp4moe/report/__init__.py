"""The reproduction's report (issue 6, P5): MLflow runs + conf/paper/numbers.yaml + the paper-scale model ->
``results/report/`` (Markdown, CSV, PNG). ``python -m fp4moe.report [--tracking-uri URI] [--out DIR]``.

No torch: this package reads MLflow and the config only (checked by tests/report and the import-linter contracts
in pyproject.toml). The paper's numbers come from :mod:`fp4moe.paper` (conf/paper/numbers.yaml only).

- :mod:`fp4moe.report.store`: runs read from an MLflow store (trainer, ``kernels``, ``moe_layer``)
- :mod:`fp4moe.report.predictions`: the paper-scale model's T1 prediction for experiment=paper_t1 (fp4moe.scale under
  fp4moe.analysis.paper_t1's assumption set; its allocated peak checked on 1-2 H200s, not at paper scale) and what-ifs
- :mod:`fp4moe.report.tables`: the tables (T1, F3, F4, F5) as rows of plain values
- :mod:`fp4moe.report.render`: Markdown, CSV and plots, written atomically
"""
from .render import build_report, write_report

__all__ = ["build_report", "write_report"]
