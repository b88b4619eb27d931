"""Where the Mosaic GPU kernels meet jax's own Mosaic GPU machinery, so that a
difference between the supported releases (0.11.2 on the GPU machine, 0.12 in
CI) has one place to go; and the one entry point every Mosaic GPU kernel
launches through, `kernel`, with the interpreter's race detector.

Checked on both releases (interpret runs, H100 lowering and the sm_90a
compile of every shipped config): the API these kernels use is the same.
The differences found are behavioural, and handled where they arise: the
0.11.2 interpreter also requires every thread that waited on a barrier to
have observed all of its phases when the barrier is freed (the kernels'
producers drain their last releases), the 0.11.2 CUDA plugin embeds no
GPU target descriptions (`jaxkern.aot` compiles with the H100/H200 texts
shipped in `jaxkern/aot/gpu_targets/`), and the race detector reports
differently (0.12 takes `on_race=`, raising by default; 0.11.2 prints and
sets a flag): `kernel` reads the flag after the call on both. All three are
tested in the device-stack lane (the fault tests, race-checked runs and the
sm_90a compile of the shipped configs on 0.11.2).

The race detector (`plgpu.InterpretGPUParams(detect_races=True)`): a
happens-before checker over vector clocks, one per warpgroup and per TMA
unit, joined by barrier waits, `wait_smem_to_gmem` and (for the async proxy)
`commit_smem`. It checks every `ref[...]` read and write (`plgpu.load`
included) and both ends of every TMA copy, against every earlier
conflicting access to the same buffer and range, on both releases; not the
operands of `wgmma`. docs/perf/mosaic_gpu.md ("Race detector") has what that
covers in each kernel. It is off unless `JAXKERN_DETECT_RACES=1` (the test
suite sets it) or `race_detection()` turns it on: a user's interpret run
checks numerics, and the detector, though cheap (0-20% more CPU time on
the kernels' test shapes, measured on that page), keeps every access of a
launch.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from jax.experimental import io_callback
from jax.experimental.pallas import mosaic_gpu as plgpu

DETECT_RACES_ENV = "JAXKERN_DETECT_RACES"
_race_detection: contextvars.ContextVar[bool | None] = contextvars.ContextVar("race_detection", default=None)


class RaceDetected(RuntimeError):
  """A Mosaic GPU kernel run in interpret mode with the race detector made
  two accesses to one shared- or global-memory range, at least one a write,
  that no synchronization orders."""


def detects_races() -> bool:
  """Whether kernels traced now run the interpreter's race detector:
  `race_detection()`'s setting inside one, else `JAXKERN_DETECT_RACES=1`.
  Read when a kernel is traced (a jitted launcher keeps what it saw)."""
  forced = _race_detection.get()
  return forced if forced is not None else os.environ.get(DETECT_RACES_ENV) == "1"


@contextlib.contextmanager
def race_detection(enabled: bool = True) -> Iterator[None]:
  """Turns the race detector on (or off) for the kernels traced inside,
  whatever `JAXKERN_DETECT_RACES` says."""
  token = _race_detection.set(enabled)
  try:
    yield
  finally:
    _race_detection.reset(token)


def interpret_params() -> plgpu.InterpretGPUParams:
  """The interpreter's parameters: the defaults, with the race detector when
  `detects_races()` (reporting without stopping: `kernel` raises after the
  call, naming the kernel; 0.11.2 has no `on_race` and always goes on)."""
  if not detects_races():
    return plgpu.InterpretGPUParams()
  if "on_race" in {f.name for f in dataclasses.fields(plgpu.InterpretGPUParams)}:
    return plgpu.InterpretGPUParams(detect_races=True, on_race="warn")
  return plgpu.InterpretGPUParams(detect_races=True)


def races_found() -> bool:
  """Whether the race detector flagged a race in the last kernel the
  interpreter ran, a failed one included (its state lives until the next
  kernel starts or `reset_interpreter`); False when none ran since."""
  try:
    return bool(interpret_pallas_call.get_races().races_found)
  except AssertionError:  # no state: no kernel ran since the last reset
    return False


def _raise_if_races(name: str) -> None:
  if races_found():
    raise RaceDetected(
      f"{name}: the Mosaic GPU interpreter's race detector found a data race (its report, RACE DETECTED "
      "with both accesses' buffers, ranges, warpgroups and source lines, is in the log or stdout above)"
    )


def kernel(body: Callable[..., None], *, name: str, interpret: bool, **kwargs: Any) -> Callable[..., Any]:
  """`plgpu.kernel(body, **kwargs)`, every Mosaic GPU kernel's launch: run in
  Mosaic GPU's CPU interpreter when `interpret` is set, then with the race
  detector when `detects_races()`: a race fails the call with
  `RaceDetected` naming `name` (the kernel: its launcher's name), after the
  kernel ran (the interpreter's own checks, barrier phases and pending
  arrivals, still fail it first)."""
  if interpret:
    kwargs["interpret"] = interpret_params()
  call = plgpu.kernel(body, **kwargs)
  if not (interpret and detects_races()):
    return call

  def checked(*args: Any) -> Any:
    out = call(*args)
    # Ordered: after the interpreter's own ordered callbacks of this kernel
    # (the last one frees its memory), before the next kernel's first.
    io_callback(functools.partial(_raise_if_races, name), None, ordered=True)
    return out

  return checked


def reset_interpreter() -> None:
  """Clears the interpreter's global state after a kernel failed in it (it
  refuses to run another kernel until then); jax exports no public name for
  it (the same private one in 0.11.2 and 0.12)."""
  interpret_pallas_call.reset_gpu_interpret_mode_state()
