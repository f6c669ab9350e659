"""P4 dry run (fp4moe.launch): the sbatch scripts of the paper's T1 sweep, built by submitit from the
conf/hydra/launcher profiles, and the check's refusal of a broken cell. No Slurm needed, nothing submitted."""
import os
import re
import shlex
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from fp4moe.launch import dry_run
from fp4moe.config import ConfigError


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("FP4MOE_CORPUS", "/nonexistent/corpus.jsonl")
    for var in ("FP4MOE_SLURM_PARTITION", "FP4MOE_SLURM_ACCOUNT", "FP4MOE_SLURM_QOS", "FP4MOE_SLURM_CONSTRAINT",
                "FP4MOE_SLURM_CPUS_PER_TASK", "NCCL_IB_HCA", "NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "NCCL_IB_GID_INDEX",
                "NCCL_NVLS_ENABLE", "FP4MOE_ROOT"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def t1():
    mp = pytest.MonkeyPatch()
    mp.setenv("FP4MOE_CORPUS", "/nonexistent/corpus.jsonl")
    try:
        return dry_run.sbatch_scripts("paper_t1")
    finally:
        mp.undo()


def _command(script):
    return [ln for ln in script.splitlines() if ln.startswith("srun ")][0]


def test_t1_has_nine_cells_precision_by_recompute(t1):
    assert len(t1) == 9
    cells = [tuple(o for o in ov if o.split("=")[0] in ("precision", "recompute")) for ov, _ in t1]
    assert cells == [(f"precision={p}", f"recompute={r}") for p in ("bf16", "fp8", "mxfp4")
                     for r in ("attn_block_ln_experts", "attn_block_ln_mlp", "mla_up_proj")]


def test_t1_sbatch_resources_time_signal(t1):
    cfg = dry_run._compose(["experiment=paper_t1"])
    for _, script in t1:
        assert "#SBATCH --nodes=32" in script
        assert "#SBATCH --ntasks-per-node=8" in script
        assert "#SBATCH --gpus-per-node=8" in script  # submitit 1.5.4 writes --gpus-per-node, not --gres
        assert f"#SBATCH --time={cfg.cluster.time_limit_min}" in script and cfg.cluster.time_limit_min == 120
        assert f"#SBATCH --signal=USR2@{cfg.cluster.signal_delay_s}" in script
        assert "#SBATCH --partition=gpu" in script and "#SBATCH --job-name=paper_t1" in script
        assert "--account" not in script and "--qos" not in script  # null in the cluster profile: left out
    # one sweep directory for the whole multirun
    assert len({re.search(r"--output=(\S+)", s).group(1) for _, s in t1}) == 1


def test_t1_sbatch_exports_every_cluster_env_key(t1):
    env = OmegaConf.to_container(dry_run._compose(["experiment=paper_t1"]).cluster.env, resolve=True)
    for _, script in t1:
        setup = script.split("# setup\n")[1].split("# command")[0]
        assert setup.index("NCCL") < script.index("srun ")
        for key, value in env.items():
            assert f"export {key}={shlex.quote(str(value))}\n" in setup, key
    assert "export NCCL_SOCKET_IFNAME='^lo,docker'" in t1[0][1]


def test_t1_sbatch_runs_the_trainer_with_the_cell_overrides(t1):
    for overrides, script in t1:
        cmd = shlex.split(_command(script))
        i = cmd.index("python")
        assert cmd[i:i + 4] == ["python", "-m", "fp4moe.train", "hydra.mode=RUN"]
        assert cmd[i + 4:] == overrides
        assert "experiment=paper_t1" in overrides and "hydra/launcher=slurm_h100" in overrides


def test_env_reaches_the_script(monkeypatch):
    monkeypatch.setenv("NCCL_IB_HCA", "mlx5_0,mlx5_1")
    monkeypatch.setenv("FP4MOE_SLURM_ACCOUNT", "proj42")
    (_, script), *_ = dry_run.sbatch_scripts("paper_t1", ["precision=bf16", "recompute=attn_ln_mlp"])
    assert "export NCCL_IB_HCA=mlx5_0,mlx5_1\n" in script and "#SBATCH --account=proj42" in script


def test_requeue_count_reaches_submitit():
    cfg = dry_run._compose(["experiment=paper_t1", "hydra/launcher=slurm_h200", "cluster=slurm_h200"])
    assert cfg.hydra.launcher.max_num_timeout > 0 and cfg.hydra.launcher.nodes == 32


def test_broken_parallel_layout_exits_nonzero_with_the_check_message(capsys):
    assert dry_run.main(["dry-run", "experiment=paper_t1", "parallel.tensor=3", "--summary"]) == 1
    err = capsys.readouterr().err
    assert "ConfigError: parallel.tensor x pipeline x context x data = 3 x 32 x 1 x 8" in err
    with pytest.raises(ConfigError, match="!= parallel.world_size=256"):
        dry_run.sbatch_scripts("paper_t1", ["parallel.tensor=3"])


@pytest.mark.parametrize("experiment", ["paper_t9", "tiny_cpu,paper_t9"])
def test_unknown_experiment_is_refused(capsys, experiment):
    """An experiment without a file in conf/experiment/, alone or in a sweep, is refused with the ones there are."""
    assert dry_run.main(["dry-run", f"experiment={experiment}"]) == 2
    assert capsys.readouterr().err.startswith(
        "fp4moe.launch: the config does not compose: In 'train': Could not find 'experiment/paper_t9'; Available "
        "options in 'experiment': paper_f3, paper_f4, paper_f5, paper_t1, paper_t2, ")


def test_a_groups_schema_picked_is_refused_before_composing(capsys):
    """``model=base_model`` (Hydra lists the schema among the options): "1 of 1 cells cannot run" with "model.name
    has no value" before; now the line that says to pick a file of conf/model/, exit 2."""
    assert dry_run.main(["dry-run", "experiment=tiny_cpu", "model=base_model", "--summary"]) == 2
    assert capsys.readouterr().err.startswith(
        "fp4moe.launch: the config does not compose: ConfigError: model=base_model is the schema that the files of "
        "conf/model/ build on (fp4moe.settings.Model), not an option to pick: pick one of ")


def test_dry_run_prints_config_and_script_only_with_scripts(capsys):
    cell = ["experiment=paper_t1", "precision=fp8", "recompute=mla_up_proj"]
    assert dry_run.main(["dry-run", *cell]) == 0
    out = capsys.readouterr().out
    assert out.count("# ===== cell") == 1 and "num_experts: 256" in out and "#SBATCH" not in out
    assert "--scripts prints each cell's sbatch script" in out
    assert dry_run.main(["dry-run", *cell, "--summary", "--scripts"]) == 0
    out = capsys.readouterr().out
    assert out.count("#!/bin/bash") == 1 and "#SBATCH --nodes=32" in out and "num_experts" not in out


def test_tiny_cpu_with_local_launcher_composes(capsys):
    cfg = dry_run._compose(["experiment=tiny_cpu", "hydra/launcher=local"])
    assert cfg.hydra.launcher._target_.endswith("BasicLauncher")
    assert "partition" not in cfg.hydra.launcher
    cells, failures = dry_run.dry_run(["experiment=tiny_cpu", "hydra/launcher=local"])
    assert not failures and len(cells) == 3 and all(c.sbatch is None for c in cells)
    assert dry_run.main(["dry-run", "experiment=tiny_cpu", "hydra/launcher=local", "--summary"]) == 0
    assert "not Slurm, no sbatch script" in capsys.readouterr().out


def test_t1_sbatch_memory_and_requeue(t1):
    for _, script in t1:
        assert "#SBATCH --mem=0GB" in script      # cluster.mem_gb: 0 -> the whole node
        assert "#SBATCH --requeue" in script and "--no-requeue" not in script


# T1 on 2 nodes (16 GPUs) instead of 32, as a smoke run of the 256-GPU submission: what the node count changes (the
# PP32 layout becomes two stages: the embedding and 30 layers, then 31 layers and the loss); the rest is the profile's
T1_TWO_NODES = ["cluster.nodes=2", "parallel.world_size=16", "parallel.pipeline=2",
                "parallel.pipeline_layout=Et*30|t*31L"]


def _counts_alike(script, extra):
    """The script's lines with what must differ between two node counts made alike: the ``#SBATCH --nodes`` count,
    the sweep folder's time stamp, and ``extra`` (the cell's own overrides for its node count) in the command."""
    lines = []
    for ln in script.splitlines():
        ln = re.sub(r"^#SBATCH --nodes=\d+$", "#SBATCH --nodes=N", ln)
        ln = re.sub(r"/multiruns/\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d/", "/multiruns/<time>/", ln)
        if ln.startswith("srun "):
            ln = shlex.join(t for t in shlex.split(ln) if t not in extra)
        lines.append(ln)
    return lines


def test_t1_on_two_nodes_gets_the_sbatch_lines_of_32_nodes_with_other_counts(t1):
    """The dry run of T1 on 2 nodes writes, line for line, the sbatch script of the same cell on 32: the same
    resource lines (tasks and GPUs per node, CPUs, memory, time, signal, requeue, partition), exports and command;
    only the node count and the cell's layout overrides differ (the mxfp4 cells, all three recompute scopes)."""
    def cell(overrides):
        return tuple(o for o in overrides if o.split("=")[0] in ("precision", "recompute"))

    on_32 = {cell(ov): script for ov, script in t1}
    on_2 = dry_run.sbatch_scripts("paper_t1", ["precision=mxfp4", *T1_TWO_NODES])
    assert [cell(ov) for ov, _ in on_2] == [("precision=mxfp4", f"recompute={r}")
                                            for r in ("attn_block_ln_experts", "attn_block_ln_mlp", "mla_up_proj")]
    for overrides, script in on_2:
        big = on_32[cell(overrides)]
        assert "#SBATCH --nodes=2" in script.splitlines() and "#SBATCH --nodes=32" in big.splitlines()
        assert all(o in shlex.split(_command(script)) for o in T1_TWO_NODES)
        assert _counts_alike(script, T1_TWO_NODES) == _counts_alike(big, []), overrides


@pytest.mark.parametrize("overrides, present, absent", [
    (["cluster.mem_gb=512"], ["#SBATCH --mem=512GB"], []),
    (["cluster.mem_gb=null"], [], ["--mem"]),
    (["cluster.requeue=false"], ["#SBATCH --no-requeue"], ["#SBATCH --requeue"]),
], ids=["mem-512", "mem-null", "no-requeue"])
def test_cluster_memory_and_requeue_reach_sbatch(overrides, present, absent):
    (_, script), *_ = dry_run.sbatch_scripts("paper_t1", ["precision=bf16", "recompute=attn_ln_mlp", *overrides])
    for line in present:
        assert line in script, line
    for text in absent:
        assert text not in script, text


def test_requeue_must_be_a_bool(capsys):
    """Refused while composing, by the cluster group's schema (fp4moe.settings.Cluster); the dry run says it in one
    line."""
    from fp4moe.settings import explain

    with pytest.raises(Exception) as err:
        dry_run.sbatch_scripts("paper_t1", ["precision=bf16", "recompute=attn_ln_mlp", "cluster.requeue=maybe"])
    assert explain(err.value) == "cluster.requeue='maybe' is not true or false: use true or false"
    assert dry_run.main(["dry-run", "experiment=paper_t1", "cluster.requeue=maybe"]) == 2
    assert capsys.readouterr().err == ("fp4moe.launch: the config does not compose: cluster.requeue='maybe' is not "
                                       "true or false: use true or false\n")


def test_a_slurm_launcher_over_a_cluster_without_slurm_values_is_one_line(capsys):
    """hydra/launcher=slurm_h100 with the CPU cluster group (tiny_t1_cpu's): the launcher's time limit reads
    cluster.time_limit_min, null there; the dry run names it and the fix (it printed OmegaConf's two lines)."""
    assert dry_run.main(["dry-run", "experiment=tiny_t1_cpu", "hydra/launcher=slurm_h100"]) == 2
    assert capsys.readouterr().err == (
        "fp4moe.launch: the config does not compose: hydra.launcher.timeout_min=${cluster.time_limit_min} is null in "
        "this config: the launcher profile takes its values from the cluster group; pick a cluster profile that sets "
        "cluster.time_limit_min (cluster=slurm_h100, cluster=slurm_h200, cluster=slurm_local or one of yours in "
        "conf/cluster/), or set cluster.time_limit_min=...\n")
    cells, failures = dry_run.dry_run(["experiment=tiny_t1_cpu", "cluster=slurm_local", "hydra/launcher=slurm_h100"])
    assert len(cells) == 9 and not failures  # with a Slurm cluster group: the 3 x 3 cells compose and check


def test_local_slurm_profile_has_no_gpus_or_nccl():
    cells, failures = dry_run.dry_run(["experiment=tiny_cpu", "cluster=slurm_local", "hydra/launcher=slurm_local"])
    assert not failures and len(cells) == 3
    script = cells[0].sbatch
    for line in ("#SBATCH --partition=debug", "#SBATCH --mem=1GB", "#SBATCH --requeue", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --signal=USR2@30", "#SBATCH --time=10"):
        assert line in script, line
    assert "--gpus" not in script and "NCCL" not in script


# ---------------------------------------------------------------------------------------------- predicted memory

def _model_peak(cfg):
    from fp4moe.analysis.outside_torch_measured import measured_assumptions
    from fp4moe.scale.memory import mean_total_bytes, per_stage_memory

    stages = per_stage_memory(cfg, measured_assumptions())
    return max(b.total_gb for b in stages), mean_total_bytes(stages) / 2**30


def test_dry_run_prints_each_cells_predicted_memory(capsys):
    """Per cell: the memory model's most loaded GPU and the mean over the job's GPUs, for the job as submitted (its
    own dispatcher, the measured outside-PyTorch terms), against cluster.gpu_memory_gb."""
    overrides = ["experiment=paper_t1", "precision=mxfp4", "recompute=attn_block_ln_experts"]
    [cell], _ = dry_run.dry_run(overrides)
    peak, mean = _model_peak(cell.cfg)
    m = cell.memory
    assert (m.peak_gib, m.mean_gib, m.gpu_gib) == (peak, mean, 79.65) and m.fits and m.outcome == "fits"   # 81559 MiB
    assert m.source.startswith("results/scale/outside_torch_h200.json (")   # the manifest's measurement
    assert dry_run.main(["dry-run", *overrides, "--summary"]) == 0
    out = capsys.readouterr().out
    assert "# ----- predicted peak memory (fp4moe.scale.memory; outside PyTorch: " in out
    assert (f"most loaded GPU {peak:.1f} GiB ({100 * peak / 79.65:.1f} % of the GPU's 79.65 GiB)" in out
            and f"mean over the 256 GPU(s) {mean:.1f} GiB: fits" in out)


def test_strict_refuses_a_cell_predicted_not_to_fit(capsys):
    """fp8 without routed-expert recompute at mla_up_proj is predicted above 80 GB: a warning, and with --strict a
    refusal (exit 3) naming the cell, its prediction and what to change."""
    overrides = ["experiment=paper_t1", "precision=fp8", "recompute=mla_up_proj", "--summary"]
    [cell], _ = dry_run.dry_run(overrides[:-1])
    assert cell.memory.fits is False and cell.memory.peak_gib == _model_peak(cell.cfg)[0] > 79.65
    assert dry_run.main(["dry-run", *overrides]) == 0
    captured = capsys.readouterr()
    assert "WARNING: cell precision=fp8 recompute=mla_up_proj" in captured.err
    assert "PREDICTED NOT TO FIT" in captured.out
    assert "1 predicted not to fit the GPU (warned above)" in captured.out
    assert dry_run.main(["dry-run", *overrides, "--strict"]) == 3
    err = capsys.readouterr().err
    assert "refused: cell precision=fp8 recompute=mla_up_proj" in err and "Lighten it (recompute" in err
    assert "1 of 1 cells are predicted not to fit; nothing would be submitted (--strict)" in err
    assert dry_run.main(["dry-run", "experiment=paper_t1", "precision=mxfp4", "recompute=mla_up_proj", "--summary",
                         "--strict"]) == 0   # a cell that fits passes --strict


def test_memory_outcome_spans_the_models_measured_error():
    """'fits' / 'OOM' only when the allocated peak, moved across the model's error measured on H200s
    (PEAK_ERR_RANGE: the true peak may be pred / (1 + err)), stays on one side of the GPU less the memory outside
    PyTorch; else 'edge', said beside the point prediction's verdict (``fits``, which --strict goes by)."""
    from fp4moe.analysis.calibration import PEAK_ERR_RANGE

    lo, hi = PEAK_ERR_RANGE
    outside, gpu = 8.0, 80.0

    def memory(allocated):
        return dry_run.Memory(allocated + outside, allocated, 1.0, 3, 29, gpu, "test")

    room = gpu - outside
    assert memory(room * (1 + lo) * 0.999).outcome == "fits"      # even its largest true peak is within
    assert memory(room * (1 + lo) * 1.001).outcome == "edge"
    assert memory(room).outcome == "edge" and memory(room).fits   # predicted just at the limit
    edge_over = memory(room * (1 + hi) * 0.999)
    assert edge_over.outcome == "edge" and edge_over.fits is False   # over as predicted, within the error
    assert memory(room * (1 + hi) * 1.001).outcome == "OOM" and memory(room * 1.02).fits is False
    assert memory(room).text(256).endswith("GiB: fits, AT THE EDGE (the model's error measured on 1-2 H200s, "
                                           "-2.0 % to +1.3 % of the allocated peak, puts it on either side of the "
                                           "GPU; not checked at this scale)")
    assert "PREDICTED NOT TO FIT, AT THE EDGE" in edge_over.text(256)
    assert memory(room * 1.02).text(256).endswith(": PREDICTED NOT TO FIT")


def test_dry_run_warns_of_a_cell_at_the_edge(capsys):
    """A cell whose predicted peak is the GPU's memory is at the edge: warned (also under --strict, which it passes),
    counted in the last line; the verdict names the measured error."""
    overrides = ["experiment=paper_t1", "precision=mxfp4", "recompute=attn_block_ln_experts"]
    [cell], _ = dry_run.dry_run(overrides)
    edge = [*overrides, f"cluster.gpu_memory_gb={cell.memory.peak_gib:.3f}", "--summary"]
    assert dry_run.main(["dry-run", *edge, "--strict"]) == 0
    captured = capsys.readouterr()
    assert "WARNING: cell precision=mxfp4 recompute=attn_block_ln_experts" in captured.err
    assert "is at the edge of the GPU's memory" in captured.err and "AT THE EDGE (the model's error" in captured.out
    assert "1 at the edge of the GPU's memory (warned above)" in captured.out


def test_cells_without_a_gpu_size_or_a_training_run():
    cells, _ = dry_run.dry_run(["experiment=tiny_cpu", "hydra/launcher=local"])
    m = cells[0].memory
    assert isinstance(m, dry_run.Memory) and m.fits is None and m.gpu_gib is None
    assert m.text(1).endswith("no GPU size to check against (cluster.gpu_memory_gb)")
    bench, _ = dry_run.dry_run(["experiment=paper_f3"])
    assert bench[0].memory == "not predicted: a benchmark job, not a training run"


# ---------------------------------------------------------------------------------------------- slurm/ templates (P10)

def test_templates_log_where_the_submit_helper_creates_the_folder():
    """Slurm opens --output/--error before the script runs: every template logs into logs/slurm/, which
    slurm/submit.sh (the documented way to submit them) creates; tests/test_slurm.py submits through it."""
    import pathlib

    slurm = pathlib.Path(__file__).resolve().parents[1] / "slurm"
    templates = sorted(slurm.glob("*.sbatch"))
    assert templates
    for t in templates:
        paths = re.findall(r"^#SBATCH --(?:output|error)=(\S+)$", t.read_text(), re.M)
        assert len(paths) == 2 and {p.rsplit("/", 1)[0] for p in paths} == {"logs/slurm"}, t.name
        assert "slurm/submit.sh" in t.read_text(), t.name
    assert "\nmkdir -p logs/slurm\nexec sbatch \"$@\"\n" in (slurm / "submit.sh").read_text()


@pytest.mark.parametrize("python, overrides, said", [
    (None, ["experiment=tiny_cpu", "precison=fp8"],
     "slurm/submit.sh: the overrides experiment=tiny_cpu precison=fp8 are not a config the trainer can run (above); "
     "nothing submitted"),
    ("{tmp}/venv/bin/python", ["experiment=tiny_cpu"],
     "slurm/submit.sh: no Python at {tmp}/venv/bin/python, which the job would run: create the venv there (make venv, "
     "on the filesystem the nodes share) or export PYTHON=...; nothing submitted"),
])
def test_the_submit_helper_refuses_a_cell_that_could_not_run_before_queueing_it(tmp_path, python, overrides, said):
    """slurm/submit.sh checks, before sbatch, the Python the job runs and that the cell's overrides compose (the dry
    run's check): a typo used to be found only when the job started, after its wait in the queue. Nothing is
    submitted and no logs/slurm/ is made; the dry run's reason comes first. A cell that passes goes to sbatch
    (tests/test_slurm.py submits through it)."""
    import pathlib

    repo = pathlib.Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("TRAIN", "FP4MOE_ROOT")}
    env["PYTHON"] = (python or sys.executable).format(tmp=tmp_path)
    r = subprocess.run([str(repo / "slurm" / "submit.sh"), "--nodes=1", str(repo / "slurm" / "train.sbatch"),
                        *overrides], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[-1] == said.format(tmp=tmp_path)
    if python is None:
        assert "precison is not a key of the root config (conf/train.yaml): did you mean precision?" in lines[-2]
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------- shell safety (P10)

HOSTILE = {   # cluster.env key -> a value that would run something, or split, if pasted into the script unquoted
    "NCCL_IB_HCA": "mlx5'; touch PWNED1; echo '",
    "NCCL_DEBUG": 'WARN"; touch PWNED2; echo "',
    "NCCL_SOCKET_IFNAME": "$(touch PWNED3)",
    "NCCL_IB_GID_INDEX": "`touch PWNED4`",
    "NCCL_NVLS_ENABLE": "0; touch PWNED5 && echo ${HOME} $PATH * ? \\ \t|&<>!#",
    "PYTORCH_CUDA_ALLOC_CONF": "",
}


def _setup_and_header(script):
    """The script up to its command (shebang, #SBATCH lines, setup): what runs before srun."""
    return script.split("\n# command\n")[0] + "\n"


def test_hostile_env_values_are_exported_verbatim_and_run_nothing(monkeypatch, tmp_path):
    """Every cluster.env value reaches the sbatch script through shlex.quote: bash parses the script, and running its
    header and setup in an empty environment sets each variable to exactly the given string and creates no file."""
    for var, value in HOSTILE.items():
        monkeypatch.setenv(var, value)
    account = "proj'$(touch PWNED6)`touch PWNED7`;\"x\""
    monkeypatch.setenv("FP4MOE_SLURM_ACCOUNT", account)
    (_, script), = dry_run.sbatch_scripts("paper_t1", ["precision=bf16", "recompute=attn_block_ln_mlp"])
    assert f"#SBATCH --account={shlex.quote(account)}\n" in script   # one directive line; bash reads a comment
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    probe = "".join(f'printf "%s\\0" "${{{var}-UNSET}}"; ' for var in HOSTILE)
    p = subprocess.run(["env", "-i", "bash", "-c", _setup_and_header(script) + probe], cwd=tmp_path,
                       capture_output=True, text=True, check=True)
    assert p.stdout.split("\0")[:-1] == list(HOSTILE.values())
    assert list(tmp_path.iterdir()) == [], "the script ran part of a value"


@pytest.mark.parametrize("var, key", [("NCCL_IB_HCA", "cluster.env.NCCL_IB_HCA"),
                                      ("FP4MOE_SLURM_QOS", "hydra.launcher.qos")])
def test_a_line_break_in_a_script_value_is_refused_in_one_line(monkeypatch, capsys, var, key):
    """A line break cannot be written into an export line or an #SBATCH directive safely: refused, exit 2, one
    line naming the key."""
    monkeypatch.setenv(var, "ok\ntouch PWNED")
    assert dry_run.main(["dry-run", "experiment=paper_t1", "precision=bf16", "recompute=attn_block_ln_mlp"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"fp4moe.launch: {key}='ok\\ntouch PWNED' holds a control"), err


def test_export_line_refuses_a_key_that_is_not_a_variable_name():
    from fp4moe.launch.shell import UnsafeValue, export_line

    assert export_line("A_1", "x y") == "export A_1='x y'"
    with pytest.raises(UnsafeValue, match=r"env\.A;touch: not a shell variable name"):
        export_line("A;touch", "1")


# ---------------------------------------------------------------------------------------------- first contact (P10)

@pytest.fixture(scope="module")
def t1_summary():
    """``dry-run experiment=paper_t1 --summary`` without FP4MOE_CORPUS: (exit code, stdout, stderr)."""
    import contextlib
    import io

    mp = pytest.MonkeyPatch()
    for var in ("FP4MOE_CORPUS", "FP4MOE_SLURM_PARTITION", "FP4MOE_SLURM_ACCOUNT", "FP4MOE_SLURM_QOS",
                "NCCL_IB_HCA", "NCCL_IB_GID_INDEX"):
        mp.delenv(var, raising=False)
    mp.setenv("FP4MOE_SLURM_QOS", "high")
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = dry_run.main(["dry-run", "experiment=paper_t1", "cluster.account=proj7", "--summary"])
    finally:
        mp.undo()
    return rc, out.getvalue(), err.getvalue()


def test_dry_run_without_a_corpus_says_once_what_the_jobs_need(t1_summary):
    rc, out, err = t1_summary
    assert rc == 0 and "fails the check" not in err, err
    assert out.count("# ===== cell") == 9 and "# 9 cell(s) pass fp4moe.config.check" in out
    assert out.count("export FP4MOE_CORPUS=") == 1 and "# ===== the job(s) will need (every cell)" in out


def test_summary_is_one_screen_per_cell_without_scripts(t1_summary):
    _, out, _ = t1_summary
    assert "#SBATCH" not in out and "#!/bin/bash" not in out
    cells = [c.split("\n\n")[0].splitlines() for c in out.split("# ===== cell")[1:]]
    assert len(cells) == 9 and max(len(c) for c in cells) <= 30, [len(c) for c in cells]


def _row(text, label):
    """(value, origin) of the ``label`` row of a settings table in ``text`` (the first one)."""
    m = re.search(rf"^  {re.escape(label)} +(.*?) +<- (.*)$", text, re.M)
    assert m, label
    return m.group(1), m.group(2)


def test_summary_shows_each_job_value_and_what_sets_it(t1_summary):
    _, out, _ = t1_summary
    cell = out.split("# ===== cell")[1]
    assert _row(cell, "nodes") == ("32", "cluster.nodes")
    assert _row(cell, "GPUs per node") == ("8", "cluster.gpus_per_node")
    assert _row(cell, "time limit") == ("120 min (2:00:00)", "cluster.time_limit_min")
    assert _row(cell, "partition") == ("gpu", "default; set $FP4MOE_SLURM_PARTITION or cluster.partition=...")
    assert _row(cell, "account") == ("proj7", "command line: cluster.account=proj7")
    assert _row(cell, "QoS") == ("high", "$FP4MOE_SLURM_QOS")
    assert "most loaded GPU" in cell and "GiB" in cell     # the memory model's prediction, per cell
    site = out.split("# ===== site settings exported by every Slurm cell's setup lines")[1]
    assert out.count("# ===== site settings") == 1        # once, not per cell
    assert _row(site, "NCCL_IB_HCA") == ("mlx5", "default; set $NCCL_IB_HCA or cluster.env.NCCL_IB_HCA=...")
    assert _row(site, "NCCL_IB_GID_INDEX") == ("3", "default; set $NCCL_IB_GID_INDEX or "
                                                    "cluster.env.NCCL_IB_GID_INDEX=...")
    assert _row(site, "NCCL_IB_TIMEOUT") == ("22", "cluster.env.NCCL_IB_TIMEOUT")
