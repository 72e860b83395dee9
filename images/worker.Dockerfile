# syntax=docker/dockerfile:1.7
# tandem-worker image (prefill, decode, store-client and cache roles: one binary). Build from the
# repository root:
#   docker build -f images/worker.Dockerfile -t ghcr.io/tandem-serving/tandem-worker:0.1.0 .
# Features: `cuda` (cudarc, driver API loaded at run time: libcuda.so comes from the host driver via
# the NVIDIA container toolkit) and `rdma` (ibverbs; its build compiles the vendored rdma-core
# headers with cmake and generates bindings with bindgen/libclang). Override with
#   --build-arg FEATURES=cuda         (no RDMA), or FEATURES= (host-only, TCP transport).

ARG RUST_VERSION=1.89
ARG CUDA_VERSION=12.8.1
ARG FEATURES=cuda,rdma

FROM rust:${RUST_VERSION}-bookworm AS build
ARG FEATURES
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      cmake clang libclang-dev pkg-config libnl-3-dev libnl-route-3-dev libibverbs-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p tandem-worker --bin tandem-worker --features "${FEATURES}" \
 && install -D -m 0755 target/release/tandem-worker /out/tandem-worker

# CUDA runtime libraries on Ubuntu 24.04 (glibc 2.39 ≥ bookworm's 2.36 the binary was linked
# against). rdma-core's libibverbs and its providers (mlx5, efa, …) for the RDMA transport.
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04
RUN apt-get update \
 && apt-get install -y --no-install-recommends libibverbs1 ibverbs-providers ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 65532 tandem \
 && useradd --system --uid 65532 --gid 65532 --home-dir /var/lib/tandem --create-home tandem \
 && mkdir -p /etc/tandem /var/lib/tandem/cache \
 && chown -R 65532:65532 /var/lib/tandem
COPY --from=build /out/tandem-worker /usr/local/bin/tandem-worker
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 65532:65532
WORKDIR /var/lib/tandem
# 7000 control (gRPC), 7001 KV data (TCP), 8000 front door (decode), 7420 L3 store (cache),
# 8080 health/metrics (worker/interfaces/README.md §2).
EXPOSE 7000 7001 7420 8000 8080
ENTRYPOINT ["/usr/local/bin/tandem-worker"]
