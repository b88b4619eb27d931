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
