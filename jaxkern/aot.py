"""Compiles kernels for sm_90a (H100/H200) on a machine without a GPU and
reports, per Pallas kernel, what the GPU toolchain made of it.

  python -m jaxkern.aot                                   # every implemented definition
  python -m jaxkern.aot --definition moe_router --axes M=1 --all_candidates
  python -m jaxkern.aot --definition dense_gemm --json

How (SPEC section 2): the CUDA PJRT plugin (`jax-cuda12-plugin`,
`jax-cuda12-pjrt`) embeds GPU target descriptions (`GpuTargetConfigProto`
text, one per device); `jax.experimental.topologies.get_topology_desc` turns
one into compile-only devices, and `.compile()` of a function lowered on a
mesh of them runs XLA's real GPU pipeline: XLA's Triton on each
`__gpu$xla.gpu.triton` call, then ptxas (`nvidia-cuda-nvcc-cu12`) for
`sm_90a`. jax hands XLA `CUDA_ROOT` as the CUDA directory, so we point it at
a folder whose `bin/ptxas` is a wrapper that keeps each PTX and runs the real
ptxas with `-v` (registers, spills, stack). XLA's thunk dump gives each
kernel's launch: grid, threads and (dynamic) shared memory.

Per kernel (one per `pallas_call`, named by its `name=`): registers per thread,
shared memory, spill stores/loads, whether the PTX uses wgmma or mma.sync,
an occupancy estimate (CTAs per SM from registers x threads, shared memory
and threads, with the target's limits) and a status: `ok`, `spills`,
`smem_overflow` or `error`. The exit code is 1 unless every kernel is `ok`.

These packages are the optional `aot` extra (`pip install -e '.[aot]'`);
`available()` says why the tool cannot run when they are missing. The
parsing and occupancy functions need nothing and are tested everywhere.
"""

from __future__ import annotations

import atexit
import dataclasses
import glob
import importlib.util
import json
import math
import mmap
import os
import re
import shlex
import shutil
import stat
import sys
import tempfile
import time
from typing import Any, Callable, Mapping, Sequence


def skip_cuda_checks() -> None:
  """The CUDA plugin looks for a CUDA runtime and cuDNN when jax initializes
  its backends (and prints a traceback on a machine without them); a
  compile-only target needs neither. Call before the first jax.devices()."""
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

DEFAULT_TARGET = "NVIDIA H200 141GB HBM3e"
OK, SPILLS, SMEM_OVERFLOW, ERROR = "ok", "spills", "smem_overflow", "error"


# -- target and limits --------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Limits:
  """Per-SM resources of a target (defaults: H100/H200, sm_90)."""
  threads_per_sm: int = 2048
  registers_per_sm: int = 65536
  smem_per_sm: int = 233472          # 228 KiB
  smem_per_block: int = 232448       # 227 KiB opt-in maximum per CTA
  max_ctas_per_sm: int = 32
  smem_reserved_per_cta: int = 1024  # the driver's per-CTA reservation
  register_granularity: int = 256    # registers are allocated per warp in these units
  max_registers_per_thread: int = 255

  @classmethod
  def from_target_config(cls, text: str) -> "Limits":
    """The limits a `GpuTargetConfigProto` text states; defaults otherwise."""
    def field(name, default):
      m = re.search(rf"^\s*{name}: (\d+)", text, re.M)
      return int(m.group(1)) if m else default
    d = cls()
    return dataclasses.replace(
        d, threads_per_sm=field("threads_per_core_limit", d.threads_per_sm),
        registers_per_sm=field("registers_per_core_limit", d.registers_per_sm),
        smem_per_sm=field("shared_memory_per_core", d.smem_per_sm),
        smem_per_block=field("shared_memory_per_block_optin", d.smem_per_block))


def occupancy(registers: int, threads: int, smem_bytes: int, limits: Limits = Limits()) -> tuple[int, str]:
  """(CTAs per SM, what limits it: `threads`, `registers`, `smem` or `ctas`).

  Registers are allocated per warp, rounded up to `register_granularity`;
  each CTA's shared memory carries the driver's 1 KiB reservation. 0 CTAs
  means the kernel cannot launch (too many registers x threads or too much
  shared memory)."""
  warps = max(1, math.ceil(threads / 32))
  per_warp = math.ceil(max(registers, 1) * 32 / limits.register_granularity) * limits.register_granularity
  bounds = {
      "threads": limits.threads_per_sm // max(threads, 1),
      "registers": (limits.registers_per_sm // per_warp) // warps,
      "smem": (limits.smem_per_sm // (smem_bytes + limits.smem_reserved_per_cta)
               if smem_bytes <= limits.smem_per_block else 0),
      "ctas": limits.max_ctas_per_sm,
  }
  limiter = min(bounds, key=lambda k: (bounds[k], list(bounds).index(k)))
  return bounds[limiter], limiter


# -- parsing ptxas -v, PTX and XLA's thunk dump -------------------------------

@dataclasses.dataclass
class PtxasStats:
  registers: int = 0
  spill_stores: int = 0
  spill_loads: int = 0
  stack_frame: int = 0
  static_smem: int = 0
  ptxas_ms: float | None = None


_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)'")
_PROPS_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED_RE = re.compile(r"Used (\d+) registers")
_SMEM_RE = re.compile(r"(\d+) bytes smem")
_TIME_RE = re.compile(r"Compile time = ([\d.]+) ms")


def parse_ptxas_verbose(text: str) -> dict[str, PtxasStats]:
  """Per entry function, what `ptxas -v` printed (stderr and stdout together)."""
  out: dict[str, PtxasStats] = {}
  current = None
  for line in text.splitlines():
    if m := _ENTRY_RE.search(line):
      current = out.setdefault(m.group(1), PtxasStats())
      continue
    if current is None:
      continue
    if m := _PROPS_RE.search(line):
      current.stack_frame, current.spill_stores, current.spill_loads = map(int, m.groups())
    if m := _USED_RE.search(line):
      current.registers = int(m.group(1))
      if s := _SMEM_RE.search(line):
        current.static_smem = int(s.group(1))
    if m := _TIME_RE.search(line):
      current.ptxas_ms = float(m.group(1))
  return out


def ptx_matrix_ops(ptx: str) -> dict[str, str]:
  """Per `.entry` function of a PTX module: `wgmma` (Hopper warpgroup MMA),
  `mma` (mma.sync) or `none`."""
  out = {}
  parts = re.split(r"^\s*(?:\.visible\s+)?\.entry\s+(\w+)\s*\(", ptx, flags=re.M)
  for name, body in zip(parts[1::2], parts[2::2]):
    out[name] = "wgmma" if "wgmma.mma_async" in body else "mma" if re.search(r"\bmma\.sync", body) else "none"
  return out


@dataclasses.dataclass(frozen=True)
class Launch:
  name: str
  grid: tuple[int, ...]
  threads: int
  smem_bytes: int


_THUNK_RE = re.compile(r"kCustomKernel.*?\]\s+(\S+)\s+grid:\s*\[([\d,\s]+)\]\s+threads:\s*\[([\d,\s]+)\]"
                       r"\s+shared_memory:\s*(\d+)")


def parse_thunk_sequence(text: str) -> list[Launch]:
  """The custom (Triton) kernel launches of XLA's `*thunk_sequence.txt` dump."""
  out = []
  for m in _THUNK_RE.finditer(text):
    grid = tuple(int(x) for x in m.group(2).split(","))
    threads = math.prod(int(x) for x in m.group(3).split(","))
    out.append(Launch(m.group(1), grid, threads, int(m.group(4))))
  return out


_TRITON_CALL_RE = re.compile(r'name = "([^"]+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32')


def triton_calls(stablehlo: str) -> list[tuple[str, int, int]]:
  """(name, num_stages, num_warps) of each `__gpu$xla.gpu.triton` call of a
  lowered module, in order."""
  return [(m.group(1), int(m.group(2)), int(m.group(3))) for m in _TRITON_CALL_RE.finditer(stablehlo)]


# -- reports ------------------------------------------------------------------

@dataclasses.dataclass
class KernelReport:
  name: str
  status: str = OK
  registers: int | None = None
  smem_bytes: int | None = None       # dynamic (Triton) + static
  spill_stores: int | None = None
  spill_loads: int | None = None
  stack_frame: int | None = None
  matrix_ops: str | None = None       # wgmma | mma | none
  threads: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  grid: tuple[int, ...] | None = None
  ctas_per_sm: int | None = None
  occupancy_limit: str | None = None
  ptxas_ms: float | None = None
  error: str = ""

  @property
  def ok(self) -> bool:
    return self.status == OK


@dataclasses.dataclass
class CompileReport:
  kernels: list[KernelReport]
  compile_seconds: float
  error: str = ""

  @property
  def ok(self) -> bool:
    return not self.error and all(k.ok for k in self.kernels)

  @property
  def status(self) -> str:
    """The worst status: error > smem_overflow > spills > ok."""
    order = (ERROR, SMEM_OVERFLOW, SPILLS, OK)
    found = {k.status for k in self.kernels}
    if self.error and found <= {OK}:  # an error no kernel accounts for
      found.add(ERROR)
    return next((s for s in order if s in found), OK)

  def summary(self) -> str:
    """One line: each kernel's registers / smem / spills."""
    parts = []
    for k in self.kernels:
      if k.registers is None:
        parts.append(f"{k.name}: {k.status}")
      else:
        parts.append(f"{k.name}: {k.registers} regs, {_kib(k.smem_bytes)} smem, "
                     f"spills {k.spill_stores}/{k.spill_loads} B, {k.matrix_ops}, {k.ctas_per_sm} CTA/SM")
    return "; ".join(parts) + (f" [{self.status}]" if not self.ok else "")


def _kib(n: int | None) -> str:
  return "-" if n is None else f"{n / 1024:.1f} KiB"


def kernel_status(k: KernelReport, limits: Limits) -> str:
  if k.error:
    return SMEM_OVERFLOW if "Shared memory size limit exceeded" in k.error else ERROR
  if k.smem_bytes is not None and k.smem_bytes > limits.smem_per_block:
    return SMEM_OVERFLOW
  if k.spill_stores or k.spill_loads:
    return SPILLS
  if k.registers is None:
    return ERROR
  return OK


def build_reports(calls: Sequence[tuple[str, int, int]], launches: Sequence[Launch],
                  ptxas: Mapping[str, PtxasStats], matrix_ops: Mapping[str, str],
                  limits: Limits, error: str = "") -> list[KernelReport]:
  """Joins what the lowering (names, warps, stages), XLA's thunks (launch) and
  ptxas said about each Pallas kernel, by name and in order."""
  # XLA may suffix repeated kernel names; match each call to the first unused
  # launch whose name starts with it.
  unused = list(launches)
  reports = []
  for name, num_stages, num_warps in calls:
    launch = next((l for l in unused if l.name == name), None) or next(
        (l for l in unused if l.name.startswith(name)), None)
    if launch is not None:
      unused.remove(launch)
    entry = launch.name if launch else name
    stats = ptxas.get(entry)
    k = KernelReport(name=name, num_warps=num_warps, num_stages=num_stages)
    if launch is not None:
      k.grid, k.threads, k.smem_bytes = launch.grid, launch.threads, launch.smem_bytes
    if stats is not None:
      k.registers, k.spill_stores, k.spill_loads = stats.registers, stats.spill_stores, stats.spill_loads
      k.stack_frame, k.ptxas_ms = stats.stack_frame, stats.ptxas_ms
      k.smem_bytes = (k.smem_bytes or 0) + stats.static_smem
      k.matrix_ops = matrix_ops.get(entry)
    if stats is None or launch is None:
      k.error = error or "no ptxas/launch record for this kernel"
    if k.registers is not None:
      threads = k.threads or num_warps * 32
      k.ctas_per_sm, k.occupancy_limit = occupancy(k.registers, threads, k.smem_bytes or 0, limits)
    k.status = kernel_status(k, limits)
    reports.append(k)
  return reports


# -- the toolchain ------------------------------------------------------------

def _package_dir(module: str) -> str | None:
  try:
    spec = importlib.util.find_spec(module)
  except (ImportError, ValueError):
    return None
  if spec is None:
    return None
  locations = list(spec.submodule_search_locations or [])
  return locations[0] if locations else os.path.dirname(spec.origin or "")


def plugin_library() -> str | None:
  """The CUDA PJRT plugin's shared library (from `jax-cuda12-pjrt`)."""
  d = _package_dir("jax_plugins.xla_cuda12")
  path = d and os.path.join(d, "xla_cuda_plugin.so")
  return path if path and os.path.exists(path) else None


def ptxas_binary() -> str | None:
  """`JAXKERN_PTXAS`, else the ptxas of `nvidia-cuda-nvcc-cu12`."""
  if os.environ.get("JAXKERN_PTXAS"):
    return os.environ["JAXKERN_PTXAS"]
  d = _package_dir("nvidia.cuda_nvcc")
  path = d and os.path.join(d, "bin", "ptxas")
  return path if path and os.path.exists(path) else None


def available() -> str | None:
  """None when the `aot` extra is usable, else why not."""
  missing = []
  if plugin_library() is None:
    missing.append("jax-cuda12-pjrt (jax_plugins/xla_cuda12/xla_cuda_plugin.so)")
  if ptxas_binary() is None:
    missing.append("nvidia-cuda-nvcc-cu12 (ptxas)")
  if _package_dir("jax_cuda12_plugin") is None:
    missing.append("jax-cuda12-plugin")
  if missing:
    return ("the aot extra is not installed: missing " + ", ".join(missing)
            + "; install it with: pip install -c constraints.txt -e '.[aot]'")
  return None


_TARGETS_CACHE: dict[str, dict[str, str]] = {}


def target_configs(library: str | None = None) -> dict[str, str]:
  """Device name -> `GpuTargetConfigProto` text embedded in the plugin."""
  library = library or plugin_library()
  if library is None:
    raise RuntimeError(available() or "no CUDA plugin library")
  if library not in _TARGETS_CACHE:
    found = {}
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
      for m in re.finditer(rb'device_description_str: "([^"\n]+)"', data):
        start = data.rfind(b"\0", 0, m.start()) + 1
        end = data.find(b"\0", m.end())
        text = data[start:end].decode("utf-8", "replace")
        if "gpu_device_info" in text:
          found[m.group(1).decode()] = text
    _TARGETS_CACHE[library] = found
  return _TARGETS_CACHE[library]


def resolve_target(name: str) -> tuple[str, str]:
  """(device name, target text) for an exact name or a unique-enough
  substring (`H100` -> `NVIDIA H100 80GB HBM3`: MIG slices and PCIe boards
  rank after the full SXM part)."""
  targets = target_configs()
  if name in targets:
    return name, targets[name]
  matches = sorted((n for n in targets if name.lower() in n.lower()),
                   key=lambda n: ("MIG" in n, "PCIe" in n, len(n)))
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
    import jax  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    from jax.experimental import topologies  # pylint: disable=g-import-not-at-top

    self.target, text = resolve_target(target)
    self.limits = Limits.from_target_config(text)
    self.workdir = workdir
    if workdir is None:
      self.workdir = tempfile.mkdtemp(prefix="jaxkern_aot_")
      atexit.register(shutil.rmtree, self.workdir, True)
    self._cuda_root = os.path.join(self.workdir, "cuda")
    self._logs = os.path.join(self.workdir, "ptxas")
    os.makedirs(os.path.join(self._cuda_root, "bin"), exist_ok=True)
    os.makedirs(self._logs, exist_ok=True)
    real = ptxas_binary()
    nvvm = os.path.join(os.path.dirname(os.path.dirname(real)), "nvvm")
    if os.path.isdir(nvvm) and not os.path.exists(os.path.join(self._cuda_root, "nvvm")):
      os.symlink(nvvm, os.path.join(self._cuda_root, "nvvm"))  # libdevice for XLA's own fusions
    wrapper = os.path.join(self._cuda_root, "bin", "ptxas")
    with open(wrapper, "w", encoding="utf-8") as f:
      f.write(_WRAPPER.format(real=shlex.quote(real), logs=shlex.quote(self._logs)))
    os.chmod(wrapper, os.stat(wrapper).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    topology = topologies.get_topology_desc(platform="cuda", topology_name="", target_config=text,
                                            topology="1x1x1")
    self._jax = jax
    self.mesh = jax.sharding.Mesh(np.array(topology.devices[:1]), ("x",))
    self._count = 0

  def _use_mesh(self):
    jax = self._jax
    return jax.sharding.use_mesh(self.mesh) if hasattr(jax.sharding, "use_mesh") else jax.set_mesh(self.mesh)

  def compile(self, fn: Callable[..., Any], *args: Any) -> CompileReport:
    jax = self._jax
    self._count += 1
    dump = os.path.join(self.workdir, f"dump{self._count}")
    for f in glob.glob(os.path.join(self._logs, "*")):
      os.remove(f)
    sharding = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    avals = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)
    t0 = time.perf_counter()
    error, calls = "", []
    try:
      with self._use_mesh():
        lowered = jax.jit(fn).trace(*avals).lower()
      calls = triton_calls(lowered.as_text())
      # jax sets xla_gpu_cuda_data_dir from CUDA_ROOT (read at import);
      # an explicit option overrides it. A fresh dump folder per compile
      # also keeps jax from reusing a cached executable.
      lowered.compile({"xla_dump_to": dump, "xla_gpu_cuda_data_dir": self._cuda_root})
    except Exception as e:  # pylint: disable=broad-except
      error = _short(e)
    seconds = time.perf_counter() - t0
    launches = []
    for path in glob.glob(os.path.join(dump, "*thunk_sequence.txt")):
      with open(path, encoding="utf-8") as f:
        launches += parse_thunk_sequence(f.read())
    stats: dict[str, PtxasStats] = {}
    mma: dict[str, str] = {}
    for path in sorted(glob.glob(os.path.join(self._logs, "*.log"))):
      with open(path, encoding="utf-8", errors="replace") as f:
        stats.update(parse_ptxas_verbose(f.read()))
      ptx = path[:-4] + ".ptx"
      if os.path.exists(ptx):
        with open(ptx, encoding="utf-8", errors="replace") as f:
          mma.update(ptx_matrix_ops(f.read()))
    shutil.rmtree(dump, ignore_errors=True)
    if not calls and not error:
      error = "no Pallas (Triton) kernel in the lowered function"
    return CompileReport(build_reports(calls, launches, stats, mma, self.limits, error), seconds, error)


def _short(e: BaseException, limit: int = 600) -> str:
  text = f"{type(e).__name__}: {e}"
  for key in ("Shared memory size limit exceeded",):
    i = text.find(key)
    if i >= 0:
      return text[max(0, i - 200): i + 300].strip()
  return text if len(text) <= limit else text[:limit] + " ..."


# -- definitions --------------------------------------------------------------

def select_ops(patterns: Sequence[str]) -> list:
  """Implemented ops whose names equal or start with one of `patterns` (all
  implemented ones when empty); raises on a pattern that matches nothing."""
  from jaxkern import registry  # pylint: disable=g-import-not-at-top
  ops = [registry.get(n) for n in registry.names()]
  if not patterns:
    return [op for op in ops if op.implemented]
  chosen = []
  for p in patterns:
    hits = [op for op in ops if op.name == p or op.name.startswith(p)]
    if not hits:
      raise ValueError(f"--definition {p!r} matches no definition")
    for op in hits:
      if not op.implemented:
        raise ValueError(f"{op.name} has no kernel yet ({op.missing})")
      if op not in chosen:
        chosen.append(op)
  return chosen


def check_op(compiler: Compiler, op, axes: Mapping[str, int], configs: Sequence[Any] | None = None,
             progress: Callable[[dict], None] | None = None) -> list[dict]:
  """Compiles `op` at `axes` for each config (default: the heuristic's) and
  returns one JSON-ready row per config."""
  from jaxkern import tuning  # pylint: disable=g-import-not-at-top
  shapes = op.input_shapes(axes)
  heuristic = op.choose_config(shapes)
  rows = []
  for config in (configs if configs is not None else [heuristic]):
    rep = compiler.compile(lambda x, config=config: op.kernel(x, interpret=False, config=config), shapes)
    row = {"definition": op.name, "axes": {a: axes[a] for a in op.definition.var_axes if a in axes},
           "config": tuning.config_to_json(config), "heuristic": config == heuristic, "target": compiler.target,
           "status": rep.status, "compile_seconds": round(rep.compile_seconds, 2), "error": rep.error,
           "kernels": [dataclasses.asdict(k) for k in rep.kernels]}
    rows.append(row)
    if progress:
      progress(row)
  return rows


def format_rows(rows: Sequence[dict]) -> str:
  import tabulate  # pylint: disable=g-import-not-at-top
  table = []
  for r in rows:
    axes = ",".join(f"{k}={v}" for k, v in r["axes"].items())
    for k in r["kernels"] or [{"name": "-", "status": r["status"]}]:
      table.append([
          r["definition"], axes, json.dumps(r["config"], separators=(",", ":")) + (" *" if r["heuristic"] else ""),
          k["name"], _n(k.get("registers")), _kib(k.get("smem_bytes")),
          "-" if k.get("spill_stores") is None else f"{k['spill_stores']}/{k['spill_loads']}",
          k.get("matrix_ops") or "-",
          "-" if k.get("ctas_per_sm") is None else f"{k['ctas_per_sm']} ({k['occupancy_limit']})",
          f"{k.get('num_warps') or '-'}w", k["status"], f"{r['compile_seconds']:.1f}"])
  return tabulate.tabulate(table, headers=["definition", "axes", "config (* heuristic)", "kernel", "regs",
                                           "smem", "spill st/ld B", "mma", "CTA/SM", "warps", "status", "s"])


def _n(x) -> str:
  return "-" if x is None else str(x)


def main(argv: list[str]) -> None:
  from absl import app  # pylint: disable=g-import-not-at-top
  from absl import logging  # pylint: disable=g-import-not-at-top
  from jaxkern import selection  # pylint: disable=g-import-not-at-top

  logging.set_verbosity(logging.WARNING)  # jax's backend probing is noise here
  skip_cuda_checks()
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  reason = available()
  if reason:
    print(f"jaxkern.aot: {reason}", file=sys.stderr)
    sys.exit(2)
  try:
    ops = select_ops(_DEFINITION.value or [])
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  compiler = Compiler(_TARGET.value)
  print(f"target: {compiler.target} (sm_90a), ptxas {ptxas_binary()}", file=sys.stderr)
  rows = []
  for op in ops:
    axes = op.validated_axes(selection.parse_axes(_AXES.value) if _AXES.value else selection.largest_recorded_axes(op.definition))
    configs = op.candidate_configs(op.input_shapes(axes)) if _ALL_CANDIDATES.value else None
    rows += check_op(compiler, op, axes, configs, progress=lambda r: print(
        f"{r['definition']} {r['config']}: {r['status']} ({r['compile_seconds']:.1f} s)", file=sys.stderr, flush=True))
  if _JSON.value:
    print(json.dumps({"target": compiler.target, "limits": dataclasses.asdict(compiler.limits), "rows": rows},
                     indent=1))
  else:
    print(format_rows(rows))
    bad = [r for r in rows if r["status"] != OK]
    print(f"{len(rows) - len(bad)}/{len(rows)} configs compile clean for {compiler.target}"
          + "".join(f"\n  {r['definition']} {r['config']}: {r['status']} {r['error'][:300]}" for r in bad))
  sys.exit(0 if all(r["status"] == OK for r in rows) else 1)


if __name__ == "__main__":
  from absl import app as _app  # pylint: disable=g-import-not-at-top
  from absl import flags as _flags  # pylint: disable=g-import-not-at-top

  _DEFINITION = _flags.DEFINE_list("definition", [], "Definition names or prefixes (default: every implemented one).")
  _AXES = _flags.DEFINE_string("axes", "", "Variable axes, e.g. 'M=4096' (default: the largest recorded, by input bytes).")
  _ALL_CANDIDATES = _flags.DEFINE_bool("all_candidates", False, "Every sweep candidate, not just the heuristic's config.")
  _TARGET = _flags.DEFINE_string("target", DEFAULT_TARGET, "GPU target (a device name in the CUDA plugin, or a part of one).")
  _JSON = _flags.DEFINE_bool("json", False, "Print JSON instead of a table.")
  _app.run(main)
