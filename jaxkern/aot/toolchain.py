"""The compile-only sm_90a toolchain: the CUDA 13 PJRT plugin and ptxas,
the GPU targets, and `Compiler`, which lowers a function on a compile-only
device and compiles it with XLA's GPU pipeline.

How: the CUDA 13 PJRT plugin of the installed jax
(`jax-cuda13-plugin`, `jax-cuda13-pjrt`) takes a GPU target description
(`GpuTargetConfigProto` text: the plugin's own where it embeds one, else the
shipped H100/H200 texts of `jaxkern.aot.targets`);
`jax.experimental.topologies.get_topology_desc` turns it into compile-only
devices, and `.compile()` of a function lowered on a mesh of them runs XLA's
real GPU pipeline: XLA's Triton on each `__gpu$xla.gpu.triton` call, then
ptxas (`nvidia-cuda-nvcc`, `nvidia/cu13/bin`) for `sm_90a`, with libdevice
from `nvidia-nvvm`. jax hands XLA `CUDA_ROOT` as the CUDA directory, so we
point it at a folder whose `bin/ptxas` is a wrapper that keeps each PTX and
runs the real ptxas with `-v` (registers, spills, stack). XLA's thunk dump
gives each kernel's launch: grid, threads and (dynamic) shared memory. A Mosaic GPU
kernel (`mosaic_gpu_v2` call) is compiled by the plugin with its own ptxas,
which the wrapper never sees: its PTX and `ptxas -v` report come from the
plugin's dump (`MOSAIC_GPU_DUMP_TO`, set for every compile). The plugin
compiles each distinct kernel once per process (by the call's
`kernel_hash`): a later call of the same kernel finds what its first
compile dumped. The dump also disassembles each kernel with nvdisasm, which
the report does not read and the extra does not hold: where jax's CUDA
folder has none, a silent stand-in answers for it.
"""

from __future__ import annotations

import atexit
import glob
import importlib.metadata
import importlib.util
import os
import re
import shlex
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

from jaxkern.aot import targets
from jaxkern.aot.parsing import PtxasStats, parse_ptxas_verbose, parse_thunk_sequence
from jaxkern.aot.ptx import KernelPtx, parse_ptx
from jaxkern.aot.report import CompileReport, Limits, MosaicDump, build_reports
from pallas_kernels.shared.lowering import MosaicGpuCall, mosaic_gpu_calls, triton_calls

DEFAULT_TARGET = "NVIDIA H200 141GB HBM3e"


def skip_cuda_checks() -> None:
  """The CUDA plugin looks for a CUDA runtime and cuDNN when jax initializes
  its backends (and prints a traceback on a machine without them); a
  compile-only target needs neither. Call before the first jax.devices()."""
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def _package_dir(module: str) -> str | None:
  try:
    spec = importlib.util.find_spec(module)
  except (ImportError, ValueError):
    return None
  if spec is None:
    return None
  locations = list(spec.submodule_search_locations or [])
  return locations[0] if locations else os.path.dirname(spec.origin or "")


PLUGIN_MODULE = "jax_plugins.xla_cuda13"  # jax-cuda13-pjrt
PLUGIN_PACKAGE = "jax_cuda13_plugin"  # jax-cuda13-plugin
PTXAS_PACKAGE = "nvidia.cu13"  # nvidia-cuda-nvcc (bin/ptxas) and nvidia-nvvm (nvvm/libdevice)


def plugin_library() -> str | None:
  """The CUDA 13 PJRT plugin's shared library (from `jax-cuda13-pjrt`)."""
  d = _package_dir(PLUGIN_MODULE)
  path = d and os.path.join(d, "xla_cuda_plugin.so")
  return path if path and os.path.exists(path) else None


def ptxas_binary() -> str | None:
  """`JAXKERN_PTXAS`, else the ptxas of `nvidia-cuda-nvcc` (`nvidia/cu13/bin`)."""
  if os.environ.get("JAXKERN_PTXAS"):
    return os.environ["JAXKERN_PTXAS"]
  d = _package_dir(PTXAS_PACKAGE)
  path = d and os.path.join(d, "bin", "ptxas")
  return path if path and os.path.exists(path) else None


def libdevice_dir() -> str | None:
  """The `nvvm` folder (libdevice) next to ptxas's `bin`, from `nvidia-nvvm`;
  XLA's own (non-Triton) fusions link libdevice."""
  real = ptxas_binary()
  d = real and os.path.join(os.path.dirname(os.path.dirname(real)), "nvvm")
  return d if d and os.path.isdir(os.path.join(d, "libdevice")) else None


def ptxas_version(binary: str | None = None) -> str:
  """`ptxas 13.5.37` (the release line of `ptxas --version`), or `ptxas ?`."""
  binary = binary or ptxas_binary()
  if binary is None:
    return "ptxas ?"
  try:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
  except (OSError, TypeError, subprocess.SubprocessError):
    return "ptxas ?"
  m = re.search(r"release [\d.]+, V([\d.]+)", out)
  return f"ptxas {m.group(1)}" if m else "ptxas ?"


def _version(distribution: str) -> str | None:
  try:
    return importlib.metadata.version(distribution)
  except importlib.metadata.PackageNotFoundError:
    return None


def plugin_version() -> str:
  """The installed `jax-cuda13-pjrt` version, or `?`."""
  return _version("jax-cuda13-pjrt") or "?"


def available() -> str | None:
  """None when the `aot` extra is usable, else why not: a missing package,
  or a plugin whose version is not jax's (jax loads only its own)."""
  missing = []
  if plugin_library() is None:
    missing.append("jax-cuda13-pjrt (jax_plugins/xla_cuda13/xla_cuda_plugin.so)")
  if _package_dir(PLUGIN_PACKAGE) is None:
    missing.append("jax-cuda13-plugin")
  if ptxas_binary() is None:
    missing.append("nvidia-cuda-nvcc (nvidia/cu13/bin/ptxas)")
  elif libdevice_dir() is None:
    missing.append("nvidia-nvvm (nvidia/cu13/nvvm/libdevice)")
  if missing:
    return (
      "the aot extra is not installed: missing "
      + ", ".join(missing)
      + "; install it with: make install (or see README: jaxkern.aot)"
    )
  jax_version = _version("jax")
  wrong = [f"{d} {_version(d)}" for d in ("jax-cuda13-plugin", "jax-cuda13-pjrt") if _version(d) != jax_version]
  if wrong:
    return (
      f"the aot extra does not match jax {jax_version}: {', '.join(wrong)}; install "
      f"jax-cuda13-plugin=={jax_version} jax-cuda13-pjrt=={jax_version} (pip install --no-deps)"
    )
  return None


def target_configs(library: str | None = None) -> dict[str, str]:
  """Device name -> `GpuTargetConfigProto` text: the plugin's own, plus the
  shipped ones (`jaxkern.aot.targets`) for devices the plugin does not embed."""
  library = library or plugin_library()
  if library is None:
    raise RuntimeError(available() or "no CUDA plugin library")
  return {**targets.shipped_target_configs(), **targets.embedded_target_configs(library)}


def target_origin(name: str, library: str | None = None) -> str:
  """Where `name`'s target text comes from: `plugin` (embedded in the
  installed plugin) or `shipped` (`jaxkern.aot.targets.TARGETS_DIR`)."""
  library = library or plugin_library()
  return "plugin" if library and name in targets.embedded_target_configs(library) else "shipped"


def resolve_target(name: str) -> tuple[str, str]:
  """(device name, target text) for an exact name or a unique-enough
  substring (`H100` -> `NVIDIA H100 80GB HBM3`: MIG slices and PCIe boards
  rank after the full SXM part)."""
  targets = target_configs()
  if name in targets:
    return name, targets[name]
  matches = sorted((n for n in targets if name.lower() in n.lower()), key=lambda n: ("MIG" in n, "PCIe" in n, len(n)))
  if not matches:
    raise ValueError(f"no GPU target matching {name!r}; known: {sorted(targets)}")
  return matches[0], targets[matches[0]]


_WRAPPER = """#!/bin/sh
# jaxkern.aot: keeps the PTX XLA hands to ptxas and runs ptxas -v.
real={real}
logs={logs}
case " $* " in *" --version "*|*" --input-as-string "*) exec "$real" "$@";; esac
n="$$.$(date +%s%N)"
prev=""
for a in "$@"; do
  case "$a" in -*) ;; *) if [ "$prev" != "-o" ] && [ -f "$a" ]; then cp "$a" "$logs/$n.ptx"; fi;; esac
  prev="$a"
done
"$real" "$@" -v > "$logs/$n.log" 2>&1
rc=$?
grep -v -e '^ptxas info' -e 'bytes stack frame' "$logs/$n.log" >&2
exit $rc
"""


_NVDISASM_STAND_IN = """#!/bin/sh
# jaxkern.aot: the CUDA plugin's Mosaic GPU dump disassembles each kernel; the
# report reads PTX and ptxas -v only, and nvdisasm is not part of the aot extra.
echo "// no SASS: nvdisasm is not installed (jaxkern.aot reads the PTX and ptxas -v)"
"""


def _mosaic_cuda_root(workdir: str) -> str | None:
  """A CUDA folder for the plugin's Mosaic GPU compiles: jax's own
  (`MOSAIC_GPU_CUDA_ROOT`: ptxas, libdevice) entry by entry, plus the
  nvdisasm stand-in; None when jax's folder has an nvdisasm (or none is known)."""
  try:
    import jax.experimental.mosaic.gpu  # noqa: F401  (sets MOSAIC_GPU_CUDA_ROOT at import)
  except ImportError:
    return None
  real = os.environ.get("MOSAIC_GPU_CUDA_ROOT", "")
  if not os.path.isdir(os.path.join(real, "bin")) or os.path.exists(os.path.join(real, "bin", "nvdisasm")):
    return None
  root = os.path.join(workdir, "mosaic_cuda")
  os.makedirs(os.path.join(root, "bin"), exist_ok=True)
  for folder in (real, os.path.join(real, "bin")):
    for name in os.listdir(folder):
      link = os.path.join(root, os.path.relpath(os.path.join(folder, name), real))
      if name != "bin" and not os.path.lexists(link):
        os.symlink(os.path.join(folder, name), link)
  stand_in = os.path.join(root, "bin", "nvdisasm")
  with open(stand_in, "w", encoding="utf-8") as f:
    f.write(_NVDISASM_STAND_IN)
  os.chmod(stand_in, 0o755)
  return root


# Kernel hash -> what the plugin's dump held when it compiled that Mosaic GPU
# kernel: the plugin compiles each kernel once per process, so a later call of
# the same kernel (another config that lowers to it, a repeat) dumps nothing.
_MOSAIC_COMPILED: dict[str, MosaicDump] = {}


def _mosaic_dumps(folder: str) -> list[MosaicDump]:
  """The kernels the plugin dumped into `folder` (`<module>_<n>.ptx`,
  `.ptxas`), in the order it compiled them (n)."""
  stems: dict[str, dict[str, str]] = {}
  for path in glob.glob(os.path.join(folder, "**", "*"), recursive=True):
    stem, ext = os.path.splitext(path)
    if ext in (".ptx", ".ptxas") and os.path.isfile(path):
      with open(path, encoding="utf-8", errors="replace") as f:
        stems.setdefault(stem, {})[ext] = f.read()
  order = lambda stem: (int(m.group(1)) if (m := re.search(r"_(\d+)$", stem)) else -1, stem)  # noqa: E731
  dumps = []
  for stem in sorted(stems, key=order):
    ptx = parse_ptx(stems[stem].get(".ptx", ""))
    for entry, stats in parse_ptxas_verbose(stems[stem].get(".ptxas", "")).items():
      dumps.append(MosaicDump(entry, stats, ptx.get(entry)))
  return dumps


def _match_mosaic(calls: list[MosaicGpuCall], dumps: list[MosaicDump]) -> list[MosaicDump | None]:
  """Each Mosaic GPU call's dump: a kernel compiled before (by hash) has
  its first dump; each new one takes the next of `dumps`."""
  fresh = iter(dumps)
  matched = []
  for call in calls:
    dump = _MOSAIC_COMPILED.get(call.kernel_hash) if call.kernel_hash else None
    if dump is None:
      dump = next(fresh, None)
      if dump is not None and call.kernel_hash:
        _MOSAIC_COMPILED[call.kernel_hash] = dump
    matched.append(dump)
  return matched


class Compiler:
  """Compile-only sm_90a toolchain for one GPU target.

  `compile(fn, args)` lowers `fn` on the target's compile-only device
  (`args`: a pytree of `jax.ShapeDtypeStruct`) and compiles it with XLA's
  GPU pipeline; it returns a `CompileReport` and never raises for kernel
  problems."""

  def __init__(self, target: str = DEFAULT_TARGET, workdir: str | None = None):
    reason = available()
    if reason:
      raise RuntimeError(reason)
    skip_cuda_checks()
    import jax
    import numpy as np
    from jax.experimental import topologies

    self.target, text = resolve_target(target)
    self.limits = Limits.from_target_config(text)
    if workdir is None:
      workdir = tempfile.mkdtemp(prefix="jaxkern_aot_")
      atexit.register(shutil.rmtree, workdir, True)
    self.workdir = workdir
    self._cuda_root = os.path.join(self.workdir, "cuda")
    self._logs = os.path.join(self.workdir, "ptxas")
    self._mosaic_dump = os.path.join(self.workdir, "mosaic_gpu")
    os.makedirs(os.path.join(self._cuda_root, "bin"), exist_ok=True)
    os.makedirs(self._logs, exist_ok=True)
    os.makedirs(self._mosaic_dump, exist_ok=True)
    os.environ.update(MOSAIC_GPU_DUMP_TO=self._mosaic_dump)
    mosaic_root = _mosaic_cuda_root(self.workdir)
    if mosaic_root:
      os.environ["MOSAIC_GPU_CUDA_ROOT"] = mosaic_root
    real = ptxas_binary()
    assert real is not None  # available() found it
    nvvm = libdevice_dir()
    if nvvm and not os.path.exists(os.path.join(self._cuda_root, "nvvm")):
      os.symlink(nvvm, os.path.join(self._cuda_root, "nvvm"))  # libdevice for XLA's own fusions
    wrapper = os.path.join(self._cuda_root, "bin", "ptxas")
    with open(wrapper, "w", encoding="utf-8") as f:
      f.write(_WRAPPER.format(real=shlex.quote(real), logs=shlex.quote(self._logs)))
    os.chmod(wrapper, os.stat(wrapper).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    topology = topologies.get_topology_desc(platform="cuda", topology_name="", target_config=text, topology="1x1x1")
    self._jax = jax
    self.mesh = jax.sharding.Mesh(np.array(topology.devices[:1]), ("x",))
    self._count = 0

  def _use_mesh(self):
    jax = self._jax
    return jax.set_mesh(self.mesh)  # a context manager on every jax we support (>= 0.11.2)

  def compile(self, fn: Callable[..., Any], *args: Any) -> CompileReport:
    jax = self._jax
    self._count += 1
    dump = os.path.join(self.workdir, f"dump{self._count}")
    for f in glob.glob(os.path.join(self._logs, "*")) + glob.glob(
      os.path.join(self._mosaic_dump, "**", "*"), recursive=True
    ):
      if os.path.isfile(f):
        os.remove(f)
    sharding = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    avals = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)
    t0 = time.perf_counter()
    error, calls, mosaic_calls = "", [], []
    try:
      with self._use_mesh():
        lowered = jax.jit(fn).trace(*avals).lower()
      text = lowered.as_text()
      mosaic_calls = mosaic_gpu_calls(text)
      calls = [*triton_calls(text), *mosaic_calls]
      # jax sets xla_gpu_cuda_data_dir from CUDA_ROOT (read at import);
      # an explicit option overrides it. A fresh dump folder per compile
      # also keeps jax from reusing a cached executable.
      lowered.compile({"xla_dump_to": dump, "xla_gpu_cuda_data_dir": self._cuda_root})
    except Exception as e:
      error = _short(e)
    seconds = time.perf_counter() - t0
    launches = []
    for path in glob.glob(os.path.join(dump, "*thunk_sequence.txt")):
      with open(path, encoding="utf-8") as f:
        launches += parse_thunk_sequence(f.read())
    stats: dict[str, PtxasStats] = {}
    kernels: dict[str, KernelPtx] = {}
    for path in sorted(glob.glob(os.path.join(self._logs, "*.log"))):
      with open(path, encoding="utf-8", errors="replace") as f:
        stats.update(parse_ptxas_verbose(f.read()))
      ptx = path[:-4] + ".ptx"
      if os.path.exists(ptx):
        with open(ptx, encoding="utf-8", errors="replace") as f:
          kernels.update(parse_ptx(f.read()))
    mosaic = _match_mosaic(mosaic_calls, _mosaic_dumps(self._mosaic_dump))
    shutil.rmtree(dump, ignore_errors=True)
    if not calls and not error:
      error = "no Pallas kernel (Triton or Mosaic GPU call) in the lowered function"
    return CompileReport(
      build_reports(calls, launches, stats, kernels, self.limits, error, mosaic=mosaic), seconds, error
    )


def _short(e: BaseException, limit: int = 600) -> str:
  text = f"{type(e).__name__}: {e}"
  for key in ("Shared memory size limit exceeded",):
    i = text.find(key)
    if i >= 0:
      return text[max(0, i - 200) : i + 300].strip()
  return text if len(text) <= limit else text[:limit] + " ..."
