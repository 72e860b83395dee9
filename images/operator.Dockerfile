# syntax=docker/dockerfile:1.7
# tandem-operator image. Build from the repository root:
#   docker build -f images/operator.Dockerfile -t ghcr.io/tandem-serving/tandem-operator:0.1.0 .
# The image name's last path component must stay `tandem-operator` (charts/tandem's schema checks it).

ARG RUST_VERSION=1.89

FROM rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
COPY . .
# Cache mounts keep the registry and target dir between builds; the binary is copied out of the
# cache mount in the same step.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p tandem-operator --bin tandem-operator \
 && install -D -m 0755 target/release/tandem-operator /out/tandem-operator

# glibc + libgcc, CA certificates, no shell, no package manager; uid/gid 65532 ("nonroot").
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/tandem-operator /usr/local/bin/tandem-operator
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/tandem-operator"]
