# `make demo`: set up and run the main job on the embedded corpus. `make test`: set up and run the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build of torch where there is no NVIDIA GPU (torch==2.13.0 is the local CPU wheel on our machines),
# the regular CUDA build where there is one. Override with `make TORCH_SPEC=... setup`, and the index with
# TORCH_INDEX (PyTorch's CPU wheels elsewhere: TORCH_INDEX=https://download.pytorch.org/whl/cpu).
HAS_GPU := $(shell if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then echo 1; fi)
TORCH_SPEC ?= $(if $(HAS_GPU),torch,torch==2.13.0)
# The demo: a few minutes of BERT-mini on a CPU; on a GPU the same model on ~53x the sequences (configs/default-gpu.yaml)
DEMO_CONFIG ?= $(if $(HAS_GPU),default-gpu,default)
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM ?= false
# DeepSpeed's JIT-built ops live with this venv: a fresh clone never meets a stale build lock from elsewhere
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions

.PHONY: setup warm demo check test test-fast clean
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: setup
	$(VENV)/bin/pretrain run $(DEMO_CONFIG)

# DeepSpeed JIT-compiles its CPU comm op on first use; build it once here so that test processes (and
# several ranks) never race to compile it at the same time.
warm: setup
	DS_ACCELERATOR=cpu $(PY) -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"

# Lint and format (ruff, configured in pyproject.toml), and no file over 1 MiB in git outside data/ (wheels, tools
# and build output stay out of the repository).
check: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	@big=$$(git ls-files -z | xargs -0 -r stat -c '%s %n' | awk '$$1 > 1048576 && $$2 !~ /^data\// {print "  " $$2 " (" int($$1 / 1048576) " MiB)"}'); \
	if [ -n "$$big" ]; then echo "files over 1 MiB outside data/ (keep tools, wheels and build output out of git):"; echo "$$big"; exit 1; fi

test: warm
	$(PY) -m pytest -q tests

test-fast: warm
	$(PY) -m pytest -q -m "not slow" tests

clean:
	rm -rf runs .pytest_cache
