# tollgate container image.
#
#   docker build -t tollgate .
#   docker run --rm -p 8080:8080 tollgate        # serves the demo policy
#   docker run --rm -p 8080:8080 -v "$PWD/policy.yaml:/etc/tollgate/tollgate.yaml:ro" tollgate
#
# The image carries a demo policy (deploy/docker/tollgate.yaml) at the path
# its CMD reads, and warns at start while it serves it. Mount a policy file
# in its place, or a directory over /etc/tollgate when the policy has a keys
# file or certificates beside it (a directory mount also sees editors that
# save by rename, which a single-file mount does not). The policy must listen
# on 0.0.0.0:8080 to be reachable through the published port, and set
# admin_listen to 127.0.0.1:9091 or 0.0.0.0:9091 for the health check below.

# --- build ------------------------------------------------------------------
FROM rust:1-bookworm AS build

# Same system packages as the Makefile's build: cmake builds Pingora's zlib-ng.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends cmake \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /src

# Fetch dependencies in their own layer, so that source edits do not
# download them again. The stub sources only satisfy the manifest.
COPY Cargo.toml Cargo.lock ./
# Pingora's core, patched (vendor/pingora-core/PATCHED.md): a path
# dependency the manifest needs whole before it can fetch.
COPY vendor ./vendor
RUN mkdir -p src bench benches \
 && touch src/lib.rs bench/plain_proxy.rs benches/hot_paths.rs \
 && echo 'fn main() {}' > src/main.rs \
 && cargo fetch --locked \
 && rm -rf src bench benches

# The sources, the Lua scripts embedded at build time, and the other
# targets the manifest declares.
COPY src ./src
COPY lua ./lua
COPY bench ./bench
COPY benches ./benches
RUN cargo build --release --locked --bin tollgate \
 && install -D -m 0755 target/release/tollgate /out/tollgate

# --- runtime ----------------------------------------------------------------
FROM debian:bookworm-slim

RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 65532 tollgate \
 && useradd --system --uid 65532 --gid tollgate --home-dir /nonexistent --no-create-home \
      --shell /usr/sbin/nologin tollgate \
 && mkdir -p /etc/tollgate

COPY --from=build /out/tollgate /usr/local/bin/tollgate
# Read-only for the gateway's user: the demo policy, replaced by a mount.
COPY deploy/docker/tollgate.yaml /etc/tollgate/tollgate.yaml

# 8080: client traffic; 9091: admin (/healthz, /readyz).
EXPOSE 8080 9091

USER tollgate

# Liveness from the admin listener, with bash's /dev/tcp: no HTTP client
# needs to be installed in the image.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/9091 && printf 'GET /healthz HTTP/1.1\\r\\nHost: localhost\\r\\nConnection: close\\r\\n\\r\\n' >&3 && head -n 1 <&3 | grep -q ' 200 '"]

# SIGTERM (docker stop) shuts down gracefully.
ENTRYPOINT ["tollgate"]
CMD ["run", "--config", "/etc/tollgate/tollgate.yaml"]
