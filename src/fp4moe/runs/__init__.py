"""The trainer's runs as records: where a run lives, what it says at its end, and archives of runs. No torch.

- :mod:`fp4moe.runs.folder`: the run folder of ``python -m fp4moe.train``, one per config (the same command
  resumes a stopped run)
- :mod:`fp4moe.runs.outcome`: the trainer's final ``done:`` line and a multirun's table of cells (the Hydra
  callback ``hydra.callbacks.summary``)
- :mod:`fp4moe.runs.archive`: ``python -m fp4moe.runs.archive``, trainer runs as JSON (results/train_proxy/) <->
  any MLflow store
"""
