"""`python -m jaxkern.aot`: compile definitions' kernels for sm_90a and
print (or write) what the toolchain made of them.

  python -m jaxkern.aot                                   # every implemented definition
  python -m jaxkern.aot --definition moe_router --axes M=1 --all_candidates
  python -m jaxkern.aot --definition dense_gemm --json
  python -m jaxkern.aot --markdown docs/perf/sm90a_compile.md   # this jax version's section of the page
  python -m jaxkern.aot --backward --definition noncausal       # the gradients' kernels
  python -m jaxkern.aot --backend mosaic_gpu                     # one kernel backend (default: each one)
  python -m jaxkern.aot --write_targets   # rewrites the shipped H100/H200 target texts (jax 0.12 plugin)

The exit code is 1 unless every kernel is `ok`; 2 when the `aot` extra is
missing. A config that fails to compile is listed with its definition,
backend, kernel, config and the first lines of the compiler's message.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxkern.aot import targets
from jaxkern.aot.report import OK, format_rows, markdown_page, markdown_section, page_sections
from jaxkern.aot.toolchain import (
  DEFAULT_TARGET,
  PLUGIN_MODULE,
  Compiler,
  available,
  plugin_library,
  plugin_version,
  ptxas_binary,
  ptxas_version,
  skip_cuda_checks,
  target_origin,
)


def select_ops(patterns: Sequence[str]) -> list:
  """Implemented ops whose names equal or start with one of `patterns` (all
  implemented ones when empty); raises on a pattern that matches nothing."""
  from jaxkern import registry

  ops = [registry.get(n) for n in registry.names()]
  if not patterns:
    return [op for op in ops if op.implemented]
  chosen = []
  for p in patterns:
    hits = [op for op in ops if op.name == p or op.name.startswith(p)]
    if not hits:
      raise ValueError(f"--definition {p!r} matches no definition")
    for op in hits:
      if not op.implemented:
        raise ValueError(f"{op.name} has no kernel yet ({op.missing})")
      if op not in chosen:
        chosen.append(op)
  return chosen


def gradient_of(kernel: Callable[[dict], Any]) -> Callable[[dict, Any], Any]:
  """`(inputs, cotangent) -> gradients` of `kernel(inputs)` with respect to
  its floating inputs: what training compiles (the forward that saves the
  residuals, then the backward kernels)."""
  import jax
  import jax.numpy as jnp

  def fn(inputs, cotangent):
    floating = {k: v for k, v in inputs.items() if jnp.issubdtype(v.dtype, jnp.floating)}
    _, vjp = jax.vjp(lambda d: kernel({**inputs, **d}), floating)
    return vjp(cotangent)

  return fn


def check_op(
  compiler: Compiler,
  op,
  axes: Mapping[str, int],
  configs: Sequence[Any] | None = None,
  progress: Callable[[dict], None] | None = None,
  backward: bool = False,
  backend: str | None = None,
) -> list[dict]:
  """Compiles `op`'s kernel of `backend` (None: its default one) at `axes`
  for each config (default: the heuristic's) and returns one JSON-ready row
  per config; with `backward`, its gradient (`gradient_of`: the forward and
  the backward kernels, whose configs are their heuristic's)."""
  import jax

  from jaxkern import tuning

  shapes = op.input_shapes(axes)
  backend = op.kernel_of(backend).backend
  heuristic = op.choose_config(shapes, backend=backend)
  rows = []
  for config in configs if configs is not None else [heuristic]:
    kernel = lambda x, config=config: op.kernel(x, interpret=False, config=config, backend=backend)  # noqa: E731
    if backward:
      rep = compiler.compile(gradient_of(kernel), shapes, jax.eval_shape(kernel, shapes))
    else:
      rep = compiler.compile(kernel, shapes)
    row = {
      "definition": op.name + (" (backward)" if backward else ""),
      "backend": backend,
      "axes": {a: axes[a] for a in op.definition.var_axes if a in axes},
      "config": tuning.config_to_json(config),
      "heuristic": config == heuristic,
      "target": compiler.target,
      "status": rep.status,
      "compile_seconds": round(rep.compile_seconds, 2),
      "error": rep.message,  # the compiler's own message, first lines ("" when clean)
      "kernels": [dataclasses.asdict(k) for k in rep.kernels],
    }
    rows.append(row)
    if progress:
      progress(row)
  return rows


@dataclasses.dataclass(frozen=True)
class Flags:
  """The command line's flag holders (absl), defined by `define_flags`."""

  definition: Any
  axes: Any
  all_candidates: Any
  target: Any
  json: Any
  markdown: Any
  backward: Any
  backend: Any
  write_targets: Any


_FLAGS: Flags | None = None


def define_flags() -> Flags:
  """Defines the command line's flags; only `python -m jaxkern.aot` does
  this, so importing the package defines no global flag."""
  global _FLAGS
  from absl import flags

  _FLAGS = Flags(
    definition=flags.DEFINE_list("definition", [], "Definition names or prefixes (default: every implemented one)."),
    axes=flags.DEFINE_string(
      "axes", "", "Variable axes, e.g. 'M=4096' (default: the largest recorded, by input bytes)."
    ),
    all_candidates=flags.DEFINE_bool("all_candidates", False, "Every sweep candidate, not just the heuristic's."),
    target=flags.DEFINE_string(
      "target", DEFAULT_TARGET, "GPU target (a device name in the CUDA plugin, or a part of one)."
    ),
    json=flags.DEFINE_bool("json", False, "Print JSON instead of a table."),
    markdown=flags.DEFINE_string(
      "markdown",
      "",
      "Also write this jax version's section of the generated "
      "markdown page here (e.g. docs/perf/sm90a_compile.md), keeping the others.",
    ),
    backward=flags.DEFINE_bool(
      "backward",
      False,
      "Compile the gradient instead (forward and backward kernels) "
      "of the definitions whose kernels have Pallas backward kernels.",
    ),
    backend=flags.DEFINE_string(
      "backend", "pallas", "Kernel backend: pallas (each backend of the family) | triton | mosaic_gpu."
    ),
    write_targets=flags.DEFINE_bool(
      "write_targets",
      False,
      "Rewrite the shipped H100/H200 target texts "
      "(jaxkern/aot/gpu_targets) from the installed plugin, which must embed them "
      "(jax >= 0.12), then exit.",
    ),
  )
  return _FLAGS


def _write_targets() -> None:
  library = plugin_library()
  assert library is not None  # main checked available()
  source = f"jax-cuda13-pjrt {plugin_version()} ({PLUGIN_MODULE.replace('.', '/')}/{pathlib.Path(library).name})"
  for path in targets.write_shipped(library, source):
    print(f"wrote {path}", file=sys.stderr)


def toolchain_line(compiler: Compiler) -> str:
  """The plugin, ptxas and target text a page section names."""
  origin = (
    "embedded in the plugin"
    if target_origin(compiler.target) == "plugin"
    else "shipped in jaxkern/aot/gpu_targets (the plugin embeds none)"
  )
  return f"jax-cuda13-plugin {plugin_version()}, {ptxas_version()}, target text {origin}"


def _write_markdown(path: pathlib.Path, rows: list[dict], compiler: Compiler) -> None:
  """Writes `path` with this jax version's section replaced (or added) and
  the other versions' sections kept."""
  import jax

  sections = page_sections(path.read_text(encoding="utf-8")) if path.exists() else {}
  sections[jax.__version__] = markdown_section(
    rows,
    target=compiler.target,
    toolchain=toolchain_line(compiler),
    jax_version=jax.__version__,
    command=_command(sys.argv),
    date=datetime.date.today().isoformat(),
  )
  path.write_text(markdown_page(sections), encoding="utf-8")
  print(f"wrote {path} (section jax {jax.__version__})", file=sys.stderr)


def not_clean_line(row: Mapping[str, Any]) -> str:
  """A config that did not compile clean: definition, backend, kernels,
  config, status, then the compiler's message (first lines, indented)."""
  kernels = ", ".join(k["name"] for k in row["kernels"]) or "-"
  head = f"{row['definition']} {row['backend']} kernel {kernels}, config {json.dumps(row['config'])}: {row['status']}"
  return head + "".join(f"\n      {line}" for line in row["error"].splitlines())


def _command(argv: Sequence[str]) -> str:
  return " ".join(["python -m jaxkern.aot", *argv[1:]])


def main(argv: list[str]) -> None:
  """The command line (run through absl's `app.run` after `define_flags`)."""
  from absl import app

  from jaxkern import command_line, selection

  if _FLAGS is None:
    raise RuntimeError("jaxkern.aot.main runs as `python -m jaxkern.aot` (its flags are defined there)")
  f = _FLAGS
  command_line.quiet_absl_logging()
  skip_cuda_checks()
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  reason = available()
  if reason:
    print(f"jaxkern.aot: {reason}", file=sys.stderr)
    sys.exit(2)
  if f.write_targets.value:
    try:
      _write_targets()
    except ValueError as e:  # the plugin embeds none (jax 0.11.2)
      sys.exit(f"jaxkern.aot --write_targets: {e}")
    return
  try:
    ops = select_ops(f.definition.value or [])
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  if f.markdown.value and not pathlib.Path(f.markdown.value).resolve().parent.is_dir():
    raise app.UsageError(f"--markdown {f.markdown.value}: no folder {pathlib.Path(f.markdown.value).parent}")
  jobs = [(op, b) for op in ops for b in op.backends if f.backend.value in ("pallas", b)]
  if not jobs:
    raise app.UsageError(f"--backend {f.backend.value}: none of these definitions has such a kernel")
  if f.backward.value:
    jobs = [(op, b) for op, b in jobs if op.kernel_of(b).own_vjp]
    if not jobs:
      raise app.UsageError("--backward: none of these definitions has Pallas backward kernels")
  compiler = Compiler(f.target.value)
  print(f"target: {compiler.target} (sm_90a), {toolchain_line(compiler)}, ptxas {ptxas_binary()}", file=sys.stderr)
  rows = []
  for op, backend in jobs:
    axes = op.validated_axes(
      selection.parse_axes(f.axes.value) if f.axes.value else selection.largest_recorded_axes(op.definition)
    )
    configs = op.candidate_configs(op.input_shapes(axes), backend=backend) if f.all_candidates.value else None
    rows += check_op(
      compiler,
      op,
      axes,
      configs,
      backward=f.backward.value,
      backend=backend,
      progress=lambda r: print(
        f"{r['definition']} {r['backend']} {r['config']}: {r['status']} ({r['compile_seconds']:.1f} s)"
        + (f": {r['error'].splitlines()[0]}" if r["error"] else ""),
        file=sys.stderr,
        flush=True,
      ),
    )
  if f.markdown.value:
    _write_markdown(pathlib.Path(f.markdown.value), rows, compiler)
  if f.json.value:
    print(
      json.dumps({"target": compiler.target, "limits": dataclasses.asdict(compiler.limits), "rows": rows}, indent=1)
    )
  else:
    print(format_rows(rows))
    bad = [r for r in rows if r["status"] != OK]
    import jax

    print(
      f"{len(rows) - len(bad)}/{len(rows)} configs compile clean for {compiler.target} (jax {jax.__version__}, "
      f"{toolchain_line(compiler)})" + "".join("\n  " + not_clean_line(r) for r in bad)
    )
  sys.exit(0 if all(r["status"] == OK for r in rows) else 1)
