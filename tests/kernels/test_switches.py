"""fp4moe_kernels.switches: the kernel switches in one place. The environment's are read at each call (parsed once
per set of values), a ``use`` block overrides them, the trainer's ``kernels`` config group defaults to the environment
and records what ran, and every bad value is one error naming the key, the variable and the values."""
from __future__ import annotations

import pytest

from fp4moe_kernels import switches as sw


def test_defaults_environment_and_use(monkeypatch):
    for var in sw.ENV.values():
        monkeypatch.delenv(var, raising=False)
    assert sw.current() == sw.Switches()
    monkeypatch.setenv("FP4MOE_GROUPED_GEMM", " LOOP ")
    assert sw.current().grouped_gemm == "loop"            # read now, normalised
    with sw.use(sw.Switches(grouped_gemm="triton", fused_swiglu=False)) as s:
        assert sw.current() is s and s.fused_swiglu == "0"  # the block's switches win over the environment
        with sw.use(sw.Switches(cuda_col="0")):
            assert sw.current().cuda_col == "0" and sw.current().grouped_gemm == "triton"
        assert sw.current() is s
    assert sw.current().grouped_gemm == "loop"
    assert sw.current() is sw.current()  # parsed once while the environment holds the same values
    monkeypatch.setenv("FP4MOE_GROUPED_GEMM", "triton")
    assert sw.current().grouped_gemm == "triton"  # a change is seen at the next call
    monkeypatch.setenv("FP4MOE_GROUPED_GEMM", "typo")
    for _ in range(2):  # a bad value is refused at every call, not remembered
        with pytest.raises(sw.SwitchError, match="FP4MOE_GROUPED_GEMM='typo'"):
            sw.current()
    monkeypatch.setenv("FP4MOE_GROUPED_GEMM", " LOOP ")
    assert sw.Switches(dispatch_quantize="rows", tiles=" {} ").as_env() == {"FP4MOE_DISPATCH_QUANTIZE": "rows",
                                                                             "FP4MOE_TILES": "{}"}


@pytest.mark.parametrize("field", sorted(sw.CHOICES))
def test_every_choice_refuses_a_typo_naming_its_values(field):
    values, _ = sw.CHOICES[field]
    for v in values:
        assert getattr(sw.Switches(**{field: v.upper()}), field) == v
    with pytest.raises(sw.SwitchError, match=f"{sw.ENV[field]}='typo': use "):
        sw.Switches.from_env({sw.ENV[field]: "typo"})
    with pytest.raises(sw.SwitchError, match=rf"kernels.{field}='typo' \(the config's, or \${sw.ENV[field]}'s\): use "):
        sw.Switches.from_config({field: "typo"})
    with pytest.raises(sw.SwitchError, match=r"unknown key\(s\) \['cuda_cols'\]"):
        sw.Switches.from_config({"cuda_cols": "0"})


def test_the_config_group_defaults_to_the_environment(monkeypatch):
    """conf/kernels/default.yaml: each key is its variable when set, else the default; a command-line value wins."""
    from hydra import compose, initialize_config_dir

    from fp4moe.ops import kernel_switches
    from fp4moe.paths import conf_dir

    for var in sw.ENV.values():
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FP4MOE_DISPATCH_QUANTIZE", "rows")
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("train")
        over = compose("train", overrides=["kernels.dispatch_quantize=tokens", "kernels.fused_swiglu=0"])
        # the command line's true / false reach the str-typed schema as 'True' / 'False': a 0 / 1 switch takes them
        spelled = compose("train", overrides=["kernels.fused_swiglu=false", "kernels.fused_swiglu_fp8=true"])
    assert set(cfg.kernels) == set(sw.ENV)
    assert kernel_switches(cfg.kernels) == sw.Switches(dispatch_quantize="rows")
    assert kernel_switches(over.kernels) == sw.Switches(fused_swiglu="0")
    assert kernel_switches(spelled.kernels) == sw.Switches(dispatch_quantize="rows", fused_swiglu="0",
                                                          fused_swiglu_fp8="1")
    with pytest.raises(sw.SwitchError, match="use 'triton'"):  # a choice of words takes no bool
        sw.Switches(gather_sum="true")
