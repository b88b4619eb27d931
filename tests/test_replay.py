"""The replay app: configs, selection, statuses, results, resume, bad input.

Most tests use a toy definition of their own (written to a temporary dataset
with its family module), so that every status can be provoked on purpose; the
last ones replay real definitions in the smoke config."""

import json
import pathlib
import subprocess
import sys

from absl import flags
from ml_collections import config_flags
import pytest

from jaxkern import replay

REPO = pathlib.Path(__file__).resolve().parent.parent

TOY_FAMILY = '''
import dataclasses, time
import jax, jax.numpy as jnp
from jaxkern.op import OpImpl

@dataclasses.dataclass(frozen=True)
class ToyConfig:
  block: int = 8

def toy_reference(x, s):
  return {"y": (x * s).astype(jnp.bfloat16)}

def make_inputs(axes, key, record):
  if axes["M"] == 19:
    raise ValueError("cannot synthesize M=19")
  x = jax.random.normal(key, (axes["M"], axes["N"]), jnp.float32)
  return {"x": x, "s": jnp.asarray(2.0, jnp.float32)}

def kernel(x, s, *, interpret, config):
  m = x.shape[0]
  if m == 17:
    raise RuntimeError("toy kernel cannot lower M=17")
  if m == 23:
    time.sleep(1.5)  # slower than the test's timeout
  y = x * s + (1.0 if m == 13 else 0.0)
  return {"y": y.astype(jnp.bfloat16)}

IMPLS = {"toy_scale": OpImpl(
    reference=toy_reference, make_inputs=make_inputs, kernel=kernel,
    choose_config=lambda shapes: ToyConfig(), candidate_configs=lambda shapes: [ToyConfig()],
    cpu_axes=lambda axes: {**axes, "M": min(axes["M"], 11)})}
'''

TOY_DEFINITION = {
    "name": "toy_scale", "op_type": "toy", "description": "y = x * s", "tags": [],
    "axes": {"M": {"type": "var"}, "N": {"type": "const", "value": 8}},
    "inputs": {"x": {"shape": ["M", "N"], "dtype": "float32"}, "s": {"shape": None, "dtype": "float32"}},
    "outputs": {"y": {"shape": ["M", "N"], "dtype": "bfloat16"}},
    "constraints": ["M >= 1"], "reference": "toy_family:toy_reference",
}


def rec(uuid, m, variant="a"):
  return {"uuid": uuid, "definition": "toy_scale", "axes": {"M": m}, "variant": variant}


@pytest.fixture
def toy(tmp_path, monkeypatch):
  """A dataset with the toy definition; its workload file has a corrupted line 3."""
  (tmp_path / "toy_family.py").write_text(TOY_FAMILY)
  monkeypatch.syspath_prepend(str(tmp_path))
  ds = tmp_path / "ds"
  (ds / "definitions").mkdir(parents=True)
  (ds / "workloads").mkdir()
  (ds / "definitions" / "toy_scale.json").write_text(json.dumps(TOY_DEFINITION))
  lines = [json.dumps(rec("u0", 4)), json.dumps(rec("u1", 5)), '{"uuid": "u2", "definition": "toy_sc',
           json.dumps(rec("u3", 6, "b")), json.dumps(rec("u4", 1, "b"))]
  (ds / "workloads" / "toy_scale.jsonl").write_text("\n".join(lines) + "\n")
  return ds


def make_config(ds, tmp_path, **overrides):
  cfg = replay.default_config()
  cfg.dataset_dir = str(ds)
  cfg.output = str(tmp_path / "out.jsonl")
  cfg.warmup, cfg.iters, cfg.progress = 0, 2, False
  cfg.update(overrides)
  return cfg


def read(path):
  return [json.loads(l) for l in pathlib.Path(path).read_text().splitlines()]


def test_config_files_define_every_field_and_accept_overrides():
  spec_fields = ["dataset_dir", "definitions", "variants", "uuids", "max_workloads_per_definition", "seed",
                 "scale", "interpret", "blob_root", "output", "resume", "warmup", "iters"]
  for name in ("replay", "full", "smoke"):
    cfg = parse_config(f"--config={REPO}/configs/{name}.py", "--config.definitions=dense_gemm",
                       "--config.max_workloads_per_definition=2", "--config.interpret=True", "--config.seed=7",
                       "--config.scale=smoke", "--config.resume=True", "--config.iters=4")
    for f in spec_fields:
      assert f in cfg, (name, f)
    assert (cfg.definitions, cfg.max_workloads_per_definition, cfg.interpret, cfg.seed, cfg.scale,
            cfg.resume, cfg.iters) == ("dense_gemm", 2, True, 7, "smoke", True, 4)
  full = parse_config(f"--config={REPO}/configs/full.py")
  assert full.scale == "full" and full.interpret is False and full.max_workloads_per_variant == 0
  default = parse_config(f"--config={REPO}/configs/replay.py")
  assert default.scale == "auto" and default.interpret is None and default.max_workloads_per_variant == 1


def parse_config(*args):
  """Parses flags as the absl app does, on a private FlagValues."""
  argv = ["prog", *args]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=fv, sys_argv=argv)
  fv(argv)
  return fv.config


def test_statuses_results_and_bad_line(toy, tmp_path):
  path = toy / "workloads" / "toy_scale.jsonl"
  with open(path, "a") as f:
    for r in (rec("u13", 13), rec("u17", 17), rec("u19", 19), rec("u99", 9, "c") | {"definition": "toy_scal"}):
      f.write(json.dumps(r) + "\n")
  logs = []
  code = replay.replay(make_config(toy, tmp_path, scale="full"), log=logs.append)
  assert code == 1
  results = {r["workload"]["uuid"]: r for r in read(tmp_path / "out.jsonl")}
  status = {u: r["evaluation"]["status"] for u, r in results.items()}
  assert status == {"u0": "passed", "u1": "passed", "u3": "passed", "u4": "passed",
                    "u13": "incorrect_numerical", "u17": "compile_error", "u19": "runtime_error"}
  text = "\n".join(logs)
  assert f"{path}:3:" in text and "invalid JSON" in text
  assert f"{path}:9:" in text and "did you mean toy_scale" in text
  r = results["u0"]
  assert r["definition"] == "toy_scale" and r["workload"]["axes"] == {"M": 4}
  ev = r["evaluation"]
  assert ev["config"] == {"name": "ToyConfig", "block": 8}
  assert ev["correctness"]["outputs"]["y"]["matched_ratio"] == 1.0
  assert ev["performance"]["latency_ms"] > 0 and ev["performance"]["reference_latency_ms"] > 0
  assert ev["environment"]["interpret"] is True and "jax" in ev["environment"]["libs"]
  assert "toy kernel cannot lower" in results["u17"]["evaluation"]["log"]
  assert results["u19"]["evaluation"]["log"].startswith("input synthesis:")
  assert results["u13"]["evaluation"]["correctness"]["max_absolute_error"] == pytest.approx(1.0, abs=0.02)
  assert "toy_scale" in text and "4 passed, 3 failed" in text


def test_timeout_is_a_status_and_the_run_goes_on(toy, tmp_path):
  with open(toy / "workloads" / "toy_scale.jsonl", "a") as f:
    f.write(json.dumps(rec("u23", 23, "t")) + "\n" + json.dumps(rec("u24", 3, "t")) + "\n")
  cfg = make_config(toy, tmp_path, variants="t", timeout_s=1.0, scale="full")
  code = replay.replay(cfg, log=lambda s: None)
  status = {r["workload"]["uuid"]: r["evaluation"]["status"] for r in read(tmp_path / "out.jsonl")}
  assert status == {"u23": "timeout", "u24": "passed"} and code == 1


def test_selection_filters_and_caps(toy, tmp_path):
  sel = lambda **kw: [w.uuid for w in replay.select_workloads(make_config(toy, tmp_path, **kw), lambda e: None)[0]]
  assert sel() == ["u0", "u1", "u3", "u4"]
  assert sel(variants="b") == ["u3", "u4"]
  assert sel(uuids="u1,u4") == ["u1", "u4"]
  assert sel(max_workloads_per_definition=3) == ["u0", "u1", "u3"]
  assert sel(max_workloads_per_variant=1) == ["u0", "u3"]
  with pytest.raises(ValueError, match="close matches"):
    sel(definitions="tox")


def test_scale_shrinks_and_records_both_axes(toy, tmp_path):
  with open(toy / "workloads" / "toy_scale.jsonl", "a") as f:
    f.write(json.dumps(rec("big", 40, "big")) + "\n")
  replay.replay(make_config(toy, tmp_path, variants="big"), log=lambda s: None)
  (r,) = read(tmp_path / "out.jsonl")
  assert r["workload"]["axes"] == {"M": 40} and r["workload"]["axes_run"] == {"M": 11}
  assert r["workload"]["scaled"] is True and r["evaluation"]["status"] == "passed"
  replay.replay(make_config(toy, tmp_path, variants="big", scale="full"), log=lambda s: None)
  (r,) = read(tmp_path / "out.jsonl")
  assert r["workload"]["axes_run"] == {"M": 40} and r["workload"]["scaled"] is False


def test_seeds_are_deterministic_per_uuid_and_seed():
  assert replay.derive_seed("u0", 0) == replay.derive_seed("u0", 0)
  assert len({replay.derive_seed("u0", 0), replay.derive_seed("u0", 1), replay.derive_seed("u1", 0)}) == 3


def test_resume_after_interrupt_gives_every_workload_once(toy, tmp_path, monkeypatch):
  real = replay.run_workload
  calls = []

  def interrupting(op, w, *a):
    calls.append(w.uuid)
    if len(calls) == 3:
      raise KeyboardInterrupt
    return real(op, w, *a)

  monkeypatch.setattr(replay, "run_workload", interrupting)
  logs = []
  assert replay.replay(make_config(toy, tmp_path), log=logs.append) == 130
  assert [r["workload"]["uuid"] for r in read(tmp_path / "out.jsonl")] == ["u0", "u1"]
  assert any("resume=True" in l for l in logs)
  # A run killed mid-write leaves a torn line; resume must cope.
  with open(tmp_path / "out.jsonl", "a") as f:
    f.write('{"definition": "toy_scale", "workl')
  monkeypatch.setattr(replay, "run_workload", real)
  assert replay.replay(make_config(toy, tmp_path, resume=True), log=lambda s: None) == 1  # the bad line
  uuids = []
  for line in (tmp_path / "out.jsonl").read_text().splitlines():
    try:
      uuids.append(json.loads(line)["workload"]["uuid"])
    except json.JSONDecodeError:
      pass
  assert sorted(uuids) == ["u0", "u1", "u3", "u4"]


def test_unimplemented_definitions_are_skipped_not_failed(tmp_path):
  """The real dataset: a definition without an implementation yields `skipped` lines."""
  from jaxkern import registry  # pylint: disable=g-import-not-at-top
  missing = [n for n in registry.names() if not registry.get(n).implemented]
  if not missing:
    pytest.skip("every definition is implemented")
  cfg = make_config(REPO / "datasets", tmp_path, definitions=missing[0], max_workloads_per_definition=2)
  assert replay.replay(cfg, log=lambda s: None) == 0
  assert [r["evaluation"]["status"] for r in read(tmp_path / "out.jsonl")] == ["skipped", "skipped"]


def test_command_line_app(toy, tmp_path):
  """The absl entry point, as users run it."""
  env_path = f"{tmp_path}:{REPO}"
  cmd = [sys.executable, "-m", "jaxkern.replay", f"--config={REPO}/configs/smoke.py",
         f"--config.dataset_dir={toy}", f"--config.output={tmp_path}/cli.jsonl", "--config.variants=a",
         "--config.progress=False"]
  p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                     env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"})
  assert p.returncode == 1, p.stderr  # the corrupted line 3 makes the run fail
  assert "invalid JSON" in p.stdout and "1 passed, 0 failed" in p.stdout
  assert len(read(tmp_path / "cli.jsonl")) == 1


def test_smoke_replay_of_real_definitions(tmp_path):
  """End to end on the real dataset: one workload of each implemented
  definition, CPU-budget sizes, Pallas kernels in interpret mode."""
  from jaxkern import registry  # pylint: disable=g-import-not-at-top
  implemented = [n for n in registry.names() if registry.get(n).implemented]
  if not implemented:
    pytest.skip("no definition is implemented yet")
  cfg = make_config(REPO / "datasets", tmp_path, definitions=",".join(implemented),
                    max_workloads_per_definition=1, scale="smoke", iters=1)
  logs = []
  code = replay.replay(cfg, log=logs.append)
  results = read(tmp_path / "out.jsonl")
  assert {r["definition"] for r in results} == set(implemented)
  assert all(r["evaluation"]["status"] == "passed" for r in results), "\n".join(logs)
  assert code == 0


def test_blob_root_loads_recorded_tensors_and_compares_expected_output(toy, tmp_path):
  import numpy as np  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  import ml_dtypes  # pylint: disable=g-import-not-at-top

  blobs = tmp_path / "blobs"
  (blobs / "blob").mkdir(parents=True)
  x = np.arange(24, dtype=np.float32).reshape(3, 8) / 7
  save_file({"tensor": x}, str(blobs / "blob" / "x.safetensors"))
  save_file({"tensor": (x * 2).astype(ml_dtypes.bfloat16)}, str(blobs / "blob" / "y.safetensors"))
  save_file({"tensor": (x * 2 + 1).astype(ml_dtypes.bfloat16)}, str(blobs / "blob" / "y_bad.safetensors"))
  save_file({"tensor": x[:2]}, str(blobs / "blob" / "x_short.safetensors"))
  st = lambda name: {"type": "safetensors", "path": f"blob/{name}.safetensors", "tensor_key": "tensor"}  # noqa: E731
  inputs = {"x": st("x"), "s": {"type": "scalar", "value": 2.0}}
  records = [
      {**rec("b-ok", 3, "blob"), "inputs": inputs, "expected_output": st("y")},
      {**rec("b-engine-differs", 3, "blob"), "inputs": inputs, "expected_output": st("y_bad")},
      {**rec("b-wrong-shape", 3, "blob"), "inputs": {**inputs, "x": st("x_short")}},
      {**rec("b-absent", 3, "blob"), "inputs": {**inputs, "x": st("nowhere")}},
  ]
  with open(toy / "workloads" / "toy_scale.jsonl", "a") as f:
    f.write("".join(json.dumps(r) + "\n" for r in records))
  replay.replay(make_config(toy, tmp_path, variants="blob", blob_root=str(blobs), scale="full"), log=lambda s: None)
  res = {r["workload"]["uuid"]: r["evaluation"] for r in read(tmp_path / "out.jsonl")}
  assert res["b-ok"]["status"] == "passed" and res["b-ok"]["expected_output"]["status"] == "passed"
  assert res["b-engine-differs"]["expected_output"]["status"] == "incorrect_numerical"
  assert res["b-wrong-shape"]["status"] == "runtime_error"
  assert "field 'inputs.x'" in res["b-wrong-shape"]["log"] and "(3, 8)" in res["b-wrong-shape"]["log"]
  # Tensors not under the blob root: synthesized inputs, no expected-output check.
  assert res["b-absent"]["status"] == "passed" and res["b-absent"]["expected_output"] is None


def test_command_line_ctrl_c_exits_130_with_results_on_disk(toy, tmp_path):
  import signal  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top

  with open(toy / "workloads" / "toy_scale.jsonl", "a") as f:
    for r in (rec("i0", 3, "i"), rec("i1", 23, "i"), rec("i2", 23, "i"), rec("i3", 4, "i")):
      f.write(json.dumps(r) + "\n")
  out = tmp_path / "int.jsonl"
  cmd = [sys.executable, "-m", "jaxkern.replay", f"--config={REPO}/configs/replay.py", f"--config.dataset_dir={toy}",
         f"--config.output={out}", "--config.variants=i", "--config.scale=full", "--config.max_workloads_per_variant=0",
         "--config.progress=False"]
  p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                       env={"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"})
  deadline = time.monotonic() + 120
  while not (out.exists() and out.read_text().count("\n") >= 1) and time.monotonic() < deadline:
    time.sleep(0.1)
  p.send_signal(signal.SIGINT)  # i1 (a slow one) is running now
  stdout, _ = p.communicate(timeout=120)
  assert p.returncode == 130, stdout
  assert "resume=True" in stdout and "Fatal" not in stdout
  done = [r["workload"]["uuid"] for r in read(out)]
  assert done[0] == "i0" and len(done) < 4
