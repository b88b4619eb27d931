"""The roofline: each family's cost formula (`OpImpl.cost`, applied by
`Op.cost`) on small axes computed by hand, every definition of the dataset
covered at its recorded axes, device peaks, and the replay's speed-of-light
fields (sol_fraction only when timed on a GPU)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkern import bench, dataset, evaluate, registry, replay, results, roofline
from jaxkern.families import dense_gemm as dense_gemm_family
from jaxkern.families import flash_attention as attention_family
from jaxkern.families import grouped_gemm as grouped_gemm_family

DEFS = dataset.load_definitions()


def cost(name, inputs=None, **axes):
  c = registry.get(name).cost(axes, inputs=inputs)
  assert c.counted_from == ("axes" if inputs is None else "inputs")
  return c.flops, c.bytes, c.dtype_class


# Each case overrides the constant axes with small ones, so the expected
# numbers can be checked by hand (bytes: bf16 2, f32 / int32 4, fp8 / uint8 / bool 1).


def test_dense_gemm():
  # 2*M*N*K; A 2x4, B 3x4, C 2x3 in bf16: (8 + 12 + 6) * 2.
  assert cost("dense_gemm_bf16_nt_n4096_k4096", M=2, N=3, K=4) == (48, 52, "bf16")


def test_moe_router():
  # 2*M*E*D; hidden 2x8 bf16 32, weight 4x8 bf16 64, bias 4 f32 16, scalar 4, ids and weights 2x2 x4 16 + 16.
  assert cost("moe_router_gemm_topk_deepseek41_d5120_e384_topk6", M=2, D=8, E=4, TOPK=2) == (128, 148, "bf16")


def test_grouped_gemm_counts_only_routed_experts():
  name = "grouped_gemm_fp8_fp4_e384_n4608_k5120_g32"
  small = dict(N=2, K=64, G=32, K_groups=2, K_packed=32)
  # One row, 4 experts: a 64 + a_scale 2 + expert_ids 4 + C 1x2 bf16 4 = 74, plus one expert's
  # weights as stored: b 2x32 + b_scale 2x2 = 68. The kernel's dots are fp8 (e2m1 weights decoded
  # to e4m3): the fp8 peak.
  assert cost(name, M=1, E=4, **small) == (2 * 1 * 2 * 64, 74 + 68, "fp8")
  # Two rows, two experts, no inputs: expected distinct experts 2 * (1 - 1/4) = 1.5.
  assert grouped_gemm_family.expected_experts(2, 2) == 1.5
  assert cost(name, M=2, E=2, **small) == (2 * 2 * 2 * 64, 128 + 4 + 8 + 8 + round(1.5 * 68), "fp8")
  assert grouped_gemm_family.expected_experts(1, 384) == pytest.approx(1.0)
  assert grouped_gemm_family.expected_experts(10**6, 384) == pytest.approx(384)
  # With the run's ids: rows routed to 3, 0, 3 (the -1 padding row and the out-of-range 7 do no
  # work), two distinct experts. a and a_scale of 3 rows (66 each), expert_ids 5x4, C 5x2 bf16,
  # weights of 2 experts.
  ids = jnp.asarray([3, 0, -1, 3, 7], jnp.int32)
  assert cost(name, inputs={"expert_ids": ids}, M=5, E=4, **small) == (2 * 3 * 2 * 64, 3 * 66 + 20 + 20 + 2 * 68, "fp8")
  # Folded scales run f16 dots: the same work, judged at the bf16/f16 MMA peak.
  folded = grouped_gemm_family.kernel_lib.GroupedGemmConfig(
    64, 128, 128, swap_ab=True, expert_items=True, fold_scales=True
  )
  work = registry.get(name).cost({"M": 1, "E": 4, **small}, config=folded)
  assert (work.flops, work.bytes, work.dtype_class) == (2 * 1 * 2 * 64, 74 + 68, "bf16")


def test_dense_attention():
  # 4*B*H*Nq*Nk*D; q 16, k 24, v 24, key_valid 3, o 16.
  assert cost("noncausal_dense_attention_h32_d64", B=1, Nq=2, Nk=3, H=1, D=4) == (96, 83, "bf16")


def test_padded_attention_counts_only_its_visible_keys():
  name = "noncausal_dense_attention_h32_d64"
  # Row 0 sees 1 of 3 keys, row 1 sees 3: 4 visible keys. FLOPs 4*H*Nq*D*4; q 2x2x4 bf16 32,
  # key_valid 6, o 32, and the k and v rows of the 4 visible keys (8 + 8 bytes each).
  key_valid = jnp.asarray([[True, False, False], [True, True, True]])
  assert cost(name, inputs={"key_valid": key_valid}, B=2, Nq=2, Nk=3, H=1, D=4) == (
    4 * 2 * 4 * 4,
    32 + 6 + 32 + 4 * 16,
    "bf16",
  )
  # A recorded attn2 (padded text) workload as the replay synthesizes it: only its valid keys.
  op = registry.get("noncausal_dense_attention_h32_d128")
  w = next(w for w in dataset.load_workloads(op.name) if w.variant == "attn2")
  axes = op.cpu_axes(w.axes)
  inputs = op.make_inputs(axes, seed=0, record=w.record, allow_shrunk_constants=True)
  visible = int(np.count_nonzero(np.asarray(inputs["key_valid"])))
  assert 0 < visible < axes["B"] * axes["Nk"]
  c = op.cost(axes, inputs=inputs, record=w.record)
  assert c.flops == 4 * axes["H"] * axes["Nq"] * axes["D"] * visible < op.cost(axes).flops


def test_prefix_cached_attention():
  # every query sees Nq + Np keys: 4*2*5*4; q, k, v 16 each, prefixes 24 each, o 16.
  assert cost("prefix_cached_block_causal_h32_d128", B=1, Nq=2, Np=3, H=1, D=4) == (160, 112, "bf16")


def test_block_causal_counts_visible_pairs_only():
  name = "prefix_cached_block_causal_h32_d128_prefix0"
  axes = dict(B=1, Nq=4, H=1, D=4)
  # q, k, v 4x4 bf16 32 each, segment_ids 4 int32 16, o 32.
  assert cost(name, **axes) == (4 * 16 * 4, 144, "bf16")  # no record: one segment, Nq^2 pairs
  record = {"prefix_segments": [[0, 1, False], [1, 3, True], [3, 4, False]]}
  # segments of 1, 2, 1 tokens ending at 1, 3, 4: 1*1 + 2*3 + 1*4 = 11 visible pairs.
  assert attention_family.block_causal_pairs([1, 3, 4]) == 11
  assert registry.get(name).cost(axes, record=record).flops == 4 * 11 * 4
  # The recorded layout [[0,8],[8,4104],[4104,4125]].
  assert attention_family.block_causal_pairs([8, 4104, 4125]) == 8 * 8 + 4096 * 4104 + 21 * 4125
  # From the run's segment_ids (what the kernel is given): row 0 as the record above (11 pairs),
  # row 1 one segment (16 pairs).
  ids = jnp.asarray([[0, 1, 1, 2], [0, 0, 0, 0]], jnp.int32)
  c = registry.get(name).cost({**axes, "B": 2}, inputs={"segment_ids": ids})
  assert (c.flops, c.counted_from) == (4 * (11 + 16) * 4, "inputs")


def test_neighborhood_attention_counts_the_window():
  # 60 queries, each sees exactly 1*3*3 keys: 4*60*1*2*9; q, k, v, o of 60x1x2 bf16: 4 * 240.
  got = cost("neighborhood_attention_3d_h8_d64_kt3_ky5_kx5", B=1, T=3, Y=4, X=5, H=1, D=2, KT=1, KY=3, KX=3)
  assert got == (4320, 960, "bf16")


GDN_HEADS = dict(num_q_heads=1, num_k_heads=1, num_v_heads=2, head_size=2)


def test_gdn_decode():
  # 7*B*HV*K*V = 7*2*2*2*2; q 8, k 8, v 16, state 2x2x2x2 f32 64, A_log 8, a 8, dt_bias 8, b 8,
  # scale 4, output 16, new_state 64.
  got = cost("gdn_decode_qk4_v8_d128_k_last", batch_size=2, seq_len=1, **GDN_HEADS)
  assert got == (112, 212, "fp32")


def test_gdn_prefill():
  # 7*T*HV*K*V = 7*3*2*4; q 12, k 12, v 24, state 32, A_log 8, a 12, dt_bias 8, b 12, cu_seqlens 8,
  # scale 4, output 24, new_state 32.
  got = cost("gdn_prefill_qk4_v8_d128_k_last", total_seq_len=3, num_seqs=1, len_cu_seqlens=2, **GDN_HEADS)
  assert got == (168, 188, "bf16")


def test_sparse_mla_counts_gathered_rows():
  name = "sparse_mla_prefill_h64_d512_k128"
  small = dict(H=1, HKV=1, D=4)
  # q 16, indices 2x2 int32 16, sm_scale 4, attn_sink 4, out 16, lse 8 = 64; gathered
  # min(M*TOPK=4, Nkv=3) rows of 8 bytes = 24. FLOPs 4*M*H*min(TOPK, Nkv)*D.
  assert cost(name, M=2, Nkv=3, TOPK=2, **small) == (4 * 2 * 2 * 4, 88, "bf16")
  # More slots than rows: each query attends to at most Nkv rows.
  assert cost(name, M=2, Nkv=3, TOPK=4, **small)[0] == 4 * 2 * 3 * 4
  # With the run's indices: 3 valid slots (-1 and 3 >= Nkv are not), 2 distinct rows (0 twice).
  indices = jnp.asarray([[[0, -1]], [[0, 3]], [[2, -1]]], jnp.int32)
  c = registry.get(name).cost(dict(M=3, Nkv=3, TOPK=2, **small), inputs={"indices": indices})
  # q 24, indices 24, scalars 8, out 24, lse 12 = 92, plus 2 rows of 8 bytes.
  assert (c.flops, c.bytes) == (4 * 3 * 4, 92 + 16)
  # The gather floor: every valid slot's row once per query row (1 KiB per slot at D=512).
  assert c.gather_bytes == 3 * 8
  full = registry.get(name).cost({"M": 1, "Nkv": 200}, inputs={"indices": jnp.arange(128).reshape(1, 1, 128)})
  assert full.gather_bytes == 128 * 1024


def test_mixed_mla_counts_gathered_tokens_as_stored():
  got = cost(
    "mixed_mla_decode_deepseek41_h64_d512_k8128_k4512",
    B=1,
    N8=1,
    N4=1,
    P8=2,
    P4=2,
    H=1,
    HKV=1,
    D=4,
    K8=1,
    K4=3,
    token_bytes_fp8=8,
    token_bytes_fp4=6,
  )
  # slots min(1, 2) + min(3, 2) = 3; q 8, indices 4 + 12, sm_scale 4, sink 4, out 8, lse 4 = 44;
  # gathered: 1 fp8 token of 8 bytes + min(3, 2) fp4 tokens of 6 bytes = 20.
  assert got == (4 * 3 * 4, 64, "bf16")
  # The real token records: 528 and 288 bytes each (scales included).
  full = registry.get("mixed_mla_decode_deepseek41_h64_d512_k8128_k4512").cost({"B": 1, "N8": 1, "N4": 4})
  small_io = 64 * 512 * 2 + (128 + 512) * 4 + 4 + 64 * 4 + 64 * 512 * 2 + 64 * 4
  assert full.bytes == small_io + 128 * 528 + 512 * 288
  # With the run's indices: fp8 slots [1, -1] (1 valid), fp4 slots [0, 0, 4] (2 valid: 4 >= 4 rows),
  # distinct tokens 1 + 1.
  inputs = {"indices_fp8": jnp.asarray([[1]], jnp.int32), "indices_fp4": jnp.asarray([[0, 0, 4]], jnp.int32)}
  c = registry.get("mixed_mla_decode_deepseek41_h64_d512_k8128_k4512").cost(
    dict(B=1, N8=1, N4=2, P8=2, P4=2, H=1, HKV=1, D=4, K8=1, K4=3, token_bytes_fp8=8, token_bytes_fp4=6), inputs=inputs
  )
  assert (c.flops, c.bytes, c.gather_bytes) == (4 * 3 * 4, 44 + 8 + 6, 8 + 2 * 6)


def test_qsa_index_topk_counts_referenced_pages():
  got = cost("qsa_index_topk_decode_qwen38_h4_d128_topk512_c4", B=2, MP=2, NP=3, P=2, H=1, HKV=1, D=4, TOPK=2, C=4)
  # scores: 2*B*MP*P*H*D = 64; q 16, page_table 16, seq_lens 8, topk_ids 16; pages min(NP=3, B*MP=4)
  # of 2x1x4 bf16 = 16 bytes: 48.
  assert got == (64, 56 + 48, "bf16")
  # With the run's data: sequence 0 has 9 tokens (2 keys, on page 2), sequence 1 has 16 tokens
  # (4 keys: its pages 2 and 0, page 2 shared): 6 scored keys, 2 distinct pages.
  inputs = {"seq_lens": jnp.asarray([9, 16], jnp.int32), "page_table": jnp.asarray([[2, 1], [2, 0]], jnp.int32)}
  got = cost(
    "qsa_index_topk_decode_qwen38_h4_d128_topk512_c4", inputs=inputs, B=2, MP=2, NP=3, P=2, H=1, HKV=1, D=4, TOPK=2, C=4
  )
  assert got == (2 * 6 * 4, 56 + 2 * 16, "bf16")


def test_qsa_sparse_gqa_counts_visible_tokens():
  got = cost(
    "qsa_sparse_gqa_decode_qwen38_h24_kv2_d256_topk512_c4", B=1, MP=2, NP=2, P=4, HQ=2, HKV=1, D=2, TOPK=1, C=2
  )
  # t = min(MP*P=8, TOPK*C + C-1 = 3) = 3: 4*1*2*3*2; q 8, page_table 8, seq_lens 4, topk_ids 4,
  # sm_scale 4, o 8 = 36; gathered 3 tokens of k and v rows (1x2 bf16 each): 3 * 8.
  assert got == (48, 60, "bf16")
  # With the run's data: seq_len 7 (n = 3 blocks of 2 and a 1-token tail); ids 2, 2 (once), -1 and
  # 5 (>= n: ignored): tokens 4, 5 and the tail 6 on logical page 1 -> physical page 0.
  inputs = {
    "seq_lens": jnp.asarray([7], jnp.int32),
    "topk_ids": jnp.asarray([[2, 2, -1, 5]], jnp.int32),
    "page_table": jnp.asarray([[1, 0]], jnp.int32),
  }
  c = registry.get("qsa_sparse_gqa_decode_qwen38_h24_kv2_d256_topk512_c4").cost(
    dict(B=1, MP=2, NP=2, P=4, HQ=2, HKV=1, D=2, TOPK=4, C=2), inputs=inputs
  )
  # q 8, page_table 8, seq_lens 4, topk_ids 16, sm_scale 4, o 8 = 48; 3 rows of 8.
  assert (c.flops, c.bytes, c.gather_bytes) == (4 * 2 * 2 * 3, 48 + 24, 24)


def test_every_definition_has_a_formula_at_its_recorded_axes():
  assert len(DEFS) == 21
  for name in DEFS:
    op = registry.get(name)
    assert op.impl.cost is not None, name  # the family's formula, on its OpImpl
    for w in dataset.load_workloads(name):
      c = op.cost(w.axes, record=w.record)
      assert c.flops > 0 and c.bytes > 0, (name, w.uuid)
      assert 0 < c.speed_of_light_ms() < 100, (name, w.uuid)


def test_formulas_live_with_their_families():
  """Every shape of a family uses its family's formula; the Cost names it."""
  for name in ("dense_gemm_bf16_nt_n4096_k4096", "dense_gemm_bf16_nt_n12288_k4096"):
    assert registry.get(name).impl.cost is dense_gemm_family.dense_gemm_cost
    assert registry.get(name).cost({"M": 1}).family == "dense_gemm_cost"
  costs = {registry.get(n).impl.cost for n in DEFS if n.startswith(("noncausal", "prefix_cached"))}
  assert costs == {
    attention_family.noncausal_attention_cost,
    attention_family.prefix_cached_attention_cost,
    attention_family.block_causal_attention_cost,
  }


def test_speed_of_light_and_peaks():
  h200 = roofline.DEVICES["h200"]["datasheet"]
  one_ms_flops = h200["bf16_tflops"] * 1e12 * 1e-3
  one_ms_bytes = h200["hbm_tb_s"] * 1e12 * 1e-3
  assert roofline.speed_of_light_ms(one_ms_flops, 0, "h200", "bf16") == pytest.approx(1.0)
  assert roofline.speed_of_light_ms(0, one_ms_bytes, "h200", "bf16") == pytest.approx(1.0)
  assert roofline.speed_of_light_ms(one_ms_flops, 2 * one_ms_bytes, "h200", "bf16") == pytest.approx(2.0)
  assert roofline.speed_of_light_ms(one_ms_flops, 0, "h200", "fp8") == pytest.approx(0.5, rel=1e-3)
  assert roofline.speed_of_light_ms(0, one_ms_bytes, "h100_sxm") == pytest.approx(4.8 / 3.35)
  assert roofline.speed_of_light_ms(one_ms_flops, 0, "h200", "bf16", basis="measured") == pytest.approx(989.4 / 790)
  assert roofline.peaks("h100_sxm", "measured") == roofline.peaks("h100_sxm")  # none measured: datasheet
  for key, dev in roofline.DEVICES.items():
    assert set(dev["datasheet"]) == {"bf16_tflops", "fp8_tflops", "fp32_tflops", "hbm_tb_s"}, key
    assert all(dev["sources"].get(basis) for basis in ("datasheet", *(["measured"] if dev["measured"] else [])))
  assert roofline.device_key("NVIDIA H100 80GB HBM3") == "h100_sxm"
  assert roofline.device_key("NVIDIA H200") == "h200"
  assert roofline.device_key("cpu") == "h200" and roofline.device_key("NVIDIA H100 PCIe") == "h200"
  with pytest.raises(ValueError):
    roofline.speed_of_light_ms(1, 1, "h200", "fp4")


def test_performance_fields():
  op = registry.get("dense_gemm_bf16_nt_n4096_k4096")
  c = op.cost({"M": 4096})
  cpu = roofline.performance_fields(lambda: c, 5.0, device_kind="cpu", measured_on_gpu=False)
  assert "sol_fraction" not in cpu
  assert cpu["speed_of_light_ms"] == pytest.approx(c.speed_of_light_ms("h200"))
  assert cpu["roofline"] == {
    "flops": c.flops,
    "bytes": c.bytes,
    "device": "h200",
    "dtype_class": "bf16",
    "peak": "bf16 MMA 989.4 TFLOP/s, HBM 4.8 TB/s",
    "bound": "compute",
    "basis": "datasheet",
    "counted_from": "axes",
  }
  gpu = roofline.performance_fields(lambda: c, 0.5, device_kind="NVIDIA H100 80GB HBM3", measured_on_gpu=True)
  assert gpu["roofline"]["device"] == "h100_sxm"
  assert gpu["sol_fraction"] == pytest.approx(c.speed_of_light_ms("h100_sxm") / 0.5)

  def no_formula():
    raise NotImplementedError("toy: the family has no cost formula (OpImpl.cost)")

  broken = roofline.performance_fields(no_formula, 1.0, device_kind="cpu", measured_on_gpu=True)
  assert broken["speed_of_light_ms"] is None and "no cost formula" in broken["roofline"]["error"]


TOY_GEMM = """
import dataclasses
import jax.numpy as jnp
from jaxkern.families.dense_gemm import dense_gemm_cost
from jaxkern.family import OpImpl
from pallas_kernels.shared.kernel import Kernel, kernels

def toy_matmul(A, B):
  return jnp.dot(A, B.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

def make_inputs(axes, key, record):
  return {"A": jnp.ones((axes["M"], axes["K"]), jnp.bfloat16), "B": jnp.ones((axes["N"], axes["K"]), jnp.bfloat16)}

def kernel(A, B, *, interpret, config):
  return toy_matmul(A, B)

@dataclasses.dataclass(frozen=True)
class ToyConfig:
  block: int = 8

KERNEL = Kernel(name="toy_gemm", backend="triton", launch=kernel, config_class=ToyConfig,
                choose_config=lambda s: ToyConfig(), candidate_configs=lambda s: [ToyConfig()])
IMPLS = (OpImpl(reference=toy_matmul, make_inputs=make_inputs, kernels=kernels(KERNEL), cpu_axes=lambda axes: axes,
                cost=dense_gemm_cost),)
"""


def test_replay_results_carry_speed_of_light_and_sol_fraction_only_on_gpu(tmp_path, monkeypatch):
  """A toy GEMM (plain jnp kernel, so it can run as if timed on a GPU here)
  with the dense GEMM's cost formula: the speed of light is always there, sol_fraction
  only when timed on a GPU outside interpret mode; the summary shows both."""
  (tmp_path / "toy_gemm_family.py").write_text(TOY_GEMM)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setenv("JAXKERN_FAMILY_PACKAGES", "toy_gemm_family")
  ds = tmp_path / "ds"
  (ds / "definitions").mkdir(parents=True)
  (ds / "workloads").mkdir()
  definition = {
    "name": "toy_gemm_n16_k32",
    "op_type": "gemm",
    "description": "C = A B^T",
    "tags": [],
    "axes": {"M": {"type": "var"}, "N": {"type": "const", "value": 16}, "K": {"type": "const", "value": 32}},
    "inputs": {"A": {"shape": ["M", "K"], "dtype": "bfloat16"}, "B": {"shape": ["N", "K"], "dtype": "bfloat16"}},
    "outputs": {"C": {"shape": ["M", "N"], "dtype": "bfloat16"}},
    "constraints": [],
    "reference": "toy_gemm_family:toy_matmul",
  }
  (ds / "definitions" / "toy_gemm_n16_k32.json").write_text(json.dumps(definition))
  (ds / "workloads" / "toy_gemm_n16_k32.jsonl").write_text(
    json.dumps({"uuid": "g0", "definition": "toy_gemm_n16_k32", "axes": {"M": 8}}) + "\n"
  )
  op = registry.get("toy_gemm_n16_k32", ds)
  [w] = dataset.load_workloads("toy_gemm_n16_k32", ds)
  cfg = replay.default_config()
  cfg.warmup, cfg.iters = 0, 2
  expected = roofline.speed_of_light_ms(2 * 8 * 16 * 32, (8 * 32 + 16 * 32 + 8 * 16) * 2, "h200", "bf16")

  interp = evaluate.run_workload(op, w, cfg, bench.CompileCache(), interpret=True, on_gpu=False)
  perf = interp.evaluation.performance
  assert interp.status == results.Status.PASSED
  assert perf["speed_of_light_ms"] == pytest.approx(expected) and "sol_fraction" not in perf

  timed = evaluate.run_workload(op, w, cfg, bench.CompileCache(), interpret=False, on_gpu=True)
  perf = timed.evaluation.performance
  assert timed.status == results.Status.PASSED
  assert perf["sol_fraction"] == pytest.approx(perf["speed_of_light_ms"] / perf["latency_ms"])

  row = dict(zip(results.SUMMARY_HEADERS, results.summarize([interp])[0]))
  assert row["SOL ms"] == f"{expected:.3g}" and row["SOL frac"] == "-"
  row = dict(zip(results.SUMMARY_HEADERS, results.summarize([timed])[0]))
  assert row["SOL frac"] == f"{perf['sol_fraction']:.3g}"
