"""`jaxkern.aot`: the parsing, instruction-mix and occupancy logic always;
real sm_90a compiles only when the `aot` extra (CUDA plugin + ptxas) is
installed."""

import dataclasses
import json
import pathlib
import subprocess
import sys

import pytest

from jaxkern import aot, selection
from jaxkern.aot.cli import not_clean_line
from pallas_kernels.shared.lowering import MosaicGpuCall

# Captured from the tool's ptxas wrapper (ptxas 12.9, XLA's Triton, jax
# 0.12.0.1): the router at M=1 before its epilogue was made spill-free.
PTXAS_V = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'moe_router_partial_logits' for 'sm_90a'
ptxas info    : Function properties for moe_router_partial_logits
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 160 registers, used 1 barriers
ptxas info    : Compile time = 245.040 ms
ptxas warning : Registers are spilled to local memory in function 'moe_router_reduce_route', 228 bytes spill stores, 228 bytes spill loads
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'moe_router_reduce_route' for 'sm_90a'
ptxas info    : Function properties for moe_router_reduce_route
    208 bytes stack frame, 228 bytes spill stores, 228 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 208 bytes cumulative stack size, 16 bytes smem
ptxas info    : Compile time = 3491.152 ms
"""

THUNKS = """\
001: kCustomKernel [source       | next=002 (1)] moe_router_partial_logits grid: [1, 80, 1] threads: [128, 1, 1]  shared_memory: 67584 bytes
002: kCustomKernel [prev=001 (1) | sink        ] moe_router_reduce_route grid: [1, 1, 1] threads: [128, 1, 1]  shared_memory: 512 bytes
"""

PTX = """\
.version 8.7
.target sm_90a
.extern .shared .align 16 .b8 global_smem[];
.visible .entry gemm(
\t.param .u64 gemm_param_0
)
{
\twgmma.fence.sync.aligned;
\twgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, 1, 1, 1, 0, 0;
}
.visible .entry ampere(
)
{
\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1}, {%r1}, {%r2}, {%f2};
}
.entry plain(
)
{
\tld.global.f32 %f1, [%rd1];
}
"""

STABLEHLO = (
  'stablehlo.custom_call @"__gpu$xla.gpu.triton"(%0) {backend_config = {debug = false, grid_x = 1 : i32, '
  'grid_y = 80 : i32, grid_z = 1 : i32, ir = "ML\\EFR...", name = "moe_router_partial_logits", '
  "num_stages = 2 : i32, num_warps = 4 : i32}} ...\n"
  'stablehlo.custom_call @"__gpu$xla.gpu.triton"(%1) {backend_config = {debug = false, grid_x = 1 : i32, '
  'grid_y = 1 : i32, grid_z = 1 : i32, ir = "ML\\EFR...", name = "moe_router_reduce_route", '
  "num_stages = 1 : i32, num_warps = 4 : i32}}\n"
)


def test_parse_ptxas_verbose():
  stats = aot.parse_ptxas_verbose(PTXAS_V)
  assert set(stats) == {"moe_router_partial_logits", "moe_router_reduce_route"}
  a, b = stats["moe_router_partial_logits"], stats["moe_router_reduce_route"]
  assert (a.registers, a.spill_stores, a.spill_loads, a.stack_frame, a.static_smem) == (160, 0, 0, 0, 0)
  assert (b.registers, b.spill_stores, b.spill_loads, b.stack_frame, b.static_smem) == (255, 228, 228, 208, 16)
  assert b.ptxas_ms == pytest.approx(3491.152)


def test_ptx_matrix_ops_per_entry():
  assert aot.ptx_matrix_ops(PTX) == {"gemm": "wgmma", "ampere": "mma", "plain": "none"}


def test_parse_thunks_and_triton_calls():
  launches = aot.parse_thunk_sequence(THUNKS)
  assert launches == [
    aot.Launch("moe_router_partial_logits", (1, 80, 1), 128, 67584),
    aot.Launch("moe_router_reduce_route", (1, 1, 1), 128, 512),
  ]
  assert aot.triton_calls(STABLEHLO) == [
    aot.TritonCall("moe_router_partial_logits", (1, 80, 1), 4, 2),
    aot.TritonCall("moe_router_reduce_route", (1, 1, 1), 4, 1),
  ]


# A k-loop in the shape XLA's Triton writes it: address arithmetic, an
# inline-asm scope with its own predicate, e2m1-style decode (bit ops,
# conversions, float scaling), two e4m3 wgmma and one bf16 wgmma, and a
# predicated branch back to the loop label. Before and after the loop: code
# that must not count in the k-step.
KLOOP = """\
.visible .entry gemm_fp8(
\t.param .u64 gemm_fp8_param_0
)
{
\t.reg .b32 %r<100>;
\tld.param::entry.b64 \t%rd1, [gemm_fp8_param_0];
\tmov.b32 \t%r1, 0;
$L__BB0_1:
\tadd.s32 \t%r2, %r1, 1;          // loop counter
\tmul.wide.s32 \t%rd2, %r2, 2;
\tld.shared.b16 \t%rs1, [%rd2+16];
\tshr.u32 \t%r3, %r2, 4;
\tand.b32 \t%r4, %r3, 7;
\tlop3.b32 \t%r5, %r4, %r3, 240, 0xf8;
\tprmt.b32 \t%r6, %r5, 0, 0x3340;
\tcvt.rn.f16x2.e4m3x2 \t%r7, %rs1;
\tcvt.f32.f16 \t%r8, %rs1;
\tfma.rn.f32 \t%r9, %r8, %r8, %r8;
\tmul.rn.f32 \t%r10, %r9, %r8;
\tex2.approx.f32 \t%r11, %r10;
\tsetp.lt.s32 \t%p1, %r2, 64;
\tselp.b32 \t%r12, %r4, %r5, %p1;
\twgmma.fence.sync.aligned;
\t// begin inline asm
\t{
\t.reg .pred p;
\tsetp.ne.b32 p, %r12, 0;
\twgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%r20,%r21,
\t%r22,%r23}, %rd3, %rd4, p, 1, 1;
\t}
\t// end inline asm
\t/* a block comment with wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 inside */
\twgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%r20,%r21,%r22,%r23}, %rd5, %rd6, p, 1, 1;
\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r24}, %rd5, %rd6, p, 1, 1, 0, 0;
\twgmma.commit_group.sync.aligned;
\twgmma.wait_group.sync.aligned 1;
\tcp.async.cg.shared.global [ %r30 + 0 ], [ %rd7 + 0 ], 0x10, %p1;
\tbar.sync \t0;
\tmov.b32 \t%r1, %r2;
\t@%p1 bra \t$L__BB0_1;
\tcvt.rn.bf16x2.f32 \t%r40, %r20, %r21;
\tst.global.v4.b32 \t[%rd1], {%r40, %r40, %r40, %r40};
\tret;
}
"""

# mma.sync in straight-line code inside an outer loop without MMA in a
# nested inner loop: the innermost loop holding MMAs is the k-step.
NESTED = """\
.visible .entry attn(
)
{
$L__BB1_1:
\tadd.s32 \t%r1, %r1, 1;
\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1,%f2,%f3,%f4}, {%r1,%r2,%r3,%r4}, {%r5,%r6}, {%f1,%f2,%f3,%f4};
$L__BB1_2:
\tmma.sync.aligned.m16n8k32.row.col.f32.e4m3.e5m2.f32 {%f1,%f2,%f3,%f4}, {%r1,%r2,%r3,%r4}, {%r5,%r6}, {%f1,%f2,%f3,%f4};
\tsub.f32 \t%f9, %f1, %f2;
\tsetp.ne.s32 \t%p2, %r1, 0;
\t@%p2 bra.uni \t$L__BB1_2;
\t@!%p3 bra \t$L__BB1_1;
\tret;
}
.entry straight(
)
{
\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1}, {%r1}, {%r2}, {%f2};
\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1}, {%r1}, {%r2}, {%f2};
\txor.b32 \t%r9, %r1, %r2;
\tbra.uni \t$L__BB2_9;
$L__BB2_9:
\tret;
}
"""

# Two sibling MMA loops (a fast path and its fallback, as the grouped GEMM's
# folded f16 loop and its fp8 one): the k-step is the loop with more MMAs,
# even when the other is shorter.
SIBLINGS = """\
.visible .entry fallback(
)
{
$L__BB3_1:
\tmma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%f1,%f2,%f3,%f4}, {%r1,%r2,%r3,%r4}, {%r5,%r6}, {%f1,%f2,%f3,%f4};
\t@%p1 bra \t$L__BB3_1;
$L__BB3_2:
\tmma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1,%f2,%f3,%f4}, {%r1,%r2,%r3,%r4}, {%r5,%r6}, {%f1,%f2,%f3,%f4};
\tmma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1,%f2,%f3,%f4}, {%r1,%r2,%r3,%r4}, {%r5,%r6}, {%f1,%f2,%f3,%f4};
\tadd.s32 \t%r1, %r1, 1;
\tcvt.rn.f16x2.e4m3x2 \t%r7, %rs1;
\t@%p2 bra \t$L__BB3_2;
\tret;
}
"""


@pytest.mark.parametrize(
  "opcode,kind",
  [
    ("add.s32", "int"),
    ("mul.wide.s32", "int"),
    ("mad.lo.s64", "int"),
    ("cvta.to.global.u64", "int"),
    ("add.f32", "float"),
    ("fma.rn.f32", "float"),
    ("max.bf16x2", "float"),
    ("ex2.approx.ftz.f32", "float"),
    ("rcp.approx.f32", "float"),
    ("cvt.rn.bf16x2.f32", "convert"),
    ("cvt.u64.u32", "convert"),
    ("lop3.b32", "bit"),
    ("prmt.b32", "bit"),
    ("shl.b64", "bit"),
    ("and.pred", "bit"),
    ("bfe.u32", "bit"),
    ("setp.lt.s32", "compare"),
    ("selp.f32", "compare"),
    ("ld.global.v4.b32", "memory"),
    ("cp.async.cg.shared.global", "memory"),
    ("ldmatrix.sync.aligned.m8n8.x4.shared.b16", "memory"),
    ("st.shared.b8", "memory"),
    ("mov.b32", "other"),
    ("bar.sync", "other"),
    ("bra.uni", "other"),
    ("shfl.sync.idx.b32", "other"),
    ("wgmma.fence.sync.aligned", "other"),
    ("wgmma.wait_group.sync.aligned", "other"),
    ("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16", "mma"),
    ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "mma"),
  ],
)
def test_classify_opcodes(opcode, kind):
  assert aot.ptx.classify(opcode) == kind


def test_mma_kinds():
  kind = aot.ptx.mma_kind
  assert kind("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16") == "wgmma.m64n256k16.bf16"
  assert kind("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3") == "wgmma.m64n128k32.e4m3"
  assert kind("wgmma.mma_async.sync.aligned.m64n128k32.f16.e4m3.e5m2") == "wgmma.m64n128k32.e4m3.e5m2"
  assert kind("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == "mma.m16n8k16.bf16"
  assert kind("wgmma.commit_group.sync.aligned") is None and kind("mov.b32") is None


def test_instruction_mix_of_a_k_loop():
  """The k-step is the loop body only; comments, directives and inline-asm
  braces do not count; a wgmma split over two lines counts once."""
  [(name, k)] = aot.parse_ptx(KLOOP).items()
  assert name == "gemm_fp8" and k.matrix_ops == "wgmma"
  step = k.k_step.to_json()
  assert step["mma"] == {"wgmma.m64n128k32.e4m3": 2, "wgmma.m64n64k16.bf16": 1} and step["mma_total"] == 3
  # int: add, mul.wide; float: fma, mul, ex2; convert: 2 cvt; bit: shr, and, lop3, prmt;
  # compare: setp, selp and the inline scope's setp.
  assert step["alu"] == {"int": 2, "float": 3, "convert": 2, "bit": 4, "compare": 3}
  assert step["alu_total"] == 14 and step["alu_per_mma"] == pytest.approx(14 / 3, abs=0.01)
  assert (step["memory"], step["other"]) == (2, 6)  # ld, cp.async; fence, commit, wait, bar, mov, bra
  whole = k.kernel.to_json()
  assert whole["mma_total"] == 3 and whole["alu"]["convert"] == 3 and whole["memory"] == 4
  assert whole["other"] == 8  # + the mov before the loop and ret


WARP_SPECIALIZED = """\
.visible .entry ws(
	.param .u64 ws_param_0
)
{
	.loc	1 171 6
	// begin inline asm
	setmaxnreg.dec.sync.aligned.u32 40;
	// end inline asm
	.loc	1 172 6
	mbarrier.init.shared::cta.b64 [%r1], 2;
	mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%r1], 16384;
	cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%r2], [%rd1, {%r3, %r4}], [%r1];
	.loc	1 200 6
	setmaxnreg.inc.sync.aligned.u32 232;
	mbarrier.try_wait.parity.shared.b64 %p1, [%r1], %r5;
	mbarrier.arrive.release.cta.shared::cta.b64 _, [%r1];
	cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%rd2, {%r3, %r4}], [%r6];
	cp.async.ca.shared.global [%r7], [%rd3], 16;
	cp.async.commit_group;
	ret;
}
"""


def test_hopper_evidence_and_instructions_after_line_directives():
  """Register budgets, TMA loads and stores, plain cp.async and mbarrier
  kinds; an instruction right after a `.loc` line (which has no `;`) still
  counts."""
  [(name, k)] = aot.parse_ptx(WARP_SPECIALIZED).items()
  assert name == "ws"
  assert k.hopper.to_json() == {
    "setmaxnreg": ["dec.40", "inc.232"],
    "tma_loads": 1,
    "tma_stores": 1,
    "cp_async": 1,
    "mbarrier": {"arrive": 1, "arrive.expect_tx": 1, "init": 1, "try_wait": 1},
  }
  assert k.kernel.memory == 8  # 4 mbarrier, 2 bulk tensor copies, cp.async and its commit


def test_instruction_mix_innermost_mma_loop_and_straight_code():
  kernels = aot.parse_ptx(NESTED)
  attn, straight = kernels["attn"], kernels["straight"]
  assert attn.k_step.mma == {"mma.m16n8k32.e4m3.e5m2": 1}  # the inner loop, not the outer one
  assert attn.k_step.alu == {"float": 1, "compare": 1}
  assert attn.kernel.mma == {"mma.m16n8k16.bf16": 1, "mma.m16n8k32.e4m3.e5m2": 1} and attn.matrix_ops == "mma"
  # A forward branch is no loop: whole-kernel counts only.
  assert straight.k_step is None and straight.kernel.mma_total == 2 and straight.kernel.alu_per_mma == 0.5
  assert aot.ptx_matrix_ops(NESTED) == {"attn": "mma", "straight": "mma"}


def test_instruction_mix_of_sibling_mma_loops_is_the_one_with_more_mma():
  k = aot.parse_ptx(SIBLINGS)["fallback"]
  assert k.k_step.mma == {"mma.m16n8k16.f16": 2} and k.k_step.alu == {"int": 1, "convert": 1}
  assert k.kernel.mma_total == 3


def test_instruction_mix_in_table_json_and_markdown():
  ptx = aot.parse_ptx(KLOOP)
  limits = aot.Limits()
  stats = {"gemm_fp8": aot.PtxasStats(registers=168)}
  launches = [aot.Launch("gemm_fp8", (132, 1, 1), 256, 100 * 1024)]
  [k] = aot.build_reports([aot.TritonCall("gemm_fp8", (1, 1, 1), 8, 3)], launches, stats, ptx, limits)
  row = {
    "definition": "grouped",
    "axes": {"M": 6},
    "config": {"block_m": 64},
    "heuristic": True,
    "target": "H200",
    "status": k.status,
    "compile_seconds": 1.0,
    "error": "",
    "kernels": [json.loads(json.dumps(dataclasses.asdict(k)))],
  }
  assert row["kernels"][0]["instruction_mix"]["k_step"]["alu_per_mma"] == pytest.approx(4.67)
  table = aot.format_rows([row])
  assert "2 wgmma.m64n128k32.e4m3 + 1 wgmma.m64n64k16.bf16" in table and "14 (2/3/2/4/3)" in table
  section = aot.markdown_section(
    [row],
    target="NVIDIA H200",
    toolchain="ptxas 13.5",
    jax_version="0.12",
    command="python -m jaxkern.aot --markdown x.md",
    date="2026-12-01",
  )
  page = aot.markdown_page({"0.12": section})
  line = next(l for l in page.splitlines() if l.startswith("| `grouped`"))
  cells = [c.strip() for c in line.strip("|").split("|")]
  header = next(l for l in page.splitlines() if l.startswith("| definition"))
  assert len(cells) == len(header.strip("|").split("|"))
  assert cells[4:7] == ["132x1x1", "168", "100.0 KiB"] and cells[-4:] == [
    "2 wgmma.m64n128k32.e4m3 + 1 wgmma.m64n64k16.bf16",
    "14 (2/3/2/4/3)",
    "4.67",
    "ok",
  ]
  assert "1/1 configs compile clean" in page and "python -m jaxkern.aot --markdown x.md" in page
  assert "jax 0.12, ptxas 13.5;" in page


def test_markdown_page_keeps_other_versions_sections():
  """A page holds one section per jax version, oldest first; rewriting one
  keeps the others byte for byte."""

  def section(version, status):
    row = {
      "definition": "d",
      "axes": {"M": 1},
      "config": {"b": 1},
      "heuristic": True,
      "target": "H200",
      "status": status,
      "compile_seconds": 1.0,
      "error": "" if status == aot.OK else "boom",
      "kernels": [
        {"name": "k", "status": status, "registers": 40, "smem_bytes": 0, "spill_stores": 0, "spill_loads": 0}
      ],
    }
    return aot.markdown_section(
      [row], target="H200", toolchain="t", jax_version=version, command="c", date="2026-12-01"
    )

  page = aot.markdown_page({"0.12.0.1": section("0.12.0.1", aot.OK), "0.11.2": section("0.11.2", aot.SPILLS)})
  sections = aot.page_sections(page)
  assert list(sections) == ["0.11.2", "0.12.0.1"] and "### Not clean" in sections["0.11.2"]
  assert sections["0.12.0.1"] == section("0.12.0.1", aot.OK)
  sections["0.11.2"] = section("0.11.2", aot.OK)
  again = aot.page_sections(aot.markdown_page(sections))
  assert again["0.11.2"] == section("0.11.2", aot.OK) and again["0.12.0.1"] == section("0.12.0.1", aot.OK)
  assert aot.page_sections(aot.markdown_page({})) == {}


def test_command_line_defines_its_flags_only_when_run():
  """`python -m jaxkern.aot` parses its flags (importing the package defines
  none, so tools with flags of the same name can import it), and its plain
  `--help` lists every one with its default."""
  from absl import flags

  assert "markdown" not in flags.FLAGS
  out = subprocess.run(
    [sys.executable, "-m", "jaxkern.aot", "--help"],
    capture_output=True,
    text=True,
    timeout=120,
    check=False,
    cwd=pathlib.Path(__file__).parent.parent,
  )
  help_text = out.stdout
  for flag in ("--definition", "--axes", "--[no]all_candidates", "--target", "--[no]json", "--markdown"):
    assert flag in help_text, (flag, out.stderr[-2000:])
  for flag in ("--[no]backward", "--backend", "--[no]write_targets"):
    assert flag in help_text, flag
  assert "(default: 'NVIDIA H200 141GB HBM3e')" in help_text and "(default: 'pallas')" in help_text
  assert "--helpfull" in help_text and "--xla_" not in help_text  # the tool's own flags, not every module's


def test_compile_report_names_the_failure():
  """A failed compile's summary ends with its status and the compiler's
  message (first line), `message` keeps its first lines, and the command
  line's listing names definition, backend, kernel and config."""
  message = "ValueError: Mosaic GPU lowering failed\n  line two\n  line three\n  line four"
  k = aot.KernelReport("mosaic_gpu(...)", status=aot.ERROR, error=message)
  rep = aot.CompileReport([k], 0.5)
  assert rep.summary() == "mosaic_gpu(...): error [error]: ValueError: Mosaic GPU lowering failed"
  assert rep.message == "ValueError: Mosaic GPU lowering failed\n  line two\n  line three"
  assert aot.CompileReport([], 0.5, "Unsupported: no kernel takes these inputs").summary() == (
    "[error]: Unsupported: no kernel takes these inputs"
  )
  clean = aot.KernelReport("k", registers=32, spill_stores=0, spill_loads=0, matrix_ops="wgmma")
  assert aot.CompileReport([clean], 0.5).summary() == "k: 32 regs, - smem, spills 0/0 B, wgmma, - CTA/SM"
  assert aot.CompileReport([clean], 0.5).message == ""
  row = {
    "definition": "dense_gemm_bf16_nt_n4096_k4096",
    "backend": "mosaic_gpu",
    "config": {"block_m": 128},
    "status": "error",
    "error": rep.message,
    "kernels": [{"name": "anonymous_mosaic_gpu_kernel"}],
  }
  line = not_clean_line(row)
  assert line.startswith(
    'dense_gemm_bf16_nt_n4096_k4096 mosaic_gpu kernel anonymous_mosaic_gpu_kernel, config {"block_m": 128}: error'
  )
  assert "\n      ValueError: Mosaic GPU lowering failed\n        line two" in line and "line four" not in line


def test_mosaic_gpu_calls_carry_their_kernel_hash():
  """Calls of one kernel share a hash (the plugin compiles it once); the hash
  takes no part in equality."""
  from pallas_kernels.shared.lowering import mosaic_gpu_calls

  call = (
    '%0 = stablehlo.custom_call @mosaic_gpu_v2(%arg0) {backend_config = "", mhlo.backend_config = '
    '{kernel_hash = "\\D3\\A56", module = "ML\\EFR kernel_hash = x", use_custom_barrier = false}} : '
    "(tensor<16x128xbf16>) -> tensor<16x128xbf16>"
  )
  [a] = mosaic_gpu_calls(call)
  assert a.kernel_hash == "\\D3\\A56" and a.operands == ("tensor<16x128xbf16>",)
  assert a == MosaicGpuCall(("tensor<16x128xbf16>",), ("tensor<16x128xbf16>",))


def test_build_reports_takes_each_mosaic_gpu_calls_dump():
  """With the dumps matched per call, a repeated kernel (one dump, two
  calls) reports twice and a call without a dump is an error."""
  limits = aot.Limits()
  mosaic = MosaicGpuCall(("tensor<128xf32>",), ("tensor<16x128xf32>",))
  dump = aot.MosaicDump("mosaic_gpu_kernel", aot.PtxasStats(registers=168))
  first, second, missing = aot.build_reports([mosaic] * 3, [], {}, {}, limits, mosaic=[dump, dump, None])
  assert (first.name, first.registers, first.status) == (second.name, second.registers, second.status)
  assert first.status == aot.OK and missing.status == aot.ERROR and "MOSAIC_GPU_DUMP_TO" in missing.error


def test_module_sizes():
  for path in (pathlib.Path(aot.__file__).parent).glob("*.py"):
    assert len(path.read_text().splitlines()) <= 450, path.name


def test_occupancy():
  limits = aot.Limits()
  # 8 warps at 202 registers: 208 x 32 = 6656 per warp, 9 warps fit in 64K -> 1 CTA.
  assert aot.occupancy(202, 256, 144 * 1024, limits) == (1, "registers")
  # 4 warps at 160 registers: 5120 per warp, 12 warps -> 3 CTAs; 66 KiB smem (+1 KiB) -> 3 CTAs too.
  assert aot.occupancy(160, 128, 67584, limits) == (3, "registers")
  assert aot.occupancy(32, 128, 64 * 1024, limits) == (3, "smem")
  assert aot.occupancy(32, 1024, 0, limits) == (2, "threads")
  assert aot.occupancy(16, 32, 0, limits) == (32, "ctas")
  assert aot.occupancy(255, 128, 228 * 1024, limits) == (0, "smem")  # over the 227 KiB per-block maximum


def test_limits_from_target_config():
  text = """gpu_device_info {
  threads_per_block_limit: 1024
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  registers_per_core_limit: 65536
  shared_memory_per_block_optin: 232448
}"""
  assert aot.Limits.from_target_config(text) == aot.Limits()
  assert aot.Limits.from_target_config("").smem_per_block == 232448


def test_build_reports_joins_and_judges():
  limits = aot.Limits()
  ptx = {
    "moe_router_partial_logits": aot.KernelPtx(
      "moe_router_partial_logits", aot.InstructionMix(mma={"wgmma.m64n64k16.bf16": 4}), None
    )
  }
  reports = aot.build_reports(
    aot.triton_calls(STABLEHLO), aot.parse_thunk_sequence(THUNKS), aot.parse_ptxas_verbose(PTXAS_V), ptx, limits
  )
  a, b = reports
  assert (a.name, a.status, a.registers, a.smem_bytes, a.matrix_ops, a.num_stages) == (
    "moe_router_partial_logits",
    aot.OK,
    160,
    67584,
    "wgmma",
    2,
  )
  assert (a.ctas_per_sm, a.occupancy_limit) == (3, "registers")
  assert a.instruction_mix["kernel"]["mma"] == {"wgmma.m64n64k16.bf16": 4} and a.instruction_mix["k_step"] is None
  assert (b.status, b.spill_stores, b.smem_bytes, b.instruction_mix) == (aot.SPILLS, 228, 512 + 16, None)
  rep = aot.CompileReport(reports, 1.0)
  assert not rep.ok and rep.status == aot.SPILLS
  assert "moe_router_reduce_route: 255 regs" in rep.summary()


def test_build_reports_leave_out_calls_xla_did_not_launch():
  """A repeated call merged into the first and a call whose result is unused
  (no launch, no ptxas record) get no report when the compile succeeded; with
  a compile error every call is reported."""
  limits = aot.Limits()
  calls = [aot.TritonCall(n, (1, 1, 1), 4, 1) for n in ("fwd", "unused_out", "fwd", "bwd")]
  launches = [aot.Launch("fwd", (8, 1, 1), 128, 1024), aot.Launch("bwd", (8, 1, 1), 128, 2048)]
  stats = {"fwd": aot.PtxasStats(registers=64), "bwd": aot.PtxasStats(registers=96)}
  reports = aot.build_reports(calls, launches, stats, {}, limits)
  assert [(k.name, k.status, k.registers) for k in reports] == [("fwd", aot.OK, 64), ("bwd", aot.OK, 96)]
  failed = aot.build_reports(calls, [], {}, {}, limits, error="INTERNAL: boom")
  assert [k.status for k in failed] == [aot.ERROR] * 4
  [lost] = aot.build_reports(calls[:1], [aot.Launch("other", (1, 1, 1), 32, 0)], stats, {}, limits)
  assert lost.status == aot.ERROR and "no ptxas/launch record" in lost.error  # compiled, launch not found


def test_build_reports_errors_and_overflow():
  limits = aot.Limits()
  calls = [aot.TritonCall("flash_attention", (1, 1, 1), 8, 2)]
  [k] = aot.build_reports(calls, [], {}, {}, limits, error="INTERNAL: Shared memory size limit exceeded: 245760")
  assert k.status == aot.SMEM_OVERFLOW
  [k] = aot.build_reports(calls, [], {}, {}, limits, error="INTERNAL: boom")
  assert k.status == aot.ERROR
  big = [aot.Launch("flash_attention", (1, 1, 1), 256, 240 * 1024)]
  stats = {"flash_attention": aot.PtxasStats(registers=128)}
  [k] = aot.build_reports(calls, big, stats, {}, limits)
  assert k.status == aot.SMEM_OVERFLOW and k.ctas_per_sm == 0
  assert aot.CompileReport([], 0.5, "no kernel").status == aot.ERROR
  clean = aot.KernelReport("k", registers=32, spill_stores=0, spill_loads=0)
  assert aot.CompileReport([clean], 0.5, "XLA failed after the kernels").status == aot.ERROR
  assert aot.CompileReport([clean], 0.5).status == aot.OK


def test_build_reports_reads_a_mosaic_gpu_call_from_the_plugins_dump():
  """A Mosaic GPU call (no name in the lowering) takes the ptxas entry no
  Triton call claims; without one it is an error naming the dump."""
  limits = aot.Limits()
  mosaic = MosaicGpuCall(("tensor<128xf32>",), ("tensor<16x128xf32>",))
  calls = [aot.TritonCall("flash_attention", (1, 1, 1), 8, 2), mosaic]
  launches = [aot.Launch("flash_attention", (1, 1, 1), 256, 1024)]
  stats = {"flash_attention": aot.PtxasStats(registers=128), "mosaic_gpu_kernel": aot.PtxasStats(registers=168)}
  triton, mgpu = aot.build_reports(calls, launches, stats, {}, limits)
  assert (triton.name, triton.registers) == ("flash_attention", 128)
  assert (mgpu.name, mgpu.registers, mgpu.status) == ("mosaic_gpu_kernel", 168, aot.OK)
  [missing] = aot.build_reports([mosaic], [], {}, {}, limits)
  assert missing.status == aot.ERROR and "MOSAIC_GPU_DUMP_TO" in missing.error
  # XLA's own fusions go through ptxas too: the plugin's dump decides.
  xla_fusion = {"input_reduce_fusion": aot.PtxasStats(registers=32)}
  [mgpu] = aot.build_reports(
    [mosaic], [], xla_fusion, {}, limits, mosaic=[aot.MosaicDump("mosaic_gpu_kernel", aot.PtxasStats(registers=168))]
  )
  assert (mgpu.name, mgpu.registers) == ("mosaic_gpu_kernel", 168)


def test_largest_axes_by_input_bytes():
  from jaxkern import registry

  op = registry.get("moe_router_gemm_topk_deepseek41_d5120_e384_topk6")
  assert selection.largest_recorded_axes(op.definition) == {"M": 4096}
  assert [o.name for o in aot.select_ops(["moe_router"])] == [op.name]
  with pytest.raises(ValueError, match="matches no definition"):
    aot.select_ops(["no_such_definition"])


# -- target texts --------------------------------------------------------------


def test_shipped_target_texts():
  """The H100 and H200 texts ship with a header naming their source, and
  state the sm_90 limits."""
  shipped = aot.targets.shipped_target_configs()
  assert sorted(shipped) == sorted(aot.targets.SHIPPED)
  for name, text in shipped.items():
    assert text.startswith(f"# GpuTargetConfigProto of `{name}`") and "Extracted unchanged from jax-cuda13-pjrt" in text
    assert aot.Limits.from_target_config(text) == aot.Limits()
    assert 'platform_version: "Compute Capability 9.0a"' in text


def test_targets_from_a_library_written_and_read_back(tmp_path):
  """Target texts are found between NUL bytes of a library and written with
  the header; a device the library lacks is named in the error."""
  h200 = 'gpu_device_info {\n  shared_memory_per_core: 233472\n}\ndevice_description_str: "NVIDIA H200 141GB HBM3e"\n'
  other = 'gpu_device_info {\n}\ndevice_description_str: "NVIDIA B200"\n'
  library = tmp_path / "plugin.so"
  library.write_bytes(
    b"\x7fELF\0" + h200.encode() + b"\0junk\0" + other.encode() + b'\0device_description_str: "not a target"\0'
  )
  assert aot.targets.embedded_target_configs(str(library)) == {"NVIDIA H200 141GB HBM3e": h200, "NVIDIA B200": other}
  [path] = aot.targets.write_shipped(
    str(library), "a test library", str(tmp_path / "out"), ("NVIDIA H200 141GB HBM3e",)
  )
  assert pathlib.Path(path).name == "nvidia_h200_141gb_hbm3e.txtpb"
  assert aot.targets.shipped_target_configs(str(tmp_path / "out")) == {
    "NVIDIA H200 141GB HBM3e": aot.targets.header("NVIDIA H200 141GB HBM3e", "a test library") + h200
  }
  with pytest.raises(ValueError, match=r"embeds no target for \['NVIDIA H100 80GB HBM3'\]"):
    aot.targets.write_shipped(str(library), "x", str(tmp_path / "out"), ("NVIDIA H100 80GB HBM3",))
  (tmp_path / "out" / "broken.txtpb").write_text("gpu_device_info {\n}\n")
  with pytest.raises(ValueError, match="broken.txtpb: no `device_description_str"):
    aot.targets.shipped_target_configs(str(tmp_path / "out"))


# -- with the extra: real compiles -------------------------------------------


def _compiler():
  if aot.available():
    pytest.skip(aot.available())
  return aot.Compiler()


@pytest.fixture(scope="module")
def compiler():
  return _compiler()


@pytest.mark.device_stack  # sm_90a on the GPU machine's compiler too
def test_target_configs_of_the_installed_plugin(compiler):
  """Both sm_90a targets resolve whatever the plugin embeds (shipped texts
  fill in); the H200 is the default and has the sm_90 limits."""
  names = aot.target_configs()
  assert "NVIDIA H100 80GB HBM3" in names and compiler.target == "NVIDIA H200 141GB HBM3e"
  assert aot.resolve_target("H100")[0] == "NVIDIA H100 80GB HBM3"
  assert compiler.limits == aot.Limits()


def test_shipped_texts_are_the_plugins_own(compiler):
  """Where the plugin embeds the H100/H200 texts (jax >= 0.12), the shipped
  files hold exactly them under their header."""
  import jax

  embedded = aot.targets.embedded_target_configs(aot.plugin_library())
  if not set(aot.targets.SHIPPED) <= set(embedded):
    pytest.skip(f"the jax {jax.__version__} CUDA plugin embeds no H100/H200 target text (the shipped ones are used)")
  for name, text in aot.targets.shipped_target_configs().items():
    assert text.endswith(embedded[name].rstrip("\n") + "\n"), name
    assert aot.target_origin(name) == "plugin"


def _shipped():
  """Every implemented definition's kernel backends at its largest recorded
  axes, and the router's decode (M=1), few-row and above-recorded sizes."""
  from jaxkern import registry

  out = [(n, None, b) for n in registry.names() if registry.get(n).implemented for b in registry.get(n).backends]
  router = "moe_router_gemm_topk_deepseek41_d5120_e384_topk6"
  out += [(router, {"M": m}, "triton") for m in (1, 3, 128, 8192)]
  out += [("grouped_gemm_fp8_fp4_e384_n4608_k5120_g32", {"M": 6}, "mosaic_gpu")]  # its decode config (8-row items)
  return out


SHIPPED = _shipped()


@pytest.mark.device_stack  # sm_90a on the GPU machine's compiler too
@pytest.mark.parametrize("name,axes,backend", SHIPPED)
def test_shipped_heuristic_configs_compile_clean(compiler, name, axes, backend):
  """No spills, shared memory within the SM, no compile error, for the
  heuristic's config at the largest recorded axes (and more router sizes);
  GEMM and attention keep their wgmma; the Mosaic GPU kernels show their
  warp specialization (their register budgets, TMA loads, mbarriers)."""
  from jaxkern import registry

  op = registry.get(name)
  [row] = aot.check_op(
    compiler, op, op.validated_axes(axes or selection.largest_recorded_axes(op.definition)), backend=backend
  )
  assert row["status"] == aot.OK and row["backend"] == backend, (row["error"], row["kernels"])
  for k in row["kernels"]:
    assert k["spill_stores"] == 0 and k["spill_loads"] == 0, k
    assert backend == "mosaic_gpu" or k["ctas_per_sm"] >= 1, k
  if name.startswith(("dense_gemm", "noncausal", "prefix", "neighborhood")):
    assert all(k["matrix_ops"] == "wgmma" for k in row["kernels"]), row["kernels"]
  for k in row["kernels"]:
    mix = k["instruction_mix"]
    assert mix is not None and (mix["kernel"]["mma_total"] > 0) == (k["matrix_ops"] != "none"), k
  if name.startswith("dense_gemm"):  # a pipelined k-loop of bf16 wgmma
    assert set(row["kernels"][0]["instruction_mix"]["k_step"]["mma"]) == {"wgmma.m64n256k16.bf16"}
  if name.startswith("grouped_gemm") and backend == "mosaic_gpu":  # f16 wgmma, the decoded weights from registers
    wgmma = f"wgmma.m64n{row['config']['block_m']}k16.f16"
    assert set(row["kernels"][0]["instruction_mix"]["k_step"]["mma"]) == {wgmma}
  if backend == "mosaic_gpu":
    # The register split the kernel's module names (40/232 unless its
    # producer needs more), in its Mosaic GPU kernels (a split-keys launch
    # also runs the shared Triton combine).
    module = sys.modules[op.kernel_of(backend).launch.__module__]
    budgets = [f"dec.{module.PRODUCER_REGISTERS}", f"inc.{module.CONSUMER_REGISTERS}"]
    mosaic = [k for k in row["kernels"] if k["name"].endswith("mosaic_gpu_kernel")]
    assert mosaic, row["kernels"]
    for k in mosaic:
      hopper = k["instruction_mix"]["hopper"]
      assert hopper["setmaxnreg"] == budgets and hopper["tma_loads"] > 0, hopper
      assert hopper["mbarrier"].get("try_wait", 0) > 0 and hopper["mbarrier"].get("arrive.expect_tx", 0) > 0, hopper


def test_configs_lowering_to_one_mosaic_gpu_kernel_both_report_it(compiler, capfd):
  """At M=16 the dense GEMM's group_m changes nothing in its Mosaic GPU
  kernel: the plugin compiles it once and dumps nothing the second time; the
  second config still gets the kernel's figures (not a false error). The
  plugin's SASS dump runs no missing nvdisasm (no noise on stderr)."""
  from jaxkern import registry
  from pallas_kernels.dense_gemm.config import MosaicGemmConfig

  op = registry.get("dense_gemm_bf16_nt_n4096_k4096")
  first = MosaicGemmConfig(block_m=128, block_n=256, block_k=64, stages=4, group_m=8, split="m", epilogue_n=64)
  configs = [first, dataclasses.replace(first, group_m=16)]
  rows = aot.check_op(compiler, op, {"M": 16}, configs, backend="mosaic_gpu")
  assert [r["status"] for r in rows] == [aot.OK, aot.OK], [r["error"] for r in rows]
  assert rows[0]["kernels"][0]["registers"] == rows[1]["kernels"][0]["registers"] > 0
  assert "nvdisasm" not in capfd.readouterr().err


def test_markdown_page_from_a_run(compiler, tmp_path):
  page = tmp_path / "page.md"
  out = subprocess.run(
    [sys.executable, "-m", "jaxkern.aot", "--definition=dense_gemm_bf16_nt_n4096_k4096", f"--markdown={page}"],
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  import jax

  text = page.read_text()
  assert "2/2 configs compile clean" in text and "wgmma.m64n256k16.bf16" in text and "| `dense_gemm_nt` |" in text
  assert "| setmaxnreg |" in text and "dec.40 inc.232" in text  # the Mosaic GPU kernel's row
  assert list(aot.page_sections(text)) == [jax.__version__] and f"jax-cuda13-plugin {jax.__version__}" in text
