"""jaxkern: Pallas GPU kernels for recorded serving workloads, and their replay."""

import setuptools

setuptools.setup(
  name="jaxkern",
  version="0.1.0",
  description="JAX/Pallas kernels replaying recorded serving workloads against jnp references",
  packages=setuptools.find_packages(include=["jaxkern", "jaxkern.*", "pallas_kernels", "pallas_kernels.*"]),
  # The shipped GPU target texts of jaxkern.aot (jaxkern/aot/targets.py); FlashInfer-Bench 0.1.2's JSON
  # Schemas (tests/test_fib.py validates exports against them).
  package_data={"jaxkern.aot": ["gpu_targets/*.txtpb"], "jaxkern.fib": ["schemas/*.json"]},
  python_requires=">=3.12",
  install_requires=[
    "jax>=0.11.2,<0.13",
    "jaxlib>=0.11.2,<0.13",
    "chex>=0.1.90,<0.2",
    "absl-py>=2.1,<3",
    "ml_collections>=1.0,<2",
    "safetensors>=0.4,<1",
    "numpy>=2.0,<3",
    "ml_dtypes>=0.5,<1",
    "tqdm>=4.66,<5",
    "tabulate>=0.9,<1",
    "matplotlib>=3.8,<4",
  ],
  extras_require={
    # jsonschema: tests/test_fib.py validates exports against FlashInfer-Bench's schemas.
    # ruff, pyright, pdoc: `make lint` and `make docs` (both part of `make test`).
    "test": [
      "pytest>=8,<10",
      "pytest-xdist>=3.5,<4",
      "jsonschema>=4.20,<5",
      "ruff>=0.17,<0.18",
      "pyright[nodejs]>=1.1.400,<1.2",
      "pdoc>=16,<17",
    ],
    # examples/video_train.py: the optimizer of the training example (its test runs in `make test`).
    "examples": ["optax>=0.2.8,<0.3"],
    # jaxkern.nn: the Flax NNX layers (the GPU machine's stack pins flax 0.12.12).
    "nn": ["flax>=0.12,<0.13"],
    # `python -m jaxkern.aot`: compile for sm_90a without a GPU (README): the
    # CUDA 13 plugin of jax's own version (without its `with-cuda` extra it
    # pulls no CUDA libraries), ptxas and libdevice. `make install` installs
    # these with --no-deps: nvidia-cuda-nvcc would pull a CUDA runtime that a
    # compile-only target does not use.
    "aot": [
      "jax-cuda13-plugin>=0.11.2,<0.13",
      "jax-cuda13-pjrt>=0.11.2,<0.13",
      "nvidia-cuda-nvcc>=13.0,<14",
      "nvidia-nvvm>=13.0,<14",
    ],
  },
)
