# syntax=docker/dockerfile:1
# qerl/reward: the built-in reward stage (`python -m components.reward`). Build from the REPO ROOT:
#   docker build -f images/reward.Dockerfile -t REGISTRY/qerl/reward:0.1.0 .
# Small on purpose (docs/reward-contract.md, section 5): no torch, no GPU, no model. The project is
# installed with --no-deps plus only what components.common and the built-in rewards import,
# pinned to requirements.lock (which, as a constraints file, also pins their dependencies).
FROM python:3.11.13-slim-bookworm

ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="qerl/reward" \
      org.opencontainers.image.description="QeRL Pipeline reward stage: built-in GSM8K/MATH/format rewards (CPU only, no torch)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://example.invalid/qerl-pipeline" \
      org.opencontainers.image.licenses="NOASSERTION"

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml requirements.lock ./
COPY components ./components
COPY kernels ./kernels
# README.md and pipeline.py are named by pyproject.toml (readme, py-modules); the stage needs neither.
RUN touch README.md pipeline.py \
 && pip install -c requirements.lock boto3==1.44.8 pyarrow==26.0.1 PyYAML==6.0.4 tqdm==4.70.1 math-verify==0.9.0 \
 && pip install --no-deps . \
 && cd / && rm -rf /src

# Unprivileged; writes only to $TMPDIR (staging) and its --output prefix.
RUN useradd --uid 10001 --create-home --home-dir /home/qerl qerl
USER 10001
ENV HOME=/home/qerl TMPDIR=/tmp
WORKDIR /home/qerl
ENTRYPOINT ["python", "-m", "components.reward"]
