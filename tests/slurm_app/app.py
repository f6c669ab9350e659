"""A small real Hydra app with the trainer's Slurm contract (P4 tests; stands in for ``python -m fp4moe.train``).

It composes the trainer's own root config (conf/train.yaml, ``config_name=train``), so it takes the same overrides
(``experiment=tiny_cpu cluster=slurm_local hydra/launcher=slurm_local``, ``train.steps``, ...), and runs the loop of
fp4moe.slurm's docstring: a toy "training" state (step and a decaying loss) in a JSON checkpoint under
``train.checkpoint_dir``, one MLflow run per cell in ``tracking.uri``, checkpoint-and-requeue on the Slurm signal,
test faults from ``+fault.*``. Returns the cell's result (the launcher gets it back through submitit).

    python tests/slurm_app/app.py -m experiment=tiny_cpu cluster=slurm_local hydra/launcher=slurm_local
"""
import json
import os
from pathlib import Path

import hydra
import mlflow
from omegaconf import DictConfig

from fp4moe import slurm

CONF = Path(__file__).resolve().parents[2] / "conf"


@hydra.main(config_path=str(CONF), config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> dict:
    ckpts = slurm.Checkpoints(slurm.checkpoint_dir(cfg.train.checkpoint_dir))
    last = ckpts.latest()
    state = json.loads(last.path.read_text()) if last else {"step": 0, "loss": 10.0}
    resumed_from = state["step"]
    interval = cfg.train.checkpoint_interval or cfg.train.steps
    params = {"precision": cfg.precision.name, "steps": cfg.train.steps, "task_name": cfg.task_name}
    with slurm.mlflow_run(ckpts, cfg.tracking.experiment, f"precision={cfg.precision.name}", params,
                          uri=cfg.tracking.uri) as run, slurm.Preemption() as preempt:
        mlflow.log_metric("resumed_from_step", resumed_from, step=resumed_from)
        for step in range(state["step"], cfg.train.steps):
            state = {"step": step + 1, "loss": state["loss"] * 0.9}
            mlflow.log_metric("loss", state["loss"], step=step)
            slurm.inject_faults(cfg, step)
            stop = preempt.requested()
            if stop or (step + 1) % interval == 0:
                ckpts.save(step + 1, lambda path: path.write_text(json.dumps(state)))
            if stop:
                preempt.requeue()
    return {"run_id": run.info.run_id, "loss": state["loss"], "steps": state["step"], "resumed_from": resumed_from,
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "checkpoint_dir": str(ckpts.dir)}


if __name__ == "__main__":
    main()
