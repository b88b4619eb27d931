# Two commands do everything on a fresh machine (see README):
#   make replay   install, then run the replay (ARGS='--config.definitions=...' to narrow it)
#   make test     install, then run the whole test suite
# The interpreter is `python` as resolved by pyenv through .python-version (3.12).

PYTHON ?= python
VENV := .venv
STAMP := $(VENV)/.installed-stamp

$(STAMP): setup.py constraints.txt
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 12), "jaxkern needs Python >= 3.12 (see .python-version), got " + sys.version'
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

.PHONY: install replay test
install: $(STAMP)

replay: $(STAMP)
	$(VENV)/bin/python -m jaxkern.replay --config configs/replay.py $(ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n 2 --durations=15 tests
