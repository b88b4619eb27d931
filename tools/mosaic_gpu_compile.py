"""Compiles the Mosaic GPU kernels (dense GEMM, flash attention forward) for
sm_90a without a GPU and reads the machine code: registers, spills and shared memory (`ptxas -v`), the
`setmaxnreg` values, the wgmma kinds and the TMA / mbarrier instructions
(PTX), and the SASS instruction counts.

    JAX_PLATFORMS=cpu .venv/bin/python tools/mosaic_gpu_compile.py \
        [--kernel gemm|attention] [--target H100] [--m 24576] [--nk 12288x4096 ...]
        [--attention 4x2560x2560x128 ...] [--config all|heuristic] [--keep DIR]

compiles the chosen configs of the GEMM at M (default: the largest recorded,
24576) and each (N, K) (default: the three recorded), or of the attention at
each B x Nq x Nk x D with 32 heads and key_valid (default: the largest
recorded of the two non-causal definitions), and prints one markdown table
row per compile (the JSON of every figure goes to DIR/summary.json).

Needs, in the venv: `jax-cuda13-plugin` and `jax-cuda13-pjrt` of jax's
version (`--no-deps`), `nvidia-cuda-nvcc` 13.x (ptxas), `nvidia-nvvm`
(libdevice) and `nvidia-cuda-nvdisasm` (SASS). The jax 0.11.2 plugin embeds
no GPU target descriptions: pass `--plugin` the 0.12 plugin's
`xla_cuda_plugin.so` to read them from there (SPEC section 2).

How: the plugin embeds `GpuTargetConfigProto` texts; a topology built from
one gives a compile-only device, and compiling a function lowered on it runs
XLA's GPU pipeline, in which the plugin compiles the `mosaic_gpu_v2` call
with its own ptxas. `MOSAIC_GPU_DUMP_TO` (+ `_PTX`, `_PTXAS`, `_SASS`) makes it
write the PTX, the `ptxas -v` report and the SASS, read here.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import importlib.util
import json
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _plugin_library() -> str:
  spec = importlib.util.find_spec("jax_plugins.xla_cuda13")
  if spec is None or not spec.submodule_search_locations:
    raise SystemExit("jax-cuda13-pjrt is not installed (jax_plugins/xla_cuda13)")
  return os.path.join(list(spec.submodule_search_locations)[0], "xla_cuda_plugin.so")


def _setup_env(dump: str) -> None:
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  os.environ["MOSAIC_GPU_DUMP_TO"] = dump
  for what in ("PTX", "PTXAS", "SASS"):
    os.environ[f"MOSAIC_GPU_DUMP_{what}"] = "1"
  # The plugin's ptxas and nvdisasm: nvidia-cuda-nvcc / -nvdisasm put them under nvidia/cu13/bin.
  spec = importlib.util.find_spec("nvidia")
  if spec and spec.submodule_search_locations:
    bin_dir = os.path.join(list(spec.submodule_search_locations)[0], "cu13", "bin")
    if os.path.isdir(bin_dir):
      os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
      os.environ.setdefault("CUDA_ROOT", os.path.dirname(bin_dir))


_WGMMA = re.compile(r"\b(wgmma\.mma_async\.[\w.]+)")
_SETMAXNREG = re.compile(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)")
_TMA = re.compile(r"\bcp\.async\.bulk\.(?:tensor\.(\d)d\.)?(shared::cta\.global|shared::cluster\.global|global\.shared::cta)")
_MBARRIER = re.compile(r"\b(mbarrier\.[\w:.]+)")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_SASS_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)")


def read_dump(dump: str) -> dict:
  """The figures of the one kernel dumped under `dump`."""
  ptx = "\n".join(open(p, encoding="utf-8", errors="replace").read() for p in glob.glob(f"{dump}/**/*.ptx", recursive=True))
  ptxas = "\n".join(open(p, encoding="utf-8", errors="replace").read()
                    for p in glob.glob(f"{dump}/**/*ptxas*", recursive=True))
  sass = "\n".join(open(p, encoding="utf-8", errors="replace").read() for p in glob.glob(f"{dump}/**/*.sass*", recursive=True))
  regs = _PTXAS_REGS.findall(ptxas)
  spills = _PTXAS_SPILLS.findall(ptxas)
  # Tensor copies (TMA with a descriptor) and plain bulk copies (1-D, no descriptor).
  tma = collections.Counter(("load" if d.startswith("shared") else "store") + ("" if rank else " (bulk 1-D)")
                            for rank, d in _TMA.findall(ptx))
  sass_ops = collections.Counter(op.split(".")[0] for op in _SASS_OP.findall(sass))
  return {
      "files": sorted(os.path.relpath(p, dump) for p in glob.glob(f"{dump}/**/*", recursive=True) if os.path.isfile(p)),
      "registers": int(regs[-1]) if regs else None,
      "stack_spill_stores_loads": [int(x) for x in spills[-1]] if spills else None,
      "setmaxnreg": sorted({f"{d}.{n}" for d, n in _SETMAXNREG.findall(ptx)}),
      "wgmma_ptx": dict(collections.Counter(_WGMMA.findall(ptx))),
      "tma_ptx": dict(tma),
      "mbarrier_ptx": dict(collections.Counter(_MBARRIER.findall(ptx))),
      "sass": {op: sass_ops[op] for op in ("HGMMA", "UTMALDG", "UTMASTG", "SYNCS", "USETMAXREG", "WARPGROUP",
                                           "BAR", "STSM", "STS", "LDS", "STL", "LDL") if op in sass_ops},
      "ptxas_report": ptxas.strip()[-2000:],
  }


def markdown_row(r: dict) -> str:
  """| jax | sizes | config | registers | spills | smem | setmaxnreg | wgmma | TMA | mbarrier | SASS | status |"""
  config = " ".join(f"{k}={v}" for k, v in r["config"].items())
  spills = r["stack_spill_stores_loads"]
  fmt = lambda d: ", ".join(f"{v} {k}" for k, v in d.items()) or "-"
  cells = [r["jax"], " ".join(f"{k}={v}" for k, v in r["sizes"].items()), config, str(r["registers"]),
           "-" if spills is None else f"{spills[1]}/{spills[2]}", f"{r['shared_memory_bytes'] / 1024:.0f} KiB",
           " ".join(r["setmaxnreg"]), fmt({k.replace("wgmma.mma_async.sync.aligned.", ""): v
                                            for k, v in r["wgmma_ptx"].items()}),
           fmt(r["tma_ptx"]), fmt({k.replace("mbarrier.", ""): v for k, v in r["mbarrier_ptx"].items()}),
           fmt(r["sass"]), r["error"][:120] or "ok"]
  return "| " + " | ".join(cells) + " |"


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--target", default="H100")
  parser.add_argument("--plugin", default=None, help="xla_cuda_plugin.so to read the GPU targets from")
  parser.add_argument("--m", type=int, default=24576)
  parser.add_argument("--nk", nargs="+", default=["12288x4096", "4096x4096", "4096x12288"],
                      help="(N, K) pairs as NxK")
  parser.add_argument("--kernel", default="gemm", choices=("gemm", "attention"))
  parser.add_argument("--attention", nargs="+",
                      default=["4x2560x2560x128", "4x2560x126x64", "1x4096x4096x128p4125", "1x4125x4125x128s"],
                      help="attention sizes as BxNqxNkxD (32 heads) with key_valid; BxNqxNkxDpNp: prefix keys "
                           "instead; BxNxNxDs: segment_ids instead")
  parser.add_argument("--config", default="heuristic", choices=("heuristic", "all"))
  parser.add_argument("--keep", default=None, help="folder to keep the dumps in")
  args = parser.parse_args(argv)

  root = args.keep or tempfile.mkdtemp(prefix="mosaic_gpu_compile_")
  os.makedirs(os.path.join(root, "config0"), exist_ok=True)
  _setup_env(os.path.join(root, "config0"))
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  from jaxkern.aot.toolchain import target_configs  # pylint: disable=g-import-not-at-top
  from pallas_kernels.dense_gemm import mosaic_gpu as mg  # pylint: disable=g-import-not-at-top
  from pallas_kernels.flash_attention import mosaic_gpu as fa  # pylint: disable=g-import-not-at-top

  targets = target_configs(args.plugin or _plugin_library())
  names = sorted((n for n in targets if args.target.lower() in n.lower()), key=lambda n: ("MIG" in n, "PCIe" in n, len(n)))
  if not names:
    raise SystemExit(f"no target matching {args.target!r} in {sorted(targets)}")
  topology = topologies.get_topology_desc(platform="cuda", topology_name="", target_config=targets[names[0]],
                                          topology="1x1x1")
  mesh = jax.sharding.Mesh(np.array(topology.devices[:1]), ("x",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  grid = getattr(topology.devices[0], "core_count", None) or 132
  aval = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
  jobs = []   # (sizes, config, function, avals, shared memory bytes)
  if args.kernel == "gemm":
    for nk in args.nk:
      n, k = map(int, nk.split("x"))
      shapes = {"A": aval((args.m, k)), "B": aval((n, k))}
      configs = [mg.choose_config(shapes)] if args.config == "heuristic" else mg.candidate_configs(shapes)
      for config in configs:
        config = config if config.grid else dataclasses.replace(config, grid=grid)
        jobs.append(({"M": args.m, "N": n, "K": k}, config,
                     lambda a, b, c=config: mg.dense_gemm_nt(a, b, config=c, interpret=False),
                     (shapes["A"], shapes["B"]), config.shared_memory_bytes))
  else:
    for spec in args.attention:
      shape, prefix_len = (spec.split("p") + ["0"])[:2] if "p" in spec else (spec.rstrip("s"), "0")
      b, nq, nk, d = map(int, shape.split("x"))
      np_ = int(prefix_len)
      sizes = {"B": b, "Nq": nq, "Nk": nk, "H": 32, "D": d}
      qkv = (aval((b, nq, 32, d)), aval((b, nk, 32, d)), aval((b, nk, 32, d)))
      if np_:
        sizes["Np"] = np_
        extra, call = (aval((b, np_, 32, d)), aval((b, np_, 32, d))), lambda kp, vp: {"k_prefix": kp, "v_prefix": vp}
      elif spec.endswith("s"):
        sizes["segments"] = True
        extra, call = (aval((b, nq), jnp.int32),), lambda ids: {"segment_ids": ids}
      else:
        extra, call = (aval((b, nk), jnp.bool_),), lambda kv: {"key_valid": kv}
      named = {"q": qkv[0], "k": qkv[1], "k_prefix": extra[0] if np_ else None}
      configs = [fa.choose_config(named)] if args.config == "heuristic" else fa.candidate_configs(named)
      for config in configs:
        def fn(q, k, v, *rest, c=config, call=call):
          return fa.flash_attention_forward(q, k, v, config=c, interpret=False, **call(*rest))
        jobs.append((sizes, config, fn, qkv + extra, fa.shared_memory_bytes(config, d)))
  results = []
  for sizes, config, fn, avals, smem in jobs:
    # The plugin names its dumps per kernel; one folder per compile keeps them apart.
    dump = os.path.join(root, f"config{len(results)}")
    os.makedirs(dump, exist_ok=True)
    os.environ["MOSAIC_GPU_DUMP_TO"] = dump
    error = ""
    try:
      jax.jit(fn).trace(*avals).lower().compile()
    except Exception as e:  # pylint: disable=broad-except
      error = f"{type(e).__name__}: {str(e)[:800]}"
    results.append({"target": names[0], "jax": jax.__version__, "sizes": sizes,
                    "config": dataclasses.asdict(config), "shared_memory_bytes": smem,
                    "error": error, **read_dump(dump)})
    print(markdown_row(results[-1]), flush=True)
  with open(os.path.join(root, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1)
  print("dumps under", root, file=sys.stderr)


if __name__ == "__main__":
  main()
