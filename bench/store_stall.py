#!/usr/bin/env python3
"""How long a request takes while the shared store fails.

The end-to-end tests assert what each limit answers while Redis is paused
(SIGSTOP: connections stay open, nothing answers) or killed; they do not
assert how fast, since timings move with the machine. This script measures
it: the release tollgate with `store.timeout_ms` 50 and a circuit breaker
(3 failures, open 400 ms), in front of a real redis-server, answering
requests to three routes whose limits fail open, closed and to the local
share, one request at a time. It prints the statuses and the latency
(median and slowest) per route and phase. A request should take about the
store timeout until the breaker opens, and no store time at all while it
is open.

    python3 bench/store_stall.py [--requests 50]

Needs `cargo build --release --bin tollgate` and `redis-server`.
"""

import argparse
import hashlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import run  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINARY = os.path.join(ROOT, "target", "release", "tollgate")
KEY = "stall-key"
TIMEOUT_MS = 50

POLICY = """
version: 1
server: {{ listen: ["127.0.0.1:{port}"], admin_listen: "127.0.0.1:{admin}", threads: 1 }}
store:
  backend: redis
  urls: ["redis://127.0.0.1:{redis}"]
  timeout_ms: {timeout}
  circuit_breaker: {{ failure_threshold: 3, open_ms: 400 }}
  expected_instances: 2
auth:
  keys: [ {{ id: c1, tenant: acme, sha256: "{digest}" }} ]
limits:
  open-limit: {{ key: [credential], capacity: 1000000, refill_per_second: 1000, on_store_error: open }}
  closed-limit: {{ key: [credential], capacity: 1000000, refill_per_second: 1000, on_store_error: closed }}
  local-limit: {{ key: [credential], capacity: 1000000, refill_per_second: 1000, on_store_error: local }}
routes:
  - {{ name: open, path: /open, respond: {{ status: 200 }}, limits: [open-limit] }}
  - {{ name: closed, path: /closed, respond: {{ status: 200 }}, limits: [closed-limit] }}
  - {{ name: local, path: /local, respond: {{ status: 200 }}, limits: [local-limit] }}
"""


def timed_get(port, path):
    """The status of one request and its latency in milliseconds."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                 headers={"Authorization": f"Bearer {KEY}"})
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        e.read()
        status = e.code
    return status, (time.perf_counter() - started) * 1000


def measure(port, phase, n):
    for path in ["/open", "/closed", "/local"]:
        results = [timed_get(port, path) for _ in range(n)]
        statuses = sorted({s for s, _ in results})
        ms = [t for _, t in results]
        print(f"| {phase} | {path} | {', '.join(map(str, statuses))} "
              f"| {statistics.median(ms):.1f} | {max(ms):.1f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=50, help="per route and phase")
    args = ap.parse_args()
    port, admin, redis_port = run.free_port(), run.free_port(), run.free_port()
    with tempfile.TemporaryDirectory() as tmp:
        redis = run.start_redis(redis_port, tmp)
        gw = None
        try:
            policy = os.path.join(tmp, "policy.yaml")
            with open(policy, "w") as f:
                f.write(POLICY.format(port=port, admin=admin, redis=redis_port, timeout=TIMEOUT_MS,
                                      digest=hashlib.sha256(KEY.encode()).hexdigest()))
            gw = subprocess.Popen([BINARY, "run", "--config", policy],
                                  env={**os.environ, "TOLLGATE_KEY_SECRET": "stall-secret", "RUST_LOG": "error"},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            run.wait_port(port)
            print(f"store.timeout_ms {TIMEOUT_MS}; {args.requests} requests per route and phase, one at a time\n")
            print("| Redis | route | statuses | median ms | slowest ms |")
            print("|---|---|---|---:|---:|")
            measure(port, "up", args.requests)
            redis.send_signal(signal.SIGSTOP)
            measure(port, "paused", args.requests)
            redis.send_signal(signal.SIGCONT)
            redis.kill()
            redis.wait()
            measure(port, "killed", args.requests)
        finally:
            if gw:
                gw.terminate()
                gw.wait()
            redis.send_signal(signal.SIGCONT)
            redis.kill()
            redis.wait()


if __name__ == "__main__":
    main()
