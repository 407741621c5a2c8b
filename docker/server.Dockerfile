# Packfeed loader server: `packfeed serve` (plus index / plan / stats / health). No torch.
# Build from the repository root:  docker build -f docker/server.Dockerfile -t packfeed/server .
# BASE_IMAGE: any Debian-like image with python3 >= 3.11 and its venv module (offline builds: a local base).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    PATH=/opt/packfeed/bin:$PATH
RUN python3 -m venv /opt/packfeed

WORKDIR /src
# Dependencies first, in their own layer (rebuilt only when pyproject.toml changes), then the source.
# EXTRAS: optional features from pyproject's extras, e.g. --build-arg EXTRAS="s3 fast" for shards in S3 and
# `pixels: fast` (the default image has neither).
ARG EXTRAS=""
COPY pyproject.toml docker/requirements.py ./
RUN python3 requirements.py ${EXTRAS} > requirements.txt && pip install -r requirements.txt
COPY setup.py README.md ./
COPY protos protos
COPY media media
COPY loader_server loader_server
COPY cli cli
COPY client client
COPY trainer trainer
# The server side installs without torch: packfeed.trainer / packfeed.client import it only when used.
RUN pip install --no-deps --no-build-isolation . && cd / && rm -rf /src
# The planner's kernels compiled into the image once (packfeed.server.plan.warmup), so a new container plans
# its first job at once. The cache is keyed to a CPU baseline, not to the build machine's CPU, so it stays
# valid on every host that has it (x86-64-v3: AVX2, every x86 server since 2013; arm64 builds: e.g. generic).
ARG NUMBA_CPU_NAME=x86-64-v3
ENV NUMBA_CACHE_DIR=/opt/packfeed/numba-cache NUMBA_CPU_NAME=${NUMBA_CPU_NAME} NUMBA_CPU_FEATURES=
RUN packfeed warmup

WORKDIR /data
# Scaled replicas share the host network: each binds the first free port of the ranges and writes the one it
# got to PACKFEED_ADDRESS_FILE, which the healthcheck reads.
ENV PACKFEED_LISTEN=0.0.0.0:50051-50058 \
    PACKFEED_METRICS_PORT=9400-9407 \
    PACKFEED_ADDRESS_FILE=/tmp/packfeed.address
HEALTHCHECK --interval=5s --timeout=5s --start-period=60s --retries=3 CMD ["packfeed", "health"]
ENTRYPOINT ["packfeed"]
CMD ["serve"]
