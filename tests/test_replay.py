"""The replay app: configs, selection, statuses, results, resume, bad input.

Most tests use a toy definition of their own (written to a temporary dataset
with its family module), so that every status can be provoked on purpose; the
last ones replay real definitions in the smoke config."""

import json
import pathlib
import subprocess
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from jaxkern import evaluate, registry, replay

REPO = pathlib.Path(__file__).resolve().parent.parent

TOY_FAMILY = """
import dataclasses, os, threading
import jax, jax.numpy as jnp
from jaxkern.family import OpImpl
from pallas_kernels.shared.kernel import Kernel, kernels

# M=23 blocks (while tracing the kernel) until a test releases it: a workload
# that cannot finish, whatever the machine's load (TOY_BLOCK=0 turns it off).
RELEASE = threading.Event()

@dataclasses.dataclass(frozen=True)
class ToyConfig:
  block: int = 8

def toy_reference(x, s):
  return (x * s).astype(jnp.bfloat16)

def make_inputs(axes, key, record):
  if axes["M"] == 19:
    raise ValueError("cannot synthesize M=19")
  x = jax.random.normal(key, (axes["M"], axes["N"]), jnp.float32)
  return {"x": x, "s": jnp.asarray(2.0, jnp.float32)}

def kernel(x, s, *, interpret, config):
  m = x.shape[0]
  if m == 17:
    raise RuntimeError("toy kernel cannot lower M=17")
  if m == 23 and os.environ.get("TOY_BLOCK", "1") == "1":
    RELEASE.wait()
  y = x * s + (1.0 if m == 13 else 0.0)
  return y.astype(jnp.bfloat16)

KERNEL = Kernel(name="toy", backend="triton", launch=kernel, config_class=ToyConfig,
                choose_config=lambda shapes: ToyConfig(), candidate_configs=lambda shapes: [ToyConfig()])
IMPLS = (OpImpl(
    reference=toy_reference, make_inputs=make_inputs, kernels=kernels(KERNEL),
    cpu_axes=lambda axes: {**axes, "M": min(axes["M"], 11)}),)
"""

TOY_DEFINITION = {
  "name": "toy_scale",
  "op_type": "toy",
  "description": "y = x * s",
  "tags": [],
  "axes": {"M": {"type": "var"}, "N": {"type": "const", "value": 8}},
  "inputs": {"x": {"shape": ["M", "N"], "dtype": "float32"}, "s": {"shape": None, "dtype": "float32"}},
  "outputs": {"y": {"shape": ["M", "N"], "dtype": "bfloat16"}},
  "constraints": ["M >= 1"],
  "reference": "toy_family:toy_reference",
}


def rec(uuid, m, variant="a"):
  return {"uuid": uuid, "definition": "toy_scale", "axes": {"M": m}, "variant": variant}


def toy_env(tmp_path):
  """The environment a replay subprocess needs to find the toy family."""
  return {
    "PYTHONPATH": f"{tmp_path}:{REPO}",
    "PATH": "/usr/bin:/bin",
    "JAX_PLATFORMS": "cpu",
    "JAXKERN_FAMILY_PACKAGES": "toy_family",
  }


@pytest.fixture
def toy(tmp_path, monkeypatch):
  """A dataset with the toy definition; its workload file has a corrupted line 3."""
  (tmp_path / "toy_family.py").write_text(TOY_FAMILY)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setenv("JAXKERN_FAMILY_PACKAGES", "toy_family")
  ds = tmp_path / "ds"
  (ds / "definitions").mkdir(parents=True)
  (ds / "workloads").mkdir()
  (ds / "definitions" / "toy_scale.json").write_text(json.dumps(TOY_DEFINITION))
  lines = [
    json.dumps(rec("u0", 4)),
    json.dumps(rec("u1", 5)),
    '{"uuid": "u2", "definition": "toy_sc',
    json.dumps(rec("u3", 6, "b")),
    json.dumps(rec("u4", 1, "b")),
  ]
  (ds / "workloads" / "toy_scale.jsonl").write_text("\n".join(lines) + "\n")
  return ds


def make_config(ds, tmp_path, **overrides):
  """A library-call config; workloads run in this process unless a test
  asks for worker processes (the command-line tests use them)."""
  cfg = replay.default_config()
  cfg.dataset_dir = str(ds)
  cfg.output = str(tmp_path / "out.jsonl")
  cfg.warmup, cfg.iters, cfg.progress = 0, 2, False
  cfg.max_workloads_per_variant = 0
  cfg.isolation = "none"
  cfg.update(overrides)
  return cfg


def read(path):
  return [json.loads(l) for l in pathlib.Path(path).read_text().splitlines()]


def test_config_files_define_every_field_and_accept_overrides():
  spec_fields = [
    "dataset_dir",
    "definitions",
    "variants",
    "uuids",
    "max_workloads_per_definition",
    "seed",
    "scale",
    "interpret",
    "blob_root",
    "output",
    "resume",
    "warmup",
    "iters",
  ]
  for name in ("replay", "full", "smoke"):
    cfg = parse_config(
      f"--config={REPO}/configs/{name}.py",
      "--config.definitions=dense_gemm",
      "--config.max_workloads_per_definition=2",
      "--config.interpret=True",
      "--config.seed=7",
      "--config.scale=smoke",
      "--config.resume=True",
      "--config.iters=4",
    )
    for f in spec_fields:
      assert f in cfg, (name, f)
    assert (
      cfg.definitions,
      cfg.max_workloads_per_definition,
      cfg.interpret,
      cfg.seed,
      cfg.scale,
      cfg.resume,
      cfg.iters,
    ) == ("dense_gemm", 2, True, 7, "smoke", True, 4)
  full = parse_config(f"--config={REPO}/configs/full.py")
  assert full.scale == "full" and full.interpret is False and full.max_workloads_per_variant == 0
  default = parse_config(f"--config={REPO}/configs/replay.py")
  # None: every record on a GPU, one per variant on a CPU (the run's first line says which).
  assert default.scale == "auto" and default.interpret is None and default.max_workloads_per_variant is None
  assert default.dataset_dir == ""  # the package's own dataset, wherever the command runs


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
  assert status == {
    "u0": "passed",
    "u1": "passed",
    "u3": "passed",
    "u4": "passed",
    "u13": "incorrect_numerical",
    "u17": "compile_error",
    "u19": "runtime_error",
  }
  text = "\n".join(logs)
  assert f"{path}:3:" in text and "invalid JSON" in text
  assert f"{path}:9:" in text and "did you mean toy_scale" in text
  r = results["u0"]
  assert r["definition"] == "toy_scale" and r["workload"]["axes"] == {"M": 4}
  ev = r["evaluation"]
  assert ev["config"] == {"block": 8} and ev["config_source"] == "heuristic"
  assert ev["correctness"]["outputs"]["y"]["matched_ratio"] == 1.0
  assert ev["performance"]["latency_ms"] > 0 and ev["performance"]["reference_latency_ms"] > 0
  assert ev["environment"]["interpret"] is True and "jax" in ev["environment"]["libs"]
  assert "toy kernel cannot lower" in results["u17"]["evaluation"]["log"]
  assert results["u19"]["evaluation"]["log"].startswith("inputs:")
  assert results["u13"]["evaluation"]["correctness"]["max_absolute_error"] == pytest.approx(1.0, abs=0.02)
  assert "toy_scale" in text and "4 passed, 3 failed" in text
  assert "[1/7] toy_scale u0: passed" in text  # one line per workload without a progress bar


def test_timeout_is_a_status_and_the_run_goes_on(toy, tmp_path):
  """u23 never finishes (its kernel blocks forever in the worker process):
  past the timeout the worker is killed and replaced, and the run goes on to
  u24, which also times out (its budget is 0 s, by whichever path comes
  first). Nothing depends on how fast a workload runs, and nothing is left
  running in this process (pytest exits cleanly)."""
  with open(toy / "workloads" / "toy_scale.jsonl", "a") as f:
    f.write(json.dumps(rec("u23", 23, "t")) + "\n" + json.dumps(rec("u24", 3, "t")) + "\n")
  cfg = make_config(toy, tmp_path, variants="t", timeout_s=0.0, scale="full", isolation="process")
  code = replay.replay(cfg, log=lambda s: None)
  results = {r["workload"]["uuid"]: r["evaluation"] for r in read(tmp_path / "out.jsonl")}
  assert {u: e["status"] for u, e in results.items()} == {"u23": "timeout", "u24": "timeout"} and code == 1
  assert "no result within 0.0s" in results["u23"]["log"] and "killed" in results["u23"]["log"]
  import multiprocessing

  assert not multiprocessing.active_children()  # the stuck worker was killed, the other one closed


LIBRARY_CALL = """
import json, sys
from jaxkern import evaluate
from jaxkern import replay
cfg = replay.default_config()
cfg.update(json.loads(sys.argv[1]))
print("code", replay.replay(cfg, log=lambda s: None), flush=True)
# Were the stuck workload in this process, releasing it now would have it
# compile and run in XLA while the interpreter shuts down.
toy = sys.modules.get("toy_family")
if toy is not None:
  toy.RELEASE.set()
"""


def test_a_library_call_with_a_timeout_lets_the_process_exit_cleanly(toy, tmp_path):
  """`replay.replay(...)` as a library with a workload stuck past its
  timeout: the process exits 0 at its end (an abandoned XLA call used to
  crash interpreter shutdown)."""
  with open(toy / "workloads" / "toy_scale.jsonl", "a") as f:
    f.write(json.dumps(rec("u23", 23, "t")) + "\n" + json.dumps(rec("u24", 3, "t")) + "\n")
  overrides = {
    "dataset_dir": str(toy),
    "output": str(tmp_path / "lib.jsonl"),
    "variants": "t",
    "scale": "full",
    "timeout_s": 2.0,
    "warmup": 0,
    "iters": 1,
    "progress": False,
    "max_workloads_per_variant": 0,
  }
  p = subprocess.run(
    [sys.executable, "-c", LIBRARY_CALL, json.dumps(overrides)],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=REPO,
    env=toy_env(tmp_path),
  )
  assert p.returncode == 0, p.stdout + p.stderr
  assert "code 1" in p.stdout
  got = statuses(tmp_path / "lib.jsonl")
  assert got["u23"] == "timeout" and set(got) == {"u23", "u24"}


def test_a_worker_that_dies_is_an_error_status_and_is_replaced(toy, tmp_path):
  """A workload that kills its worker process (here: os._exit in the
  kernel, as a crashing runtime would) is a runtime_error naming the exit
  code; the next workload runs in a fresh worker."""
  (tmp_path / "toy_family.py").write_text(
    TOY_FAMILY.replace("  if m == 17:", "  if m == 29:\n    os._exit(7)\n  if m == 17:")
  )
  with open(toy / "workloads" / "toy_scale.jsonl", "a") as f:
    f.write(json.dumps(rec("d0", 29, "d")) + "\n" + json.dumps(rec("d1", 3, "d")) + "\n")
  cfg = make_config(toy, tmp_path, variants="d", scale="full", isolation="process")
  assert replay.replay(cfg, log=lambda s: None) == 1
  results = {r["workload"]["uuid"]: r["evaluation"] for r in read(tmp_path / "out.jsonl")}
  assert results["d0"]["status"] == "runtime_error" and "exit code 7" in results["d0"]["log"]
  assert results["d1"]["status"] == "passed"


def test_deadline_is_checked_before_timing(toy, tmp_path):
  """A workload past its budget after comparison is a timeout, with its
  correctness kept (run in this thread: no isolation timing involved)."""
  from jaxkern import bench, registry
  from jaxkern import dataset as dataset_lib

  [w] = [w for w in dataset_lib.load_workloads("toy_scale", toy, on_error=lambda e: None) if w.uuid == "u0"]
  cfg = make_config(toy, tmp_path, timeout_s=0.0, scale="full")
  t = evaluate.run_workload(registry.get("toy_scale", toy), w, cfg, bench.CompileCache(), True, False)
  assert t.status == "timeout" and "before timing" in t.evaluation.log
  assert t.evaluation.correctness["matched_ratio"] == 1.0 and t.evaluation.performance is None


def test_selection_filters_and_caps(toy):
  from jaxkern import selection

  sel = lambda **kw: [w.uuid for w in selection.select_workloads(toy, selection.Selection(**kw), lambda e: None)]  # noqa: E731
  assert sel() == ["u0", "u1", "u3", "u4"]
  assert sel(variants=("b",)) == ["u3", "u4"]
  assert sel(uuids=("u1", "u4")) == ["u1", "u4"]
  assert sel(max_per_definition=3) == ["u0", "u1", "u3"]
  assert sel(max_per_variant=1) == ["u0", "u3"]
  with pytest.raises(ValueError, match="close matches"):
    sel(definitions=("tox",))
  with pytest.raises(ValueError, match="no definitions/ folder"):
    selection.select_workloads(toy / "nowhere", selection.Selection(), lambda e: None)


def test_scale_shrinks_and_records_both_axes(toy, tmp_path):
  with open(toy / "workloads" / "toy_scale.jsonl", "a") as f:
    f.write(json.dumps(rec("big", 40, "big")) + "\n")
  replay.replay(make_config(toy, tmp_path, variants="big"), log=lambda s: None)
  (r,) = read(tmp_path / "out.jsonl")
  assert r["workload"]["axes"] == {"M": 40} and r["workload"]["axes_run"] == {"M": 11}
  assert r["workload"]["scaled"] is True and r["evaluation"]["status"] == "passed"
  replay.replay(
    make_config(toy, tmp_path, variants="big", scale="full", output=str(tmp_path / "full.jsonl")), log=lambda s: None
  )
  (r,) = read(tmp_path / "full.jsonl")
  assert r["workload"]["axes_run"] == {"M": 40} and r["workload"]["scaled"] is False


def test_seeds_are_deterministic_per_uuid_and_seed():
  assert evaluate.derive_seed("u0", 0) == evaluate.derive_seed("u0", 0)
  assert len({evaluate.derive_seed("u0", 0), evaluate.derive_seed("u0", 1), evaluate.derive_seed("u1", 0)}) == 3


def test_resume_after_interrupt_gives_every_workload_once(toy, tmp_path, monkeypatch):
  real = evaluate.run_workload
  calls = []

  def interrupting(op, w, *a):
    calls.append(w.uuid)
    if len(calls) == 3:
      raise KeyboardInterrupt
    return real(op, w, *a)

  monkeypatch.setattr(evaluate, "run_workload", interrupting)
  logs = []
  assert replay.replay(make_config(toy, tmp_path), log=logs.append) == 130
  assert [r["workload"]["uuid"] for r in read(tmp_path / "out.jsonl")] == ["u0", "u1"]
  assert any("resume=True" in l for l in logs)
  # A run killed mid-write leaves a truncated line: resume says so, cuts it
  # off and runs its workload again.
  with open(tmp_path / "out.jsonl", "a") as f:
    f.write('{"definition": "toy_scale", "workl')
  monkeypatch.setattr(evaluate, "run_workload", real)
  logs = []
  assert replay.replay(make_config(toy, tmp_path, resume=True), log=logs.append) == 1  # the bad record line 3
  assert any("out.jsonl:3: truncated last line" in l and "runs again" in l for l in logs), logs
  assert sorted(r["workload"]["uuid"] for r in read(tmp_path / "out.jsonl")) == ["u0", "u1", "u3", "u4"]


def test_rerun_without_resume_never_replaces_results(toy, tmp_path):
  """A second run onto a results file refuses (exit 2, one message saying
  what to do) and leaves the file as it was; with resume it appends."""
  assert replay.replay(make_config(toy, tmp_path, variants="a"), log=lambda s: None) == 1  # the bad line 3
  before = (tmp_path / "out.jsonl").read_text()
  logs = []
  assert replay.replay(make_config(toy, tmp_path, variants="b"), log=logs.append) == 2
  assert "already holds results (2 lines)" in logs[-1] and "--config.resume=True" in logs[-1]
  assert "--config.output" in logs[-1] and (tmp_path / "out.jsonl").read_text() == before
  assert replay.replay(make_config(toy, tmp_path, variants="b", resume=True), log=lambda s: None) == 1
  assert [r["workload"]["uuid"] for r in read(tmp_path / "out.jsonl")] == ["u0", "u1", "u3", "u4"]


def test_output_with_time_is_a_new_file_per_run(toy, tmp_path):
  """`{time}` in `output` (the shipped configs' default): each run writes a
  file of its own, named on the run's last line, so the same command runs
  again; resume and several processes need one fixed name."""
  template = str(tmp_path / "runs" / "toy-{time}.jsonl")
  ends = []
  for _ in range(2):
    logs = []
    assert replay.replay(make_config(toy, tmp_path, variants="b", output=template), log=logs.append) == 1  # line 3
    ends.append(logs[-1])
  files = sorted((tmp_path / "runs").iterdir())
  assert len(files) == 2 and all(len(read(f)) == 2 for f in files)
  assert {e.rsplit("results in ", 1)[1] for e in ends} == {str(f) for f in files}
  for overrides, message in (
    ({"resume": True}, "--config.resume continues one results file: name it with --config.output=PATH"),
    ({"num_processes": 2, "process_id": 0}, "name it with --config.output=PATH"),
    ({"coordinator_address": "localhost:1"}, "name it with --config.output=PATH"),
  ):
    logs = []
    assert replay.replay(make_config(toy, tmp_path, output=template, **overrides), log=logs.append) == 2
    assert logs[-1].startswith("error: ") and message in logs[-1] and template in logs[-1], logs[-1]
  assert len(list((tmp_path / "runs").iterdir())) == 2  # a refused run creates no file


def test_new_results_file_never_takes_an_existing_name(tmp_path):
  template = str(tmp_path / "a" / "r-{time}.jsonl")
  now = 1_800_000_000.0
  first, second, third = (replay.new_results_file(template, now) for _ in range(3))
  assert first.name.startswith("r-20") and first.name.endswith(".jsonl") and len(first.stem) == len("r-20270115-080000")
  assert (second.stem, third.stem) == (f"{first.stem}-2", f"{first.stem}-3")
  assert all(p.is_file() and p.stat().st_size == 0 for p in (first, second, third))


def test_config_by_name_is_the_packaged_file(tmp_path, monkeypatch):
  from jaxkern import _data

  configs = _data.folder("configs")
  assert _data.config_names() == ["full", "replay", "smoke"]
  assert replay.with_packaged_config(["--config", "smoke", "--config.iters=2"]) == [
    "--config",
    f"{configs}/smoke.py",
    "--config.iters=2",
  ]
  assert replay.with_packaged_config(["--config=full:x"]) == [f"--config={configs}/full.py:x"]
  for argv in (["--config=configs/smoke.py"], ["--config", "nosuch"], ["--config.iters=2"]):
    assert replay.with_packaged_config(argv) == argv
  monkeypatch.chdir(tmp_path)
  (tmp_path / "smoke").write_text("")  # a file of that name wins
  assert replay.with_packaged_config(["--config=smoke"]) == ["--config=smoke"]


def test_unwritable_output_is_one_message_exit_2(toy, tmp_path):
  (tmp_path / "file").write_text("")
  logs = []
  for out in (tmp_path / "file" / "r.jsonl", tmp_path):  # a folder under a file; a folder
    assert replay.replay(make_config(toy, tmp_path, output=str(out)), log=logs.append) == 2
    assert logs[-1].startswith(f"error: cannot write --config.output {out}"), logs[-1]


def test_definitions_without_a_family_are_skipped_not_failed(toy, tmp_path):
  raw = {**TOY_DEFINITION, "name": "toy_missing", "reference": "jaxkern.families.no_such_family:ref"}
  (toy / "definitions" / "toy_missing.json").write_text(json.dumps(raw))
  (toy / "workloads" / "toy_missing.jsonl").write_text(
    "".join(json.dumps({**rec(f"m{i}", 4), "definition": "toy_missing"}) + "\n" for i in range(2))
  )
  logs = []
  assert replay.replay(make_config(toy, tmp_path, definitions="toy_missing"), log=logs.append) == 0
  results = read(tmp_path / "out.jsonl")
  assert [r["evaluation"]["status"] for r in results] == ["skipped", "skipped"]
  assert "no_such_family" in results[0]["evaluation"]["log"] and "2 skipped" in logs[-1]


def test_empty_selection_and_missing_dataset_exit_2(toy, tmp_path):
  logs = []
  assert replay.replay(make_config(toy, tmp_path, uuids="nobody"), log=logs.append) == 2
  assert "matches no workload" in logs[-1]
  assert replay.replay(make_config(tmp_path / "nowhere", tmp_path), log=logs.append) == 2
  assert "no definitions/ folder" in logs[-1]
  assert replay.replay(make_config(toy, tmp_path, scale="huge"), log=logs.append) == 2
  assert "scale must be one of" in logs[-1]


def test_first_line_says_how_many_per_variant(toy, tmp_path):
  logs = []
  cfg = make_config(toy, tmp_path)
  cfg.max_workloads_per_variant = None
  replay.replay(cfg, log=logs.append)
  first = next(line for line in logs if line.startswith("replaying"))
  assert "max per variant=1 (auto: one per variant)" in first  # no GPU here
  assert len(read(tmp_path / "out.jsonl")) == 2  # u0 (variant a) and u3 (variant b)


@pytest.mark.slow  # a subprocess
def test_command_line_app(toy, tmp_path):
  """The absl entry point, as users run it."""
  env_path = f"{tmp_path}:{REPO}"
  cmd = [
    sys.executable,
    "-m",
    "jaxkern.replay",
    f"--config={REPO}/configs/smoke.py",
    f"--config.dataset_dir={toy}",
    f"--config.output={tmp_path}/cli.jsonl",
    "--config.variants=a",
    "--config.progress=False",
  ]
  p = subprocess.run(
    cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env={**toy_env(tmp_path), "PYTHONPATH": env_path}
  )
  assert p.returncode == 1, p.stderr  # the corrupted line 3 makes the run fail
  assert "invalid JSON" in p.stdout and "1 passed, 0 failed" in p.stdout
  assert len(read(tmp_path / "cli.jsonl")) == 1


def test_command_line_rerun_and_bad_paths_are_one_message_exit_2(toy, tmp_path):
  """The same command twice: the second refuses to replace the first's
  results (exit 2, the file untouched); a missing --config file and an
  unwritable output are one message each, exit 2, no traceback."""
  out = tmp_path / "twice.jsonl"
  cmd = [
    sys.executable,
    "-m",
    "jaxkern.replay",
    f"--config={REPO}/configs/replay.py",
    f"--config.dataset_dir={toy}",
    f"--config.output={out}",
    "--config.variants=b",
    "--config.progress=False",
  ]

  def run(c):
    return subprocess.run(c, capture_output=True, text=True, timeout=300, cwd=REPO, env=toy_env(tmp_path))

  first = run(cmd)
  assert first.returncode == 1 and len(read(out)) == 1, first.stdout + first.stderr  # bad record line 3
  before = out.read_text()
  second = run(cmd)
  assert second.returncode == 2 and out.read_text() == before
  assert "already holds results (1 lines)" in second.stdout and "--config.resume=True" in second.stdout
  assert run(cmd + ["--config.resume=True"]).returncode == 1 and out.read_text() == before  # nothing left to do
  for bad, message in (
    (["--config=/nowhere/replay.py"], "--config file /nowhere/replay.py does not exist"),
    ([f"--config.output={tmp_path}/f.jsonl/x.jsonl"], "cannot write --config.output"),
  ):
    (tmp_path / "f.jsonl").write_text("")
    p = run(cmd[:3] + bad + cmd[4:] if bad[0].startswith("--config=") else cmd + bad)
    assert p.returncode == 2 and message in p.stdout + p.stderr, p.stdout + p.stderr
    assert "Traceback" not in p.stdout + p.stderr


@pytest.mark.parametrize("isolation", ["process", "none"])
def test_one_worker_per_local_device(toy_many, tmp_path, isolation):
  """Two (CPU) devices: two workers share the workloads, each once."""
  out = tmp_path / "two.jsonl"
  env = {**toy_env(tmp_path), "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  p = subprocess.run(
    shard_cmd(toy_many, out, f"--config.isolation={isolation}"),
    capture_output=True,
    text=True,
    timeout=300,
    cwd=REPO,
    env=env,
  )
  assert "2 device worker(s)" in p.stdout, p.stdout + p.stderr
  assert sorted(statuses(out)) == sorted(["u0", "u1", "u3", "u4"] + [f"p{i}" for i in range(5)])


def test_smoke_replay_of_real_definitions(tmp_path):
  """End to end on the real dataset, what the replay adds to the kit's
  per-variant check (test_definitions.py): selection by prefix, CPU-budget
  sizes, Pallas in interpret mode, result lines with axes_run, the config,
  correctness and the speed of light, the summary and the exit code. Two
  families stand for all: a one-output GEMM and a two-output GDN."""
  cfg = make_config(
    REPO / "datasets",
    tmp_path,
    definitions="dense_gemm_bf16_nt_n4096_k4096,gdn_decode",
    max_workloads_per_definition=1,
    scale="smoke",
    iters=1,
  )
  logs = []
  code = replay.replay(cfg, log=logs.append)
  results = read(tmp_path / "out.jsonl")
  assert {r["definition"] for r in results} == {"dense_gemm_bf16_nt_n4096_k4096", "gdn_decode_qk4_v8_d128_k_last"}
  assert all(r["evaluation"]["status"] == "passed" for r in results), "\n".join(logs)
  for r in results:
    ev = r["evaluation"]
    assert r["workload"]["axes_run"] and "scaled" in r["workload"]
    assert ev["config_source"] in ("heuristic", "tuned") and ev["config"]
    assert set(ev["correctness"]["outputs"]) == set(registry.get(r["definition"]).definition.outputs)
    assert ev["performance"]["speed_of_light_ms"] > 0
  assert "2 passed, 0 failed" in logs[-1] and code == 0


def test_blob_root_loads_recorded_tensors_and_compares_expected_output(toy, tmp_path):
  import ml_dtypes
  import numpy as np
  from safetensors.numpy import save_file

  blobs = tmp_path / "blobs"
  (blobs / "blob").mkdir(parents=True)
  x = np.arange(24, dtype=np.float32).reshape(3, 8) / 7
  save_file({"tensor": x}, str(blobs / "blob" / "x.safetensors"))
  save_file({"tensor": (x * 2).astype(ml_dtypes.bfloat16)}, str(blobs / "blob" / "y.safetensors"))
  save_file({"tensor": (x * 2 + 1).astype(ml_dtypes.bfloat16)}, str(blobs / "blob" / "y_bad.safetensors"))
  save_file({"tensor": x[:2]}, str(blobs / "blob" / "x_short.safetensors"))
  save_file({"tensor": np.zeros((3000, 8), np.float32)}, str(blobs / "blob" / "x_big.safetensors"))
  save_file({"tensor": x}, str(tmp_path / "outside.safetensors"))
  st = lambda name: {"type": "safetensors", "path": f"blob/{name}.safetensors", "tensor_key": "tensor"}  # noqa: E731
  inputs = {"x": st("x"), "s": {"type": "scalar", "value": 2.0}}
  records = [
    {**rec("b-ok", 3, "blob"), "inputs": inputs, "expected_output": st("y")},
    {**rec("b-engine-differs", 3, "blob"), "inputs": inputs, "expected_output": st("y_bad")},
    {**rec("b-wrong-shape", 3, "blob"), "inputs": {**inputs, "x": st("x_short")}},
    {**rec("b-absent", 3, "blob"), "inputs": {**inputs, "x": st("nowhere")}},
    {**rec("b-escape", 3, "blob"), "inputs": {**inputs, "x": {**st("x"), "path": "../outside.safetensors"}}},
    {**rec("b-too-big", 3, "blob"), "inputs": {**inputs, "x": st("x_big")}},
    {**rec("b-expected-only", 3, "blob"), "expected_output": st("y_bad")},
  ]
  with open(toy / "workloads" / "toy_scale.jsonl", "a") as f:
    f.write("".join(json.dumps(r) + "\n" for r in records))
  replay.replay(make_config(toy, tmp_path, variants="blob", blob_root=str(blobs), scale="full"), log=lambda s: None)
  res = {r["workload"]["uuid"]: r["evaluation"] for r in read(tmp_path / "out.jsonl")}
  assert res["b-ok"]["status"] == "passed" and res["b-ok"]["expected_output"]["status"] == "passed"
  # Kernel and reference agree, the recorded output does not: a failure.
  assert res["b-engine-differs"]["expected_output"]["status"] == "incorrect_numerical"
  assert res["b-engine-differs"]["status"] == "incorrect_numerical"
  assert res["b-engine-differs"]["log"].startswith("recorded expected_output: y:")
  assert res["b-wrong-shape"]["status"] == "runtime_error"
  assert "field 'inputs.x'" in res["b-wrong-shape"]["log"] and "(3, 8)" in res["b-wrong-shape"]["log"]
  # A path leaving the blob root is refused before anything is read.
  assert res["b-escape"]["status"] == "runtime_error"
  assert "toy_scale.jsonl" in res["b-escape"]["log"] and "field 'inputs.x.path'" in res["b-escape"]["log"]
  assert "leaves the blob root" in res["b-escape"]["log"]
  # A tensor larger than the definition allows is rejected from its header.
  assert res["b-too-big"]["status"] == "runtime_error" and "(3, 8)" in res["b-too-big"]["log"]
  # A blob the record names but the root lacks: an error naming it, not synthesis.
  assert res["b-absent"]["status"] == "runtime_error"
  assert (
    "blob file(s) missing" in res["b-absent"]["log"] and "inputs.x: blob/nowhere.safetensors" in res["b-absent"]["log"]
  )
  # An expected output on synthesized inputs (no recorded inputs) is not compared.
  assert res["b-expected-only"]["status"] == "passed" and res["b-expected-only"]["expected_output"] is None


@pytest.mark.slow  # a subprocess
def test_command_line_ctrl_c_exits_130_with_results_on_disk(toy, tmp_path):
  import signal
  import time

  with open(toy / "workloads" / "toy_scale.jsonl", "a") as f:
    for r in (rec("i0", 3, "i"), rec("i1", 23, "i"), rec("i2", 23, "i"), rec("i3", 4, "i")):
      f.write(json.dumps(r) + "\n")
  out = tmp_path / "int.jsonl"
  # The run gets Python's Ctrl-C handler whatever this process has: a test run
  # started in the background of a non-interactive shell ignores SIGINT, and a
  # child would inherit that (and never stop). The child sets the handler
  # itself before running the module (a preexec_fn is unsafe in a process
  # with threads, as this one is once jax is imported).
  launcher = (
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "runpy.run_module('jaxkern.replay', run_name='__main__', alter_sys=True)"
  )
  cmd = [
    sys.executable,
    "-c",
    launcher,
    f"--config={REPO}/configs/replay.py",
    f"--config.dataset_dir={toy}",
    f"--config.output={out}",
    "--config.variants=i",
    "--config.scale=full",
    "--config.max_workloads_per_variant=0",
    "--config.progress=False",
  ]
  p = subprocess.Popen(
    cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=toy_env(tmp_path)
  )
  try:
    deadline = time.monotonic() + 120
    while not (out.exists() and out.read_text().count("\n") >= 1) and time.monotonic() < deadline:
      time.sleep(0.1)
    p.send_signal(signal.SIGINT)  # i1 (a slow one) is running now
    stdout, _ = p.communicate(timeout=120)
  finally:
    p.kill()  # no-op once it has exited; a run that ignored the Ctrl-C does not outlive the test
  assert p.returncode == 130, stdout
  assert "resume=True" in stdout and "Fatal" not in stdout
  done = [r["workload"]["uuid"] for r in read(out)]
  assert done[0] == "i0" and len(done) < 4


@pytest.mark.slow  # a subprocess
def test_command_line_from_another_directory_uses_the_package_dataset(tmp_path):
  """A packaged config by name, run from elsewhere: the shipped dataset, a
  results file under the working directory, nothing on stderr (no GPU-plugin
  probing); the same command again writes a second file."""
  import os

  cmd = [
    sys.executable,
    "-m",
    "jaxkern.replay",
    "--config",
    "smoke",
    "--config.definitions=dense_gemm_bf16_nt_n4096_k4096",
    "--config.progress=False",
  ]
  # As a user's shell has it: no JAX_PLATFORMS, no JAX_SKIP_CUDA_CONSTRAINTS_CHECK
  # (whatever this test process set); the compile toolchain, where make test
  # puts it on the path, is the CUDA plugin jaxkern must keep quiet.
  path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
  env = {"PYTHONPATH": path, "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
  for run in (1, 2):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "1 passed, 0 failed" in p.stdout and str(REPO / "datasets") in p.stdout
    assert p.stderr == ""
    files = sorted((tmp_path / "results").glob("smoke-*.jsonl"))
    assert len(files) == run and f"results in results/{files[-1].name}" in p.stdout.splitlines()[-1]


@pytest.mark.slow  # a subprocess
def test_command_line_misspelt_field_names_the_valid_ones(tmp_path):
  cmd = [sys.executable, "-m", "jaxkern.replay", f"--config={REPO}/configs/smoke.py", "--config.nosuchfield=1"]
  p = subprocess.run(
    cmd,
    capture_output=True,
    text=True,
    timeout=300,
    cwd=tmp_path,
    env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"},
  )
  assert p.returncode == 2
  assert "nosuchfield" in p.stderr and "valid --config fields" in p.stderr and "dataset_dir" in p.stderr
  assert "Traceback" not in p.stderr


@pytest.mark.slow  # a subprocess
def test_command_line_help_lists_every_config_field_with_its_default(tmp_path):
  """Plain `--help` (not `--helpfull`) shows each field of
  `jaxkern.replay_config` with its default and meaning."""
  from jaxkern import replay_config

  p = subprocess.run(
    [sys.executable, "-m", "jaxkern.replay", "--help"],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=tmp_path,
    env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"},
  )
  assert "Config fields" in p.stdout, p.stderr  # (absl's --help exits 1)
  fields = p.stdout.split("Config fields")[1]
  assert len(replay_config.FIELDS) == len(replay_config.default_config()) == 25
  for f in replay_config.FIELDS:
    line = next((l for l in fields.splitlines() if l.split() and l.split()[0].startswith(f.name + "=")), None)
    assert line is not None, f.name
    assert line.split()[0] == f"{f.name}={f.default!r}", line
    assert " ".join(line.split()[1:]) and " ".join(line.split()[1:]) in " ".join(f.meaning.split()), line
  assert "timeout_s=600.0" in fields and "scale='auto'" in fields and "max_workloads_per_variant=None" in fields
  assert "--config:" in p.stdout and "Traceback" not in p.stderr


def test_fields_help_wraps_and_keeps_every_meaning():
  from jaxkern import replay_config

  text = replay_config.fields_help(width=80)
  assert all(len(line) <= 80 for line in text.splitlines())
  flat = " ".join(text.split())
  for f in replay_config.FIELDS:
    assert f"{f.name}={f.default!r} {' '.join(f.meaning.split())}" in flat, f.name


# --- several processes ------------------------------------------------------


def free_port():
  import socket

  with socket.socket() as sock:
    sock.bind(("localhost", 0))
    return sock.getsockname()[1]


def shard_cmd(toy, out, *extra):
  return [
    sys.executable,
    "-m",
    "jaxkern.replay",
    f"--config={REPO}/configs/replay.py",
    f"--config.dataset_dir={toy}",
    f"--config.output={out}",
    "--config.variants=a,b,p",
    "--config.scale=full",
    "--config.max_workloads_per_variant=0",
    "--config.progress=False",
    "--config.warmup=0",
    "--config.iters=1",
    *extra,
  ]


def statuses(path):
  return {r["workload"]["uuid"]: r["evaluation"]["status"] for r in read(path)}


@pytest.fixture
def toy_many(toy):
  with open(toy / "workloads" / "toy_scale.jsonl", "a") as f:
    for i, m in enumerate((7, 8, 13, 9, 10)):
      f.write(json.dumps(rec(f"p{i}", m, "p")) + "\n")
  return toy


@pytest.mark.slow  # a subprocess
def test_three_processes_with_a_coordinator_merge_to_the_single_process_run(toy_many, tmp_path):
  single = tmp_path / "single.jsonl"
  assert (
    subprocess.run(
      shard_cmd(toy_many, single), capture_output=True, timeout=300, cwd=REPO, env=toy_env(tmp_path)
    ).returncode
    == 1
  )  # the corrupted line 3, and p2 (M=13) is wrong
  port = free_port()
  out = tmp_path / "multi.jsonl"
  procs = [
    subprocess.Popen(
      shard_cmd(
        toy_many,
        out,
        f"--config.coordinator_address=localhost:{port}",
        "--config.num_processes=3",
        f"--config.process_id={i}",
      ),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      cwd=REPO,
      env=toy_env(tmp_path),
    )
    for i in range(3)
  ]
  logs = [p.communicate(timeout=300)[0] for p in procs]
  files = [tmp_path / f"multi.{i}-of-3.jsonl" for i in range(3)]
  assert all(f.exists() for f in files), logs
  assert "shard 2 of 3" in logs[1]
  assert sum(len(read(f)) for f in files) == len(read(single)) == 9
  merged = tmp_path / "merged.jsonl"
  p = subprocess.run(
    [sys.executable, "-m", "jaxkern.shards", "merge", f"--output={merged}", *map(str, files)],
    capture_output=True,
    text=True,
    timeout=120,
    cwd=REPO,
    env=toy_env(tmp_path),
  )
  assert p.returncode == 0, p.stderr
  assert statuses(merged) == statuses(single)
  # A shard left out, or given twice, is an error.
  from jaxkern import shards

  with pytest.raises(shards.MergeError, match=r"shards \[2\] of 3 are missing"):
    shards.merge(files[:2], tmp_path / "x.jsonl")
  with pytest.raises(shards.MergeError, match="given twice"):
    shards.merge([files[0], files[0]], tmp_path / "x.jsonl")


@pytest.mark.slow  # a subprocess
def test_a_killed_shard_resumes_and_the_merge_is_complete(toy_many, tmp_path):
  """Shards without a coordinator (explicit process_id / num_processes); the
  second is killed while stuck on u23, then resumed; merge checks that every
  assigned workload has exactly one result."""
  import signal
  import time

  with open(toy_many / "workloads" / "toy_scale.jsonl", "a") as f:
    f.write(json.dumps(rec("u23", 23, "p")) + "\n")  # selection index 9: shard 9 % 3 = 0
  out = tmp_path / "k.jsonl"
  shard = lambda i, *extra: shard_cmd(toy_many, out, "--config.num_processes=3", f"--config.process_id={i}", *extra)  # noqa: E731
  procs = {
    i: subprocess.Popen(
      shard(i), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=toy_env(tmp_path)
    )
    for i in range(3)
  }
  for i in (1, 2):
    procs[i].communicate(timeout=300)
  first = tmp_path / "k.0-of-3.jsonl"
  deadline = time.monotonic() + 300
  while len(read(first)) < 3 and time.monotonic() < deadline:  # u0, u3, p1 done; u23 is stuck
    time.sleep(0.2)
  procs[0].send_signal(signal.SIGKILL)
  procs[0].communicate(timeout=60)
  from jaxkern import shards

  files = [tmp_path / f"k.{i}-of-3.jsonl" for i in range(3)]
  with pytest.raises(shards.MergeError, match="no result"):
    shards.merge(files, tmp_path / "m.jsonl")
  p = subprocess.run(
    shard(0, "--config.resume=True"),
    capture_output=True,
    text=True,
    timeout=300,
    cwd=REPO,
    env={**toy_env(tmp_path), "TOY_BLOCK": "0"},
  )
  assert "resume: 3 workloads already" in p.stdout, p.stdout + p.stderr
  assert shards.merge(files, tmp_path / "m.jsonl") == 10
  assert sorted(statuses(tmp_path / "m.jsonl")) == sorted(["u0", "u1", "u3", "u4", "u23"] + [f"p{i}" for i in range(5)])


def test_a_worker_that_cannot_start_is_each_workload_s_error(toy, tmp_path, monkeypatch):
  """A worker process that dies while starting (here: its jax finds no
  such platform) gives each workload an error status; the run ends
  normally."""
  import jax

  jax.devices()  # this process's backend is up; only the workers see the bad platform
  monkeypatch.setenv("JAX_PLATFORMS", "no_such_platform")
  cfg = make_config(toy, tmp_path, variants="b", isolation="process")
  assert replay.replay(cfg, log=lambda s: None) == 1
  results = read(tmp_path / "out.jsonl")
  assert [r["evaluation"]["status"] for r in results] == ["runtime_error", "runtime_error"]
  assert all("did not start" in r["evaluation"]["log"] for r in results)
