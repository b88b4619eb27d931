"""FlashInfer-Bench interop (`jaxkern.fib`): exports validated against FIB
0.1.2's JSON Schemas (jaxkern/fib/schemas, from its pydantic models; no
torch needed), FIB's reference rule checked as FIB checks it, the import of a
FIB-layout folder written here, and the round trip of the whole dataset.
The real client is checked by `make fib-check` (README)."""

import ast
import json
import pathlib

import fib_results
import jsonschema
import numpy as np
import pytest

from jaxkern import blobs, dataset, plan, registry
from jaxkern.fib import bridge, cli, formats
from jaxkern.fib import definitions as fib_definitions
from jaxkern.fib import export as fib_export
from jaxkern.fib import import_ as fib_import

SCHEMAS = pathlib.Path(fib_export.__file__).parent / "schemas"


def validator(name: str) -> jsonschema.Draft202012Validator:
  schema = json.loads((SCHEMAS / f"{name}.schema.json").read_text())
  jsonschema.Draft202012Validator.check_schema(schema)
  return jsonschema.Draft202012Validator(schema)


def jsonl(path: pathlib.Path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_reference_rule(fib_def: dict) -> None:
  """FIB's Definition._validate_reference_code: valid Python with a
  top-level `run`; here also: its parameters are the inputs, in order."""
  module = ast.parse(fib_def["reference"], mode="exec")
  [run] = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "run"]
  assert [a.arg for a in run.args.args] == list(fib_def["inputs"])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """The GEMM and router definitions with the synthetic results."""
  root = tmp_path_factory.mktemp("fib")
  exp, left_out = fib_results.write(root / "results.jsonl")
  summary = fib_export.export(
    root / "out", results=[root / "results.jsonl"], names=[fib_results.GEMM, fib_results.ROUTER]
  )
  return root / "out", summary, exp, left_out


def test_every_definition_is_a_fib_definition():
  v = validator("definition")
  for d in dataset.load_definitions().values():
    fib = fib_definitions.to_fib(d)
    v.validate(fib)
    check_reference_rule(fib)
    assert fib[fib_definitions.POINTER_FIELD] == d.reference
    assert {t["dtype"] for t in [*fib["inputs"].values(), *fib["outputs"].values()]} <= set(formats.FIB_DTYPES)


def test_byte_tensors_export_as_int8_and_fp4_imports_too():
  defs = dataset.load_definitions()
  gemm = defs["grouped_gemm_fp8_fp4_e384_n4608_k5120_g32"]
  fib = fib_definitions.to_fib(gemm)
  assert [fib["inputs"][n]["dtype"] for n in ("a", "a_scale", "b", "b_scale")] == [
    "float8_e4m3fn",
    "int8",
    "int8",
    "int8",
  ]
  mla = fib_definitions.to_fib(defs["mixed_mla_decode_deepseek41_h64_d512_k8128_k4512"])["inputs"]
  assert (mla["kv_fp8"]["dtype"], mla["kv_fp4"]["dtype"]) == ("int8", "int8")
  # FIB's own FP4 type names our packed e2m1 weights, and only those.
  fib["inputs"]["b"]["dtype"] = "float4_e2m1"
  assert fib_definitions.match(fib, defs).exact
  fib["inputs"]["b_scale"]["dtype"] = "float4_e2m1"
  m = fib_definitions.match(fib, defs)
  assert m.ours is None and "inputs.b_scale.dtype 'float4_e2m1' (ours 'int8')" in m.message


def test_export_writes_fib_traces_by_its_rules(exported):
  out, summary, exp, left_out = exported
  trace_v, solution_v = validator("trace"), validator("solution")
  assert (summary.definitions, summary.traces) == (2, len(exp))
  assert sum(summary.skipped.values()) == len(left_out)
  for uuid_reason in left_out.values():
    assert any(uuid_reason in reason for reason in summary.skipped), (uuid_reason, summary.skipped)

  defs = dataset.load_definitions()
  workloads = [t for p in sorted((out / "workloads").rglob("*.jsonl")) for t in jsonl(p)]
  assert len(workloads) == sum(len(dataset.load_workloads(n)) for n in (fib_results.GEMM, fib_results.ROUTER))
  for t in workloads:
    trace_v.validate(t)
    assert t["solution"] is None and t["evaluation"] is None
    assert list(t["workload"]["inputs"]) == list(defs[t["definition"]].inputs)

  traces = [t for p in sorted((out / "traces").rglob("*.jsonl")) for t in jsonl(p)]
  assert {t["workload"]["uuid"]: t["evaluation"]["status"] for t in traces} == exp
  solutions = {s["name"]: s for s in (json.loads(p.read_text()) for p in (out / "solutions").rglob("*.json"))}
  for t in traces:
    trace_v.validate(t)
    ev = t["evaluation"]
    assert (ev["correctness"] is not None) == (ev["status"] in ("PASSED", "INCORRECT_NUMERICAL"))
    assert (ev["performance"] is not None) == (ev["status"] == "PASSED")
    assert ev["environment"]["hardware"] in ("NVIDIA_H200", "cpu")
    assert t["solution"].startswith("jaxkern-triton_" + t["definition"] + "_")
    assert solutions[t["solution"]]["definition"] == t["definition"]
    assert t[fib_export.RESULT_FIELD]["workload"]["uuid"] == t["workload"]["uuid"]
  passed = [t for t in traces if t["evaluation"]["status"] == "PASSED"]
  assert {t["evaluation"]["performance"]["latency_ms"] for t in passed} == {0.21, 0.25}
  for s in solutions.values():
    solution_v.validate(s)
    assert s["spec"]["entry_point"] == "main.py::run"
  # The two GEMM configs are one solution; the router's failures (no config) another.
  assert len(solutions) == 2


def test_exported_sources_call_the_bridge_with_the_inputs_in_order(exported, monkeypatch):
  out, *_ = exported
  calls = []
  monkeypatch.setattr(bridge, "run_kernel_torch", lambda *a, backend: calls.append(("kernel", *a, backend)))
  monkeypatch.setattr(bridge, "run_reference", lambda *a: calls.append(("reference", *a)))
  monkeypatch.setattr(bridge, "run_reference_torch", lambda *a: bridge.run_reference(*a))
  [sol_path] = (out / "solutions").rglob(f"*{fib_results.GEMM}*.json")
  sol = json.loads(sol_path.read_text())
  exec(compile(sol["sources"][0]["content"], "main.py", "exec"), ns := {})
  ns["run"]("a", "b")
  fib_def = json.loads(next((out / "definitions").rglob(f"{fib_results.ROUTER}.json")).read_text())
  exec(compile(fib_def["reference"], "reference.py", "exec"), ref_ns := {})
  ref_ns["run"]("h", "w", "bias", 1.5)
  assert calls == [
    ("kernel", fib_results.GEMM, fib_results.GEMM_CONFIG, "a", "b", "triton"),
    ("reference", fib_results.ROUTER, "h", "w", "bias", 1.5),
  ]


def test_bridge_reads_fib_bytes_as_our_dtypes():
  spec = lambda dtype: dataset.TensorSpec(name="x", shape=("N",), dtype=dtype)  # noqa: E731
  signed = np.array([-1, 0, 127], np.int8)
  np.testing.assert_array_equal(bridge.to_our_array(signed, spec("uint8")), [255, 0, 127])
  assert bridge.to_our_array(np.array([3, 2**31 - 1], np.int64), spec("int32")).dtype == np.int32
  with pytest.raises(ValueError, match="outside int32"):
    bridge.to_our_array(np.array([2**31], np.int64), spec("int32"))
  bits = np.array([0x3F80, 0xC000], np.uint16)  # bfloat16 1.0, -2.0
  np.testing.assert_array_equal(bridge.to_our_array(bits, spec("bfloat16")).astype(np.float32), [1.0, -2.0])
  with pytest.raises(ValueError, match="cannot be read as float32"):
    bridge.to_our_array(bits, spec("float32"))
  assert bridge.to_our_array(0.25, dataset.TensorSpec(name="s", shape=None, dtype="float32")).dtype == np.float32


def test_bridge_runs_our_reference():
  rng = np.random.default_rng(0)
  a = rng.standard_normal((3, 4096)).astype(np.float32).astype(np.dtype("bfloat16"))
  b = rng.standard_normal((4096, 4096)).astype(np.float32).astype(np.dtype("bfloat16"))
  [c] = bridge.run_reference(fib_results.GEMM, a.view(np.uint16), b.view(np.uint16))
  want = registry.get(fib_results.GEMM).reference({"A": a, "B": b})["C"]
  np.testing.assert_array_equal(np.asarray(c).view(np.uint16), np.asarray(want).view(np.uint16))


def test_export_refuses_a_folder_with_files(tmp_path):
  (tmp_path / "keep.txt").write_text("x")
  with pytest.raises(FileExistsError, match="not empty"):
    fib_export.export(tmp_path, names=[fib_results.GEMM])
  assert cli.main(["export", "--out", str(tmp_path), "--definitions", fib_results.GEMM]) == 2
  assert cli.main(["export", "--out", str(tmp_path / "new"), "--definitions", fib_results.GEMM]) == 0
  assert [p.name for p in (tmp_path / "new" / "definitions" / "gemm").iterdir()] == [f"{fib_results.GEMM}.json"]
  assert cli.main(["import", str(tmp_path / "nothing"), "--out", str(tmp_path / "ds")]) == 2


def test_the_whole_dataset_round_trips(tmp_path):
  summary = fib_export.export(tmp_path / "fib")
  assert (summary.definitions, summary.workloads, summary.traces) == (21, 1104, 0)
  result = fib_import.import_trace_set(tmp_path / "fib", tmp_path / "ds")
  assert (len(result.matched), len(result.unmatched), result.problems) == (21, 0, [])
  assert all(m.exact for m in result.matched)
  ours, back = dataset.validate_dataset(), dataset.validate_dataset(tmp_path / "ds")
  assert {n: [w.record for w in ws] for n, ws in back.items()} == {n: [w.record for w in ws] for n, ws in ours.items()}
  assert sum(len(ws) for ws in back.values()) == 1104
  assert {n: d.raw for n, d in dataset.load_definitions(tmp_path / "ds").items()} == {
    n: d.raw for n, d in dataset.load_definitions().items()
  }


def fib_folder(root: pathlib.Path) -> pathlib.Path:
  """A small FIB TraceSet folder as FIB's own tools write it: a router with
  another name and a scalar input, a GEMM at other constants, an op no family
  implements, and a workload missing an axis."""
  defs = dataset.load_definitions()
  router = fib_definitions.to_fib(defs[fib_results.ROUTER])
  router = {k: v for k, v in router.items() if k != fib_definitions.POINTER_FIELD}
  router.update(
    name="deepseek_router_topk6", reference="def run(hidden, weight, bias, routed_scaling_factor):\n  ...\n"
  )
  gemm = fib_definitions.to_fib(defs[fib_results.GEMM])
  gemm = {k: v for k, v in gemm.items() if k != fib_definitions.POINTER_FIELD}
  gemm["name"], gemm["axes"]["N"]["value"] = "gemm_n2048_k4096", 2048
  rmsnorm = {
    "name": "rmsnorm_h4096",
    "op_type": "rmsnorm",
    "axes": {"B": {"type": "var"}, "H": {"type": "const", "value": 4096}},
    "inputs": {"x": {"shape": ["B", "H"], "dtype": "bfloat16"}},
    "outputs": {"y": {"shape": ["B", "H"], "dtype": "bfloat16"}},
    "reference": "def run(x):\n  return x\n",
  }
  for d in (router, gemm, rmsnorm):
    formats.definition_path(root, d["op_type"], d["name"]).parent.mkdir(parents=True, exist_ok=True)
    formats.definition_path(root, d["op_type"], d["name"]).write_text(json.dumps(d))

  def wl(name, axes, uuid, inputs):
    return json.dumps(
      {
        "definition": name,
        "workload": {"axes": axes, "inputs": inputs, "uuid": uuid},
        "solution": None,
        "evaluation": None,
      }
    )

  rand = {"type": "random"}
  rows = {
    ("moe_router", router["name"]): [
      wl(
        router["name"],
        {"M": 3},
        "r-1",
        {"hidden": rand, "weight": rand, "bias": rand, "routed_scaling_factor": {"type": "scalar", "value": 2.5}},
      ),
      wl(router["name"], {}, "r-bad", {}),
    ],
    ("gemm", gemm["name"]): [wl(gemm["name"], {"M": 5}, "g-1", {"A": rand, "B": rand})],
    ("rmsnorm", rmsnorm["name"]): [wl(rmsnorm["name"], {"B": 2}, "n-1", {"x": rand})],
  }
  for (op_type, name), lines in rows.items():
    formats.workloads_path(root, op_type, name).parent.mkdir(parents=True, exist_ok=True)
    formats.workloads_path(root, op_type, name).write_text("\n".join(lines) + "\n")
  return root


def test_import_matches_by_math_and_reports_the_rest(tmp_path):
  root = fib_folder(tmp_path / "fib")
  s = fib_import.import_trace_set(root, tmp_path / "ds")
  by_name = {m.name: m for m in s.matched}
  assert by_name["deepseek_router_topk6"].exact and by_name["deepseek_router_topk6"].ours.name == fib_results.ROUTER
  gemm = by_name["gemm_n2048_k4096"]  # N differs from every GEMM of ours: the family's other shape
  assert list(gemm.constants) == ["N"] and gemm.constants["N"][0] == 2048
  assert gemm.ours.reference == "jaxkern.families.dense_gemm:dense_gemm_reference"
  [unmatched] = s.unmatched
  assert "rmsnorm_h4096" in unmatched.message and "no jaxkern family implements it" in unmatched.message
  assert "differs in: op_type 'rmsnorm'" in unmatched.message
  [problem] = s.problems
  assert "missing axis" in problem and "axes.M" in problem
  assert s.workloads == {"deepseek_router_topk6": 1, "gemm_n2048_k4096": 1}
  assert cli.main(["import", str(root), "--out", str(tmp_path / "ds2")]) == 1

  # The imported dataset replays: its definitions find their families, and the
  # workload's scalar input is the one the replay runs with.
  ds = tmp_path / "ds"
  assert dataset.validate_dataset(ds)["gemm_n2048_k4096"][0].axes == {"M": 5}
  op = registry.get("deepseek_router_topk6", ds)
  [w] = dataset.load_workloads("deepseek_router_topk6", ds)
  assert float(blobs.recorded_scalars(op.definition, w)["routed_scaling_factor"]) == 2.5
  p = plan.plan(op, w, size="smoke", on_gpu=False)
  assert float(p.inputs["routed_scaling_factor"]) == 2.5
  weights = np.asarray(op.reference(p.inputs)["expert_weights"])
  np.testing.assert_allclose(weights.sum(axis=1), 2.5, rtol=1e-5)
  assert registry.get("gemm_n2048_k4096", ds).definition.const_axes["N"] == 2048
