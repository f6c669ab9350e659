"""Dry run of a Hydra multirun sweep on Slurm (P4, issue 5): what would be submitted, without submitting.

    python -m fp4moe.launch dry-run experiment=paper_t1 [overrides...] [--summary]

For each cell of the experiment's sweep (``hydra.sweeper.params`` plus the command line's own sweeps, expanded
by Hydra's ``BasicSweeper.split_arguments``: the cartesian product, in Hydra's order) it composes the config
through Hydra's compose API, runs ``fp4moe.config.check``, and prints the resolved config (or a summary) and the
sbatch script, written by submitit's own ``SlurmExecutor`` from the ``hydra.launcher`` values exactly as
hydra-submitit-launcher hands them over. Exits 1 with the ``ConfigError`` message(s) when a cell fails the check,
2 when the config does not compose.

The launcher profile is the one on the command line (``hydra/launcher=slurm_h100``); when none is given and the
composed cluster is a Slurm one (``cluster.kind: slurm``), ``hydra/launcher=<cluster.name>`` is added, the profile of
the same name in conf/hydra/launcher/. A cell whose launcher is not Slurm (local, basic) prints no sbatch script.

What differs from a real submission: the script's command is ``python -m fp4moe.train hydra.mode=RUN <cell
overrides>``, the job one cell stands for. hydra-submitit-launcher submits the same header and setup lines, but
with ``python -u -m submitit.core._submit <folder>`` (a pickled Hydra job with these overrides) as the command, and
all cells of a sweep as one job array (``--array=0-<n-1>%<array_parallelism>``, log paths ``%A_%a``).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence
from unittest import mock

from omegaconf import DictConfig, OmegaConf, open_dict

from fp4moe.config import ConfigError, check

CONF_DIR = Path(os.environ.get("FP4MOE_CONF_DIR", Path(__file__).resolve().parents[2] / "conf"))
TRAIN_MODULE = "fp4moe.train"
DRY_RUN_JOB_ID = "dry-run"


@dataclass
class Cell:
    """One job of the sweep: its overrides (as the launcher gets them), composed config (without the ``hydra``
    node), ``check``'s derived values, the resolved ``hydra.launcher`` and the sbatch script (None if not Slurm)."""
    overrides: list[str]
    cfg: DictConfig
    derived: dict[str, Any]
    launcher: dict[str, Any]
    sbatch: str | None


# ---------------------------------------------------------------------------------------------- composition

def _compose(overrides: Sequence[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=list(overrides), return_hydra_config=True)


def _parser():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def _with_launcher(overrides: Sequence[str]) -> list[str]:
    """The overrides, plus ``hydra/launcher=<cluster.name>`` when none is given and the cluster is Slurm."""
    overrides = list(overrides)
    parsed = _parser().parse_overrides(overrides)
    if any(o.get_key_element().lstrip("+~") == "hydra/launcher" for o in parsed):
        return overrides
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    cluster = _compose(fixed).cluster
    name = str(cluster.get("name"))
    if cluster.get("kind") == "slurm" and (CONF_DIR / "hydra" / "launcher" / f"{name}.yaml").is_file():
        overrides.append(f"hydra/launcher={name}")
    return overrides


def sweep_cells(overrides: Sequence[str]) -> list[list[str]]:
    """The override list of every job of the multirun, as Hydra's basic sweeper builds it: the config's
    ``hydra.sweeper.params`` first, then the command line's overrides (a key on both keeps the sweeper's position
    and takes the command line's value), cartesian product in that order. Adds the Slurm launcher (see module)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    parser = _parser()
    for o in parser.parse_overrides(list(overrides)):  # `optional experiment` would silently skip a typo
        if o.get_key_element().lstrip("+") == "experiment" and not o.is_sweep_override():
            if not (CONF_DIR / "experiment" / f"{o.get_value_element_as_str()}.yaml").is_file():
                raise ConfigError(f"experiment={o.get_value_element_as_str()}: no conf/experiment/"
                                  f"{o.get_value_element_as_str()}.yaml; pick one of "
                                  f"{', '.join(sorted(p.stem for p in (CONF_DIR / 'experiment').glob('*.yaml')))}")
    overrides = _with_launcher(overrides)
    fixed = [o.input_line for o in parser.parse_overrides(overrides) if not o.is_sweep_override()]
    params = OmegaConf.select(_compose(fixed), "hydra.sweeper.params") or {}
    params_conf = [f"{k}={v}" for k, v in params.items()] + overrides
    (cells,) = BasicSweeper.split_arguments(parser.parse_overrides(params_conf), None)
    return cells


# ---------------------------------------------------------------------------------------------- sbatch

def train_command(overrides: Sequence[str]) -> str:
    """The job one cell stands for: the trainer on that cell alone (``hydra.mode=RUN``: no nested sweep)."""
    return " ".join(["python", "-m", TRAIN_MODULE, "hydra.mode=RUN", *(shlex.quote(o) for o in overrides)])


def sbatch_text(launcher: dict[str, Any], command: str) -> str:
    """The sbatch script submitit writes for ``launcher`` (a resolved ``hydra.launcher`` of ``submitit_slurm``),
    through the same path as hydra-submitit-launcher 1.2.0 (``BaseSubmititLauncher.launch``): AutoExecutor with
    ``slurm_max_num_timeout``, generic keys as they are, the others prefixed ``slurm_``, then the executor's own
    ``_make_submission_file_text``. Only the "is srun on PATH" probe is bypassed, so this runs without Slurm."""
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from submitit.slurm.slurm import SlurmExecutor

    params = {k: v for k, v in launcher.items() if k != "_target_"}
    folder = params.pop("submitit_folder")
    init = {"slurm_max_num_timeout": params.pop("max_num_timeout")} if "max_num_timeout" in params else {}
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    params = {k if k in base else f"slurm_{k}": v for k, v in params.items()}
    with mock.patch.object(SlurmExecutor, "affinity", classmethod(lambda cls: 2)):
        executor = submitit.AutoExecutor(folder=folder, cluster="slurm", **init)
    executor.update_parameters(**params)
    return executor._executor._make_submission_file_text(command, DRY_RUN_JOB_ID)


def _is_slurm(launcher: dict[str, Any]) -> bool:
    return str(launcher.get("_target_", "")).endswith(".SlurmLauncher")


# ---------------------------------------------------------------------------------------------- dry run

def dry_run(overrides: Sequence[str]) -> tuple[list[Cell], list[tuple[list[str], str]]]:
    """Compose and check every cell. Returns (cells that pass, [(overrides, ConfigError message)] that fail)."""
    cells, failures = [], []
    all_cells = sweep_cells(overrides)
    # Hydra resolves the sweep directory (${now:...}) once for the whole multirun: pin it for every cell.
    sweep_dir = str(_compose([o.input_line for o in _parser().parse_overrides(all_cells[0])]).hydra.sweep.dir)
    pin = "hydra.sweep.dir='" + sweep_dir.replace("\\", "\\\\").replace("'", "\\'") + "'"
    for cell in all_cells:
        cfg = _compose([*cell, pin])
        launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
        with open_dict(cfg):
            del cfg["hydra"]
        try:
            d = check(cfg)
        except ConfigError as e:
            failures.append((cell, str(e)))
            continue
        script = sbatch_text(launcher, train_command(cell)) if _is_slurm(launcher) else None
        cells.append(Cell(cell, cfg, d, launcher, script))
    return cells, failures


def sbatch_scripts(experiment: str, overrides: Sequence[str] = ()) -> list[tuple[list[str], str]]:
    """(overrides, sbatch script) of each cell of ``experiment=<experiment>`` with ``overrides``; raises
    ConfigError (the first cell's message) when a cell fails the check."""
    cells, failures = dry_run([f"experiment={experiment}", *overrides])
    if failures:
        raise ConfigError(failures[0][1])
    return [(c.overrides, c.sbatch) for c in cells]


def summary(cell: Cell) -> str:
    cfg, d = cell.cfg, cell.derived
    sel = lambda k: OmegaConf.select(cfg, k)  # noqa: E731
    p = cfg.parallel
    lines = [
        f"task_name: {sel('task_name')}",
        f"model: {sel('model.name')}  params total/active: {d['params_total'] / 1e9:.1f}B / {d['params_active'] / 1e9:.1f}B",
        f"precision: {sel('precision.name')}  recompute: {sel('recompute.name')} ({sel('recompute.paper_label')})",
        f"cluster: {sel('cluster.name')}  {sel('cluster.nodes')} nodes x {sel('cluster.gpus_per_node')} = "
        f"world {d['world_size']}  time limit {sel('cluster.time_limit_min')} min",
        f"parallel: TP{p.tensor} PP{p.pipeline} CP{p.context} EP{p.expert} DP{p.data}  micro {p.micro_batch} "
        f"global {p.global_batch} seq {p.seq_length}  grad accum {d['grad_accum_steps']}",
        f"train: {d['steps']} steps, {d['tokens_per_step']} tokens/step, {d['tokens']} tokens",
    ]
    from fp4moe import bench_job

    if bench_job.is_bench(cfg):  # F3/F4: the job runs a benchmark; the model/train lines do not apply
        lines = [lines[0], lines[3], f"parallel: EP{p.expert} world {d['world_size']}",
                 f"bench: {cfg.bench.module}.main({' '.join(map(str, cfg.bench.args))}) in each of the "
                 f"{d['world_size']} GPU process(es) (fp4moe.bench_job); without Hydra: {bench_job.command(cfg)}"]
    return "\n".join(lines)


def _print_cell(i: int, n: int, cell: Cell, short: bool) -> None:
    print(f"# ===== cell {i}/{n}: {' '.join(cell.overrides)}")
    print("# ----- config" + (" (summary)" if short else " (resolved)"))
    print(summary(cell) if short else OmegaConf.to_yaml(cell.cfg, resolve=True).rstrip())
    if cell.sbatch is None:
        print(f"# ----- launcher {cell.launcher.get('_target_')}: not Slurm, no sbatch script")
    else:
        print("# ----- sbatch script (not submitted; hydra-submitit-launcher runs the same header and setup with "
              "`python -u -m submitit.core._submit <folder>`, all cells as one job array)")
        print(cell.sbatch.rstrip())
    print()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fp4moe.launch", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    dr = sub.add_parser("dry-run", help="print each cell's resolved config and sbatch script; submit nothing")
    dr.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. experiment=paper_t1 hydra/launcher=slurm_h200")
    dr.add_argument("--summary", action="store_true", help="a short summary instead of the full resolved config")
    args = ap.parse_args(argv)
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        cells, failures = dry_run(args.overrides)
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        print(f"fp4moe.launch: the config does not compose: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    n = len(cells) + len(failures)
    for i, cell in enumerate(cells, 1):
        _print_cell(i, n, cell, args.summary)
    for cell_overrides, msg in failures:
        print(f"fp4moe.launch: cell {' '.join(cell_overrides)} fails the check: ConfigError: {msg}", file=sys.stderr)
    if failures:
        print(f"fp4moe.launch: {len(failures)} of {n} cells cannot run; nothing would be submitted", file=sys.stderr)
        return 1
    print(f"# {n} cell(s) pass fp4moe.config.check; nothing submitted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
