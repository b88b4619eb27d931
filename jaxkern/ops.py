"""Model-friendly, jit-compatible entry points: plain arrays in, arrays out.

Each op takes a `backend`:
  None           "pallas" on a GPU, "xla" otherwise (default)
  "pallas"       the best available kernel (interpret mode when no GPU is
                 present): the backend the tuned table has fastest for this
                 device and shape, else the family's order (Triton first),
                 falling back when a kernel does not take the inputs
  "triton", "mosaic_gpu"
                 that backend's kernel; an op without one raises a
                 ValueError naming the backends it has
  "xla"          the plain-jnp path (the definitions' references): correct
                 everywhere, fast on CPU
`backend=None` (or no `backend=`) takes the default of the innermost
`with jaxkern.backend(name):` scope around the call (`jaxkern.backends.scope`),
else the automatic default above; `jaxkern.explain(op, *args, **kwargs)`
says which backend, kernel and config a call would run, and why.
Each op also takes a `config` (see `pallas_kernels.<family>.config`; its class names the
backend). Without one, the tuned table of the current device kind is
consulted for the kernel and the call's shape bucket (`jaxkern.tuning`),
else the backend's heuristic decides; no dataset file is read.
`checks=True` validates the op's index and length inputs (checked mode,
`jaxkern.dispatch`); under jit, wrap the jitted function in `checked`.
Each op's docstring states its contract: shapes, dtypes, the valid range of
every index input and what happens outside it; its last line names the
backends it has (`xla` always; `triton` for every op; `mosaic_gpu` for
`dense_gemm`, the three attentions, `sparse_mla_prefill` and
`mixed_mla_decode`) and the inputs a Mosaic GPU kernel takes.

Every op validates its arguments before dispatch, the same on every backend
(`jaxkern.contract`): a rank, shape or dtype outside its contract raises
`InputError` (a ValueError and a TypeError) whose message names the
argument, what the contract expects and what the call passed. Tensors are
positional, everything else keyword-only; the softmax scale is `sm_scale`
(None: D**-0.5, D the head dim of q) in every op that has one.

This module is the stable import path; each function lives with its family
(`jaxkern/families/<name>.py`) and runs through `jaxkern.dispatch`.
"""

from jaxkern.contract import InputError
from jaxkern.dispatch import Backend, checked
from jaxkern.families.dense_gemm import dense_gemm
from jaxkern.families.flash_attention import attention, block_causal_attention, prefix_cached_attention
from jaxkern.families.gdn_decode import gdn_decode
from jaxkern.families.gdn_prefill import gdn_prefill
from jaxkern.families.grouped_gemm import grouped_gemm_fp8_fp4, grouped_gemm_mxfp4_ste
from jaxkern.families.mixed_mla import mixed_mla_decode
from jaxkern.families.moe_router import moe_router
from jaxkern.families.neighborhood_attention import neighborhood_attention_3d
from jaxkern.families.qsa_index import qsa_index_topk
from jaxkern.families.qsa_sparse_gqa import qsa_sparse_gqa_decode
from jaxkern.families.sparse_mla import sparse_mla_prefill

__all__ = [
  "Backend",
  "InputError",
  "attention",
  "block_causal_attention",
  "checked",
  "dense_gemm",
  "gdn_decode",
  "gdn_prefill",
  "grouped_gemm_fp8_fp4",
  "grouped_gemm_mxfp4_ste",
  "mixed_mla_decode",
  "moe_router",
  "neighborhood_attention_3d",
  "prefix_cached_attention",
  "qsa_index_topk",
  "qsa_sparse_gqa_decode",
  "sparse_mla_prefill",
]
