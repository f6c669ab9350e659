"""Dry run of a Hydra multirun sweep on Slurm (P4, issue 5): what would be submitted, without submitting.

    python -m fp4moe.launch dry-run experiment=paper_t1 [overrides...] [--summary] [--scripts] [--strict]

For each cell of the experiment's sweep (``hydra.sweeper.params`` plus the command line's own sweeps, expanded
by Hydra's ``BasicSweeper.split_arguments``: the cartesian product, in Hydra's order) it composes the config
through Hydra's compose API, runs ``fp4moe.config.check``, prints the resolved config (``--summary``: a few lines of
it), the Slurm job (nodes, GPUs, time limit, partition/account/QoS, ...: each with the config key or environment
variable that sets it, and whether it is the profile's default), the paper-scale memory model's predicted peak
(``predicted_memory``: the most loaded GPU and the mean over the job's GPUs, as nvidia-smi would show them, against
``cluster.gpu_memory_gb``) and, with ``--scripts``, the sbatch script, written by submitit's own ``SlurmExecutor``
from the ``hydra.launcher`` values exactly as hydra-submitit-launcher hands them over. The site settings the jobs
export (``cluster.env``: NCCL/InfiniBand, host threads) are printed once, each with its origin. Exits 1 with the
``ConfigError`` message(s) when a cell fails the check, 2 when the config does not compose (or a value cannot go
into an sbatch script: fp4moe.launch.shell), 3 under ``--strict`` when a cell is predicted not to fit the GPU (without
``--strict`` such a cell is a warning). A cell predicted to fit that the model's measured error puts on either
side of the GPU's memory (``Memory.outcome`` 'edge') is a warning, with or without ``--strict``.

Without a corpus (``data=user_corpus`` and neither ``FP4MOE_CORPUS`` nor ``data.path`` set) the cells are checked
with a placeholder path, and the dry run says once what the jobs will need.

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
import re
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any, Sequence
from unittest import mock

from omegaconf import DictConfig, OmegaConf, open_dict

from fp4moe.config import ConfigError, check
from fp4moe.paths import conf_dir
from fp4moe.launch.shell import UnsafeValue
from fp4moe.settings import Settings, schema_picked

CONF_DIR = conf_dir()   # fp4moe.paths: $FP4MOE_CONF_DIR, else the checkout's conf/
TRAIN_MODULE = "fp4moe.train"
DRY_RUN_JOB_ID = "dry-run"
CORPUS_VAR = "FP4MOE_CORPUS"
CORPUS_PLACEHOLDER = f"<{CORPUS_VAR}>"   # data.path while a corpus-less cell is checked


@dataclass
class Memory:
    """The memory model's prediction for one cell, in GiB: the most loaded GPU (pipeline ``rank``, ``in_flight``
    micro-batches) and the mean over the job's GPUs, both as nvidia-smi would show them; ``gpu_gib`` the cluster's
    GPU (``cluster.gpu_memory_gb``, None: unknown); ``source`` where the outside-PyTorch terms come from.

    ``fits``: the predicted peak is within the GPU (what ``--strict`` goes by). ``outcome``: 'fits' / 'OOM' when
    the allocated peak lies on that side of the GPU (less the memory outside PyTorch) across the model's error
    measured on 1-2 H200s (``fp4moe.analysis.calibration.PEAK_ERR_RANGE``, ``gpu_outcome``), 'edge' when that error
    straddles it."""
    peak_gib: float
    allocated_gib: float
    mean_gib: float
    rank: int
    in_flight: int
    gpu_gib: float | None
    source: str

    @property
    def outcome(self) -> str | None:
        from fp4moe.analysis.calibration import gpu_outcome

        return None if self.gpu_gib is None else gpu_outcome(self.peak_gib, self.allocated_gib, self.gpu_gib)

    @property
    def fits(self) -> bool | None:
        return None if self.gpu_gib is None else self.peak_gib <= self.gpu_gib

    def text(self, world: int) -> str:
        from fp4moe.analysis.calibration import PEAK_ERR_RANGE

        pct = "" if self.gpu_gib is None else f" ({100 * self.peak_gib / self.gpu_gib:.1f} % of the GPU's {self.gpu_gib:g} GiB)"
        lo, hi = (100 * e for e in PEAK_ERR_RANGE)
        verdict = {None: "no GPU size to check against (cluster.gpu_memory_gb)", True: "fits",
                   False: "PREDICTED NOT TO FIT"}[self.fits]
        if self.outcome == "edge":
            verdict += (f", AT THE EDGE (the model's error measured on 1-2 H200s, {lo:+.1f} % to {hi:+.1f} % of the "
                        "allocated peak, puts it on either side of the GPU; not checked at this scale)")
        return (f"most loaded GPU {self.peak_gib:.1f} GiB{pct} (pipeline rank {self.rank}, {self.in_flight} "
                f"micro-batch(es) in flight; allocated {self.allocated_gib:.1f}), mean over the {world} GPU(s) "
                f"{self.mean_gib:.1f} GiB: {verdict}")


@dataclass
class Setting:
    """One value of a job as the dry run shows it: ``label``, the resolved ``value`` and ``origin``, the config key
    or environment variable that sets it (``origin()``)."""
    label: str
    value: Any
    origin: str


@dataclass
class Cell:
    """One job of the sweep: its overrides (as the launcher gets them), composed config (without the ``hydra``
    node), its typed ``settings`` (``Settings.from_config`` of the config as checked: ``data.path`` is
    ``CORPUS_PLACEHOLDER`` when ``needs`` names the corpus), ``check``'s derived values, the resolved
    ``hydra.launcher``, the sbatch script (None if not Slurm), the memory model's prediction (a ``Memory``, or the
    reason it has none), the Slurm job's settings and the exported environment (``cluster.env``), each a list of
    ``Setting`` (empty if not Slurm), and what the job needs that the dry run did not have (e.g. the corpus)."""
    overrides: list[str]
    cfg: DictConfig
    settings: Settings
    derived: dict[str, Any]
    launcher: dict[str, Any]
    sbatch: str | None
    memory: Memory | str = "not predicted"
    job: list[Setting] = field(default_factory=list)
    env: list[Setting] = field(default_factory=list)
    needs: list[str] = field(default_factory=list)


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

    why = schema_picked(overrides, CONF_DIR)
    if why is not None:
        raise ConfigError(why)
    parser = _parser()
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


# ---------------------------------------------------------------------------------------------- memory

def predicted_memory(cfg: DictConfig, settings: Settings) -> Memory | str:
    """fp4moe.scale.memory's peak for the job ``cfg`` runs (``settings``: its typed config; its own dispatcher and
    recipe, the measured outside-PyTorch terms of fp4moe.analysis.outside_torch_measured), or why there is none (a benchmark
    job, a layout the model does not cover)."""
    from fp4moe.launch import bench_job
    from fp4moe.analysis.outside_torch_measured import measured_assumptions
    from fp4moe.scale.memory import GB, mean_total_bytes, per_stage_memory

    if bench_job.is_bench(cfg):
        return "not predicted: a benchmark job, not a training run"
    a = measured_assumptions(deepep_buffers=settings.parallel.dispatcher == "flex")
    try:
        stages = per_stage_memory(cfg, a, recipe=settings.precision)
    except (ValueError, KeyError) as e:
        return f"not predicted: {e}"
    b = max(stages, key=lambda x: x.total_bytes)
    gpu = settings.cluster.gpu_memory_gb
    return Memory(b.total_gb, b.allocated_gb, mean_total_bytes(stages) / GB, b.pipeline_rank, b.in_flight,
                  None if gpu is None else float(gpu), a.outside_torch_source)


# ---------------------------------------------------------------------------------------------- origins

_ENV_REF = re.compile(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)")
_KEY_REF = re.compile(r"\$\{(?:oc\.select:)?([A-Za-z_]\w*(?:\.\w+)+)[},]")


def _raw(cfg: DictConfig, key: str) -> Any:
    """The unresolved value of the dotted ``key`` (an interpolation stays its ``${...}`` text); None if absent."""
    parent, _, last = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if not isinstance(node, DictConfig) or last not in node:
        return None
    return node._get_node(last)._value()


def _given(key: str, overrides: Sequence[str]) -> str | None:
    """The command-line override of ``key`` among ``overrides``, if any."""
    for o in overrides:
        k, sep, _ = o.partition("=")
        if sep and k.lstrip("+~") == key:
            return o
    return None


def origin(cfg: DictConfig, key: str, overrides: Sequence[str] = ()) -> str:
    """What sets the value of the dotted ``key`` of ``cfg`` (with its ``hydra`` node), for a person who wants to
    change it: ``command line: <override>``; ``$VAR`` (an environment variable, set now); ``default; set $VAR or
    <key>=...`` (the variable is unset: the profile's default); else the config key that holds it (its YAML file or
    the experiment's override). Follows references (``${cluster.nodes}``, resolvers around one) to the key they name."""
    for _ in range(8):
        given = _given(key, overrides)
        if given:
            return f"command line: {given}"
        raw = _raw(cfg, key)
        if not isinstance(raw, str):
            break
        env = _ENV_REF.search(raw)
        if env:
            var = env.group(1)
            return f"${var}" if var in os.environ else f"default; set ${var} or {key}=..."
        ref = _KEY_REF.search(raw)
        if not ref:
            break
        key = ref.group(1)
    return key


# ---------------------------------------------------------------------------------------------- job settings

# (label, hydra.launcher key) of the Slurm job, in the order the dry run prints them
JOB_KEYS = [("nodes", "nodes"), ("GPUs per node", "gpus_per_node"), ("tasks per node", "tasks_per_node"),
            ("CPUs per task", "cpus_per_task"), ("memory per node", "mem_gb"), ("time limit", "timeout_min"),
            ("partition", "partition"), ("account", "account"), ("QoS", "qos"), ("constraint", "constraint"),
            ("requeue", "additional_parameters"), ("signal before limit", "signal_delay_s"),
            ("requeues on time-out", "max_num_timeout")]


def _job_value(key: str, value: Any) -> str:
    if key == "additional_parameters":
        return "yes (--requeue)" if (value or {}).get("requeue") else "no (--no-requeue)"
    if value is None:
        return "- (not set: the site's default)"
    if key == "mem_gb":
        return "the whole node (--mem=0GB)" if value == 0 else f"{value} GB"
    if key == "timeout_min":
        return f"{value} min ({int(value) // 60}:{int(value) % 60:02d}:00)"
    if key == "signal_delay_s":
        return f"USR2 {value} s before"
    return str(value)


def job_settings(cfg: DictConfig, launcher: dict[str, Any], overrides: Sequence[str]) -> list[Setting]:
    """The Slurm job's resources and placement (``JOB_KEYS``) as the sbatch script gets them, each with its origin;
    ``cfg`` still holds its ``hydra`` node."""
    return [Setting(label, _job_value(key, launcher.get(key)), origin(cfg, f"hydra.launcher.{key}", overrides))
            for label, key in JOB_KEYS if key in launcher]


def env_settings(cfg: DictConfig, overrides: Sequence[str]) -> list[Setting]:
    """``cluster.env``, the variables the launcher's setup lines export (none when its ``setup`` does not read
    ``cluster.env``, e.g. slurm_local), each with its origin."""
    setup = OmegaConf.to_container(cfg.hydra.launcher, resolve=False).get("setup") or []
    if "cluster.env" not in str(setup):
        return []
    env = OmegaConf.to_container(cfg.cluster.env, resolve=True) or {}
    return [Setting(k, v, origin(cfg, f"cluster.env.{k}", overrides)) for k, v in env.items() if v is not None]


def _corpus_needs(cfg: DictConfig) -> list[str]:
    """What a cell's job needs that the dry run does not: the corpus of ``data=user_corpus`` when none is set."""
    if cfg.data.get("name") != "user_corpus" or cfg.data.get("path"):
        return []
    return [f"a corpus: export {CORPUS_VAR}=/path/to/text-or-jsonl-or-prefix (or pass data.path=...) in the shell "
            "that submits (Slurm passes its environment on to the jobs); the cells were checked without it"]


# ---------------------------------------------------------------------------------------------- dry run

def dry_run(overrides: Sequence[str]) -> tuple[list[Cell], list[tuple[list[str], str]]]:
    """Compose and check every cell. Returns (cells that pass, [(overrides, ConfigError message)] that fail). A
    cell without its corpus is checked with ``CORPUS_PLACEHOLDER`` as ``data.path``, its ``needs`` saying so."""
    import copy

    cells, failures = [], []
    all_cells = sweep_cells(overrides)
    # Hydra resolves the sweep directory (${now:...}) once for the whole multirun: pin it for every cell.
    sweep_dir = str(_compose([o.input_line for o in _parser().parse_overrides(all_cells[0])]).hydra.sweep.dir)
    pin = "hydra.sweep.dir='" + sweep_dir.replace("\\", "\\\\").replace("'", "\\'") + "'"
    for cell in all_cells:
        cfg = _compose([*cell, pin])
        launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
        slurm = _is_slurm(launcher)
        job = job_settings(cfg, launcher, cell) if slurm else []
        env = env_settings(cfg, cell) if slurm else []
        with open_dict(cfg):
            del cfg["hydra"]
        needs = _corpus_needs(cfg)
        checked = cfg
        if needs:
            checked = copy.deepcopy(cfg)
            with open_dict(checked):
                checked.data.path = CORPUS_PLACEHOLDER
        try:
            settings = Settings.from_config(checked)  # the typed config, once
            d = check(checked, settings)
        except ConfigError as e:
            failures.append((cell, str(e)))
            continue
        script = sbatch_text(launcher, train_command(cell)) if slurm else None
        cells.append(Cell(cell, cfg, settings, d, launcher, script, predicted_memory(cfg, settings), job, env, needs))
    return cells, failures


def sbatch_scripts(experiment: str, overrides: Sequence[str] = ()) -> list[tuple[list[str], str]]:
    """(overrides, sbatch script) of each cell of ``experiment=<experiment>`` with ``overrides``; raises
    ConfigError (the first cell's message) when a cell fails the check."""
    cells, failures = dry_run([f"experiment={experiment}", *overrides])
    if failures:
        raise ConfigError(failures[0][1])
    return [(c.overrides, c.sbatch) for c in cells]


def summary(cell: Cell) -> str:
    """A few lines of the cell's config (its ``settings``): model, precision, recompute, layout, training length,
    data."""
    cfg, s, d = cell.cfg, cell.settings, cell.derived
    p, c = s.parallel, s.cluster
    data = f"data: {s.data.name}"
    if s.data.path and not cell.needs:  # with needs, s.data.path is the placeholder the cell was checked with
        data += f"  path: {s.data.path}"
    elif cell.needs:
        data += f"  path: not set (the job needs ${CORPUS_VAR})"
    if s.data.name == "user_corpus":
        data += f"  tokenizer: {s.data.tokenizer.path or 'not set (a byte-level BPE is trained)'}"
    label = s.precision.label  # a variant of a preset: its own name (fp4moe.recipe.Recipe.tag), then the preset
    precision = f"{label} ({s.precision.name})" if label else s.precision.name
    lines = [
        f"task_name: {OmegaConf.select(cfg, 'task_name')}",
        f"model: {s.model.name}  params total/active: {d['params_total'] / 1e9:.1f}B / {d['params_active'] / 1e9:.1f}B",
        f"precision: {precision}  recompute: {s.recompute.name} ({s.recompute.paper_label})",
        f"cluster: {c.name}  {c.nodes} nodes x {c.gpus_per_node} = "
        f"world {d['world_size']}  time limit {c.time_limit_min} min",
        f"parallel: TP{p.tensor} PP{p.pipeline} CP{p.context} EP{p.expert} DP{p.data}  micro {p.micro_batch} "
        f"global {p.global_batch} seq {p.seq_length}  grad accum {d['grad_accum_steps']}",
        f"train: {d['steps']} steps, {d['tokens_per_step']} tokens/step, {d['tokens']} tokens",
        data,
    ]
    from fp4moe.launch import bench_job

    if bench_job.is_bench(cfg):  # F3/F4: the job runs a benchmark; the model/train lines do not apply
        lines = [lines[0], lines[3], f"parallel: EP{p.expert} world {d['world_size']}",
                 f"bench: {cfg.bench.module}.main({' '.join(map(str, cfg.bench.args))}) in each of the "
                 f"{d['world_size']} GPU process(es) (fp4moe.launch.bench_job); "
                 f"without Hydra: {bench_job.command(cfg.bench, p)}"]
    return "\n".join(lines)


def _table(settings: Sequence[Setting]) -> str:
    """``label  value  <- origin`` rows, aligned."""
    wl = max(len(s.label) for s in settings)
    wv = max(len(str(s.value)) for s in settings)
    return "\n".join(f"  {s.label:<{wl}}  {str(s.value):<{wv}}  <- {s.origin}" for s in settings)


def _print_cell(i: int, n: int, cell: Cell, short: bool, scripts: bool) -> None:
    print(f"# ===== cell {i}/{n}: {' '.join(cell.overrides)}")
    print("# ----- config" + (" (summary)" if short else " (resolved)"))
    print(summary(cell) if short else OmegaConf.to_yaml(cell.cfg, resolve=True).rstrip())
    if cell.sbatch is None:
        print(f"# ----- launcher {cell.launcher.get('_target_')}: not Slurm, no sbatch script")
    else:
        print(f"# ----- Slurm job {cell.launcher.get('name')} (value <- the config key or variable that sets it)")
        print(_table(cell.job))
    if isinstance(cell.memory, Memory):
        print(f"# ----- predicted peak memory (fp4moe.scale.memory; outside PyTorch: {cell.memory.source})")
        print(cell.memory.text(int(cell.derived["world_size"])))
    else:
        print(f"# ----- predicted peak memory: {cell.memory}")
    if scripts and cell.sbatch is not None:
        print("# ----- sbatch script (not submitted; hydra-submitit-launcher runs the same header and setup with "
              "`python -u -m submitit.core._submit <folder>`, all cells as one job array)")
        print(cell.sbatch.rstrip())
    print()


def _print_site(cells: Sequence[Cell]) -> None:
    """The exported environment (``cluster.env``) once per distinct set, naming the cells it applies to."""
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(cells, 1):
        if c.env:
            groups.setdefault(tuple((s.label, str(s.value), s.origin) for s in c.env), []).append(i)
    for env, idx in groups.items():
        every = len(idx) == sum(1 for c in cells if c.env)
        which = "every Slurm cell" if every else f"cells {', '.join(map(str, idx))}"
        print(f"# ===== site settings exported by {which}'s setup lines (cluster.env; value <- what sets it)")
        print(_table([Setting(*row) for row in env]))
        print()


def _cause(e: BaseException, kind: type) -> BaseException | None:
    """``e`` or the first exception of kind ``kind`` it was raised from (OmegaConf wraps a resolver's error)."""
    seen = 0
    while e is not None and seen < 16:
        if isinstance(e, kind):
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fp4moe.launch", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    dr = sub.add_parser("dry-run", help="print each cell's config, Slurm job and predicted memory; submit nothing")
    dr.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. experiment=paper_t1 hydra/launcher=slurm_h200")
    dr.add_argument("--summary", action="store_true", help="a short summary instead of the full resolved config")
    dr.add_argument("--scripts", action="store_true", help="also print each cell's full sbatch script")
    dr.add_argument("--strict", action="store_true",
                    help="refuse (exit 3) when a cell is predicted not to fit the GPU (cluster.gpu_memory_gb)")
    args = ap.parse_args(argv)
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        cells, failures = dry_run(args.overrides)
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        unsafe = _cause(e, UnsafeValue)
        if unsafe is not None:
            print(f"fp4moe.launch: {unsafe}", file=sys.stderr)
        else:  # a wrong type or a key no schema has (fp4moe.settings) in one line; others as Hydra says them
            from fp4moe.settings import explain

            said = explain(e) if isinstance(e, (HydraException, OmegaConfBaseException)) else f"{type(e).__name__}: {e}"
            print(f"fp4moe.launch: the config does not compose: {said}", file=sys.stderr)
        return 2
    n = len(cells) + len(failures)
    for i, cell in enumerate(cells, 1):
        _print_cell(i, n, cell, args.summary, args.scripts)
    _print_site(cells)
    for cell_overrides, msg in failures:
        print(f"fp4moe.launch: cell {' '.join(cell_overrides)} fails the check: ConfigError: {msg}", file=sys.stderr)
    if failures:
        print(f"fp4moe.launch: {len(failures)} of {n} cells cannot run; nothing would be submitted", file=sys.stderr)
        return 1
    needs = list(dict.fromkeys(need for c in cells for need in c.needs))
    if needs:
        print(f"# ===== the job(s) will need{' (every cell)' if all(c.needs for c in cells) else ''}")
        for need in needs:
            print(f"- {need}")
        print()
    # cells that fit as predicted but not across the model's error (those that do not fit are warned of below)
    edge = [c for c in cells if isinstance(c.memory, Memory) and c.memory.outcome == "edge" and c.memory.fits]
    for c in edge:
        print(f"fp4moe.launch: WARNING: cell {' '.join(c.overrides)} is at the edge of the GPU's memory: "
              f"{c.memory.text(int(c.derived['world_size']))}. It may run out of memory; lighten it to be sure "
              "(results/scale/paper_t1.md lists how the model compares with the paper's cells)", file=sys.stderr)
    over = [c for c in cells if isinstance(c.memory, Memory) and c.memory.fits is False]
    for c in over:
        print(f"fp4moe.launch: {'refused' if args.strict else 'WARNING'}: cell {' '.join(c.overrides)} is predicted "
              f"not to fit: {c.memory.text(int(c.derived['world_size']))}. Lighten it (recompute, micro-batch, "
              "optimizer=offload, more pipeline stages) or check the prediction (results/scale/paper_t1.md)",
              file=sys.stderr)
    if over and args.strict:
        print(f"fp4moe.launch: {len(over)} of {n} cells are predicted not to fit; nothing would be submitted "
              "(--strict)", file=sys.stderr)
        return 3
    hint = "; --scripts prints each cell's sbatch script" if any(c.sbatch for c in cells) and not args.scripts else ""
    print(f"# {n} cell(s) pass fp4moe.config.check"
          + (f", {len(over)} predicted not to fit the GPU (warned above)" if over else "")
          + (f", {len(edge)} at the edge of the GPU's memory (warned above)" if edge else "")
          + f"; nothing submitted{hint}")
    return 0
