"""The package as users install it: the wheel carries the dataset, the replay
configs and the typing markers inside jaxkern (never a top-level `datasets`),
an unpacked wheel finds them through importlib.resources from any directory,
and importing jaxkern keeps jax's CUDA plugin quiet on a host without a GPU."""

import glob
import json
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
# What a build reads: the packaging files and the folders that ship.
SOURCES = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "jaxkern", "pallas_kernels", "datasets", "configs")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
  """The wheel `pip wheel --no-deps .` builds, from a copy of the tree (the
  build writes build/ and *.egg-info beside its sources)."""
  tmp = tmp_path_factory.mktemp("wheel")
  src = tmp / "src"
  src.mkdir()
  skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
  for name in SOURCES:
    path = REPO / name
    if path.is_dir():
      shutil.copytree(path, src / name, ignore=skip)
    else:
      shutil.copy(path, src / name)
  p = subprocess.run(
    [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp / "dist"), str(src)],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert p.returncode == 0, p.stdout + p.stderr
  (path,) = (tmp / "dist").glob("jaxkern-*.whl")
  return path


def names_in(wheel_path):
  with zipfile.ZipFile(wheel_path) as z:
    return set(z.namelist())


@pytest.mark.slow  # a wheel build (a subprocess)
def test_wheel_carries_the_dataset_configs_and_typing_markers(wheel):
  names = names_in(wheel)
  data = "jaxkern/_data/"
  for folder, pattern in (("definitions", "*.json"), ("workloads", "*.jsonl")):
    shipped = {pathlib.Path(n).name for n in names if n.startswith(f"{data}datasets/{folder}/")}
    assert shipped == {p.name for p in (REPO / "datasets" / folder).glob(pattern)}, folder
  assert len([n for n in names if n.startswith(f"{data}datasets/definitions/")]) == 21
  assert {f"{data}configs/{c}.py" for c in ("smoke", "replay", "full")} <= names
  assert {"jaxkern/py.typed", "pallas_kernels/py.typed"} <= names
  assert {"jaxkern/aot/gpu_targets/nvidia_h100_80gb_hbm3.txtpb", "jaxkern/fib/schemas/trace.schema.json"} <= names
  # Only jaxkern and pallas_kernels at the top: no `datasets` or `configs`
  # package to collide with other projects' (PyPI's `datasets`).
  assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"jaxkern", "pallas_kernels"}
  # Every module of the tree ships (a new family needs no packaging edit).
  tree = {str(p.relative_to(REPO)) for pkg in ("jaxkern", "pallas_kernels") for p in (REPO / pkg).rglob("*.py")}
  assert tree <= names
  with zipfile.ZipFile(wheel) as z:
    (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    text = z.read(metadata).decode()
  for extra in ("test", "examples", "aot", "cuda", "nn"):
    assert f"Provides-Extra: {extra}\n" in text, extra


@pytest.mark.slow  # a wheel build and a subprocess
def test_unpacked_wheel_finds_its_dataset_from_anywhere(wheel, tmp_path):
  """The wheel's files as an install lays them out (site-packages is the
  unpacked wheel), imported from another directory: the dataset and the
  configs come from inside the package, not from the checkout."""
  site = tmp_path / "site"
  with zipfile.ZipFile(wheel) as z:
    z.extractall(site)
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  probe = (
    "import json, jaxkern; from jaxkern import _data, dataset, registry, tuning; "
    "print(json.dumps({'package': jaxkern.__file__, 'datasets': str(dataset.default_dataset_dir()), "
    "'definitions': len(dataset.load_definitions()), 'ops': len(registry.names()), "
    "'configs': _data.config_names(), 'tuned': str(tuning.tuned_dir())}))"
  )
  p = subprocess.run(
    [sys.executable, "-c", probe],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=elsewhere,
    env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"},
  )
  assert p.returncode == 0, p.stderr
  found = json.loads(p.stdout)
  assert found["package"] == str(site / "jaxkern" / "__init__.py")
  assert found["datasets"] == str(site / "jaxkern" / "_data" / "datasets")
  assert found["definitions"] == 21 and found["ops"] == 21
  assert found["configs"] == ["full", "replay", "smoke"]
  assert found["tuned"] == str(site / "jaxkern" / "_data" / "configs" / "tuned")


@pytest.mark.slow  # subprocesses
def test_import_jaxkern_keeps_the_cuda_plugin_quiet_without_a_gpu():
  """Without NVIDIA device nodes, importing jaxkern before jax starts its
  backends skips the CUDA plugin's runtime checks (their traceback); a value
  the caller set is kept. Needs the plugin (make test puts the compile
  toolchain on the path)."""
  if glob.glob("/dev/nvidia[0-9]*"):
    pytest.skip("an NVIDIA GPU host: the plugin's checks run there")
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)

  def run(code, **extra):
    """`code` in a fresh interpreter: the environment above, plus `extra`."""
    return subprocess.run(
      [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env={**env, **extra}
    )

  bare = run("import jax; jax.devices()")
  if "Traceback" not in bare.stderr:
    pytest.skip("no CUDA plugin here, or one that probes quietly: nothing to keep quiet")
  p = run("import os, jaxkern, jax; print(jax.devices(), os.environ['JAX_SKIP_CUDA_CONSTRAINTS_CHECK'])")
  assert p.returncode == 0 and p.stderr == "", p.stderr
  assert p.stdout.split()[-1] == "1"
  chosen = run(
    "import os, jaxkern; print(os.environ['JAX_SKIP_CUDA_CONSTRAINTS_CHECK'])", JAX_SKIP_CUDA_CONSTRAINTS_CHECK=""
  )
  assert chosen.stdout == "\n"
