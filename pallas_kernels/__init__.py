"""Pallas GPU kernels (Triton and Mosaic GPU lowerings), one module per kernel family.

This package knows nothing about datasets or replay: every module is usable on
its own. Each family exposes a frozen config dataclass, a heuristic that picks a
config from shapes, and a launcher taking `interpret=` and `config=`.
"""

import os

# Mosaic GPU's interpreter (interpret mode on CPU) runs each warpgroup of a
# kernel as a thread whose body executes on XLA CPU's intra-op pool and blocks
# there in barrier waits; with no more pool threads than warpgroups (the pool
# holds os.cpu_count() threads: 2 on a small CI host, 3 warpgroups in the MLA
# kernels) every thread waits and the interpreter deadlocks. tsl sizes the
# pool from NPROC when set; it takes effect only if set before JAX creates its
# CPU client, so it is set here, on import, unless the caller chose a value.
os.environ.setdefault("NPROC", str(max(os.cpu_count() or 1, 8)))

# The first trace of a Pallas call imports Pallas's fuser, which registers a
# config flag (`pallas_fuser_disable_nested_fuse`) that is part of jit's cache
# key: the first jitted function of a process would change its own key between
# its first and second call and compile twice (measured: a jitted dense GEMM
# held 2 cache entries after two calls, 1 with this import). Importing the
# fuser here registers the flag before anything is jitted.
import jax.experimental.pallas.fuser  # noqa: E402, F401
