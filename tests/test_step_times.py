"""tools/step_times.py on the committed e431a41 T1 archive and the nvidia-smi log taken beside its first call (H200,
results/train_proxy/README.md section 17)."""
from pathlib import Path

import pytest

from tool_module import load_tool

ROOT = Path(__file__).resolve().parents[1]
st = load_tool("tools/step_times.py")

ARCHIVE = ROOT / "results/train_proxy/proxy_t1_h200_2026-12-01_e431a41.json.xz"
SMI = ROOT / "results/train_proxy/diagnostic/host_stalls_h200_2026-12-01_e431a41/nvidia_smi_call1_t1cells.csv.xz"


@pytest.fixture(scope="module")
def rows():
    smi = st.read_smi(str(SMI))
    return [r for r in (st.analyse(run, 1.2, smi) for run in st.read_runs([str(ARCHIVE)])) if r is not None]


def test_fp8s_slow_steps_wait_for_the_host(rows):
    """Call 1's cells in start order: fp8's slow steps (2-8 of the fourth cell) ran at full SM clock and lower board
    power than its other steps (the GPU idle part of each: a host stall, not a slower GPU); mxfp4 had none."""
    call1 = rows[:6]
    off = {"FP4MOE_TRACKING_THREAD": "0"}
    assert [(r["recipe"], r["env"]) for r in call1] == [
        ("fp8", {}), ("mxfp4", {}), ("fp8", off), ("fp8", {}), ("mxfp4", {}), ("fp8", off)]
    fp8 = call1[3]
    assert fp8["slow"] == [2, 3, 4, 5, 6, 7, 8] and fp8["tgs"] == pytest.approx(171165.6, abs=0.1)
    assert fp8["slow_power"] < 560 < 640 < fp8["other_power"]
    assert fp8["slow_clock"] >= fp8["other_clock"] - 50
    assert all(r["slow"] == [] for r in call1 if r["recipe"] == "mxfp4")
    assert [len(r["slow"]) for r in call1 if r["recipe"] == "fp8"] == [1, 2, 7, 8]
    # the smi log covers call 1 only: later runs have no samples
    assert rows[-1]["slow_power"] is None and rows[-1]["other_clock"] is None


def test_cli_table_and_bad_input(capsys):
    assert st.main([str(ARCHIVE), "--slow", "1.5"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("| recipe | scope | mb | env | tokens/GPU/s |")
    assert len(out.splitlines()) == 2 + 17 and "| TORCHINDUCTOR_COMPILE_THREADS=1 | 176014 |" in out
    with pytest.raises(SystemExit):
        st.main([str(ARCHIVE), "--slow", "1"])
    assert "give a factor above 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        st.main([str(ARCHIVE), "--smi", "missing.csv"])
    assert "no such file" in capsys.readouterr().err
