# Demo trainer: the reference trainer (`packfeed train`, torch on CPU) and the gRPC client, plus the demo
# dataset writer (scikit-image). Build from the repository root:
#   docker build -f docker/trainer.Dockerfile -t packfeed/trainer .
# BASE_IMAGE as for the server. Torch comes from TORCH_INDEX_URL (the CPU wheels by default: PyPI's
# default Linux wheel pulls in GBs of CUDA libraries); wheels put in docker/wheels/ are used first, which
# is how an offline build gets its torch (leave TORCH_INDEX_URL empty then).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG TORCH_SPEC="torch>=2.4,<=2.14.1"
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    PATH=/opt/packfeed/bin:$PATH
RUN python3 -m venv /opt/packfeed
COPY docker/wheels/ /wheels/
RUN pip install --find-links /wheels ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"

WORKDIR /src
# Dependencies first, in their own layer (rebuilt only when pyproject.toml changes), then the source.
COPY pyproject.toml docker/requirements.py ./
RUN python3 requirements.py client demo > requirements.txt && pip install --find-links /wheels -r requirements.txt
COPY setup.py README.md ./
COPY protos protos
COPY media media
COPY loader_server loader_server
COPY cli cli
COPY client client
COPY trainer trainer
RUN pip install --no-deps --no-build-isolation . && cd / && rm -rf /src /wheels

WORKDIR /work
ENTRYPOINT ["packfeed"]
CMD ["train", "--help"]
