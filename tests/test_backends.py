"""The kernel backend seam on a toy family with a Triton and a Mosaic GPU
kernel (`tests/toy_backends.py`): selection and fallback, the tuned table,
the registry, replay, sweep and the kit's per-backend lowering and
interpret checks."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import kit
import numpy as np
import pytest
import toy_backends as toy

from jaxkern import backends, bench, dataset, dispatch, evaluate, registry, sweep, tuning
from jaxkern.replay_config import default_config
from pallas_kernels.shared.kernel import Kernel, Unsupported
from pallas_kernels.shared.lowering import MosaicGpuCall, TritonCall


@pytest.fixture
def toy_op(tmp_path, monkeypatch):
  """The toy definition in its own dataset, its family found through
  JAXKERN_FAMILY_PACKAGES; tuned tables in a fresh folder."""
  (tmp_path / "ds" / "definitions").mkdir(parents=True)
  (tmp_path / "ds" / "workloads").mkdir()
  (tmp_path / "ds" / "definitions" / f"{toy.NAME}.json").write_text(json.dumps(toy.DEFINITION))
  (tmp_path / "ds" / "workloads" / f"{toy.NAME}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in toy.RECORDS))
  monkeypatch.setenv("JAXKERN_FAMILY_PACKAGES", "toy_backends")
  monkeypatch.setenv("JAXKERN_TUNED_DIR", str(tmp_path / "tuned"))
  return registry.get(toy.NAME, tmp_path / "ds")


def inputs(rows=16, dtype=jnp.float32):
  x = jnp.asarray(np.random.default_rng(0).standard_normal((rows, 128)), dtype)
  return {"x": x, "s": jnp.asarray(3.0, jnp.float32)}


def ran(impl, arrays, **kw):
  """The backend a dispatch ran (the one whose launcher it called)."""
  seen = []

  def spy(kernel):
    def launch(*a, **k):
      seen.append(kernel.backend)
      return kernel.launch(*a, **k)

    return dataclasses.replace(kernel, launch=launch)

  spied = dataclasses.replace(impl, kernels={b: spy(k) for b, k in impl.kernels.items()})
  out = dispatch.run(spied, arrays, interpret=True, **kw)
  return seen, out


def test_the_mosaic_gpu_toy_interprets_and_lowers_to_a_mosaic_gpu_call():
  x = inputs()
  np.testing.assert_array_equal(np.asarray(toy.mosaic_gpu_kernel(**x, interpret=True)), np.asarray(x["x"] * 3))
  shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in x.items()}
  text = kit.lower_for_h100(lambda a: toy.mosaic_gpu_kernel(**a, interpret=False), shapes)
  assert toy.MOSAIC_GPU_KERNEL.calls(text) == toy.launches_mosaic_gpu(None, {"M": 16, "N": 128})
  assert toy.TRITON_KERNEL.calls(text) == []


def test_pallas_runs_the_default_order_and_falls_back_when_a_kernel_refuses():
  x = inputs()
  assert ran(toy.IMPL, x, backend="pallas")[0] == ["triton"]
  assert ran(toy.IMPL, x, backend="mosaic_gpu")[0] == ["mosaic_gpu"]
  mosaic_first = dataclasses.replace(
    toy.IMPL, kernels={"mosaic_gpu": toy.MOSAIC_GPU_KERNEL, "triton": toy.TRITON_KERNEL}
  )
  seen, out = ran(mosaic_first, inputs(dtype=jnp.bfloat16), backend="pallas")
  assert seen == ["mosaic_gpu", "triton"]  # the Mosaic GPU kernel refused bf16
  np.testing.assert_array_equal(np.asarray(out), np.asarray(inputs(dtype=jnp.bfloat16)["x"] * 3))


def test_when_every_kernel_refuses_one_error_names_each_backend_and_why():
  def refuse(x, s, **_):
    raise Unsupported("x must be float64")

  impl = dataclasses.replace(
    toy.IMPL,
    kernels={"triton": dataclasses.replace(toy.TRITON_KERNEL, launch=refuse), "mosaic_gpu": toy.MOSAIC_GPU_KERNEL},
  )
  with pytest.raises(
    Unsupported,
    match=r"toy: no kernel takes these inputs \(backends: triton, mosaic_gpu\); "
    r"triton: x must be float64; mosaic_gpu: x must be float32 .*got bfloat16",
  ):
    dispatch.run(impl, inputs(dtype=jnp.bfloat16), backend="pallas", interpret=True)


def test_a_tuned_entry_puts_the_fastest_backend_first(toy_op):
  shapes = toy_op.input_shapes({"M": 16})
  bucket = toy_op.bucket(shapes)
  assert bucket == "s=scalar,x=16x128"
  tuning.record(toy.NAME, "triton", bucket, toy.ToyConfig(2), latency_ms=2.0)
  tuning.record(toy.NAME, "mosaic_gpu", bucket, toy.ToyConfig(4), latency_ms=1.0)
  assert toy_op.config_for(shapes) == backends.Choice("mosaic_gpu", toy.ToyConfig(4), tuning.TUNED)
  assert toy_op.config_for(shapes, backend="triton") == backends.Choice("triton", toy.ToyConfig(2), tuning.TUNED)
  assert ran(toy.IMPL, inputs(), backend="pallas")[0] == ["mosaic_gpu"]
  # Another bucket has no entry: the default order and the heuristic.
  assert toy_op.config_for(toy_op.input_shapes({"M": 64})) == backends.Choice(
    "triton", toy.ToyConfig(8), tuning.HEURISTIC
  )


def test_an_explicit_config_runs_the_backend_of_its_class():
  other = Kernel(
    name=toy.NAME,
    backend="mosaic_gpu",
    launch=toy.mosaic_gpu_kernel,
    config_class=tuple,
    choose_config=lambda s: (),
    candidate_configs=lambda s: [()],
  )
  impl = dataclasses.replace(toy.IMPL, kernels={"triton": toy.TRITON_KERNEL, "mosaic_gpu": other})
  assert [c.backend for c in backends.select(impl.kernels, inputs(), op="toy", config=())] == ["mosaic_gpu"]
  with pytest.raises(TypeError, match="config ToyConfig is no config of its kernels"):
    list(backends.select(impl.kernels, inputs(), op="toy", config=toy.ToyConfig(), backend="mosaic_gpu"))


def test_registry_and_kit_check_each_backend(toy_op):
  assert toy_op.backends == ("triton", "mosaic_gpu")
  axes = {"M": 16, "N": 128}
  x = toy_op.make_inputs({"M": 16})
  for backend in toy_op.backends:
    out = toy_op.kernel(x, interpret=True, backend=backend)
    np.testing.assert_array_equal(np.asarray(out["y"]), np.asarray(x["x"] * 3))
    np.testing.assert_array_equal(
      np.asarray(kit.run_kernel(toy_op, axes, x, toy.ToyConfig(4), backend)["y"]), np.asarray(x["x"] * 3)
    )
  assert kit.lowered_calls(toy_op, axes, toy.ToyConfig(4), backend="mosaic_gpu") == toy.launches_mosaic_gpu(
    toy.ToyConfig(4), axes
  )
  assert kit.lowered_calls(toy_op, axes, toy.ToyConfig(4), backend="triton") == [
    TritonCall("toy_scale_rows", (4, 1, 1), 4, 3)
  ]
  assert kit.launches_hook("mosaic_gpu") == "launches_mosaic_gpu" and kit.launches_hook("triton") == "launches"
  assert all(isinstance(c, MosaicGpuCall) for c in toy.launches_mosaic_gpu(None, axes))


@pytest.mark.parametrize("backend", ["pallas", "triton", "mosaic_gpu"])
def test_replay_records_the_backend_that_ran(toy_op, tmp_path, backend):
  [w] = dataset.load_workloads(toy.NAME, tmp_path / "ds")
  cfg = default_config()
  cfg.scale, cfg.warmup, cfg.iters, cfg.backend = "full", 0, 1, backend
  trace = evaluate.run_workload(toy_op, w, cfg, bench.CompileCache(), True, False)
  assert trace.status == "passed", trace.evaluation.log
  assert trace.evaluation.backend == ("triton" if backend == "pallas" else backend)
  assert trace.evaluation.config == {"block_rows": 8} and trace.evaluation.config_source == "heuristic"


def test_sweep_ranks_the_candidates_of_every_backend(toy_op):
  """The candidates of both backends, taken in turn (`max_configs` caps the
  total), form one ranking."""
  rows = sweep.sweep(
    toy_op, toy_op.validated_axes({"M": 16}), seed=0, warmup=0, iters=1, interpret=True, max_configs=4, lower_only=False
  )
  assert [(r["backend"], r["config"]["block_rows"]) for r in rows] == [
    ("triton", 8),
    ("mosaic_gpu", 8),
    ("triton", 1),
    ("mosaic_gpu", 1),
  ]
  assert all(r["status"] == "passed" for r in rows)
  assert {r["backend"] for r in sweep.ranking(rows)} == {"triton", "mosaic_gpu"}
  only = sweep.sweep(
    toy_op,
    toy_op.validated_axes({"M": 16}),
    seed=0,
    warmup=0,
    iters=1,
    interpret=True,
    max_configs=1,
    lower_only=True,
    backend="mosaic_gpu",
  )
  assert [(r["backend"], r["status"]) for r in only] == [("mosaic_gpu", "lowered")]
