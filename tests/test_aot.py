"""`jaxkern.aot`: the parsing and occupancy logic always; real sm_90a
compiles only when the `aot` extra (CUDA plugin + ptxas) is installed."""

import pytest

from jaxkern import aot
from jaxkern import selection

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

STABLEHLO = ('stablehlo.custom_call @"__gpu$xla.gpu.triton"(%0) {backend_config = {debug = false, grid_x = 1 : i32, '
             'grid_y = 80 : i32, grid_z = 1 : i32, ir = "ML\\EFR...", name = "moe_router_partial_logits", '
             'num_stages = 2 : i32, num_warps = 4 : i32}} ...\n'
             'stablehlo.custom_call @"__gpu$xla.gpu.triton"(%1) {backend_config = {debug = false, grid_x = 1 : i32, '
             'grid_y = 1 : i32, grid_z = 1 : i32, ir = "ML\\EFR...", name = "moe_router_reduce_route", '
             'num_stages = 1 : i32, num_warps = 4 : i32}}\n')


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
  assert launches == [aot.Launch("moe_router_partial_logits", (1, 80, 1), 128, 67584),
                      aot.Launch("moe_router_reduce_route", (1, 1, 1), 128, 512)]
  assert aot.triton_calls(STABLEHLO) == [("moe_router_partial_logits", 2, 4), ("moe_router_reduce_route", 1, 4)]


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
  reports = aot.build_reports(aot.triton_calls(STABLEHLO), aot.parse_thunk_sequence(THUNKS),
                              aot.parse_ptxas_verbose(PTXAS_V), {"moe_router_partial_logits": "wgmma"}, limits)
  a, b = reports
  assert (a.name, a.status, a.registers, a.smem_bytes, a.matrix_ops, a.num_stages) == (
      "moe_router_partial_logits", aot.OK, 160, 67584, "wgmma", 2)
  assert (a.ctas_per_sm, a.occupancy_limit) == (3, "registers")
  assert (b.status, b.spill_stores, b.smem_bytes) == (aot.SPILLS, 228, 512 + 16)
  rep = aot.CompileReport(reports, 1.0)
  assert not rep.ok and rep.status == aot.SPILLS
  assert "moe_router_reduce_route: 255 regs" in rep.summary()


def test_build_reports_errors_and_overflow():
  limits = aot.Limits()
  calls = [("flash_attention", 2, 8)]
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


def test_largest_axes_by_input_bytes():
  from jaxkern import registry  # pylint: disable=g-import-not-at-top
  op = registry.get("moe_router_gemm_topk_deepseek41_d5120_e384_topk6")
  assert selection.largest_recorded_axes(op.definition) == {"M": 4096}
  assert [o.name for o in aot.select_ops(["moe_router"])] == [op.name]
  with pytest.raises(ValueError, match="matches no definition"):
    aot.select_ops(["no_such_definition"])


# -- with the extra: real compiles -------------------------------------------

def _compiler():
  pytest.importorskip("jax_plugins.xla_cuda12")
  pytest.importorskip("nvidia.cuda_nvcc")
  if aot.available():
    pytest.skip(aot.available())
  return aot.Compiler()


@pytest.fixture(scope="module")
def compiler():
  return _compiler()


def test_target_configs_embedded_in_the_plugin(compiler):
  names = aot.target_configs()
  assert "NVIDIA H100 80GB HBM3" in names and compiler.target in names
  assert aot.resolve_target("H100")[0] == "NVIDIA H100 80GB HBM3"
  assert compiler.limits == aot.Limits()


def _shipped():
  """Every implemented definition at its largest recorded axes, and the
  router's decode (M=1), few-row and above-recorded sizes."""
  from jaxkern import registry  # pylint: disable=g-import-not-at-top
  out = [(n, None) for n in registry.names() if registry.get(n).implemented]
  router = "moe_router_gemm_topk_deepseek41_d5120_e384_topk6"
  out += [(router, {"M": m}) for m in (1, 3, 128, 8192)]
  return out


SHIPPED = _shipped()


@pytest.mark.parametrize("name,axes", SHIPPED)
def test_shipped_heuristic_configs_compile_clean(compiler, name, axes):
  """No spills, shared memory within the SM, no compile error, for the
  heuristic's config at the largest recorded axes (and more router sizes);
  GEMM and attention keep their wgmma."""
  from jaxkern import registry  # pylint: disable=g-import-not-at-top
  op = registry.get(name)
  [row] = aot.check_op(compiler, op, op.validated_axes(axes or selection.largest_recorded_axes(op.definition)))
  assert row["status"] == aot.OK, (row["error"], row["kernels"])
  for k in row["kernels"]:
    assert k["spill_stores"] == 0 and k["spill_loads"] == 0 and k["ctas_per_sm"] >= 1, k
  if name.startswith(("dense_gemm", "noncausal", "prefix")):
    assert all(k["matrix_ops"] == "wgmma" for k in row["kernels"]), row["kernels"]
