"""scripts/gpu_run.sh in its dry mode (CPU, smoke scale, interpret mode):
phase 1 covers every definition, phase 1c runs the peers (tokamax's from
the kit), phase 2 resumes its file, phase 3 sweeps (lowering only here),
then the report with the peer columns, the environment and one tarball; and
the device kit it imports ml_collections and tokamax from on the GPU machine.

The dry run is what the first GPU run depends on, so it runs in the
device-stack lane (`make test-device`: the GPU machine's packages, jax
0.11.2, plus the kit's wheels), from a copy of the tree without `.git`, as
the tree reaches the GPU machine."""

import importlib.metadata
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import zipfile

import jax
import pytest

from jaxkern import peers, registry

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import device_kit  # noqa: E402

# What the lane adds to the machine's packages: the test runner, and ptxas and
# libdevice for the sm_90a compile tests (tests/test_aot.py).
TEST_TOOLS = {"pytest", "pytest-xdist", "execnet", "iniconfig", "pluggy", "nvidia-cuda-nvcc", "nvidia-nvvm"}


def tree_as_on_the_gpu_machine(to: pathlib.Path) -> pathlib.Path:
  """The working tree and the kit (.whl/), without .git or environments."""
  skip = shutil.ignore_patterns(
    ".git", ".venv*", ".aot-toolchain", "*.egg-info", "results", "__pycache__", ".pytest_cache", "bazel-*"
  )
  shutil.copytree(REPO, to, ignore=skip)
  return to


@pytest.mark.slow  # a subprocess
@pytest.mark.device_stack
@pytest.mark.lane_only
def test_dry_run_covers_every_definition_in_phase_1(tmp_path):
  tree = tree_as_on_the_gpu_machine(tmp_path / "tree")
  out = tmp_path / "run"
  # Phase 1b on one Mosaic GPU definition: its interpret mode is slow.
  env = {
    **os.environ,
    "DRY_RUN": "1",
    "PYTHON": sys.executable,
    "JAX_PLATFORMS": "cpu",
    "GIT_COMMIT": "0123abc",
    "GPU_RUN_MOSAIC_DEFINITIONS": "noncausal_dense_attention_h32_d64",
  }
  env.pop("PYTHONPATH", None)  # only what the script puts there: the tree and the kit's wheels
  p = subprocess.run(
    ["bash", str(tree / "scripts" / "gpu_run.sh"), str(out)],
    capture_output=True,
    text=True,
    timeout=1500,
    cwd=tmp_path,
    env=env,
  )
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  log = (out / "run.log").read_text()
  lines = [json.loads(l) for l in (out / "replay.jsonl").read_text().splitlines()]
  names = set(registry.names())
  # Phase 1: one workload of each of the 21 definitions, interleaved.
  phase1 = lines[: len(names)]
  assert {l["definition"] for l in phase1} == names and len(names) == 21
  assert "== phase 1 (one workload per recorded variant): start" in log
  assert "== phase 1 (one workload per recorded variant): end after" in log and "21 results (21 passed" in log
  # Phase 1b: phase 1's workload of a definition with a Mosaic GPU kernel, on it, in a file of its own.
  [mosaic] = [json.loads(l) for l in (out / "replay_mosaic_gpu.jsonl").read_text().splitlines()]
  assert mosaic["definition"] == "noncausal_dense_attention_h32_d64" and mosaic["evaluation"]["backend"] == "mosaic_gpu"
  assert mosaic["workload"]["uuid"] in {l["workload"]["uuid"] for l in phase1}
  assert mosaic["evaluation"]["status"] == "passed" and "== phase 1b (the same workloads on mosaic_gpu): end" in log
  # Phase 1c: each peer on phase 1's workloads it covers (XLA's dot, jax.nn's and tokamax's attention from the
  # kit, tokamax's ragged dot on the grouped GEMM), checked and timed.
  peer_rows = peers.read_peer_results(out / "peers.jsonl")
  attention = {n for n in names if n.startswith(("noncausal_dense_attention", "prefix_cached"))}
  gemm, grouped = {n for n in names if n.startswith("dense_gemm")}, {n for n in names if n.startswith("grouped_gemm")}
  assert len(attention) == 4 and len(gemm) == 3 and len(grouped) == 2
  assert sorted((r.definition, r.peer) for r in peer_rows) == sorted(
    [(n, "xla dot") for n in gemm]
    + [(n, p) for n in attention for p in ("jax.nn.dot_product_attention[xla]", "tokamax.dot_product_attention[xla]")]
    + [(n, "tokamax.ragged_dot_general[xla]") for n in grouped]
  )
  assert all(r.status == "passed" and r.latency_ms is not None for r in peer_rows), peer_rows
  assert "== phase 1c (peers): end after" in log and "13 peer results" in log
  # Phase 2 resumed phase 1's file and added the second workload of two definitions.
  assert "resume: 21 workloads already in" in log and len(lines) == 23
  assert {l["definition"] for l in lines[21:]} == {
    "gdn_decode_qk4_v8_d128_k_last",
    "qsa_index_topk_decode_qwen38_h4_d128_topk512_c4",
  }
  assert len({l["workload"]["uuid"] for l in lines}) == 23
  assert all(l["evaluation"]["status"] == "passed" for l in lines)
  assert all(l["evaluation"]["performance"]["timer"] == "interpret" for l in lines)
  assert all("speed_of_light_ms" in l["evaluation"]["performance"] for l in lines)
  # Phase 3: sweeps (lowering only in the dry run) at the largest recorded axes.
  for name in ("dense_gemm_bf16_nt_n4096_k4096", "moe_router_gemm_topk_deepseek41_d5120_e384_topk6"):
    rows = [json.loads(l) for l in (out / f"sweep_{name}.jsonl").read_text().splitlines()]
    backends = registry.get(name).backends  # the sweep ranks every backend's candidates (2 each here)
    assert len(rows) == 2 * len(backends) and {r["backend"] for r in rows} == set(backends)
    assert all(r["status"] == "lowered" for r in rows)
    assert rows[0]["axes"]["M"] == (24576 if name.startswith("dense") else 4096)
  assert "== phase 3 (sweeps): end after" in log and "2 definitions swept" in log
  assert (out / "report" / "index.html").stat().st_size > 0
  assert "dense_gemm_bf16_nt_n4096_k4096" in (out / "summary.txt").read_text()
  summary = (out / "summary.md").read_text()  # the page docs/perf/<device>.md takes
  assert "dense_gemm_bf16_nt_n4096_k4096" in summary and "interpret" in summary
  assert "| `noncausal_dense_attention_h32_d64` | mosaic_gpu | interpret | 1 / 1 |" in summary  # both backends
  # The peer columns: peers timed by wall clock, ours in interpret mode: named, not compared.
  assert "| best peer | peer ms | peer/ours (>1: ours faster) |" in summary
  for name in gemm | grouped:
    [line] = [l for l in summary.splitlines() if l.startswith(f"| `{name}` | triton |")]
    assert line.endswith(f"| {'xla dot' if name in gemm else 'tokamax.ragged_dot_general[xla]'} | n/c | n/c |")
  assert "Peers of 10 rows were timed by another timer than our kernels" in summary  # 9 triton rows, 1 mosaic_gpu
  printed = (out / "summary.txt").read_text()
  assert "tokamax.dot_product_attention[xla]" in printed and "peer/ours (>1: ours faster)" in printed
  env_txt = (out / "env.txt").read_text()
  assert f"jax {jax.__version__}" in env_txt and "git commit: 0123abc" in env_txt and "nvidia-smi" in env_txt
  assert "kit wheels unpacked onto PYTHONPATH:" in env_txt and "ml_collections==" in env_txt
  assert "tokamax==0.0.17" in env_txt and "tokamax-0.0.17-py3-none-any.whl" in env_txt
  with tarfile.open(f"{out}.tar.gz") as tar:
    assert {"run/replay.jsonl", "run/env.txt", "run/run.log", "run/summary.md", "run/report/index.html"} <= set(
      tar.getnames()
    )


@pytest.mark.device_stack
@pytest.mark.lane_only
def test_the_lane_holds_the_gpu_machines_packages_and_the_kit():
  """jax as on the GPU machine; ml_collections only from the kit's wheel;
  nothing installed beyond constraints-device.txt but the test tools."""
  machine = device_kit.pins(REPO / "constraints-device.txt")
  assert jax.__version__ == machine["jax"]
  import ml_collections

  assert ".whl/ml_collections-" in ml_collections.__file__
  environment = pathlib.Path(sys.prefix).resolve()
  installed = {
    device_kit.canonicalize_name(d.metadata["Name"])
    for d in importlib.metadata.distributions()
    if pathlib.Path(str(d.locate_file(""))).resolve().is_relative_to(environment)
  }
  assert installed - set(machine) <= {device_kit.canonicalize_name(n) for n in TEST_TOOLS} | {"pip"}


def test_kit_reads_pins_and_wheel_metadata(tmp_path):
  constraints = tmp_path / "c.txt"
  constraints.write_text("# a comment\nml_collections==1.1.0\nPyYAML==6.0.4  # trailing\n\n")
  assert device_kit.pins(constraints) == {"ml-collections": "1.1.0", "pyyaml": "6.0.4"}
  wheel = tmp_path / "toy-1.0-py3-none-any.whl"
  with zipfile.ZipFile(wheel, "w") as z:
    z.writestr("toy-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n")
    z.writestr(
      "toy-1.0.dist-info/METADATA",
      'Name: toy\nRequires-Dist: absl-py\nRequires-Dist: PyYAML>=5\nRequires-Dist: pytest; extra == "test"\n',
    )
  pure, reqs = device_kit.metadata(wheel)
  assert pure and [r.name for r in reqs] == ["absl-py", "PyYAML"]


def test_kit_follows_requirements_less_the_ones_not_carried_and_checks_its_size(tmp_path, monkeypatch):
  """A fake index: tokamax needs xprof and qwix (flax on the machine); xprof
  needs fire and duckdb, which is not carried; nothing is installed."""
  index = {
    "ml-collections": ["absl-py"],
    "tokamax": ["xprof", "qwix"],
    "xprof": ["fire", "duckdb"],
    "qwix": ["flax"],
    "fire": [],
    "duckdb": [],
  }
  sizes = {"xprof": 30 * 2**20}

  def download(name, version, into):
    wheel = into / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
      z.writestr(f"{name}-{version}.dist-info/WHEEL", "Root-Is-Purelib: true\n")
      z.writestr(f"{name}-{version}.dist-info/METADATA", "".join(f"Requires-Dist: {r}\n" for r in index[name]))
      z.writestr("padding", os.urandom(sizes.get(name, 0)))
    return wheel

  (tmp_path / "constraints-device.txt").write_text("absl-py==2.5.1\nflax==0.12.12\n")
  (tmp_path / "constraints.txt").write_text("".join(f"{n}==1.0\n" for n in index))
  monkeypatch.setattr(device_kit, "REPO", tmp_path)
  monkeypatch.setattr(device_kit, "download", download)
  wheels = device_kit.build(tmp_path / "kit")
  assert sorted(w.name.split("-")[0] for w in wheels) == ["fire", "ml_collections", "qwix", "tokamax", "xprof"]
  monkeypatch.setattr(device_kit, "MAX_BYTES", 20 * 2**20)
  with pytest.raises(SystemExit, match=r"over 20 MiB \(MiB: xprof-1.0-py3-none-any.whl 30.0"):
    device_kit.build(tmp_path / "kit")


def test_every_package_jaxkern_requires_is_on_the_gpu_machine_or_in_the_kit():
  """The installed package's run-time requirements (setup.py): each on the
  machine (constraints-device.txt) or among the kit's packages."""
  try:
    requires = importlib.metadata.requires("jaxkern")
  except importlib.metadata.PackageNotFoundError:
    pytest.skip("jaxkern is not installed here (the lane puts it on PYTHONPATH)")
  machine = device_kit.pins(REPO / "constraints-device.txt")
  needed = {device_kit.canonicalize_name(device_kit.Requirement(r).name) for r in requires if "extra ==" not in r}
  assert needed - set(machine) == {device_kit.canonicalize_name(n) for n in device_kit.NEEDED}
