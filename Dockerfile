# syntax=docker/dockerfile:1
# swarmnode: the node daemon image (docs/operations.md, 'Docker'). amd64 only (hivemind ships an x86_64 p2pd).
#
# The default image is CUDA-capable: torch comes from the CUDA wheel index, whose wheels bundle the
# CUDA runtime, so the host needs only the NVIDIA driver and the NVIDIA container toolkit. The same
# image runs on a machine without a GPU (device.device = "auto" falls back to the CPU). For a
# smaller CPU-only image pass the CPU index:
#   docker build -t swarmnode:dev .                                                     # CUDA-capable
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu -t swarmnode:dev-cpu .
# or swap the runtime base for a CUDA image that provides python3.11 and pip on PATH:
#   docker build --build-arg BASE_IMAGE=<cuda runtime image with python3.11> .
#
# Join a swarm (deploy/README.md has the whole operator guide):
#   docker run -d --gpus all --shm-size=8g --stop-timeout 30 --restart on-failure:5 \
#     -v swarmnode:/var/lib/swarmnode -p 31337:31337 -p 31337:31337/udp -p 50051:50051 -p 127.0.0.1:9400:9400 \
#     -e SWARMNODE_DHT__INITIAL_PEERS='["/ip4/203.0.113.10/tcp/31337/p2p/12D3KooW..."]' \
#     -e SWARMNODE_DHT__ANNOUNCE_MADDRS='["/ip4/198.51.100.7/tcp/31337"]' -e SWARMNODE_ADVERTISE_HOST=198.51.100.7 \
#     swarmnode:dev run --role noloco --config /etc/swarmnode/noloco.toml
# `--gpus all` uses every GPU; device.device = "auto" (node/device.py) takes the first visible one,
# `--set device.device=cuda:1` / `device.precision=bf16` pick another GPU / precision, and a missing
# GPU with device.device = "cuda" stops the node at start with what torch found.
#
# --shm-size: hivemind moves tensors between its processes through /dev/shm. Docker's default 64 MB
# is too small (the node warns at start with the size it wants): give 2g for the embedded demo
# model and about 4x the model's fp32 size for real ones (8g for a 500M-parameter model).
# --stop-timeout 30: SIGTERM drains within drain.budget_s (20 s); Docker's default 10 s would SIGKILL it.

ARG BASE_IMAGE=python:3.11-slim
ARG BUILDER_IMAGE=python:3.11-slim

# ---- builder: generate protocol/ code with the pinned grpcio-tools, build the wheel ----------
# amd64 only: hivemind's wheel ships an x86_64 p2pd binary
# hadolint ignore=DL3029
FROM --platform=linux/amd64 ${BUILDER_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CONSTRAINT=/tmp/constraints.txt
# Debian package versions are not pinned: the base tag decides the Debian release, and a pinned
# security update (ca-certificates) vanishes from the archive; the base image tag is the pin.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential \
 && rm -rf /var/lib/apt/lists/*
# The version window that resolves cleanly (docs/architecture.md, 'Which dependency does which job'): libp2p needs protobuf<7,
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
# hadolint ignore=DL3029
FROM --platform=linux/amd64 ${BASE_IMAGE} AS runtime
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
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
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 swarmnode \
 && useradd --uid 10001 --gid 10001 --home-dir /var/lib/swarmnode --no-create-home \
            --shell /usr/sbin/nologin swarmnode \
 && mkdir -p /var/lib/swarmnode /etc/swarmnode \
 && chown 10001:10001 /var/lib/swarmnode
# torch first, in its own layer, from the CUDA (or CPU) index; same range as pyproject.toml
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
# libp2p TCP + QUIC (dht.host_port), gRPC (grpc.port), ops HTTP (ops.port: /metrics /metrics/swarm
# /healthz /readyz /peerinfo), event-bus gossip (eventbus.port; only with eventbus.enabled = true)
EXPOSE 31337/tcp 31337/udp 50051/tcp 9400/tcp 31338/tcp
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
  CMD ["swarmnode", "status", "--local", "--ready"]
# tini is PID 1: forwards SIGTERM to swarmnode (which drains) and reaps hivemind's forks and p2pd
ENTRYPOINT ["tini", "--", "swarmnode"]
CMD ["run", "--config", "/etc/swarmnode/node.toml"]
