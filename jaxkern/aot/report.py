"""What the toolchain made of each kernel: per-kernel and per-compile
reports, the occupancy estimate, the status, and their table and markdown."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from jaxkern.aot.parsing import Launch, PtxasStats
from jaxkern.aot.ptx import ALU_CLASSES, KernelPtx
from pallas_kernels.shared.device import SHARED_MEMORY_PER_BLOCK
from pallas_kernels.shared.lowering import MosaicGpuCall, TritonCall

OK, SPILLS, SMEM_OVERFLOW, ERROR = "ok", "spills", "smem_overflow", "error"


@dataclasses.dataclass(frozen=True)
class Limits:
  """Per-SM resources of a target (defaults: H100/H200, sm_90)."""

  threads_per_sm: int = 2048
  registers_per_sm: int = 65536
  smem_per_sm: int = 233472  # 228 KiB
  smem_per_block: int = SHARED_MEMORY_PER_BLOCK  # 227 KiB opt-in maximum per CTA
  max_ctas_per_sm: int = 32
  smem_reserved_per_cta: int = 1024  # the driver's per-CTA reservation
  register_granularity: int = 256  # registers are allocated per warp in these units
  max_registers_per_thread: int = 255

  @classmethod
  def from_target_config(cls, text: str) -> Limits:
    """The limits a `GpuTargetConfigProto` text states; defaults otherwise."""

    def field(name, default):
      m = re.search(rf"^\s*{name}: (\d+)", text, re.M)
      return int(m.group(1)) if m else default

    d = cls()
    return dataclasses.replace(
      d,
      threads_per_sm=field("threads_per_core_limit", d.threads_per_sm),
      registers_per_sm=field("registers_per_core_limit", d.registers_per_sm),
      smem_per_sm=field("shared_memory_per_core", d.smem_per_sm),
      smem_per_block=field("shared_memory_per_block_optin", d.smem_per_block),
    )


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
    "smem": (
      limits.smem_per_sm // (smem_bytes + limits.smem_reserved_per_cta) if smem_bytes <= limits.smem_per_block else 0
    ),
    "ctas": limits.max_ctas_per_sm,
  }
  limiter = min(bounds, key=lambda k: (bounds[k], list(bounds).index(k)))
  return bounds[limiter], limiter


@dataclasses.dataclass
class KernelReport:
  name: str
  status: str = OK
  registers: int | None = None
  smem_bytes: int | None = None  # dynamic (Triton) + static
  spill_stores: int | None = None
  spill_loads: int | None = None
  stack_frame: int | None = None
  matrix_ops: str | None = None  # wgmma | mma | none
  threads: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  grid: tuple[int, ...] | None = None
  ctas_per_sm: int | None = None
  occupancy_limit: str | None = None
  ptxas_ms: float | None = None
  instruction_mix: dict[str, Any] | None = None  # KernelPtx.to_json(): {"kernel": ..., "k_step": ...}
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

  @property
  def message(self) -> str:
    """The compiler's own message when the compile failed (its first lines:
    the one no kernel accounts for, else the first kernel's), or ""."""
    text = self.error or next((k.error for k in self.kernels if k.error), "")
    return first_lines(text)

  def summary(self) -> str:
    """One line: each kernel's registers / smem / spills, then the status and
    the compiler's message (first line) unless it compiled clean."""
    parts = []
    for k in self.kernels:
      if k.registers is None:
        parts.append(f"{k.name}: {k.status}")
      else:
        parts.append(
          f"{k.name}: {k.registers} regs, {_kib(k.smem_bytes)} smem, "
          f"spills {k.spill_stores}/{k.spill_loads} B, {k.matrix_ops}, {_n(k.ctas_per_sm)} CTA/SM"
        )
    if self.ok:
      return "; ".join(parts)
    first = self.message.split("\n", 1)[0]
    verdict = f"[{self.status}]" + (f": {first}" if first else "")
    return " ".join(["; ".join(parts), verdict]) if parts else verdict


def first_lines(text: str, lines: int = 3, width: int = 300) -> str:
  """The first `lines` non-blank lines of a message, each cut at `width`."""
  kept = [line.rstrip() for line in text.strip().splitlines() if line.strip()][:lines]
  return "\n".join(line if len(line) <= width else line[:width] + " ..." for line in kept)


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


@dataclasses.dataclass(frozen=True)
class MosaicDump:
  """What the CUDA plugin's dump (`MOSAIC_GPU_DUMP_TO`) holds for one Mosaic
  GPU kernel it compiled: the kernel entry's name, its ptxas statistics and
  its PTX."""

  entry: str
  stats: PtxasStats
  ptx: KernelPtx | None = None


def _mosaic_gpu_report(call: MosaicGpuCall, dump: MosaicDump | None, limits: Limits, error: str) -> KernelReport:
  """A Mosaic GPU call's report from the plugin's dump of its kernel (the
  lowering names no kernel, grid or warps)."""
  k = KernelReport(name=dump.entry if dump else f"mosaic_gpu{call.operands} -> {call.results}")
  if dump is None:
    k.error = error or "no ptxas record for this Mosaic GPU kernel (MOSAIC_GPU_DUMP_TO)"
  else:
    stats = dump.stats
    k.registers, k.spill_stores, k.spill_loads = stats.registers, stats.spill_stores, stats.spill_loads
    # Mosaic GPU's scratch is dynamic shared memory, sized at launch and not
    # in ptxas's static figure; its lowering refuses a kernel over the
    # per-CTA limit, so a compiled one fits.
    k.stack_frame, k.ptxas_ms, k.smem_bytes = stats.stack_frame, stats.ptxas_ms, None
    if dump.ptx is not None:
      k.matrix_ops, k.instruction_mix = dump.ptx.matrix_ops, dump.ptx.to_json()
  k.status = kernel_status(k, limits)
  return k


def build_reports(
  calls: Sequence[TritonCall | MosaicGpuCall],
  launches: Sequence[Launch],
  ptxas: Mapping[str, PtxasStats],
  ptx: Mapping[str, KernelPtx],
  limits: Limits,
  error: str = "",
  mosaic: Sequence[MosaicDump | None] | None = None,
) -> list[KernelReport]:
  """Joins what the lowering (names, warps, stages), XLA's thunks (launch),
  ptxas and the PTX said about each Pallas kernel, by name and in order. The
  i-th Mosaic GPU call takes `mosaic[i]` (the plugin's dump of its kernel),
  or without `mosaic` the next `ptxas` entry no Triton call claims.

  A call XLA compiled without launching it (when the compile succeeded and
  other kernels launched: one whose result is unused, or a repeat of an
  identical call that XLA merged, as jax 0.11.2's lowering of a gradient
  leaves them) gets no report: a report is a launched kernel."""
  # XLA may suffix repeated kernel names; match each call to the first unused
  # launch whose name starts with it.
  unused = list(launches)
  launched: set[str] = set()
  triton_names = [c.name for c in calls if isinstance(c, TritonCall)]
  if mosaic is None:
    mosaic = [MosaicDump(e, s, ptx.get(e)) for e, s in ptxas.items() if not any(e.startswith(n) for n in triton_names)]
  dumps = iter(mosaic)
  reports = []
  for call in calls:
    if isinstance(call, MosaicGpuCall):
      reports.append(_mosaic_gpu_report(call, next(dumps, None), limits, error))
      continue
    name, num_stages, num_warps = call.name, call.num_stages, call.num_warps
    launch = next((l for l in unused if l.name == name), None) or next(
      (l for l in unused if l.name.startswith(name)), None
    )
    if launch is not None:
      unused.remove(launch)
      launched.add(name)
    elif not error and launches and (name in launched or name not in ptxas):
      continue
    entry = launch.name if launch else name
    stats = ptxas.get(entry)
    k = KernelReport(name=name, num_warps=num_warps, num_stages=num_stages)
    if launch is not None:
      k.grid, k.threads, k.smem_bytes = launch.grid, launch.threads, launch.smem_bytes
    if stats is not None:
      k.registers, k.spill_stores, k.spill_loads = stats.registers, stats.spill_stores, stats.spill_loads
      k.stack_frame, k.ptxas_ms = stats.stack_frame, stats.ptxas_ms
      k.smem_bytes = (k.smem_bytes or 0) + stats.static_smem
      if entry in ptx:
        k.matrix_ops, k.instruction_mix = ptx[entry].matrix_ops, ptx[entry].to_json()
    if stats is None or launch is None:
      k.error = error or "no ptxas/launch record for this kernel"
    if k.registers is not None:
      threads = k.threads or num_warps * 32
      k.ctas_per_sm, k.occupancy_limit = occupancy(k.registers, threads, k.smem_bytes or 0, limits)
    k.status = kernel_status(k, limits)
    reports.append(k)
  return reports


# -- tables -------------------------------------------------------------------


def _kib(n: int | None) -> str:
  return "-" if n is None else f"{n / 1024:.1f} KiB"


def _n(x) -> str:
  return "-" if x is None else str(x)


def mix_cells(mix: Mapping[str, Any] | None) -> list[str]:
  """[MMA, ALU, ALU/MMA] of a kernel's `instruction_mix` (the k-step's when
  it has a main loop, else the whole kernel's, marked `(kernel)`)."""
  if not mix:
    return ["-", "-", "-"]
  part, scope = (mix["k_step"], "") if mix.get("k_step") else (mix["kernel"], " (kernel)")
  mma = " + ".join(f"{n} {kind}" for kind, n in part["mma"].items()) or "0"
  alu = f"{part['alu_total']} ({'/'.join(str(part['alu'][c]) for c in ALU_CLASSES)})"
  ratio = "-" if part["alu_per_mma"] is None else f"{part['alu_per_mma']:g}"
  return [mma + scope, alu, ratio]


def _kernel_lines(rows: Sequence[dict]):
  """(row, kernel dict) per kernel of each row; a row without kernels once."""
  for r in rows:
    for k in r["kernels"] or [{"name": "-", "status": r["status"]}]:
      yield r, k


def _spills(k: Mapping[str, Any]) -> str:
  return "-" if k.get("spill_stores") is None else f"{k['spill_stores']}/{k['spill_loads']}"


def format_rows(rows: Sequence[dict]) -> str:
  """The terminal table: one line per kernel of each compiled config."""
  import tabulate

  table = []
  for r, k in _kernel_lines(rows):
    axes = ",".join(f"{a}={v}" for a, v in r["axes"].items())
    table.append(
      [
        r["definition"],
        axes,
        json.dumps(r["config"], separators=(",", ":")) + (" *" if r["heuristic"] else ""),
        k["name"],
        _n(k.get("registers")),
        _kib(k.get("smem_bytes")),
        _spills(k),
        k.get("matrix_ops") or "-",
        "-" if k.get("ctas_per_sm") is None else f"{k['ctas_per_sm']} ({k['occupancy_limit']})",
        f"{k.get('num_warps') or '-'}w",
        *mix_cells(k.get("instruction_mix")),
        k["status"],
        f"{r['compile_seconds']:.1f}",
      ]
    )
  return tabulate.tabulate(
    table,
    headers=[
      "definition",
      "axes",
      "config (* heuristic)",
      "kernel",
      "regs",
      "smem",
      "spill st/ld B",
      "mma",
      "CTA/SM",
      "warps",
      "MMA per k-step",
      "ALU per k-step (" + "/".join(ALU_CLASSES) + ")",
      "ALU/MMA",
      "status",
      "s",
    ],
  )


PAGE_TITLE = "# sm_90a compile of the kernels (no GPU)"
_SECTION_RE = re.compile(r"^## jax (\S+)", re.M)


def markdown_section(
  rows: Sequence[dict], *, target: str, toolchain: str, jax_version: str, command: str, date: str
) -> str:
  """One toolchain's part of the page: `## jax <version>`, how it was made
  (`toolchain`: plugin, ptxas and where the target text came from), and one
  table line per kernel of each compiled config."""
  clean = sum(r["status"] == OK for r in rows)
  lines = [
    f"## jax {jax_version}",
    "",
    f"Generated by `{command}` on {date}: jax {jax_version}, {toolchain}; "
    "XLA's Triton, the plugin's Mosaic GPU and ptxas for "
    f"`{target}` (sm_90a), compiled on a machine without a GPU. "
    f"{clean}/{len(rows)} configs compile clean (no spills, no shared-memory overflow, no error).",
    "",
    "| definition | axes | config | kernel | grid | registers | shared memory | spills (st/ld B) "
    "| tensor cores | CTAs/SM | MMA per k-step | ALU per k-step (" + "/".join(ALU_CLASSES) + ") | ALU/MMA | status |",
    "|" + " --- |" * 14,
  ]
  for r, k in _kernel_lines(rows):
    axes = ", ".join(f"{a}={v}" for a, v in r["axes"].items())
    config = json.dumps(r["config"], separators=(",", ":")) + ("" if r["heuristic"] else " (candidate)")
    grid = "-" if not k.get("grid") else "x".join(str(g) for g in k["grid"])
    cells = [
      f"`{r['definition']}`",
      axes,
      f"`{config}`",
      f"`{k['name']}`",
      grid,
      _n(k.get("registers")),
      _kib(k.get("smem_bytes")),
      _spills(k),
      k.get("matrix_ops") or "-",
      "-" if k.get("ctas_per_sm") is None else f"{k['ctas_per_sm']} ({k['occupancy_limit']})",
      *mix_cells(k.get("instruction_mix")),
      k["status"],
    ]
    lines.append("| " + " | ".join(cells) + " |")
  hopper = [(r, k) for r, k in _kernel_lines(rows) if _uses_async_machinery(k)]
  if hopper:
    lines += [
      "",
      "Warp-specialized kernels (Mosaic GPU's shared memory is dynamic: its lowering refuses a "
      "kernel over the per-CTA limit): register budgets (`setmaxnreg`), TMA copies and mbarrier "
      "operations, static PTX counts.",
      "",
      "| definition | axes | config | setmaxnreg | TMA loads / stores | cp.async | mbarrier |",
      "|" + " --- |" * 7,
    ]
    for r, k in hopper:
      h = k["instruction_mix"]["hopper"]
      axes = ", ".join(f"{a}={v}" for a, v in r["axes"].items())
      config = json.dumps(r["config"], separators=(",", ":")) + ("" if r["heuristic"] else " (candidate)")
      barriers = ", ".join(f"{n} {op}" for op, n in h["mbarrier"].items()) or "-"
      lines.append(
        f"| `{r['definition']}` | {axes} | `{config}` | {' '.join(h['setmaxnreg']) or '-'} | "
        f"{h['tma_loads']} / {h['tma_stores']} | {h['cp_async']} | {barriers} |"
      )
  errors = [
    f"- `{r['definition']}` {json.dumps(r['config'])}: {r['status']}: {r['error'][:300]}"
    for r in rows
    if r["status"] != OK
  ]
  if errors:
    lines += ["", "### Not clean", "", *errors]
  return "\n".join(lines) + "\n"


def _uses_async_machinery(k: Mapping[str, Any]) -> bool:
  h = (k.get("instruction_mix") or {}).get("hopper") or {}
  return bool(h.get("setmaxnreg") or h.get("tma_loads") or h.get("tma_stores"))


def page_sections(page: str) -> dict[str, str]:
  """jax version -> its section, of a page `markdown_page` wrote."""
  starts = [(m.start(), m.group(1)) for m in _SECTION_RE.finditer(page)]
  ends = [start for start, _ in starts[1:]] + [len(page)]
  return {version: page[start:end].rstrip("\n") + "\n" for (start, version), end in zip(starts, ends)}


def _version_key(version: str) -> tuple:
  return tuple(int(p) if p.isdigit() else p for p in re.split(r"[.+]", version))


def markdown_page(sections: Mapping[str, str]) -> str:
  """The generated page (docs/perf/sm90a_compile.md): what the columns
  mean, then one `markdown_section` per jax version, oldest first."""
  lines = [
    PAGE_TITLE,
    "",
    "One section per jax version and its toolchain (README: `jaxkern.aot`); each is rewritten by the "
    "command it names, run in an environment with that jax and the `aot` extra, which keeps the other "
    "versions' sections. Do not edit by hand.",
    "",
    "Per kernel: registers per thread, shared memory (dynamic + static), spill stores/loads in bytes, "
    "the tensor-core instructions of the PTX, CTAs per SM (and what limits them), and the instruction mix "
    "of one k-step: one iteration of the kernel's main loop (the innermost loop whose body holds MMA "
    "instructions), static PTX counts per warp. `(kernel)`: no such loop, counts of the whole kernel. "
    "ALU = integer and float arithmetic, conversions (cvt), bit operations, compares/selects; address "
    "arithmetic counts as integer ALU.",
  ]
  return "\n".join(lines) + "\n" + "".join("\n" + sections[v] for v in sorted(sections, key=_version_key))
