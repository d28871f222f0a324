"""The validator's shardings come from MaxText's logical axis rules (planner.validate.axis_rules), not from the
cost model: the copy of the rules is checked against MaxText 0.2.5's base.yml, the flax priority rule by hand."""

from __future__ import annotations

import ast
import pathlib

import yaml

from costmodel.plan import Plan
from planner.validate import axis_rules as ar

ROOT = pathlib.Path(__file__).resolve().parents[1]
BASE = ROOT / "tests" / "data" / "maxtext_0_2_5_logical_axis_rules.yml"


def _maxtext_rules() -> list[tuple[str, tuple[str, ...]]]:
    data = yaml.safe_load(BASE.read_text())
    return [(name, (axes,) if isinstance(axes, str) else tuple(axes)) for name, axes in data["logical_axis_rules"]]


def test_rules_are_maxtexts_in_maxtexts_order():
    theirs = _maxtext_rules()
    at = [theirs.index(rule) for rule in ar.LOGICAL_AXIS_RULES]  # ValueError if one is not MaxText's
    assert at == sorted(at)  # the same priority order
    # every rule MaxText has for a name the validator uses is copied (a missing second `embed` would change results)
    names = {n for n, _ in ar.LOGICAL_AXIS_RULES}
    assert [r for r in theirs if r[0] in names] == list(ar.LOGICAL_AXIS_RULES)


def test_renamed_mesh_axes_are_maxtexts():
    mesh = yaml.safe_load(BASE.read_text())["mesh_axes"]
    assert set(ar.MESH_RENAME) <= set(mesh)


def test_flax_priority_a_used_axis_sends_embed_to_its_second_rule():
    # `mlp` (listed before `embed`) takes fsdp_transpose, so `embed` cannot take its first rule, which lists it
    assert ar.logical_to_mesh(("embed", "mlp")) == [("fsdp", "context", "context_usp_ulysses", "expert"),
                                                    ("fsdp_transpose", "tensor", "tensor_sequence", "autoregressive")]
    assert ar.logical_to_mesh(("embed",))[0] == ("fsdp", "fsdp_transpose", "context", "context_usp_ulysses", "expert")
    assert ar.logical_to_mesh(("qkv", None)) == [(), ()]


def test_kernels_under_a_plan():
    plan = Plan(fsdp=2, tp=2, ep=2, cp=2)
    assert ar.spec(ar.kernel_axes("wi"), plan) == (("fsdp", "cp", "ep"), None, "tp")
    assert ar.spec(ar.kernel_axes("wo"), plan) == ("tp", None, ("fsdp", "cp", "ep"))
    assert ar.spec(ar.kernel_axes("embed"), plan) == ("tp", ("fsdp", "cp", "ep"))
    # routed experts: split by expert over ep, which then does not split their d_model (embed_moe)
    assert ar.spec(ar.kernel_axes("wi_0", moe_layer=True), plan) == ("ep", ("fsdp", "cp"), "tp")
    assert ar.spec(ar.kernel_axes("wo_mlp", moe_layer=True), plan) == ("ep", "tp", ("fsdp", "cp"))
    # MaxText's router (embed_router) is not split over ep, unlike the cost model's rule for non-expert weights
    assert ar.spec(ar.kernel_axes("router", moe_layer=True), plan) == (("fsdp", "cp"), None)
    # norm scales follow the validator's activations (d whole), not MaxText's `norm` -> tensor
    assert ar.spec(ar.kernel_axes("norm1"), plan) == (None,)
    # axes of degree 1 drop out
    assert ar.spec(ar.kernel_axes("wi"), Plan(tp=4)) == (None, None, "tp")


def test_zero3_dp_joins_fsdp_as_the_export_folds_it():
    assert ar.spec(ar.kernel_axes("wo_mlp"), Plan(dp=2, fsdp=2, zero=3)) == (None, ("fsdp", "dp"))
    assert ar.embed_axes(Plan(dp=4, zero=3)) == ("dp",)


def test_zero1_data_on_the_first_divisible_dimension_tp_does_not_split():
    plan = Plan(dp=4, tp=2, zero=1)
    # wo [heads, head_dim, d]: heads split over tp, so data goes on head_dim (16 / 4)
    assert ar.with_data(("tp", None, None), (8, 16, 128), plan) == ("tp", "dp", None)
    # head_dim 6 does not divide by 4: on to d_model
    assert ar.with_data(("tp", None, None), (8, 6, 128), plan) == ("tp", None, "dp")
    # prepended to an axis already there; unchanged when dp already splits the array, or when nothing divides
    assert ar.with_data(("ep", None), (8, 4), Plan(dp=2, ep=2, zero=1)) == (("dp", "ep"), None)
    assert ar.with_data(("dp", None), (8, 4), plan) == ("dp", None)
    assert ar.with_data((None,), (6,), plan) == (None,)


def test_batch_and_weight_shards():
    assert ar.batch_axes() == ("dp", "fsdp", "ep")  # MaxText's activation_batch: data, fsdp, expert
    assert ar.embed_axes(Plan(fsdp=2, cp=2, ep=2, tp=2)) == ("fsdp", "cp", "ep")
    assert ar.embed_axes(Plan(fsdp=2, dp=2, zero=1), moments=True) == ("fsdp", "dp")


def test_validator_does_not_take_shardings_from_the_cost_model():
    for name in ("model", "pipeline", "scale", "axis_rules", "flash"):
        tree = ast.parse((ROOT / "planner" / "validate" / f"{name}.py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "costmodel.memory" not in imported and "costmodel.estimate" not in imported, name
