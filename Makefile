# Two commands do everything on a fresh machine (see README):
#   make replay   install, then run the replay (ARGS='--config.definitions=...' to narrow it)
#   make test     install, then run the whole test suite (the Bazel build and its test subset, then pytest)
#   make aot      install (the compile toolchain into .aot-toolchain/), then compile every kernel for sm_90a (ARGS='--definition=...')
#   make docs     the API reference (pdoc) into build/docs/ (part of make test)
#   make device-kit   put the wheels the GPU machine lacks into .whl/ (see docs/device_run.md)
#   make fib-check  export the dataset as a FlashInfer-Bench TraceSet and check it with the real client (.venv-fib)
# The interpreter is `python` as resolved by pyenv through .python-version (3.12).

PYTHON ?= python
VENV := .venv
STAMP := $(VENV)/.installed-stamp
# The aot extra's packages (pyproject.toml): the compile toolchain, kept out of .venv (below).
AOT_PACKAGES := jax-cuda13-plugin jax-cuda13-pjrt nvidia-cuda-nvcc nvidia-nvvm

$(STAMP): pyproject.toml setup.py constraints.txt
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 12), "jaxkern needs Python >= 3.12 (see .python-version), got " + sys.version'
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -c constraints.txt -e '.[test,examples,nn]'
	$(VENV)/bin/python -m pip uninstall -qq -y $(AOT_PACKAGES)  # where an older make install put them
	touch $(STAMP)

# The sm_90a compile toolchain (the aot extra: the CUDA 13 plugin of jax's
# version, ptxas, libdevice) for jaxkern.aot and its tests, in a folder of its
# own that those commands put on PYTHONPATH, not in .venv: there the plugin
# would probe for a CUDA runtime in every process. --no-deps: nvidia-cuda-nvcc
# would also pull a CUDA runtime, which a compile-only target does not use.
AOT_DIR := .aot-toolchain
AOT_STAMP := $(AOT_DIR)/.installed-stamp
WITH_AOT := PYTHONPATH="$(CURDIR)/$(AOT_DIR)$${PYTHONPATH:+:$$PYTHONPATH}"

$(AOT_STAMP): constraints.txt | $(STAMP)
	rm -rf $(AOT_DIR)
	$(VENV)/bin/python -m pip install -q --no-deps --target $(AOT_DIR) -c constraints.txt $(AOT_PACKAGES)
	touch $(AOT_STAMP)

# The device-stack lane: a second environment with exactly the GPU machine's
# packages (constraints-device.txt: jax 0.11.2 + the CUDA 13 plugin, no
# ml_collections), plus pytest and the sm_90a compile tools (ptxas, libdevice:
# the aot tests compile with the machine's jax); jaxkern and the device kit's
# wheels come on PYTHONPATH as scripts/gpu_run.sh puts them there.
DEVICE_VENV := .venv-device
DEVICE_STAMP := $(DEVICE_VENV)/.installed-stamp
KIT_STAMP := .whl/.kit-stamp

$(DEVICE_STAMP): constraints-device.txt constraints.txt
	$(PYTHON) -m venv $(DEVICE_VENV)
	$(DEVICE_VENV)/bin/python -m pip install -q --upgrade pip
	$(DEVICE_VENV)/bin/python -m pip install -q -r constraints-device.txt
	$(DEVICE_VENV)/bin/python -m pip install -q -c constraints.txt pytest pytest-xdist
	$(DEVICE_VENV)/bin/python -m pip install -q --no-deps -c constraints.txt nvidia-cuda-nvcc nvidia-nvvm
	touch $(DEVICE_STAMP)

$(KIT_STAMP): scripts/device_kit.py constraints.txt constraints-device.txt | $(STAMP)
	$(VENV)/bin/python scripts/device_kit.py --out .whl
	touch $(KIT_STAMP)

.PHONY: install aot-toolchain replay test lint docs test-main test-device device-kit aot test-aot gpu-run gpu-run-dry bazel fib-venv fib-check
install: $(STAMP)

aot-toolchain: $(AOT_STAMP)

# Each run writes a new results file (results/replay-<time>.jsonl, named on
# its last line).
replay: $(STAMP)
	$(VENV)/bin/python -m jaxkern.replay --config configs/replay.py $(ARGS)

# The Bazel check and the device-stack lane run first, so that the main
# suite's pytest summary closes the output.
test: $(STAMP)
	$(MAKE) --no-print-directory lint
	$(MAKE) --no-print-directory docs
	$(MAKE) --no-print-directory bazel
	$(MAKE) --no-print-directory test-device
	$(MAKE) --no-print-directory test-main

# ruff (lint and format) and pyright (basic, jaxkern/ and pallas_kernels/), as
# configured in pyproject.toml: zero findings.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pyright

# The API reference (pdoc, from the docstrings of jaxkern's public modules and
# the pallas_kernels configs) into build/docs/ (tools/docs.py). Fails on any
# pdoc warning, on a `jaxkern.`/`pallas_kernels.` name in a docstring that does
# not resolve, and on a test-only package imported on the way.
docs: $(STAMP)
	$(VENV)/bin/python tools/docs.py --out build/docs

# With the compile toolchain on the path: tests/test_aot.py compiles for sm_90a.
test-main: $(STAMP) $(AOT_STAMP)
	$(WITH_AOT) $(VENV)/bin/python -m pytest -q -n 2 --durations=15 tests

# What the first GPU run depends on, on the GPU machine's stack (tests marked
# device_stack: the device run's dry mode with its smoke replay of every
# definition, H100 lowering of every shipped kernel, sharding and autodiff
# smoke). Only the files that hold such tests are collected: the others may
# import test-only packages the machine lacks.
test-device: $(DEVICE_STAMP) $(KIT_STAMP)
	PYTHONPATH="$(CURDIR)$$(printf ':%s' $(CURDIR)/.whl/*.whl)" JAXKERN_DEVICE_STACK=1 \
	  $(DEVICE_VENV)/bin/python -m pytest -q -n 2 -m device_stack --durations=10 $$(grep -l device_stack tests/test_*.py)

device-kit: $(KIT_STAMP)

aot: $(STAMP) $(AOT_STAMP)
	$(WITH_AOT) $(VENV)/bin/python -m jaxkern.aot $(ARGS)

test-aot: $(STAMP) $(AOT_STAMP)
	$(WITH_AOT) $(VENV)/bin/python -m pytest -q -n 0 tests/test_aot.py

# The one prepared device run (see scripts/gpu_run.sh); -dry checks it on a CPU.
gpu-run: $(STAMP)
	PYTHON=$(VENV)/bin/python scripts/gpu_run.sh $(OUT)

gpu-run-dry: $(STAMP)
	DRY_RUN=1 PYTHON=$(VENV)/bin/python scripts/gpu_run.sh $(or $(OUT),results/gpu_run_dry)

# Bazel (Debian's bazel-bootstrap 4.2, installed with apt if missing) builds
# every target and runs a fast test subset offline, on the .venv interpreter.
BAZEL_FLAGS := --override_repository=rules_cc=$(CURDIR)/tools/bazel/stubs/rules_cc \
	--override_repository=rules_java=$(CURDIR)/tools/bazel/stubs/rules_java \
	--override_repository=remote_coverage_tools=$(CURDIR)/tools/bazel/stubs/remote_coverage_tools
BAZEL_TESTS ?= //:test_build //:test_compare //:test_dataset

bazel: $(STAMP)
	command -v bazel >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bazel-bootstrap)
	bazel --batch build $(BAZEL_FLAGS) //...
	bazel --batch test $(BAZEL_FLAGS) $(BAZEL_TESTS)

# The real FlashInfer-Bench client (README, "FlashInfer-Bench"): a separate venv
# with flashinfer-bench 0.1.2 (--no-deps, see tools/fib/requirements.txt) and
# PyPI's torch with its CUDA libraries (about 4 GB of download, 5.4 GB on disk;
# it runs on the CPU). fib-check exports the dataset with a smoke replay and the
# synthetic results of tests/fib_results.py (6 of them are FIB traces), loads
# the folder with the client (tools/fib/check.py), imports it back and replays
# the import with FIB_REPLAY_CONFIG (default: configs/replay.py, scale auto).
FIB_VENV := .venv-fib
FIB_STAMP := $(FIB_VENV)/.installed-stamp
FIB_OUT ?= results/fib_check
FIB_REPLAY_CONFIG ?= configs/replay.py

$(FIB_STAMP): pyproject.toml setup.py constraints.txt tools/fib/requirements.txt
	$(PYTHON) -m venv $(FIB_VENV)
	$(FIB_VENV)/bin/python -m pip install -q --upgrade pip
	$(FIB_VENV)/bin/python -m pip install -q -c constraints.txt -r tools/fib/requirements.txt -e .
	$(FIB_VENV)/bin/python -m pip install -q --no-deps flashinfer-bench==0.1.2
	touch $(FIB_STAMP)

fib-venv: $(FIB_STAMP)

fib-check: $(STAMP) $(FIB_STAMP)
	rm -rf $(FIB_OUT) && mkdir -p $(FIB_OUT)
	$(VENV)/bin/python -m jaxkern.replay --config configs/smoke.py --config.progress=False \
	    --config.definitions=dense_gemm_bf16_nt_n4096_k4096,moe_router --config.output=$(FIB_OUT)/smoke.jsonl
	cd tests && ../$(VENV)/bin/python -c 'import fib_results; fib_results.write("../$(FIB_OUT)/synthetic.jsonl")'
	$(VENV)/bin/python -m jaxkern.fib export --out $(FIB_OUT)/traceset \
	    --results $(FIB_OUT)/smoke.jsonl $(FIB_OUT)/synthetic.jsonl
	$(FIB_VENV)/bin/python tools/fib/check.py $(FIB_OUT)/traceset --definitions 21 --workloads 1104 --traces 6 \
	    --reference dense_gemm_bf16_nt_n4096_k4096 --reference moe_router_gemm_topk_deepseek41_d5120_e384_topk6 \
	    --reference mixed_mla_decode_deepseek41_h64_d512_k8128_k4512
	$(VENV)/bin/python -m jaxkern.fib import $(FIB_OUT)/traceset --out $(FIB_OUT)/dataset
	$(VENV)/bin/python -m jaxkern.replay --config $(FIB_REPLAY_CONFIG) --config.progress=False \
	    --config.dataset_dir=$(FIB_OUT)/dataset --config.output=$(FIB_OUT)/imported.jsonl
