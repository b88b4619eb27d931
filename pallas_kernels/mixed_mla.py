"""Mixed FP8/FP4 MLA decode (DeepSeek-V4.1, SPEC 4.10) on the Pallas Triton lowering.

One query token per sequence, 64 heads sharing one latent KV head (D = 512,
used as key and value). Its keys are the union of two paged byte caches,
dequantized inside the kernel:

* FP8 window cache `kv_fp8 [N8, P8, 1, D + 4*D/128]` (528-byte records: D
  e4m3 bytes, then D/128 little-endian f32 scales, one per 128 dims), read at
  the flat rows `indices_fp8 [B, K8]` (`page * P8 + offset`);
* FP4 compressed cache `kv_fp4 [N4, P4, 1, D/2 + D/16]` (288-byte records: D/2
  bytes of packed e2m1, low nibble = even dim, then D/16 UE8M0 scales, one
  per 16 dims), read at `indices_fp4 [B, K4]`.

An index is invalid when negative or past the cache's rows. One softmax over
both sets: `P = q.k * sm_scale`; `lse = logsumexp(P)` (natural log, without
the sink); `out = sum exp(P) k / (sum exp(P) + exp(attn_sink[h]))`. A row with
no valid index gives `out = 0`, `lse = +inf`.

Two stages (split-K decode with a logsumexp combine), each its own
`pallas_call` and its own part of `MixedMlaDecodeConfig`:

1. Split (`_split_kernel`), grid `(B, splits, H / block_h)`. The K8 window
   slots are cut into `cdiv(K8, keys_per_split)` splits and the K4 compressed
   slots into `cdiv(K4, keys_per_split)` more; a program owns one split of one
   sequence for `block_h` heads (one gathered key tile serves all its heads:
   the MLA "one KV head" reuse). It walks its slots in `block_k` steps: loads
   the `block_k` indices, gathers the token records by row with index
   vectors (`kv_ref[rows, ...]`), dequantizes them and runs the online
   softmax (fp32, base 2). Its partial `(out normalized, lse in base 2)`
   goes to HBM in fp32. Programs of the window part run only the FP8 loop,
   the others only the FP4 loop (loop trip counts from `program_id`, no
   branches).
2. Combine (`split_kv.combine_splits`), grid `(H / block_h, B, D / block_d)`:
   the logsumexp-weighted sum of the partials, the sink in the denominator,
   the bf16 rounding; lonely rows -> 0 / +inf.

Dequantization and layout. Records are read through power-of-two ref slices,
never loaded whole (a 528-wide value cannot exist in a Triton kernel). The
head dim is processed as `D/128` chunks of 128 dims, each as its even and its
odd 64 dims (`pl.ds(start, 64, stride=2)`): a packed FP4 byte holds dims
(2j, 2j+1), so the even/odd split reads the packed bytes contiguously and
never interleaves nibbles; q is read and the partial output written with the
same strided slices, so HBM layouts stay natural. Both dots of a step are
`sum over 2*D/128 parts` of `[block_h, 64] x [64, block_k]` and
`[block_h, block_k] x [block_k, 64]` bf16 MXU/tensor-core dots with fp32
accumulation.

* FP8: e4m3 bytes are bitcast to float8_e4m3fn and widened to bf16 (exact);
  the f32 scale of a 128-dim chunk (four single-byte columns assembled with
  shifts and a bitcast) multiplies that chunk's partial scores, and the
  probabilities before the value dot: no rounding of scaled keys at all.
* FP4: codes are decoded with integer ops (`fp_formats.e2m1_to_f32`), the
  UE8M0 scale of each 16 dims is gathered by column (`rows x (D/2 + j//8)`)
  and multiplied in; e2m1 times a power of two is exact in bf16.

Invalid slots read row 0 (clamped), their keys are zeroed and their scores
masked to -inf, so no garbage (not even NaN bytes) reaches the sums.

On sm_90a the split stage runs mma.sync tensor-core ops (16-row head tiles
are below wgmma's 64 rows), and 4 warps spill where 8 do not (register
counts: docs/perf/sm90a_compile.md and docs/perf/kernel_notes.md).

Performance (per sequence): 4 * H * 640 * D = 84 MFLOP over ~0.35 MB of
unique bytes (q, 128 x 528 + 512 x 288 record bytes, out): tiny; a decode
step is latency-bound (two launches, the index -> gather -> dot chain).
The fp32 partials (`B x splits x H x D`, 2.6 MB each way at B = 1 with 20
splits) are the largest HBM traffic; bf16 partials or fewer splits would
halve it (the sweep's `keys_per_split` trades it against parallelism).

Limits: H a multiple of `block_h` (>= 16), D a multiple of 128, q bf16.
(Whole engine pools work: the Triton lowering switches to 64-bit offsets for
arrays over 4 GiB.)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, NamedTuple

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from pallas_kernels import common
import jax.numpy as jnp

from pallas_kernels import fp_formats
from pallas_kernels.common import MIN_DOT_DIM, cdiv, resolve_interpret
from pallas_kernels.config_rules import KernelConfig, field, instance_of
from pallas_kernels.device import num_sms
from pallas_kernels.online_softmax import LOG2_E, init_carry, lse_base2, normalize, online_softmax_step
from pallas_kernels.split_kv import CombineStage, SplitStage, combine_splits, fit_combine

# Split programs the heuristic aims for: about one per SM for 60% of them
# (see `choose_config`).
_TARGET_SPLIT_PROGRAMS = 80
_CHUNK = 128   # dims per FP8 scale group, and per dequantization chunk
_HALF = _CHUNK // 2
_FP4_GROUP = 16


@dataclasses.dataclass(frozen=True)
class MixedMlaDecodeConfig(KernelConfig):
  """`split`: a program gathers `block_k` token slots per step for `block_h`
  heads (both >= 16: dot dimensions), `keys_per_split` slots in all;
  `combine`: `split_kv.combine_splits`' tiling."""
  split: SplitStage = field(SplitStage(), instance_of(SplitStage))
  combine: CombineStage = field(CombineStage(), instance_of(CombineStage))


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Static problem facts the kernels need."""
  head_dim: int
  k8: int
  k4: int
  rows8: int
  rows4: int
  keys8: int      # slots per FP8 split (keys_per_split, capped to K8 rounded up)
  keys4: int
  splits8: int
  splits4: int

  @property
  def splits(self) -> int:
    return self.splits8 + self.splits4


def _layout(head_dim, k8, k4, rows8, rows4, split: SplitStage) -> _Layout:
  def keys(k):
    return min(split.keys_per_split, cdiv(k, split.block_k) * split.block_k)
  keys8, keys4 = keys(k8), keys(k4)
  return _Layout(head_dim, k8, k4, rows8, rows4, keys8, keys4, cdiv(k8, keys8), cdiv(k4, keys4))


class MixedMlaSizes(NamedTuple):
  """Problem sizes of the inputs' shapes (input name -> array or ShapeDtypeStruct)."""
  batch: int
  heads: int
  head_dim: int
  k8: int     # FP8 window slots per sequence
  k4: int     # FP4 compressed slots per sequence

  @classmethod
  def of(cls, shapes: Mapping[str, Any]) -> MixedMlaSizes:
    batch, heads, head_dim = shapes["q"].shape
    return cls(int(batch), int(heads), int(head_dim), int(shapes["indices_fp8"].shape[1]),
               int(shapes["indices_fp4"].shape[1]))


def _fit(config: MixedMlaDecodeConfig, heads: int, head_dim: int) -> MixedMlaDecodeConfig:
  """Caps the head blocks to the problem and raises the key step to a dot
  dimension; the combine's blocks divide H and D."""
  block_k = max(config.split.block_k, MIN_DOT_DIM)
  split = dataclasses.replace(config.split, block_h=min(config.split.block_h, max(heads, MIN_DOT_DIM)),
                              block_k=block_k, keys_per_split=max(config.split.keys_per_split, block_k))
  return MixedMlaDecodeConfig(split=split, combine=fit_combine(config.combine, heads, head_dim))


def _split_programs(batch, heads, k8, k4, split: SplitStage) -> int:
  lay = _layout(_CHUNK, k8, k4, 1, 1, split)
  return batch * lay.splits * cdiv(heads, split.block_h)


def choose_config(shapes: Mapping[str, Any]) -> MixedMlaDecodeConfig:
  """Heuristic: 16 heads per program (the smallest dot tile) and 32-key
  steps with 8 warps: the 16 x 512 fp32 accumulator and the 32 x 512 bf16
  dequantized key tile are 32 registers a thread each (4 warps spill on
  sm_90a, see docs/perf/kernel_notes.md), and the largest `keys_per_split`
  of 128, 64, 32 that still gives `_TARGET_SPLIT_PROGRAMS` programs, so small
  batches (B = 1: 80 programs of 32 keys) spread over the SMs while large
  ones keep the partials few (each split writes and the combine reads
  `B x H x D` fp32). The combine uses 64-dim blocks unless 128 already gives
  a program per SM."""
  sizes = MixedMlaSizes.of(shapes)
  for keys_per_split in (128, 64, 32):
    split = SplitStage(block_h=16, block_k=32, keys_per_split=keys_per_split, num_warps=8,
                       num_stages=2)
    if _split_programs(sizes.batch, sizes.heads, sizes.k8, sizes.k4, split) >= _TARGET_SPLIT_PROGRAMS:
      break
  combine_programs = sizes.batch * cdiv(sizes.heads, 16) * cdiv(sizes.head_dim, 128)
  combine = CombineStage(block_h=16, block_d=128 if combine_programs >= num_sms() else 64,
                         num_warps=4, num_stages=1)
  return _fit(MixedMlaDecodeConfig(split=split, combine=combine), sizes.heads, sizes.head_dim)


def candidate_configs(shapes: Mapping[str, Any]) -> list[MixedMlaDecodeConfig]:
  """What a sweep explores, heuristic first, without duplicates: split
  tilings that compile without spills on sm_90a (64-head blocks and 64-key
  steps spill and are left out), then the combine's column blocks."""
  sizes = MixedMlaSizes.of(shapes)
  chosen = choose_config(shapes)
  combine = chosen.combine
  configs = [chosen]
  for block_h, block_k, keys_per_split, num_warps in (
      (16, 32, 32, 8), (16, 32, 64, 8), (16, 32, 128, 8), (16, 16, 16, 8), (16, 16, 32, 4),
      (32, 32, 64, 8), (32, 16, 128, 8)):
    split = SplitStage(block_h, block_k, keys_per_split, num_warps=num_warps, num_stages=2)
    configs.append(MixedMlaDecodeConfig(split=split, combine=combine))
  for block_d in (32, 64, 128):
    configs.append(MixedMlaDecodeConfig(split=chosen.split, combine=CombineStage(16, block_d)))
  return list(dict.fromkeys(_fit(c, sizes.heads, sizes.head_dim) for c in configs))


# ---------------------------------------------------------------------------
# Stage 1: split.


def _load_rows(idx_ref, start, *, block_k: int, num_slots: int, num_rows: int, masked: bool):
  """Indices of slots [start, start + block_k): (rows clamped to 0 where
  invalid, valid)."""
  if masked:
    slots = start + jnp.arange(block_k)
    idx = plgpu.load(idx_ref.at[pl.ds(start, block_k)], mask=slots < num_slots, other=-1)
  else:
    idx = idx_ref[pl.ds(start, block_k)]
  valid = (idx >= 0) & (idx < num_rows)
  return jnp.where(valid, idx, 0), valid


def _fp8_tile(kv_ref, rows, valid, head_dim):
  """Gathered FP8 records -> (bf16 key parts [(chunk, parity)] of [bk, 64]
  unscaled e4m3 values, f32 per-chunk scales [bk])."""
  parts, scales = [], []
  for c in range(head_dim // _CHUNK):
    word = jnp.zeros(rows.shape, jnp.uint32)
    for j in range(4):  # little-endian f32
      byte = kv_ref[rows, head_dim + 4 * c + j]
      word = word | (byte.astype(jnp.uint32) << (8 * j))
    scales.append(jnp.where(valid, lax.bitcast_convert_type(word, jnp.float32), 0.0))
    for parity in (0, 1):
      raw = kv_ref[rows, pl.ds(_CHUNK * c + parity, _HALF, stride=2)]
      values = lax.bitcast_convert_type(raw, jnp.float8_e4m3fn).astype(jnp.bfloat16)
      parts.append(jnp.where(valid[:, None], values, 0.0).astype(jnp.bfloat16))
  return parts, scales


def _fp4_tile(kv_ref, rows, valid, head_dim):
  """Gathered FP4 records -> bf16 key parts [(chunk, parity)] of [bk, 64],
  scales applied (exact)."""
  parts = []
  scale_cols = jnp.arange(_HALF) // (_FP4_GROUP // 2)   # packed byte j -> its scale
  for c in range(head_dim // _CHUNK):
    packed = kv_ref[rows, pl.ds(_HALF * c, _HALF)]     # bytes of dims 128c + 2j, +1
    scale_bytes = kv_ref[rows[:, None],
                         (head_dim // 2 + (_CHUNK // _FP4_GROUP) * c + scale_cols)[None, :]]
    scale = fp_formats.ue8m0_to_f32(scale_bytes)
    for code in fp_formats.unpack_e2m1(packed):
      values = fp_formats.e2m1_to_f32(code) * scale
      parts.append(jnp.where(valid[:, None], values, 0.0).astype(jnp.bfloat16))
  return parts


def _scores(q_parts, k_parts, scales):
  """Unscaled scores `[bh, bk]` of one key tile: the sum over the (chunk,
  parity) parts of `q . k`; `scales` (FP8 only) multiply each chunk's part."""
  s = None
  for c in range(len(q_parts) // 2):
    part = sum(jnp.dot(q_parts[2 * c + p], k_parts[2 * c + p].T, preferred_element_type=jnp.float32)
               for p in (0, 1))
    if scales is not None:
      part = part * scales[c][None, :]
    s = part if s is None else s + part
  return s


def _split_kernel(q_ref, idx8_ref, idx4_ref, kv8_ref, kv4_ref, scale_ref, o_ref, lse_ref, *,
                  lay: _Layout, block_k: int):
  head_dim = lay.head_dim
  block_h = q_ref.shape[0]
  split = pl.program_id(1)
  qk_scale = scale_ref[0] * LOG2_E
  q_parts = [q_ref[:, pl.ds(_CHUNK * c + p, _HALF, stride=2)]
             for c in range(head_dim // _CHUNK) for p in (0, 1)]
  carry = init_carry(block_h, _HALF, parts=len(q_parts))

  is_fp8 = split < lay.splits8
  base8 = split * lay.keys8
  base4 = (split - lay.splits8) * lay.keys4
  load8 = functools.partial(_load_rows, idx8_ref, block_k=block_k, num_slots=lay.k8,
                            num_rows=lay.rows8, masked=lay.k8 % lay.keys8 != 0)
  load4 = functools.partial(_load_rows, idx4_ref, block_k=block_k, num_slots=lay.k4,
                            num_rows=lay.rows4, masked=lay.k4 % lay.keys4 != 0)

  def fp8_body(t, carry):
    rows, valid = load8(base8 + t * block_k)
    k_parts, scales = _fp8_tile(kv8_ref, rows, valid, head_dim)
    # FP8 scales multiply the probabilities of their chunk's two parts
    # (exact keys, one rounding of `p * scale` to bf16).
    return online_softmax_step(_scores(q_parts, k_parts, scales) * qk_scale, carry, k_parts,
                               visible=valid[None, :], value_scales=[w for w in scales for _ in (0, 1)])

  def fp4_body(t, carry):
    rows, valid = load4(base4 + t * block_k)
    k_parts = _fp4_tile(kv4_ref, rows, valid, head_dim)
    return online_softmax_step(_scores(q_parts, k_parts, None) * qk_scale, carry, k_parts,
                               visible=valid[None, :])

  # Trip counts from program_id. (Not `jnp.where(is_fp8, n, 0)`: XLA's
  # Triton then rejects the loop, "scf.for ... bounds have same type".)
  in_fp8 = is_fp8.astype(jnp.int32)
  carry = lax.fori_loop(0, in_fp8 * (lay.keys8 // block_k), fp8_body, carry)
  accs, m, l = lax.fori_loop(0, (1 - in_fp8) * (lay.keys4 // block_k), fp4_body, carry)

  for i, part in enumerate(normalize(accs, m, l)):
    o_ref[:, pl.ds(_CHUNK * (i // 2) + i % 2, _HALF, stride=2)] = part
  lse_ref[...] = lse_base2(m, l)


# ---------------------------------------------------------------------------
# Launcher.


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def mixed_mla_decode(q: jax.Array, kv_fp8: jax.Array, indices_fp8: jax.Array, kv_fp4: jax.Array,
                     indices_fp4: jax.Array, sm_scale: jax.Array, attn_sink: jax.Array, *,
                     config: MixedMlaDecodeConfig | None = None,
                     interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """Mixed FP8/FP4 MLA decode (SPEC 4.10).

  Args:
    q: `[B, H, D]` bf16; D a multiple of 128.
    kv_fp8: `[N8, P8, 1, D + 4*D/128]` uint8 FP8 token records.
    indices_fp8: `[B, K8]` int32 flat rows `page*P8 + offset`.
    kv_fp4: `[N4, P4, 1, D/2 + D/16]` uint8 FP4 token records.
    indices_fp4: `[B, K4]` int32 flat rows `page*P4 + offset`.
    sm_scale: f32 scalar (0-d array or float; may be traced).
    attn_sink: `[H]` f32 sink logits (denominator only).
    config: None = `choose_config`.
    interpret: None = interpret when no GPU is present.

  Returns:
    `(out [B, H, D] bf16, lse [B, H] f32)`; negative or out-of-range
    indices are skipped; rows with none valid give 0 and +inf.
  """
  batch, heads, head_dim = q.shape
  k8, k4 = indices_fp8.shape[1], indices_fp4.shape[1]
  if head_dim % _CHUNK:
    raise ValueError(f"D={head_dim} must be a multiple of {_CHUNK}")
  n8, p8, hkv8, bytes8 = kv_fp8.shape
  n4, p4, hkv4, bytes4 = kv_fp4.shape
  if hkv8 != 1 or hkv4 != 1:
    raise ValueError("one latent KV head expected")
  if bytes8 != head_dim + 4 * (head_dim // _CHUNK) or bytes4 != head_dim // 2 + head_dim // _FP4_GROUP:
    raise ValueError(f"token records {bytes8}/{bytes4} bytes do not match D={head_dim}")
  if indices_fp8.shape[0] != batch or indices_fp4.shape[0] != batch or attn_sink.shape != (heads,):
    raise ValueError("indices / attn_sink shapes do not match q")
  shapes = {"q": q, "indices_fp8": indices_fp8, "indices_fp4": indices_fp4}
  if config is None:
    config = choose_config(shapes)
  config = _fit(config, heads, head_dim)
  split_cfg = config.split
  if heads % split_cfg.block_h:
    raise ValueError(f"H={heads} is not a multiple of split.block_h={split_cfg.block_h}")
  rows8, rows4 = n8 * p8, n4 * p4
  lay = _layout(head_dim, k8, k4, rows8, rows4, split_cfg)
  interpret = resolve_interpret(interpret)

  kv8_flat = kv_fp8.reshape(rows8, bytes8)
  kv4_flat = kv_fp4.reshape(rows4, bytes4)
  scale = jnp.asarray(sm_scale, jnp.float32).reshape(1)
  block_h = split_cfg.block_h
  o_part, lse_part = common.pallas_call(
      functools.partial(_split_kernel, lay=lay, block_k=split_cfg.block_k),
      out_shape=(jax.ShapeDtypeStruct((batch, lay.splits, heads, head_dim), jnp.float32),
                 jax.ShapeDtypeStruct((batch, lay.splits, heads), jnp.float32)),
      grid=(batch, lay.splits, heads // block_h),
      in_specs=[
          pl.BlockSpec((None, block_h, head_dim), lambda b, s, h: (b, h, 0)),
          pl.BlockSpec((None, k8), lambda b, s, h: (b, 0)),
          pl.BlockSpec((None, k4), lambda b, s, h: (b, 0)),
          pl.BlockSpec((rows8, bytes8), lambda b, s, h: (0, 0)),
          pl.BlockSpec((rows4, bytes4), lambda b, s, h: (0, 0)),
          pl.BlockSpec((1,), lambda b, s, h: (0,)),
      ],
      out_specs=(pl.BlockSpec((None, None, block_h, head_dim), lambda b, s, h: (b, s, h, 0)),
                 pl.BlockSpec((None, None, block_h), lambda b, s, h: (b, s, h))),
      compiler_params=plgpu.CompilerParams(num_warps=split_cfg.num_warps,
                                           num_stages=split_cfg.num_stages),
      interpret=interpret,
      name="mixed_mla_decode_split",
  )(q, indices_fp8.astype(jnp.int32), indices_fp4.astype(jnp.int32), kv8_flat, kv4_flat, scale)

  return combine_splits(o_part, lse_part, attn_sink.astype(jnp.float32), stage=config.combine,
                        out_dtype=q.dtype, with_lse=True, name="mixed_mla_decode_combine",
                        interpret=interpret)
