"""F3/F4 presets (conf/experiment/paper_f3.yaml, paper_f4.yaml): their dry-run sbatch scripts, and the benchmark
job they submit (fp4moe.launch.bench_job) run on CPU with a small layer. No Slurm needed, nothing submitted."""
import json
import shlex

import pytest
from hydra import compose, initialize_config_dir

from fp4moe.launch import bench_job, dry_run
from fp4moe.config import ConfigError
from fp4moe.settings import Settings


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    for var in ("FP4MOE_SLURM_PARTITION", "FP4MOE_SLURM_ACCOUNT", "FP4MOE_SLURM_QOS", "FP4MOE_SLURM_CONSTRAINT",
                "FP4MOE_SLURM_CPUS_PER_TASK", "NCCL_IB_HCA", "FP4MOE_ROOT", "RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)


def _srun(script):
    return shlex.split([ln for ln in script.splitlines() if ln.startswith("srun ")][0])


def test_f3_dry_run_is_one_job_on_one_gpu(capsys):
    ((overrides, script),) = dry_run.sbatch_scripts("paper_f3")
    for line in ("#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=1", "#SBATCH --time=30",
                 "#SBATCH --no-requeue", "#SBATCH --job-name=paper_f3", "export NCCL_IB_HCA=mlx5\n"):
        assert line in script, line
    cmd = _srun(script)
    i = cmd.index("python")
    assert cmd[i:] == ["python", "-m", "fp4moe.train", "hydra.mode=RUN", "experiment=paper_f3",
                       "hydra/launcher=slurm_h100"]
    assert dry_run.main(["dry-run", "experiment=paper_f3", "--summary"]) == 0
    out = capsys.readouterr().out
    assert "bench: fp4moe_kernels.bench.conversions.main(--out results/kernels)" in out
    assert "without Hydra: python -m fp4moe_kernels.bench.conversions --out results/kernels" in out


def test_f4_dry_run_is_ep1_and_ep2_one_task_per_gpu(capsys):
    cells = dry_run.sbatch_scripts("paper_f4")
    assert [ov[0] for ov, _ in cells] == ["parallel=single_gpu", "parallel=two_gpu_ep2"]
    for (overrides, script), gpus in zip(cells, (1, 2)):
        for line in ("#SBATCH --nodes=1", f"#SBATCH --ntasks-per-node={gpus}", f"#SBATCH --gpus-per-node={gpus}",
                     "#SBATCH --time=30", "#SBATCH --mem=128GB", "#SBATCH --job-name=paper_f4"):
            assert line in script, line
        assert _srun(script)[-len(overrides) - 4:] == ["python", "-m", "fp4moe.train", "hydra.mode=RUN", *overrides]
    assert dry_run.main(["dry-run", "experiment=paper_f4", "--summary"]) == 0
    out = capsys.readouterr().out
    assert out.count("# ===== cell") == 2 and "parallel: EP2 world 2" in out
    assert "without Hydra: torchrun --nproc-per-node 2 -m fp4moe.bench.moe_layer --out results/moe_layer" in out


def _compose(*overrides):
    with initialize_config_dir(config_dir=str(dry_run.CONF_DIR), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def test_f4_job_runs_the_layer_benchmark_on_cpu(tmp_path):
    args = ["--device", "cpu", "--hidden", "256", "--ffn", "128", "--local-experts", "4", "--top-k", "2", "--tokens",
            "48", "--shared-ffn", "128", "--warmup", "1", "--iters", "1", "--no-gemm", "--no-profile",
            "--out", str(tmp_path), "--commit", "test"]
    cfg = _compose("experiment=paper_f4", "parallel=single_gpu", f"bench.args=[{','.join(args)}]")
    assert bench_job.is_bench(cfg) and not bench_job.is_bench(_compose())
    ret = bench_job.run(cfg.bench, Settings.from_config(cfg).parallel)
    assert ret["outcome"] == "done" and ret["bench"] == "fp4moe.bench.moe_layer" and ret["rank"] == 0
    (result,) = tmp_path.glob("moe_layer_cpu_ep1_*_test.json")
    assert [r["recipe"] for r in json.loads(result.read_text())["recipes"]] == ["bf16", "fp8", "mxfp4"]


def test_ep2_without_its_processes_is_refused():
    with pytest.raises(ConfigError, match="start 2 processes, e.g. torchrun --nproc-per-node 2"):
        cfg = _compose("experiment=paper_f4", "parallel=two_gpu_ep2")
        bench_job.run(cfg.bench, Settings.from_config(cfg).parallel)
