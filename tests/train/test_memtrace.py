"""fp4moe.tracking.memtrace: replaying an allocator trace finds the peak and what was live at it. The CPU tests feed a
hand-built trace (the replay's arithmetic); the GPU test records a real one through ``train.profile.memory``."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fp4moe.tracking.memtrace import format_breakdown, peak_breakdown

LOOP = "/x/src/fp4moe/train/loop.py"


def _f(file, line, name="f"):
    return {"filename": file, "line": line, "name": name}


def _alloc(addr, size, *frames):
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}


def _free(addr):
    return {"action": "free_requested", "addr": addr, "size": 0, "frames": []}


def test_peak_is_the_largest_live_sum_and_groups_what_is_live_there():
    """Sizes count in 512-byte granules (the allocator's rounding; the trace holds requested sizes) and a block
    leaves at free_requested, where torch.cuda.memory_allocated drops."""
    fwd, outer = _f(LOOP, 10, "_loop"), _f(LOOP, 3, "train")
    k = 512
    trace = [
        _alloc(1, 100 * k, _f("/y/site-packages/megatron/core/a.py", 5, "fa"), fwd, outer),
        _alloc(2, 50 * k - 7, _f("/y/site-packages/torch/nn/functional.py", 9), _f("/z/src/fp4moe/ops/x.py", 7, "g"),
               fwd, outer),                                                  # rounds up to 50 granules
        _alloc(3, 30 * k, fwd, outer),                                       # only the loop's frames: the loop's site
        _free(1),
        {"action": "free_completed", "addr": 1, "size": 100 * k, "frames": []},  # already counted out
        _free(99),                                                           # allocated before the window: ignored
        _alloc(4, 60 * k, _f("/z/src/fp4moe/ops/x.py", 8, "h")),             # no trainer frame (backward thread)
        _alloc(5, 1),                                                        # 1 byte takes one granule
        _free(2), _free(3), _free(4), _free(5),
    ]
    b = peak_breakdown(trace, baseline_bytes=1000 * k)
    # live granules: 100, 150, 180 (peak, event 2), 80, 80, 80, 140, 141, ...
    assert (b["peak_bytes"], b["traced_at_peak_bytes"], b["peak_event"], b["events"]) == (1180 * k, 180 * k, 2, 12)
    sites = {r["where"]: (r["bytes"], r["blocks"]) for r in b["by_site"]}
    assert sites == {"megatron/core/a.py:5 fa": (100 * k, 1), "fp4moe/ops/x.py:7 g": (50 * k, 1),
                     "fp4moe/train/loop.py:10 _loop": (30 * k, 1)}
    assert [r["bytes"] for r in b["by_site"]] == [100 * k, 50 * k, 30 * k]
    # the innermost loop.py frame (line 10, not the caller's line 3); no source at /x: the line number
    assert b["by_trainer_line"] == [{"where": "loop.py:10", "bytes": 180 * k, "blocks": 3}]
    text = format_breakdown(b)
    assert "megatron/core/a.py:5 fa" in text and "allocated before the history began" in text


def test_sites_beyond_top_are_summed_into_other():
    trace = [_alloc(i, 512 * (10 + i), _f(f"/s/fp4moe/m{i}.py", i)) for i in range(5)]
    b = peak_breakdown(trace, 0, top=2)
    assert [r["where"] for r in b["by_site"]] == ["fp4moe/m4.py:4 f", "fp4moe/m3.py:3 f", "<other>"]
    assert b["by_site"][-1] == {"where": "<other>", "bytes": 512 * (10 + 11 + 12), "blocks": 3}
    assert b["peak_bytes"] == 512 * sum(10 + i for i in range(5))
    assert b["by_trainer_line"][0]["where"].startswith("<no trainer frame")


def test_trainer_line_reads_the_source(tmp_path):
    loop = tmp_path / "src" / "fp4moe" / "train" / "loop.py"
    loop.parent.mkdir(parents=True)
    loop.write_text("a = 1\n    (loss / accum).backward()\n")
    b = peak_breakdown([_alloc(1, 8, _f("/q/torch/autograd/__init__.py", 3), _f(str(loop), 2, "_loop"))], 0)
    assert b["by_trainer_line"][0]["where"] == "(loss / accum).backward()"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_profile_memory_records_the_peak_on_gpu(tmp_path, store):
    """The trace's replayed peak is the allocator's own max_memory_allocated (the window holds the peak: warm-up 0
    resets the peak statistics at step 1) within 1 %: blocks handed out whole are larger than the rounded request.
    Run at 667fcc7+ on an H200 with the first replay (requested sizes, free_completed): 111,638,988 replayed vs
    111,583,232 bytes."""
    from hydra import compose, initialize_config_dir

    from fp4moe.train.loop import train

    out = tmp_path / "prof"
    over = ["train=short_cpu", "train.progress_bar=false", f"train.checkpoint_dir={tmp_path / 'ckpt'}",
            "precision=mxfp4", "recompute=attn_ln_mlp", "train.steps=3", "train.eval_interval=null",
            "train.checkpoint_interval=null", "cluster=workstation_1gpu", "train.measure.warmup_steps=0",
            "train.profile.steps=[1,3]", "train.profile.memory=true", "train.profile.ops=false",
            f"train.profile.dir={out}"]
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[2] / "conf"), version_base="1.3"):
        train(compose("train", overrides=over))
    b = json.loads((out / "profile_rank0" / "memory_peak.json").read_text())
    assert b["events"] > 100 and b["traced_at_peak_bytes"] > 0
    assert b["peak_bytes"] == pytest.approx(b["max_memory_allocated_bytes"], rel=0.01), b
    assert any(r["where"].startswith(("fp4moe/", "megatron/")) for r in b["by_site"])
    assert not (out / "profile_rank0" / "ops_by_device_time.txt").exists()


def test_window_start_splits_what_was_live_before_from_the_peak_after():
    """Events before start_event build up what is live when the window opens; a higher sum before it is no peak."""
    k = 512
    w, opt = _f("/s/fp4moe/w.py", 1, "weights"), _f("/s/fp4moe/o.py", 2, "optim")
    trace = [_alloc(1, 10 * k, w), _alloc(2, 90 * k, opt), _free(2),    # a transient of 100 before the window
             _alloc(3, 20 * k, opt),                                     # the window opens here (event 3): 30 live
             _alloc(4, 40 * k, w), _free(4), _alloc(5, 5 * k, w)]
    b = peak_breakdown(trace, 0, start_event=3)
    assert (b["at_start_bytes"], b["traced_at_peak_bytes"], b["peak_event"]) == (10 * k, 70 * k, 4)
    assert b["at_start_by_site"] == [{"where": "fp4moe/w.py:1 weights", "bytes": 10 * k, "blocks": 1}]
    from fp4moe.tracking.memtrace import NO_LOOP_FRAME
    assert b["at_start_by_trainer_line"] == [{"where": NO_LOOP_FRAME, "bytes": 10 * k, "blocks": 1}]
    assert {r["where"]: r["bytes"] for r in b["by_site"]} == {"fp4moe/w.py:1 weights": 50 * k,
                                                             "fp4moe/o.py:2 optim": 20 * k}
    assert peak_breakdown(trace, 0)["traced_at_peak_bytes"] == 100 * k  # from event 0 the transient is the peak
    assert "live when the window opened" in format_breakdown(b)
