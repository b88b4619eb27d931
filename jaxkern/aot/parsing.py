"""Parsers of the toolchain's text: `ptxas -v` (registers, spills, stack,
static shared memory), XLA's thunk dump (each kernel's launch) and the
lowered module's Triton calls (name, stages, warps). The PTX itself is
read by `jaxkern.aot.ptx`."""

from __future__ import annotations

import dataclasses
import math
import re


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


@dataclasses.dataclass(frozen=True)
class Launch:
  name: str
  grid: tuple[int, ...]
  threads: int
  smem_bytes: int


_THUNK_RE = re.compile(
  r"kCustomKernel.*?\]\s+(\S+)\s+grid:\s*\[([\d,\s]+)\]\s+threads:\s*\[([\d,\s]+)\]"
  r"\s+shared_memory:\s*(\d+)"
)


def parse_thunk_sequence(text: str) -> list[Launch]:
  """The custom (Triton) kernel launches of XLA's `*thunk_sequence.txt` dump."""
  out = []
  for m in _THUNK_RE.finditer(text):
    grid = tuple(int(x) for x in m.group(2).split(","))
    threads = math.prod(int(x) for x in m.group(3).split(","))
    out.append(Launch(m.group(1), grid, threads, int(m.group(4))))
  return out
