# syntax=docker/dockerfile:1
# qerl/prompts: builds chat-templated prompt shards (`python -m components.prompts`). Build from
# the REPO ROOT:
#   docker build -f images/prompts.Dockerfile -t REGISTRY/qerl/prompts:0.1.0 .
# CPU only. Versions are those of requirements.lock; torch (CPU wheel) is there so transformers
# runs with its full feature set, although the stage itself only needs the tokenizer.
FROM python:3.11.13-slim-bookworm

ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="qerl/prompts" \
      org.opencontainers.image.description="QeRL Pipeline prompts stage: GSM8K JSONL, reasoning-gym or a table -> prompt shards" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://example.invalid/qerl-pipeline" \
      org.opencontainers.image.licenses="NOASSERTION"

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml requirements.lock ./
COPY components ./components
COPY kernels ./kernels
RUN touch README.md pipeline.py \
 && pip install -c requirements.lock --extra-index-url https://download.pytorch.org/whl/cpu torch==2.13.0+cpu \
        transformers==5.19.0 reasoning-gym==0.1.25 numpy==2.3.5 \
        boto3==1.44.8 pyarrow==26.0.1 PyYAML==6.0.4 tqdm==4.70.1 \
 && pip install --no-deps . \
 && cd / && rm -rf /src

RUN useradd --uid 10001 --create-home --home-dir /home/qerl qerl
USER 10001
ENV HOME=/home/qerl TMPDIR=/tmp HF_HOME=/home/qerl/.cache/huggingface
WORKDIR /home/qerl
ENTRYPOINT ["python", "-m", "components.prompts"]
