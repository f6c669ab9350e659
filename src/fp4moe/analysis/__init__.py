"""The paper-scale model (fp4moe.scale) against our measurements and beside the paper: each study reads its inputs
through results/manifest.yaml (the result files, what each is, the GPU, date and commit that made it) and writes one
Markdown file of results/scale/. No torch; no file, path or commit named in the code.

    python -m fp4moe.analysis.calibration              # -> results/scale/calibration.md: the memory model vs the H200 runs
    python -m fp4moe.analysis.throughput_calibration   # -> results/scale/throughput.md: predicted vs measured tokens/s
    python -m fp4moe.analysis.paper_t1                 # -> results/scale/paper_t1.md: T1 as experiment=paper_t1 runs it
    python -m fp4moe.analysis.paper_t2                 # -> results/scale/paper_t2.md: T2 under every scope and reading

- :mod:`~fp4moe.analysis.manifest`: the manifest's reader (inputs by study and role, the hand-read constants, notes);
- :mod:`~fp4moe.analysis.outside_torch_measured`: the measured memory outside PyTorch as the memory model's assumptions;
- :mod:`~fp4moe.analysis.calibration`, :mod:`~fp4moe.analysis.throughput_calibration`, :mod:`~fp4moe.analysis.paper_t1`,
  :mod:`~fp4moe.analysis.paper_t2`: the studies (the report uses the last three's predictions).
"""
