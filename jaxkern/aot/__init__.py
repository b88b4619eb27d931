"""Compiles kernels for sm_90a (H100/H200) on a machine without a GPU and
reports, per Pallas kernel, what the GPU toolchain made of it.

Per kernel (one per `pallas_call`, named by its `name=`): registers per
thread, shared memory, spill stores/loads, whether the PTX uses wgmma or
mma.sync, the instruction mix (MMA instructions by kind against ALU
instructions, per k-step of the main loop: `jaxkern.aot.ptx`), an occupancy
estimate (CTAs per SM from registers x threads, shared memory and threads,
with the target's limits) and a status: `ok`, `spills`, `smem_overflow` or
`error`.

Modules: `toolchain` (plugin and ptxas discovery, the target in use, the
compile-only device and `Compiler`), `targets` (the target texts a plugin
embeds and those shipped for plugins without them), `parsing` (ptxas -v, XLA's thunk dump, the Triton
calls), `ptx` (the instruction mix), `report` (kernel and compile reports,
occupancy, status, table and markdown page), `cli` (`python -m jaxkern.aot`,
usage there). The public names are re-exported here.

The toolchain packages are the `aot` extra (`make install` installs it);
`available()` says why the tool cannot run when they are
missing. Parsing, the instruction mix and occupancy need nothing and are
tested everywhere.
"""

from jaxkern.aot.cli import check_op, main, select_ops
from jaxkern.aot.parsing import Launch, PtxasStats, parse_ptxas_verbose, parse_thunk_sequence
from jaxkern.aot.ptx import InstructionMix, KernelPtx, parse_ptx, ptx_matrix_ops
from jaxkern.aot.report import (
  ERROR,
  OK,
  SMEM_OVERFLOW,
  SPILLS,
  CompileReport,
  KernelReport,
  Limits,
  MosaicDump,
  build_reports,
  format_rows,
  kernel_status,
  markdown_page,
  markdown_section,
  occupancy,
  page_sections,
)
from jaxkern.aot.toolchain import (
  DEFAULT_TARGET,
  Compiler,
  available,
  libdevice_dir,
  plugin_library,
  plugin_version,
  ptxas_binary,
  ptxas_version,
  resolve_target,
  skip_cuda_checks,
  target_configs,
  target_origin,
)
from pallas_kernels.shared.lowering import TritonCall, triton_calls

__all__ = [
  "DEFAULT_TARGET",
  "ERROR",
  "OK",
  "SMEM_OVERFLOW",
  "SPILLS",
  "CompileReport",
  "Compiler",
  "InstructionMix",
  "KernelPtx",
  "KernelReport",
  "Launch",
  "Limits",
  "MosaicDump",
  "PtxasStats",
  "available",
  "build_reports",
  "check_op",
  "format_rows",
  "kernel_status",
  "libdevice_dir",
  "main",
  "markdown_page",
  "markdown_section",
  "occupancy",
  "page_sections",
  "parse_ptx",
  "parse_ptxas_verbose",
  "parse_thunk_sequence",
  "plugin_library",
  "plugin_version",
  "ptx_matrix_ops",
  "ptxas_binary",
  "ptxas_version",
  "resolve_target",
  "select_ops",
  "skip_cuda_checks",
  "target_configs",
  "target_origin",
  "TritonCall",
  "triton_calls",
]
