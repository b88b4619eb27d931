"""What jaxkern's command lines share: a quiet start.

Two kinds of start-up noise are not the user's business: absl logs at INFO
under `app.run`, which prints jax's backend probing ("Unable to initialize
backend 'tpu'"), and on a host without an NVIDIA GPU the CUDA plugin (the
`aot` or `cuda` extra) logs a cuDNN traceback from its version check before
jax goes on on the CPU. `--verbosity=0` (absl tools) brings the INFO lines
back.
"""

from __future__ import annotations

import glob
import os


def quiet_cuda_probe() -> None:
  """Skips the CUDA plugin's version check where no NVIDIA device exists
  (no `/dev/nvidia<N>`): it can only fail there, printing a cuDNN traceback
  (twice) before jax goes on on the CPU; on a GPU host the check still runs,
  and a value the caller set wins. `import jaxkern` calls it, so it takes
  effect wherever jaxkern is imported before jax initializes its backends;
  worker processes inherit it."""
  if not glob.glob("/dev/nvidia[0-9]*"):
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def quiet_absl_logging() -> None:
  """WARNING and above only, unless `--verbosity` was given (inside absl's
  `app.run`, after the flags are parsed)."""
  from absl import flags, logging

  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
