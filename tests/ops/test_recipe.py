"""Recipe: presets, from_config overrides, validation messages (they name the key and the fix), applies_to."""
from __future__ import annotations

import dataclasses

import pytest

from fp4moe.recipe import FP4_SWITCHES, Recipe, RecipeError


def test_presets():
    b, f, m = Recipe.bf16(), Recipe.fp8(), Recipe.mxfp4()
    assert (b.name, f.name, m.name) == ("bf16", "fp8", "mxfp4")
    assert not any(getattr(b, s) for s in FP4_SWITCHES)
    assert not any(getattr(f, s) for s in FP4_SWITCHES)
    assert all(getattr(m, s) for s in FP4_SWITCHES)  # the paper's: every FP4 switch on
    for r in (b, f, m):
        assert r.backward_a2a == "bf16" and r.scale_rule == "ceil"  # gradients stay BF16 by default
    assert f.scope == m.scope  # baseline and method cover the same linears
    assert not b.fp8_compute and f.fp8_compute and m.fp8_compute
    assert Recipe.preset("fp8") == f


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Recipe.fp8().name = "bf16"


def test_from_config_starts_from_the_named_preset():
    assert Recipe.from_config({}) == Recipe.bf16()
    assert Recipe.from_config({"name": "mxfp4"}) == Recipe.mxfp4()
    r = Recipe.from_config({"name": "mxfp4", "save_fp4": False, "backward_a2a": "fp8", "scope": "all_linears"})
    assert r.dispatch_fp4 and r.expert_input_fp4 and r.activation_fp4_store and not r.save_fp4
    assert (r.backward_a2a, r.scope) == ("fp8", "all_linears")
    for preset in (Recipe.bf16(), Recipe.fp8(), Recipe.mxfp4(), r):
        assert Recipe.from_config(preset.to_dict()) == preset
    assert Recipe.from_config(r) is r


def test_a_null_key_is_the_presets_value_and_a_files_defaults_list_is_skipped():
    """The precision group's schema (fp4moe.settings.Precision) holds null for every key a file leaves out; a
    conf/precision file loaded as it is has its Hydra defaults list (the schema's name)."""
    assert Recipe.from_config({"name": "mxfp4", "save_fp4": None, "scope": None}) == Recipe.mxfp4()
    assert Recipe.from_config({"defaults": ["base_precision", "_self_"], "name": "fp8"}) == Recipe.fp8()


def test_from_config_omegaconf():
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({"name": "fp8", "backward_a2a": "fp8", "scope": "experts"})
    assert Recipe.from_config(cfg) == Recipe(name="fp8", backward_a2a="fp8", scope="experts")
    with pytest.raises(RecipeError, match="unknown recipe key"):
        Recipe.from_config(omegaconf.OmegaConf.create({"name": "fp8", "fp4_dispatch": True}))


def test_dispatch_fp4_without_expert_input_fp4_is_allowed():
    # Documented decision: the receiver dequantizes MXFP4 -> BF16 (exact) and quantizes to FP8 as fp8 does.
    r = Recipe.from_config({"name": "mxfp4", "expert_input_fp4": False})
    assert r.dispatch_fp4 and not r.expert_input_fp4
    r = Recipe(name="mxfp4", expert_input_fp4=True)  # and the converse: receiver quantizes BF16 -> MXFP4
    assert not r.dispatch_fp4


@pytest.mark.parametrize(
    "cfg, words",
    [
        ({"name": "fp8", "fp4_dispatch": True}, ["'fp4_dispatch'", "dispatch_fp4"]),  # typo: lists the keys
        ({"name": "fp16"}, ["name='fp16'", "'mxfp4'"]),
        ({"name": "bf16", "save_fp4": True}, ["save_fp4", "name='mxfp4'", "name='bf16'"]),
        ({"name": "fp8", "dispatch_fp4": True, "activation_fp4_store": True},
         ["dispatch_fp4, activation_fp4_store", "name: mxfp4"]),
        ({"name": "bf16", "backward_a2a": "fp8"}, ["backward_a2a='fp8'", "name='bf16'", "backward_a2a: bf16"]),
        ({"name": "mxfp4", "backward_a2a": "fp4"}, ["backward_a2a='fp4'", "never FP4"]),
        ({"name": "fp8", "scope": "moe"}, ["scope='moe'", "'experts+shared'", "'all_linears'"]),
        ({"name": "mxfp4", "scale_rule": "round"}, ["scale_rule='round'", "'floor'"]),
        ({"name": "mxfp4", "save_fp4": "yes"}, ["save_fp4", "true or false"]),
        ({"name": "mxfp4", "dispatch_fp4": False, "expert_input_fp4": False, "save_fp4": False,
          "activation_fp4_store": False, "recompute_cache_fp4": False}, ["is the fp8 recipe", "name: fp8"]),
        ({"name": "mxfp4", "dispatch_fp4": False, "label": "fp8"},
         ["label='fp8'", "name='mxfp4'", "with the fp8 preset's", "its own label"]),
        ({"name": "mxfp4", "label": "mlp shared"}, ["label must be a word", "'mlp shared'"]),
    ],
)
def test_invalid_configs_name_the_key_and_the_fix(cfg, words):
    with pytest.raises(RecipeError) as info:
        Recipe.from_config(cfg)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    assert isinstance(info.value, ValueError)


def test_tag_is_the_label_of_a_variant_else_the_name():
    """What results call a recipe: a preset (or one given no label) by its name, a labelled variant by its label,
    which may repeat its own name but is kept through to_dict / from_config."""
    assert [Recipe.preset(n).tag for n in ("bf16", "fp8", "mxfp4")] == ["bf16", "fp8", "mxfp4"]
    assert Recipe.from_config({"name": "mxfp4", "save_fp4": False}).tag == "mxfp4"
    v = Recipe.from_config({"name": "mxfp4", "label": "mxfp4_mlp_shared", "dispatch_fp4": False})
    assert (v.name, v.tag, v.fp8_compute) == ("mxfp4", "mxfp4_mlp_shared", True)
    assert Recipe.from_config(v.to_dict()) == v and v != dataclasses.replace(v, label="")
    assert Recipe.from_config({"name": "fp8", "label": "fp8"}).tag == "fp8"


def test_direct_construction_is_validated_too():
    with pytest.raises(RecipeError, match="needs name='mxfp4'"):
        Recipe(name="fp8", save_fp4=True)
    with pytest.raises(RecipeError, match="mapping"):
        Recipe.from_config(["fp8"])


@pytest.mark.parametrize(
    "scope, expert, shared, dense",
    [("experts", True, False, False), ("experts+shared", True, True, False), ("all_linears", True, True, True)],
)
def test_applies_to(scope, expert, shared, dense):
    for name in ("fp8", "mxfp4"):
        r = dataclasses.replace(Recipe.preset(name), scope=scope)
        assert (r.applies_to("expert"), r.applies_to("shared_expert"), r.applies_to("dense")) == (expert, shared, dense)
    b = Recipe(name="bf16", scope=scope)
    assert not any(b.applies_to(k) for k in ("expert", "shared_expert", "dense"))
    with pytest.raises(RecipeError, match="layer_kind='attention'"):
        b.applies_to("attention")
