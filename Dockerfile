# syntax=docker/dockerfile:1
# swarmnode: the node daemon image (ops.md §8). amd64 only (hivemind ships an x86_64 p2pd).
#
#   docker build -t swarmnode:dev .
#   docker run -d --shm-size=8g --stop-timeout 30 --restart on-failure:5 \
#     -v swarmnode:/var/lib/swarmnode -p 31337:31337 -p 31337:31337/udp -p 50051:50051 -p 9400:9400 \
#     -e SWARMNODE_DHT__INITIAL_PEERS='["/ip4/203.0.113.10/tcp/31337/p2p/12D3KooW..."]' \
#     swarmnode:dev run --role noloco --config /etc/swarmnode/noloco.toml
#
# GPUs: the default is a CPU image. For CUDA, take torch from a CUDA index (its wheels bundle the
# CUDA runtime; the host needs only the driver and the NVIDIA container toolkit, `--gpus all`):
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t swarmnode:dev-cu128 .
# or swap the runtime base for a CUDA image that provides python3.11 and pip on PATH:
#   docker build --build-arg BASE_IMAGE=<cuda runtime image with python3.11> --build-arg TORCH_INDEX=... .
# Run it with `docker run --gpus all ... swarmnode:dev-cu128 run --role noloco` : device.device = "auto"
# (node/device.py) takes the first visible GPU; `--set device.device=cuda:1` / `device.precision=bf16`
# pick another GPU / precision, and a missing GPU stops the node at start with what torch found.
# Docker's default 64 MB /dev/shm is too small for hivemind: always pass --shm-size.

ARG BASE_IMAGE=python:3.11-slim
ARG BUILDER_IMAGE=python:3.11-slim

# ---- builder: generate protocol/ code with the pinned grpcio-tools, build the wheel ----------
FROM --platform=linux/amd64 ${BUILDER_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CONSTRAINT=/tmp/constraints.txt
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential \
 && rm -rf /var/lib/apt/lists/*
# The version window that resolves cleanly (ARCHITECTURE.md): libp2p needs protobuf<7,
# grpcio-tools 1.85 needs protobuf 7.
RUN printf 'protobuf>=5.29,<7\ngrpcio-tools==1.81.*\n' > /tmp/constraints.txt \
 && pip install "grpcio-tools==1.81.*" "protobuf>=5.29,<7"
WORKDIR /src
# README.m[d]: copied when present (pyproject's readme), no error when absent
COPY pyproject.toml README.m[d] ./
COPY node/ node/
COPY protocol/ protocol/
COPY optimizers/ optimizers/
COPY pipeline/ pipeline/
COPY rl/ rl/
COPY security/ security/
COPY models/ models/
RUN python -c "import protocol" \
 && pip wheel --no-deps -w /wheels .

# ---- runtime: the wheel, torch, tini; nothing else ---------------------------------------
FROM --platform=linux/amd64 ${BASE_IMAGE} AS runtime
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG VERSION=0.1.0
ARG VCS_REF=unknown
ARG BUILD_DATE=unknown
LABEL org.opencontainers.image.title="swarmnode" \
      org.opencontainers.image.description="Node daemon for decentralized training swarms (NoLoCo, SkipPipe, collaborative GRPO)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${VCS_REF}" \
      org.opencontainers.image.created="${BUILD_DATE}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/var/lib/swarmnode \
    GOLOG_LOG_FMT=json \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 swarmnode \
 && useradd --uid 10001 --gid 10001 --home-dir /var/lib/swarmnode --no-create-home \
            --shell /usr/sbin/nologin swarmnode \
 && mkdir -p /var/lib/swarmnode /etc/swarmnode \
 && chown 10001:10001 /var/lib/swarmnode
# torch first, in its own layer, from the CPU (or CUDA) index; same range as pyproject.toml
RUN pip install --index-url "${TORCH_INDEX}" "torch>=2.4,<2.14"
COPY --from=builder /tmp/constraints.txt /tmp/constraints.txt
COPY --from=builder /wheels/ /tmp/wheels/
RUN pip install -c /tmp/constraints.txt --extra-index-url "${TORCH_INDEX}" /tmp/wheels/*.whl \
 && rm -rf /tmp/wheels /tmp/constraints.txt \
 && swarmnode --help > /dev/null
COPY deploy/configs/*.toml /etc/swarmnode/
COPY deploy/configs/noloco.toml /etc/swarmnode/node.toml

# key and checkpoints live here; nothing else is written
VOLUME /var/lib/swarmnode
WORKDIR /var/lib/swarmnode
USER 10001:10001
# libp2p TCP + QUIC, gRPC, ops HTTP (/metrics /healthz /readyz /peerinfo)
EXPOSE 31337/tcp 31337/udp 50051 9400
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
  CMD ["swarmnode", "status", "--local", "--ready"]
# tini is PID 1: forwards SIGTERM to swarmnode (which drains) and reaps hivemind's forks and p2pd
ENTRYPOINT ["tini", "--", "swarmnode"]
CMD ["run", "--config", "/etc/swarmnode/node.toml"]
