"""The registry and the plug-in contract: lookup, axis validation, tensor
checks, families keyed by their reference function, constant axes bound by
name, hostile definition files, and the config seam with tuned tables.
(Per-definition checks live in test_definitions.py.)"""

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkern import backends, dataset, registry, selection, tuning
from jaxkern import plan as plan_lib
from jaxkern.family import bind_axes, shrink_rows, shrink_until
from pallas_kernels.dense_gemm import triton as dense_gemm

NAMES = registry.names()
REPO = pathlib.Path(__file__).resolve().parent.parent
GEMM = "dense_gemm_bf16_nt_n4096_k4096"


def test_get_unknown_name_lists_close_matches():
  with pytest.raises(KeyError, match="noncausal_dense_attention_h32_d64"):
    registry.get("noncausal_dense_attention_h32_d6")


def test_every_definition_has_an_op():
  assert len(NAMES) == 21
  for n in NAMES:
    op = registry.get(n)
    assert op.definition.name == n and op is registry.get(n)


def test_axes_are_validated_with_clear_errors():
  op = registry.get(GEMM)
  assert op.validated_axes({"M": 5}) == {"M": 5, "N": 4096, "K": 4096}
  with pytest.raises(dataset.DatasetError, match="axes.N.*expected 4096"):
    op.validated_axes({"M": 5, "N": 8})
  with pytest.raises(dataset.DatasetError, match="axes.M.*missing axis"):
    op.validated_axes({})
  with pytest.raises(dataset.DatasetError, match="axes.Q"):
    op.validated_axes({"M": 1, "Q": 2})


def test_check_tensors_names_field_and_expectation():
  d = registry.get(GEMM).definition
  axes = {"M": 2, "N": 4, "K": 8}
  good = {"A": np.zeros((2, 8), jax.numpy.bfloat16), "B": np.zeros((4, 8), jax.numpy.bfloat16)}
  registry.check_tensors(d, good, axes)
  with pytest.raises(dataset.DatasetError, match=r"inputs.B.*\(4, 8\)"):
    registry.check_tensors(d, {**good, "B": np.zeros((4, 7), jax.numpy.bfloat16)}, axes)
  with pytest.raises(dataset.DatasetError, match="inputs.A.*bfloat16"):
    registry.check_tensors(d, {**good, "A": np.zeros((2, 8), np.float32)}, axes)
  with pytest.raises(dataset.DatasetError, match="names differ"):
    registry.check_tensors(d, {"A": good["A"]}, axes)


def copy_dataset(tmp_path, names=(GEMM,)):
  ds = tmp_path / "ds"
  (ds / "definitions").mkdir(parents=True)
  (ds / "workloads").mkdir()
  for n in names:
    shutil.copy(REPO / "datasets" / "definitions" / f"{n}.json", ds / "definitions")
  return ds


def test_a_new_shape_of_a_family_is_only_data(tmp_path):
  """A GEMM with N=256, K=96 needs a definition JSON and records, no code."""
  ds = copy_dataset(tmp_path, ())
  raw = json.loads((REPO / "datasets" / "definitions" / f"{GEMM}.json").read_text())
  raw["name"] = "dense_gemm_bf16_nt_n256_k96"
  raw["axes"]["N"]["value"], raw["axes"]["K"]["value"] = 256, 96
  (ds / "definitions" / f"{raw['name']}.json").write_text(json.dumps(raw))
  (ds / "workloads" / f"{raw['name']}.jsonl").write_text(
    json.dumps({"uuid": "w1", "definition": raw["name"], "axes": {"M": 37}}) + "\n"
  )
  op = registry.get(raw["name"], ds)
  assert op.implemented
  [w] = dataset.load_workloads(raw["name"], ds)
  plan = plan_lib.plan(op, w, size="full", on_gpu=False)
  out = op.kernel(plan.inputs, interpret=True, config=plan.choice.config)
  assert out["C"].shape == (37, 256)
  assert op.compare(out, op.reference(plan.inputs)).passed


def test_unimplemented_definition_raises_naming_the_module(tmp_path):
  ds = copy_dataset(tmp_path, ())
  raw = json.loads((REPO / "datasets" / "definitions" / f"{GEMM}.json").read_text())
  raw["name"], raw["reference"] = "toy_missing", "jaxkern.families.no_such_family:ref"
  (ds / "definitions" / "toy_missing.json").write_text(json.dumps(raw))
  op = registry.get("toy_missing", ds)
  assert not op.implemented
  for call in (lambda: op.reference({}), lambda: op.kernel({}), lambda: op.make_inputs({"M": 1})):
    with pytest.raises(NotImplementedError, match="no_such_family"):
      call()


@pytest.mark.parametrize(
  "reference",
  [
    "os:system",
    "jaxkern.families.dense_gemm:__import__('os')",
    "jaxkern.familiesx.gemm:f",
    "jaxkern.families.gemm",
    "subprocess:run",
    "jaxkern.families..gemm:f",
    "jaxkern.families.dense_gemm:no_such_fn",
  ],
)
def test_hostile_reference_fields_are_rejected(tmp_path, reference):
  ds = copy_dataset(tmp_path, ())
  raw = json.loads((REPO / "datasets" / "definitions" / f"{GEMM}.json").read_text())
  raw["name"], raw["reference"] = "toy_hostile", reference
  (ds / "definitions" / "toy_hostile.json").write_text(json.dumps(raw))
  with pytest.raises(dataset.DatasetError, match="field 'reference'"):
    registry.get("toy_hostile", ds)


def test_constant_axes_bind_to_keyword_only_parameters():
  def f(x, *, KT, top_k, other=1):
    return x, KT, top_k, other

  bound = bind_axes(f, {"KT": 3, "TOPK": 6, "x": 9}, {"top_k": "TOPK"})
  assert bound(0) == (0, 3, 6, 1)
  assert bind_axes(len, {"KT": 3}, {}) is len


def test_parse_axes_and_largest_recorded_axes():
  assert selection.parse_axes("B=1, Nq=2352") == {"B": 1, "Nq": 2352}
  with pytest.raises(ValueError, match="NAME=INT"):
    selection.parse_axes("M")
  d = registry.get(GEMM).definition
  assert selection.largest_recorded_axes(d) == {"M": 24576}
  assert selection.input_bytes(d, {"M": 2}) == (2 * 4096 + 4096 * 4096) * 2


def test_shrink_helpers():
  assert [shrink_rows(n) for n in (1, 64, 65, 4125, 8192)] == [1, 64, 65, 93, 64]
  out = shrink_until({"N": 64, "K": 16}, lambda a: a["N"] * a["K"] <= 100, lambda a: {**a, "N": a["N"] // 2})
  assert out == {"N": 4, "K": 16}


def test_names_outputs_in_definition_order():
  op = registry.get("moe_router_gemm_topk_deepseek41_d5120_e384_topk6")
  assert list(op.name_outputs((1, 2))) == ["expert_ids", "expert_weights"]
  with pytest.raises(ValueError, match="expected 2 outputs"):
    op.name_outputs(1)


# --- the config seam ------------------------------------------------------


@pytest.fixture
def tuned_dir(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXKERN_TUNED_DIR", str(tmp_path / "tuned"))
  return tmp_path / "tuned"


def test_config_for_explicit_then_tuned_then_heuristic(tuned_dir):
  op = registry.get(GEMM)
  shapes = op.input_shapes({"M": 4125})
  heuristic = op.choose_config(shapes)
  assert op.config_for(shapes) == backends.Choice("triton", heuristic, tuning.HEURISTIC)
  other = dense_gemm.DenseGemmConfig(64, 128, 64, 8, num_warps=4, num_stages=4)
  path = tuning.record("dense_gemm", "triton", op.bucket(shapes), other, latency_ms=1.0, definition=GEMM)
  assert path == tuned_dir / f"{tuning.device_kind_slug(tuning.current_device_kind())}.json"
  assert op.config_for(shapes) == backends.Choice("triton", other, tuning.TUNED)
  # Same bucket (M in (4096, 8192]) uses it; another bucket does not.
  assert op.config_for(op.input_shapes({"M": 8000})).source == tuning.TUNED
  assert op.config_for(op.input_shapes({"M": 4000})).source == tuning.HEURISTIC
  assert op.config_for(shapes, tuned=False).source == tuning.HEURISTIC
  assert op.config_for(shapes, heuristic) == backends.Choice("triton", heuristic, tuning.EXPLICIT)
  # Another device kind's table is not consulted.
  assert op.config_for(shapes, device_kind="NVIDIA H200").source == tuning.HEURISTIC


def test_config_json_round_trip_with_nested_stages():
  import dataclasses

  @dataclasses.dataclass(frozen=True)
  class Stage:
    block: int = 16
    num_warps: int = 4

  @dataclasses.dataclass(frozen=True)
  class TwoStage:
    main: Stage = Stage()
    combine: Stage = Stage(32, 8)

  c = TwoStage(Stage(64, 8), Stage(16, 2))
  data = json.loads(json.dumps(tuning.config_to_json(c)))
  assert tuning.config_from_json(data, TwoStage()) == c
  with pytest.raises(ValueError, match="no fields"):
    tuning.config_from_json({"nope": 1}, TwoStage())


def test_shape_buckets():
  assert tuning.shape_bucket({"M": 4125}) == "M=8192"
  assert tuning.shape_bucket({"Nq": 51, "B": 1}) == "B=1,Nq=64"
  shapes = {"A": jax.ShapeDtypeStruct((4125, 4096), jnp.bfloat16), "s": jnp.float32(1.0)}
  assert tuning.shape_bucket(shapes, {"top_k": 6}) == "A=8192x4096,s=scalar,top_k=6"


def test_tuned_table_is_read_once_per_process(tuned_dir, monkeypatch):
  op = registry.get(GEMM)
  shapes = op.input_shapes({"M": 100})
  tuning.record("dense_gemm", "triton", op.bucket(shapes), op.choose_config(shapes), latency_ms=1.0)
  reads = []
  real = pathlib.Path.read_text
  monkeypatch.setattr(pathlib.Path, "read_text", lambda self, *a, **k: reads.append(self) or real(self, *a, **k))
  for _ in range(3):
    assert op.config_for(shapes).source == tuning.TUNED
  assert reads == []  # record() left the written table cached
