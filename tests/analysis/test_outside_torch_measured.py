"""fp4moe.analysis.outside_torch_measured and its measuring tool (tools/device/measure_outside_torch.py) on the CPU: the terms
the model takes from a results document, the manifest's measurement as the memory model's assumptions, and the tool's
parent side (plan, dry run, a training run against a stand-in trainer, the summary) end to end."""
import json
import sqlite3
import sys

import pytest

from fp4moe.analysis import manifest
from fp4moe.analysis import outside_torch_measured as ot
from fp4moe.scale.memory import NOT_MEASURED, compose_cfg, per_stage_memory
from tool_module import load_tool

tool = load_tool("tools/device/measure_outside_torch.py")
GiB, MiB = 2**30, 2**20


def _child(group, small, large, a2a, ranks=1):
    """The NCCL child's stages as the tool writes them: outside bytes before the group, after it, a 1-element and a
    64 MiB all-reduce, then the all-to-all (two ranks: both, the second 2 MiB lower from the 64 MiB all-reduce on)."""
    def stages(low):
        return [{"stage": s, "outside_bytes": v - (low if s in ("all_reduce", "all_to_all") else 0)}
                for s, v in (("before_group", 0), ("group", group), ("all_reduce_small", small), ("all_reduce", large),
                             ("all_to_all", a2a))]
    if ranks == 1:
        return {"stages": stages(0), "communicator_bytes": a2a}
    return {"ranks": [{"stages": stages(0)}, {"stages": stages(2 * MiB)}], "communicator_bytes": a2a}


def _doc(**over):
    doc = {"format": ot.FORMAT, "dry_run": False, "gpu": "NVIDIA H200", "date": "2026-12-03", "commit": "abc1234",
           "nccl": {"world1": _child(40 * MiB, 40 * MiB, 40 * MiB, 40 * MiB),
                    "world2": _child(50 * MiB, 250 * MiB, 350 * MiB, 700 * MiB, ranks=2),
                    "world2_lab": _child(50 * MiB, 300 * MiB, 450 * MiB, 850 * MiB, ranks=2)},
           "training_process": {"outside_torch_bytes": 3 * GiB}, "allocator": {"gap_bytes": GiB, "ref_elements": 99}}
    doc.update(over)
    return doc


def test_derive_takes_each_term_from_its_measurement():
    m = ot.derive(_doc(), "results/scale/x.json")
    assert m.cuda_context_bytes == 3 * GiB - 40 * MiB          # the training process, less its 1-rank communicator
    assert m.nccl_communicator_bytes == 40 * MiB
    # the lab's NCCL_MIN_NCHANNELS=32 when measured: the all-reduces connect the ring, the all-to-all its p2p peer
    assert (m.nccl_peer_bytes, m.nccl_p2p_peer_bytes) == (400 * MiB, 400 * MiB)
    assert (m.allocator_gap_bytes, m.allocator_gap_ref_elements) == (GiB, 99)
    assert m.source.startswith("results/scale/x.json (NVIDIA H200, 2026-12-03, abc1234: context, NCCL communicator, "
                               "NCCL peers, allocator gap measured)")
    default = ot.derive(_doc(nccl={k: v for k, v in _doc()["nccl"].items() if k != "world2_lab"}))
    assert (default.nccl_peer_bytes, default.nccl_p2p_peer_bytes) == (300 * MiB, 350 * MiB)
    # what the 1-rank group gained over the same stages is not the peer's
    grown = _doc()
    grown["nccl"]["world1"] = _child(40 * MiB, 40 * MiB, 60 * MiB, 70 * MiB)
    assert (ot.derive(grown).nccl_peer_bytes, ot.derive(grown).nccl_p2p_peer_bytes) == (380 * MiB, 390 * MiB)
    one_gpu = ot.derive(_doc(nccl={"world1": _child(40 * MiB, 40 * MiB, 40 * MiB, 40 * MiB)}))
    assert (one_gpu.nccl_peer_bytes, one_gpu.nccl_p2p_peer_bytes) == (0, 0)
    assert one_gpu.source.endswith("NCCL communicator, allocator gap measured; not measured, 0: NCCL peers)")
    failed = ot.derive(_doc(nccl={"world1": _child(40 * MiB, 40 * MiB, 40 * MiB, 40 * MiB),
                                  "world2": {"error": "exit 1: ...", "command": "..."}}))
    assert failed.nccl_peer_bytes == 0 and failed.source.endswith("not measured, 0: NCCL peers)")


def test_derive_refuses_what_is_not_a_measurement():
    with pytest.raises(ValueError, match="dry run .*run the tool on a GPU"):
        ot.derive(_doc(dry_run=True))
    with pytest.raises(ValueError, match="format None, expected 'fp4moe-outside-torch/1'"):
        ot.derive({})


def test_without_the_file_every_term_is_zero_and_says_so(tmp_path):
    m = ot.load(tmp_path / "absent.json")
    assert (m.cuda_context_bytes, m.nccl_communicator_bytes, m.nccl_peer_bytes, m.nccl_p2p_peer_bytes,
            m.allocator_gap_bytes) == (0, 0, 0, 0, 0)
    assert m.source == NOT_MEASURED
    (tmp_path / "m.json").write_text(json.dumps(_doc()))
    assert ot.load(tmp_path / "m.json").nccl_communicator_bytes == 40 * MiB


def test_the_manifests_measurement_is_what_the_model_gets():
    """The measurement the manifest names: its terms derived from the file itself, which records the same GPU, date
    and commit as its manifest entry; measured_assumptions hands them to the memory model, which adds them to the
    allocated bytes of every GPU."""
    entry, _ = manifest.load().one("memory", "outside_torch")
    doc = json.loads(entry.file.read_text())
    assert (doc["gpu"], doc["date"], doc["commit"]) == ("NVIDIA H200", entry.date, entry.commit)
    m = ot.measured()
    assert m == ot.derive(doc, entry.repo_path) and m.cuda_context_bytes > 0
    assert m.source.startswith(f"{entry.repo_path} (NVIDIA H200, {entry.date}, {entry.commit}: context")
    a = ot.measured_assumptions(deepep_buffers=True)
    assert (a.cuda_context_bytes, a.allocator_gap_bytes, a.outside_torch_source, a.deepep_buffers) == (
        m.cuda_context_bytes, m.allocator_gap_bytes, m.source, True)
    cfg = compose_cfg("proxy_h200", "single_gpu", "none", "bf16")
    (b,) = per_stage_memory(cfg, a)
    assert b.cuda_context_bytes == m.cuda_context_bytes and b.total_bytes > b.allocated_bytes


# ---------------------------------------------------------------------------------------------- the tool

def test_tool_dry_run_writes_an_unmeasured_document(tmp_path, capsys, monkeypatch):
    argv = ["--dry-run", "--out", str(tmp_path), "--micro-batches", "8,16"]
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", [str(tool.ROOT / "tools/device/measure_outside_torch.py"), *argv])
    assert tool.main(argv) == 0
    doc = json.loads((tmp_path / tool.OUT_NAME).read_text())
    assert doc["format"] == ot.FORMAT and doc["dry_run"] is True and doc["training"] == []
    # the command line as results/scale/ keeps it: no machine's folders
    assert doc["command"] == "<repo>/tools/device/measure_outside_torch.py --dry-run --out $OUT --micro-batches 8,16"
    assert len(doc["plan"]) == 4 + 2 * 2 * 2   # context, NCCL x 3; 2 allocator settings x 2 cells x 2 micro-batches
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in doc["plan"][-1]
    assert "dry run: no GPU touched" in capsys.readouterr().out
    with pytest.raises(ValueError, match="dry run"):
        ot.derive(doc)


def test_tool_refuses_bad_arguments(tmp_path):
    with pytest.raises(SystemExit):
        tool.main(["--dry-run", "--out", str(tmp_path), "--cells", "bf16"])
    with pytest.raises(SystemExit):
        tool.main(["--dry-run", "--out", str(tmp_path), "--steps", "2"])


FAKE_TRAINER = """
import os, sqlite3, sys
db = os.environ["MLFLOW_TRACKING_URI"].removeprefix("sqlite:///")
c = sqlite3.connect(db)
c.execute("CREATE TABLE latest_metrics (key TEXT, value REAL, run_uuid TEXT)")
c.execute("CREATE TABLE params (key TEXT, value TEXT, run_uuid TEXT)")
alloc = 10.0 if os.environ.get("PYTORCH_CUDA_ALLOC_CONF") else 10.0
reserved = 10.5 if os.environ.get("PYTORCH_CUDA_ALLOC_CONF") else 14.0
c.executemany("INSERT INTO latest_metrics VALUES (?, ?, 'r')", [("summary/peak_mem_allocated_gb", alloc),
              ("summary/peak_mem_reserved_gb", reserved)])
c.executemany("INSERT INTO params VALUES (?, ?, 'r')", [("parallel.micro_batch", sys.argv[1]),
              ("parallel.seq_length", "4096"), ("model.hidden_size", "2048")])
c.commit()
"""


def test_tool_training_runs_and_summary_end_to_end(tmp_path, monkeypatch):
    """The parent side on the CPU: a stand-in trainer writes an MLflow-like store, nvidia-smi reads a fixed 12 GiB
    above the baseline; each run's gap and outside bytes, then the summary the model derives its terms from."""
    script = tmp_path / "trainer.py"
    script.write_text(FAKE_TRAINER)
    used = iter([0] + [12 * 1024] * 10_000)
    monkeypatch.setattr(tool, "used_mib", lambda uuid: next(used))
    monkeypatch.setattr(tool, "process_used_mib", lambda pid: None)
    monkeypatch.setattr(tool, "trainer_command", lambda r, s, mb, steps, alloc=None: [sys.executable, str(script), str(mb)])
    expandable = tool.training_run("GPU-x", "mxfp4", "attn_block_ln_experts", 16, 4, "expandable_segments:True")
    assert expandable["gap_bytes"] == GiB // 2 and expandable["peak_reserved_bytes"] == round(10.5 * GiB)
    assert expandable["outside_torch_bytes"] == 12 * GiB - round(10.5 * GiB)
    assert (expandable["tokens"], expandable["hidden"]) == (16 * 4096, 2048)
    used = iter([0] + [12 * 1024] * 10_000)
    default = tool.training_run("GPU-x", "mxfp4", "attn_block_ln_experts", 16, 4, None)
    assert default["alloc_conf"] == "unset" and default["gap_bytes"] == 4 * GiB
    s = tool.summarize({"training": [default, expandable]})   # only expandable segments count
    assert s["allocator"] == {"gap_bytes": GiB // 2, "ref_elements": 16 * 4096 * 2048,
                              "run": "mxfp4 attn_block_ln_experts micro-batch 16"}
    assert s["training_process"]["outside_torch_bytes"] == expandable["outside_torch_bytes"]
    m = ot.derive(_doc(**s))
    assert m.allocator_gap_bytes == GiB // 2 and m.cuda_context_bytes == expandable["outside_torch_bytes"] - 40 * MiB


def test_tool_store_reader(tmp_path):
    db = tmp_path / "m.db"
    c = sqlite3.connect(db)
    c.execute("CREATE TABLE latest_metrics (key TEXT, value REAL, run_uuid TEXT)")
    c.execute("CREATE TABLE params (key TEXT, value TEXT, run_uuid TEXT)")
    c.execute("INSERT INTO latest_metrics VALUES ('a', 1.5, 'r')")
    c.execute("INSERT INTO params VALUES ('p', 'x', 'r')")
    c.commit()
    c.close()
    assert tool.store_metrics(db) == {"metrics": {"a": 1.5}, "params": {"p": "x"}}
