"""The instruction mix of PTX kernels: tensor-core (MMA) instructions by kind
against ALU instructions, per kernel and per k-step.

The k-step is one iteration of the kernel's main loop: the innermost loop
(a label and the last branch back to it) whose body holds MMA instructions;
of several such loops (a kernel with a fallback path), the one with the
most MMA instructions.
Its counts are static instructions in that body, i.e. what one iteration
issues per warp when no branch inside it is taken. A kernel with no such
loop (fully unrolled, or no MMA) has whole-kernel counts only.

Classes: `mma` (wgmma.mma_async, mma.sync, by kind: operation, shape and
input type, e.g. `wgmma.m64n256k16.bf16` or `wgmma.m64n128k32.e4m3`); ALU
(`int` and `float` arithmetic, `convert` (cvt), `bit` (logic, shifts,
permutes), `compare` (setp, selp)); `memory` (loads, stores, async copies,
ldmatrix); `other` (moves, barriers, branches, shuffles, wgmma fences).
Static PTX counts, not SASS: ptxas may still fuse or expand instructions.

Beside the mix, the Hopper machinery a warp-specialized kernel rests on
(`HopperEvidence`): the `setmaxnreg` register budgets, TMA copies
(`cp.async.bulk.tensor`, loads into and stores from shared memory), other
async copies, and the mbarrier operations by kind.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

_FLOAT_TYPE = re.compile(r"\.(?:b?f16(?:x2)?|f32(?:x2)?|f64|tf32)\b")
_ARITH = {
  "add",
  "sub",
  "mul",
  "mad",
  "fma",
  "div",
  "rem",
  "abs",
  "neg",
  "min",
  "max",
  "sad",
  "mul24",
  "mad24",
  "addc",
  "subc",
  "madc",
  "dp4a",
  "dp2a",
  "copysign",
  "cvta",
}
_FLOAT_ONLY = {"rcp", "sqrt", "rsqrt", "ex2", "lg2", "sin", "cos", "tanh", "testp"}
_BIT = {
  "and",
  "or",
  "xor",
  "not",
  "cnot",
  "shl",
  "shr",
  "shf",
  "lop3",
  "prmt",
  "bfe",
  "bfi",
  "bfind",
  "brev",
  "clz",
  "popc",
  "fns",
  "bmsk",
  "szext",
}
_COMPARE = {"setp", "set", "selp", "slct"}
_MEMORY = {
  "ld",
  "ldu",
  "st",
  "cp",
  "ldmatrix",
  "stmatrix",
  "atom",
  "red",
  "prefetch",
  "prefetchu",
  "mbarrier",
  "tensormap",
  "multimem",
}
ALU_CLASSES = ("int", "float", "convert", "bit", "compare")
_SHAPE = re.compile(r"^m\d+n\d+k\d+$")
_MMA_TYPES = {
  "f16",
  "bf16",
  "tf32",
  "f32",
  "f64",
  "e4m3",
  "e5m2",
  "e2m1",
  "e3m2",
  "e2m3",
  "s8",
  "u8",
  "s4",
  "u4",
  "b1",
  "s32",
}
_LABEL = re.compile(r"^([A-Za-z_$][\w$]*):(?!:)")
_INSTRUCTION = re.compile(r"^(?:@!?%?\w+\s+)?([a-z][\w.:]*)\s*(.*)$", re.S)
_ENTRY = re.compile(r"^\s*(?:\.visible\s+)?\.entry\s+(\w+)\s*\(", re.M)


@dataclasses.dataclass(frozen=True)
class Instruction:
  opcode: str  # the whole opcode token, e.g. `wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16`
  operands: str


def mma_kind(opcode: str) -> str | None:
  """`wgmma.m64n256k16.bf16` for a warpgroup MMA, `mma.m16n8k16.bf16` for
  mma.sync (both input types when they differ); None for anything else,
  wgmma fences and waits included."""
  parts = opcode.split(".")
  if parts[0] == "wgmma" and "mma_async" in parts:
    op, types = "wgmma", [p for p in parts if p in _MMA_TYPES][1:3]  # D, A, B
  elif parts[0] == "mma":
    op, types = "mma", [p for p in parts if p in _MMA_TYPES][1:3]  # D, A, B, C
  else:
    return None
  shape = next((p for p in parts if _SHAPE.match(p)), "?")
  inputs = types[0] if len(set(types)) == 1 else ".".join(types) or "?"
  return f"{op}.{shape}.{inputs}"


def classify(opcode: str) -> str:
  """One of `mma`, the ALU classes, `memory` or `other`."""
  base = opcode.split(".")[0]
  if mma_kind(opcode):
    return "mma"
  if base == "cvt":
    return "convert"
  if base in _BIT:
    return "bit"
  if base in _COMPARE:
    return "compare"
  if base in _FLOAT_ONLY:
    return "float"
  if base in _ARITH:
    return "float" if _FLOAT_TYPE.search(opcode) else "int"
  if base in _MEMORY:
    return "memory"
  return "other"


@dataclasses.dataclass
class InstructionMix:
  """Counts of one stretch of PTX (a kernel or a loop body)."""

  mma: dict[str, int] = dataclasses.field(default_factory=dict)  # kind -> count
  alu: dict[str, int] = dataclasses.field(default_factory=dict)  # ALU class -> count
  memory: int = 0
  other: int = 0

  @classmethod
  def of(cls, instructions: list[Instruction]) -> InstructionMix:
    mix = cls()
    for ins in instructions:
      kind = classify(ins.opcode)
      if kind == "mma":
        k = mma_kind(ins.opcode)
        assert k is not None  # classify says "mma" only for an MMA kind
        mix.mma[k] = mix.mma.get(k, 0) + 1
      elif kind in ALU_CLASSES:
        mix.alu[kind] = mix.alu.get(kind, 0) + 1
      elif kind == "memory":
        mix.memory += 1
      else:
        mix.other += 1
    return mix

  @property
  def mma_total(self) -> int:
    return sum(self.mma.values())

  @property
  def alu_total(self) -> int:
    return sum(self.alu.values())

  @property
  def alu_per_mma(self) -> float | None:
    return self.alu_total / self.mma_total if self.mma_total else None

  def to_json(self) -> dict[str, Any]:
    ratio = self.alu_per_mma
    return {
      "mma": dict(sorted(self.mma.items())),
      "mma_total": self.mma_total,
      "alu": {c: self.alu.get(c, 0) for c in ALU_CLASSES},
      "alu_total": self.alu_total,
      "alu_per_mma": None if ratio is None else round(ratio, 2),
      "memory": self.memory,
      "other": self.other,
    }


@dataclasses.dataclass
class HopperEvidence:
  """Static counts of one kernel's async machinery: `setmaxnreg` as
  `inc.232` / `dec.40`, TMA loads and stores, other `cp.async` copies, and
  mbarrier operations (`arrive`, `try_wait`, `expect_tx`, ...)."""

  setmaxnreg: list[str] = dataclasses.field(default_factory=list)
  tma_loads: int = 0
  tma_stores: int = 0
  cp_async: int = 0
  mbarrier: dict[str, int] = dataclasses.field(default_factory=dict)

  @classmethod
  def of(cls, instructions: list[Instruction]) -> HopperEvidence:
    ev = cls()
    for ins in instructions:
      parts = ins.opcode.split(".")
      if parts[0] == "setmaxnreg":
        budget = f"{parts[1]}.{ins.operands.strip().rstrip(',')}"
        if budget not in ev.setmaxnreg:
          ev.setmaxnreg.append(budget)
      elif ins.opcode.startswith("cp.async.bulk.tensor"):
        # cp.async.bulk.tensor.Nd.<dst>.<src>: a load lands in shared memory.
        if parts[5].startswith("shared"):
          ev.tma_loads += 1
        else:
          ev.tma_stores += 1
      elif (
        parts[0] == "cp"
        and parts[1] == "async"
        and parts[2] not in ("bulk", "commit_group", "wait_group", "wait_all", "mbarrier")
      ):
        ev.cp_async += 1
      elif parts[0] == "mbarrier":
        kind = "arrive.expect_tx" if parts[1] == "arrive" and "expect_tx" in parts else parts[1]
        ev.mbarrier[kind] = ev.mbarrier.get(kind, 0) + 1
    return ev

  def to_json(self) -> dict[str, Any]:
    return {
      "setmaxnreg": sorted(self.setmaxnreg),
      "tma_loads": self.tma_loads,
      "tma_stores": self.tma_stores,
      "cp_async": self.cp_async,
      "mbarrier": dict(sorted(self.mbarrier.items())),
    }


@dataclasses.dataclass
class KernelPtx:
  """One `.entry` function: its instruction mix, the k-step's if it has a
  main loop, and its Hopper async machinery."""

  name: str
  kernel: InstructionMix
  k_step: InstructionMix | None
  hopper: HopperEvidence = dataclasses.field(default_factory=HopperEvidence)

  @property
  def matrix_ops(self) -> str:
    """`wgmma`, `mma` (mma.sync) or `none`."""
    ops = {k.split(".")[0] for k in self.kernel.mma}
    return "wgmma" if "wgmma" in ops else "mma" if "mma" in ops else "none"

  def to_json(self) -> dict[str, Any]:
    return {
      "kernel": self.kernel.to_json(),
      "k_step": self.k_step.to_json() if self.k_step else None,
      "hopper": self.hopper.to_json(),
    }


# Debug-line directives end at the line, without a `;`: left in, they would
# hide the instruction that follows them.
_LINE_DIRECTIVE = re.compile(r"^\s*\.(?:loc|file)\b[^\n]*$", re.M)


def _strip_comments(text: str) -> str:
  """The text without comments and debug-line directives."""
  return _LINE_DIRECTIVE.sub("", re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.S)))


def statements(body: str) -> list[tuple[str, Any]]:
  """The labels and instructions of a function body, in order:
  `("label", name)` or `("ins", Instruction)`. Directives (`.reg`, `.loc`)
  and the braces of inline-asm scopes are dropped."""
  out: list[tuple[str, Any]] = []
  for chunk in _strip_comments(body).split(";"):
    text = chunk.strip()
    while True:
      text = text.lstrip("{}").strip()
      m = _LABEL.match(text)
      if not m:
        break
      out.append(("label", m.group(1)))
      text = text[m.end() :]
    if not text or text.startswith("."):
      continue
    m = _INSTRUCTION.match(text)
    if m:
      out.append(("ins", Instruction(m.group(1), " ".join(m.group(2).split()))))
  return out


def loops(stmts: list[tuple[str, Any]]) -> list[tuple[int, int]]:
  """(first, last) statement indices of each loop: a label and the last
  branch back to it."""
  seen: dict[str, int] = {}
  back: dict[str, int] = {}
  for i, (kind, value) in enumerate(stmts):
    if kind == "label":
      seen[value] = i
    elif value.opcode.split(".")[0] == "bra":
      target = value.operands.rstrip(",").split()[-1] if value.operands else ""
      if target in seen:
        back[target] = i
  return [(seen[label], last) for label, last in back.items()]


def kernel_ptx(name: str, body: str) -> KernelPtx:
  stmts = statements(body)
  instructions = [v for k, v in stmts if k == "ins"]
  k_step = None
  with_mma = []
  for first, last in loops(stmts):
    mix = InstructionMix.of([v for k, v in stmts[first : last + 1] if k == "ins"])
    if mix.mma_total:
      with_mma.append((first, last, mix))
  # The innermost loops that hold MMAs (no such loop inside them); of
  # several (a kernel with a fallback path), the one with the most MMAs.
  innermost = [
    (mix.mma_total, first - last, mix)
    for first, last, mix in with_mma
    if not any(first <= f and l <= last and (f, l) != (first, last) for f, l, _ in with_mma)
  ]
  if innermost:
    k_step = max(innermost, key=lambda t: t[:2])[2]
  return KernelPtx(name, InstructionMix.of(instructions), k_step, HopperEvidence.of(instructions))


def parse_ptx(ptx: str) -> dict[str, KernelPtx]:
  """Per `.entry` function of a PTX module, its instruction mix."""
  parts = _ENTRY.split(ptx)
  # Each body starts after the parameter list, at the function's opening brace.
  return {name: kernel_ptx(name, body[body.find("{") :]) for name, body in zip(parts[1::2], parts[2::2])}


def ptx_matrix_ops(ptx: str) -> dict[str, str]:
  """Per `.entry` function of a PTX module: `wgmma` (Hopper warpgroup MMA),
  `mma` (mma.sync) or `none`."""
  return {name: k.matrix_ops for name, k in parse_ptx(ptx).items()}
