"""fp4moe.train on one CUDA GPU (marked ``gpu``; skipped without CUDA): the tiny model trains under each recipe and
each recompute scope with the Triton/cuBLAS paths; peak memory is measured; under mxfp4 a micro-batch saves fewer
bytes for backward than under fp8 at the same scope. Every ``optimizer`` group trains on the GPU and holds, on the
GPU and in pinned host memory, the bytes fp4moe.scale.optimizer_state predicts; offloading lowers the memory a
step starts with by those bytes. Data: the byte-level stand-in of conftest.py."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CONF = Path(__file__).resolve().parents[2] / "conf"
SCOPES = ("none", "attn_ln_experts", "attn_ln_mlp", "mla_up_proj", "full", "attn_block_ln_experts", "attn_block_ln_mlp")


def _compose(tmp_path, precision, recompute, *extra):
    over = ["train=short_cpu", "train.progress_bar=false", f"train.checkpoint_dir={tmp_path / 'ckpt'}",
            f"precision={precision}", f"recompute={recompute}", "train.steps=6", "train.eval_interval=null",
            "train.checkpoint_interval=null", "cluster=workstation_1gpu", "+precision.scope=all_linears", *extra]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=over)


def _train(tmp_path, precision, recompute, *extra):
    from fp4moe.train.loop import train

    return train(_compose(tmp_path, precision, recompute, *extra))


@pytest.mark.parametrize("recompute", SCOPES)
def test_tiny_model_trains_on_gpu_under_every_recipe(tmp_path, store, recompute):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=store)
    saved = {}
    for precision in ("bf16", "fp8", "mxfp4"):
        r = _train(tmp_path / precision, precision, recompute)
        assert r.stopped_by == 0 and sorted(r.losses) == list(range(1, 7))
        assert all(math.isfinite(v) for v in r.losses.values())
        assert r.losses[6] < r.losses[1] - 0.5, (precision, r.losses)
        run = client.get_run(r.run_id)
        m, tags = run.data.metrics, run.data.tags
        assert tags["device"].startswith("cuda") and m["summary/peak_mem_allocated_gb"] > 0
        assert 0 < m["summary/mem_allocated_at_step_start_gb"] < m["summary/peak_mem_allocated_gb"]
        assert tags["recompute"] == recompute and tags["recipe"] == precision
        saved[precision] = m["saved_activation_bytes_per_micro_batch"]
    if recompute == "full":  # only each layer's input (BF16 in every recipe: fp4moe.model.recompute) and the logits
        assert saved["bf16"] == saved["fp8"] == saved["mxfp4"], saved
    else:
        assert saved["mxfp4"] < saved["fp8"], saved


def test_every_optimizer_setting_on_gpu(tmp_path, store):
    """mxfp4, no recompute, the four optimizer groups: the same first loss, learning, the predicted bytes on the GPU
    and on the host; the step's starting memory falls by what the state and gradient buffer predictions say."""
    from omegaconf import OmegaConf

    from fp4moe.scale.optimizer_state import rank_bytes

    start, first = {}, set()
    for setting in ("gpu_fp32", "distributed", "distributed_bf16_grads", "offload"):
        cfg = _compose(tmp_path / setting, "mxfp4", "none", f"optimizer={setting}")
        r = _train(tmp_path / setting, "mxfp4", "none", f"optimizer={setting}")
        assert r.losses[6] < r.losses[1] - 0.5, (setting, r.losses)
        first.add(r.losses[1])
        want = rank_bytes(OmegaConf.to_container(cfg, resolve=True), 0)
        s = r.summary
        assert (s["summary/optimizer_state_bytes"], s["summary/optimizer_state_host_bytes"],
                s["summary/grad_buffer_bytes"]) == (want.state_device, want.state_host, want.grads), setting
        start[setting] = (s["summary/mem_allocated_at_step_start_gb"] * 2**30, want)
    assert len(first) == 1  # the same weights and data: the first forward does not depend on the optimizer
    (dist_mem, d), (off_mem, o) = start["distributed"], start["offload"]
    freed = (d.state_device + d.grads + d.params) - (o.state_device + o.grads + o.params)
    assert dist_mem - off_mem == pytest.approx(freed, rel=0.05)


def test_micro_batch_on_cuda_is_the_host_batch():
    """fp4moe.train.batches.micro_batch on CUDA (the samples sent once from pinned memory, split on the GPU) gives the
    host batch's tokens and labels, contiguous, for every micro-batch and data-parallel rank of a step."""
    from fp4moe.train import batches

    class Samples:
        def __len__(self):
            return 37

        def __getitem__(self, i):
            return torch.arange(i * 100, i * 100 + 9)

    ds = Samples()
    for consumed, k, rank in ((0, 0, 0), (30, 1, 1), (64, 2, 0)):
        want = batches.batch(ds, batches.micro_batch_indices(consumed, k, 4, rank, 2))
        got = batches.micro_batch(ds, consumed, k, 4, rank, 2, torch.device("cuda"), non_blocking=True)
        for w, g in zip(want, got, strict=True):
            assert g.is_cuda and g.is_contiguous() and g.dtype == torch.long and torch.equal(g.cpu(), w)


@pytest.mark.parametrize("setting", ["distributed", "offload"])
def test_sharded_checkpoint_resumes_on_gpu(tmp_path, store, setting):
    """mxfp4 on CUDA with megatron's optimizer (offload: its state in pinned host memory): a run that fails at step 3
    after its step-2 checkpoint, written in the default ``sharded`` format (megatron-core dist_checkpointing), resumes
    from it, and steps 3-4 give the uninterrupted run's losses and gradient norms (the model, the FP32 main params,
    the AdamW moments and the RNG states come back from the GPU and the host), compared to 1e-6 relative (bit-exactness
    across two CUDA processes is not what this test asks)."""
    from fp4moe.train import checkpoint

    common = ("train.eval_interval=null", "train.steps=4", f"optimizer={setting}")
    full = _train(tmp_path / "full", "mxfp4", "none", *common)
    resumed = (*common, "train.checkpoint_interval=1", "train.checkpoint_format=sharded")
    with pytest.raises(RuntimeError, match="faults.fail_at_step: step=3"):
        _train(tmp_path / "resumed", "mxfp4", "none", *resumed,
               "+train.hooks.fail={factory: faults:fail_at_step, step: 3}")
    r = _train(tmp_path / "resumed", "mxfp4", "none", *resumed)
    assert r.start_step == 2 and sorted(r.losses) == [3, 4], (r.start_step, r.losses)
    for step in (3, 4):
        assert r.losses[step] == pytest.approx(full.losses[step], rel=1e-6, abs=0), (step, r.losses, full.losses)
        assert r.grad_norms[step] == pytest.approx(full.grad_norms[step], rel=1e-6, abs=0), step
    folders = sorted((tmp_path / "resumed" / "ckpt").rglob("step_*"))
    assert folders and all((f / ".metadata").is_file() and (f / "meta.json").is_file() for f in folders), folders
    assert {json.loads((f / "meta.json").read_text()).get("format") for f in folders} == {checkpoint.SHARDED}
