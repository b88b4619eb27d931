"""Where a replay's workloads run: one worker per local device, either a
child process (`isolation="process"`, the default) or a thread of this
process (`isolation="none"`).

A call into XLA cannot be interrupted. A child process can be killed: past
its timeout (or when it dies, e.g. a kernel that crashes the runtime) the
workload gets its status, the child is killed and a fresh one takes the next
workload, and nothing stuck is left behind for the interpreter to shut down
over. Each child starts once per run (about a second, plus its compiles), so
the normal case pays no per-workload cost. In this process (`none`) a
workload's `timeout_s` is only checked between its steps (compile, run,
timing), so a stuck call blocks the run; nothing is abandoned either.

Children are started with `spawn` (a fork of a process that initialized
XLA is unsafe; spawn imports the parent's main module again, so a script
calling the replay needs an `if __name__ == "__main__":` guard), inherit
`sys.path` and the environment, and do not preallocate GPU memory
(`XLA_PYTHON_CLIENT_PREALLOCATE=false` unless set), so several can share
the machine with their parent.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from jaxkern import bench, dataset
from jaxkern import results as results_lib
from jaxkern.compare import Status

ISOLATIONS = ("process", "none")
_STARTUP_S = 600.0  # a child's imports and backend start (not part of any workload's timeout)
_POLL_S = 0.2


@dataclasses.dataclass(frozen=True)
class Setup:
  """What every worker needs to run a workload."""

  cfg: Any  # ConfigDict
  dataset_dir: str
  interpret: bool
  on_gpu: bool
  device_index: int


def _run_one(setup: Setup, w: dataset.Workload, cache: bench.CompileCache, device: Any) -> results_lib.Trace:
  import jax

  from jaxkern import (
    evaluate,  # looked up per call: tests patch it
    registry,
  )

  with jax.default_device(device):
    return evaluate.run_workload(
      registry.get(w.definition, setup.dataset_dir), w, setup.cfg, cache, setup.interpret, setup.on_gpu
    )


def _cache(setup: Setup) -> bench.CompileCache:
  return bench.CompileCache(kernel_names=setup.on_gpu and not setup.interpret)


def local_devices(cfg: Any) -> list[Any]:
  import jax

  return jax.local_devices() if cfg.devices == "all" else jax.local_devices()[:1]


# -- in this process ------------------------------------------------------------


class InProcess:
  """Runs workloads on the calling thread (one thread per device)."""

  def __init__(self, setup: Setup):
    self.setup = setup
    self.device = local_devices(setup.cfg)[setup.device_index]
    self.cache = _cache(setup)

  def run(self, w: dataset.Workload, stop: threading.Event) -> results_lib.Trace | None:
    del stop  # a call in this process cannot be abandoned
    return _run_one(self.setup, w, self.cache, self.device)

  def close(self) -> None:
    pass


# -- in a child process -----------------------------------------------------------


def _die_with_parent() -> None:
  """Linux: the child is killed when the thread that started it ends (the
  parent killed with SIGKILL included), so a stuck child is never orphaned."""
  try:
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    pass


def _child_main(conn: Any, setup: Setup) -> None:
  """A child's loop: a workload in, its result (JSON) out, until None."""
  _die_with_parent()
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what a Ctrl-C stops
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  device = local_devices(setup.cfg)[setup.device_index]
  cache = _cache(setup)
  conn.send("ready")
  while True:
    w = conn.recv()
    if w is None:
      return
    try:
      conn.send(_run_one(setup, w, cache, device).to_json())
    except Exception as e:
      conn.send({"error": bench.short_error(e)})


class ChildProcess:
  """Runs workloads in a child process; past the timeout (or when the child
  dies) the workload gets a status and the child is replaced."""

  def __init__(self, setup: Setup, make_trace: Callable[[dataset.Workload, Status, str], results_lib.Trace]):
    self.setup = setup
    self.make_trace = make_trace
    self._ctx = multiprocessing.get_context("spawn")
    self._proc = None
    self._conn = None
    self._busy = False

  def _start(self, stop: threading.Event) -> None:
    parent, child = self._ctx.Pipe()
    proc = self._ctx.Process(
      target=_child_main, args=(child, self.setup), daemon=True, name=f"jaxkern-worker-{self.setup.device_index}"
    )
    try:
      proc.start()
    except Exception as e:  # e.g. a setup that cannot be pickled
      parent.close()
      raise RuntimeError(
        f"replay worker process {self.setup.device_index} did not start: {bench.short_error(e)}"
      ) from e
    finally:
      child.close()
    self._proc = proc
    self._conn = parent
    try:
      ready = self._wait(_STARTUP_S, stop) == "ready"
    except (EOFError, OSError):
      ready = False
    if not ready:
      proc.join(5.0)
      code = proc.exitcode
      self.kill()
      raise RuntimeError(f"replay worker process {self.setup.device_index} did not start (exit code {code})")

  def _wait(self, seconds: float, stop: threading.Event) -> Any:
    """The child's next message; None past `seconds` or after `stop`;
    EOFError when the child died."""
    conn = self._conn
    assert conn is not None, "_wait runs only while a child is started"
    end = time.monotonic() + seconds
    while not conn.poll(min(_POLL_S, max(end - time.monotonic(), 0.0))):
      if stop.is_set() or time.monotonic() >= end:
        return None
    return conn.recv()

  def run(self, w: dataset.Workload, stop: threading.Event) -> results_lib.Trace | None:
    """The workload's result; None when `stop` was set first (the child is
    then killed and the workload has no result)."""
    if self._proc is None:
      try:
        self._start(stop)
      except RuntimeError as e:
        return None if stop.is_set() else self.make_trace(w, Status.RUNTIME_ERROR, str(e))
    proc, conn = self._proc, self._conn
    assert proc is not None and conn is not None, "_start sets both or raises"
    timeout_s = float(self.setup.cfg.timeout_s)
    self._busy = True
    conn.send(w)
    try:
      # The grace lets a workload that checks its own deadline report first.
      msg = self._wait(timeout_s * 1.1 + 5.0, stop)
      self._busy = False
    except (EOFError, OSError):
      proc.join(5.0)
      code = proc.exitcode
      self.kill()
      return self.make_trace(
        w, Status.RUNTIME_ERROR, f"the worker process died during this workload (exit code {code}); a new one goes on"
      )
    if msg is None:
      self.kill()
      if stop.is_set():
        return None
      return self.make_trace(
        w,
        Status.TIMEOUT,
        f"no result within {self.setup.cfg.timeout_s}s (the worker process was killed; a new one goes on)",
      )
    if "error" in msg:
      return self.make_trace(w, Status.RUNTIME_ERROR, msg["error"])
    return results_lib.Trace.from_json(msg)

  def kill(self) -> None:
    if self._proc is not None:
      if self._proc.is_alive():
        self._proc.kill()
      self._proc.join(10.0)
    if self._conn is not None:
      self._conn.close()
    self._proc = self._conn = None
    self._busy = False

  def close(self) -> None:
    """Asks an idle child to finish (a busy one, after Ctrl-C, or one that
    does not finish within 10 s is killed)."""
    if self._proc is not None and self._conn is not None and self._proc.is_alive() and not self._busy:
      try:
        self._conn.send(None)
        self._proc.join(10.0)
      except (OSError, BrokenPipeError):
        pass
    self.kill()


def make_worker(
  isolation: str, setup: Setup, make_trace: Callable[[dataset.Workload, Status, str], results_lib.Trace]
) -> InProcess | ChildProcess:
  if isolation not in ISOLATIONS:
    raise ValueError(f"isolation must be one of {ISOLATIONS}, got {isolation!r}")
  return ChildProcess(setup, make_trace) if isolation == "process" else InProcess(setup)
