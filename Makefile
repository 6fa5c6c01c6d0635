# tollgate — set-up, run, test.
#
#   make run    build and serve config/quickstart.yaml (memory store, no Redis)
#   make test   install missing system packages, then run every test
#   make bench  benchmark against the peers (see bench/README.md)

SHELL := /bin/bash
CARGO ?= cargo
CONFIG ?= config/quickstart.yaml
# Debian packages the build and the tests need, as command=package pairs:
# cmake builds Pingora's zlib-ng; redis-server backs the store tests;
# openssl makes the certificates of the TLS tests; curl is the HTTP/2 client;
# python3-grpcio is the gRPC client and server of tests/grpc.rs; h2load
# floods the gateway in tests/flood.rs; python3-jsonschema and python3-yaml
# validate the policies against `tollgate schema` in tests/schema.rs;
# promtool (Debian's prometheus) checks and unit-tests the alerting rules of
# deploy/prometheus in tests/observability.rs. tests/deploy.rs renders
# deploy/kubernetes with kubectl 1.22 or later, which is not listed here:
# Debian's kubernetes-client (1.20) cannot render it; install kubectl from
# pkgs.k8s.io (the test fails, never skips, without it).
# The `openai` Python package is the real client of tests/llm_usage.rs, and
# `redis` the client of the usage ledger's example consumer that
# tests/usage.rs runs (the tests fail without them). No Debian package has it, so `python-deps` takes
# it from PyPI into target/pylib, beside the build: Debian marks its own
# interpreter's packages externally managed. It is installed for the
# `python3` on PATH, the one the test runs (some of its dependencies are
# compiled for one Python version), with that interpreter's pip; Debian's
# python3-pip only when it has none.
SYSTEM_DEPS := cmake=cmake redis-server=redis-server openssl=openssl curl=curl \
	/usr/lib/python3/dist-packages/grpc/__init__.py=python3-grpcio h2load=nghttp2-client \
	/usr/lib/python3/dist-packages/jsonschema/__init__.py=python3-jsonschema \
	/usr/lib/python3/dist-packages/yaml/__init__.py=python3-yaml promtool=prometheus
PIP_DEPS := /usr/lib/python3/dist-packages/pip/__init__.py=python3-pip
PYLIB := target/pylib
# The benchmark's contenders, its load generator and its profilers (valgrind, perf).
BENCH_DEPS := nginx=nginx-light wrk=wrk h2load=nghttp2-client valgrind=valgrind perf=linux-perf /usr/lib/nginx/modules/ngx_http_lua_module.so=libnginx-mod-http-lua

.PHONY: run test build release deps python-deps bench-deps install bench check-config lint

# Installs what is missing with apt-get when it can (root or sudo), and
# otherwise says what to install.
deps:
	@$(MAKE) --no-print-directory install PAIRS="$(SYSTEM_DEPS)"

python-deps: deps
	@PYTHONPATH=$(PYLIB) python3 -c 'import openai, redis' 2>/dev/null && exit 0; \
	python3 -m pip --version >/dev/null 2>&1 || \
	  $(MAKE) --no-print-directory install PAIRS="$(PIP_DEPS)" || exit 1; \
	echo "installing: openai, redis (pip, into $(PYLIB))"; \
	python3 -m pip install --quiet --disable-pip-version-check --target $(PYLIB) 'openai>=1.40,<2' 'redis>=5,<7'

bench-deps: deps
	@$(MAKE) --no-print-directory install PAIRS="$(BENCH_DEPS)"

install:
	@missing=""; \
	for pair in $(PAIRS); do \
	  cmd=$${pair%%=*}; pkg=$${pair#*=}; \
	  command -v $$cmd >/dev/null 2>&1 || [ -e "$$cmd" ] || missing="$$missing $$pkg"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=""; elif command -v sudo >/dev/null 2>&1; then SUDO="sudo"; \
	  else echo "please install:$$missing (need root for apt-get)"; exit 1; fi; \
	  if command -v apt-get >/dev/null 2>&1; then \
	    $$SUDO apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing; \
	  else echo "please install:$$missing"; exit 1; fi; \
	fi

build: deps
	$(CARGO) build --bin tollgate

release: deps
	$(CARGO) build --release --bin tollgate

run: release
	./target/release/tollgate run --config $(CONFIG)

check-config: build
	./target/debug/tollgate check --config config/quickstart.yaml
	./target/debug/tollgate check --config config/production.yaml

# Runs every test (unit, binary and integration tests; the benches and the
# example are not built here, `make lint` checks that they compile), then
# sums the per-binary results into one closing line.
test: deps python-deps
	@mkdir -p target
	@set -o pipefail; $(CARGO) test --lib --bins --tests 2>&1 | tee target/test.log
	@awk '/^test result:/ { passed += $$4; failed += $$6 } \
	  END { printf "tests: %d passed, %d failed\n", passed, failed }' target/test.log

bench: bench-deps
	$(CARGO) build --release --bin tollgate --example plain_proxy
	python3 bench/tls.py
	python3 bench/flood.py
	python3 bench/run.py $(BENCH_ARGS)

# Formatting, clippy on every target (the benches and the example are
# compiled here, so they cannot rot while `make test` skips them; clippy.toml
# keeps clock reads in src/clock.rs), and the API docs without a warning
# (every public item documented, every intra-doc link resolved). The links
# of the README and the book are checked by tests/docs_links.rs.
lint: deps
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets -- -D warnings
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --no-deps --lib
