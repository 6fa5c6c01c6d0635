#!/usr/bin/env python3
"""What forward auth adds to a request, cached and uncached.

One release gateway per mode, answering a `respond` route with one
per-credential limit on the memory store, under `wrk -t1 -c8` for the given
seconds with one key:

- `keys`: the key is in `auth.keys` (the baseline);
- `forward, cached`: the key is known only to the auth service (NGINX
  answering 200 with the identity headers), asked once and cached;
- `forward, uncached`: the same with `cache_ttl_s: 0`, so every request asks
  the service (concurrent requests of one key still share a call).

For each: requests per second, median and 99th-percentile latency, the
gateway's CPU per request (utime+stime over the requests served), and
calls to the service per request (`tollgate_forward_auth_seconds_count`).

    python3 bench/forward_auth.py [--seconds 5] [--connections 8]

Needs `cargo build --release --bin tollgate`, `nginx` and `wrk`.
"""

import argparse
import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import run  # noqa: E402

POLICY = """
version: 1
server: {{ listen: ["127.0.0.1:{port}"], admin_listen: "127.0.0.1:{admin}", threads: 1 }}
store: {{ backend: memory }}
auth:
{auth}
limits:
  per-credential: {{ key: [credential], capacity: {max}, refill_per_second: {max} }}
routes:
  - {{ name: bench, path: /v1/bench, limits: [per-credential], respond: {{ status: 200 }} }}
"""

KEYS = '  keys: [{{ id: bench, tenant: bench-tenant, sha256: "{digest}" }}]'
FORWARD = """  forward_auth:
    url: http://127.0.0.1:{whoami}/whoami
    tenant_header: x-tenant-id
    credential_header: x-credential-id
    cache_ttl_s: {ttl}
    max_in_flight: 1000"""


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=int, default=5)
    p.add_argument("--connections", type=int, default=8)
    args = p.parse_args()
    print(run.machine())
    bench = run.Bench(args)
    rows = []
    try:
        whoami = bench.start_nginx("whoami", "whoami.conf")
        digest = hashlib.sha256(run.API_KEY.encode()).hexdigest()
        modes = [
            ("keys", KEYS.format(digest=digest)),
            ("forward, cached", FORWARD.format(whoami=whoami, ttl=60)),
            ("forward, uncached", FORWARD.format(whoami=whoami, ttl=0)),
        ]
        for name, auth in modes:
            port, admin = run.free_port(), run.free_port()
            policy = bench.work / f"policy-{len(rows)}.yaml"
            policy.write_text(POLICY.format(port=port, admin=admin, auth=auth, max=run.MAX))
            proc = bench.procs.start(f"tollgate-{len(rows)}", [str(run.RELEASE / "tollgate"), "run", "--config", str(policy)])
            run.wait_port(port)
            status, _ = run.http_get(port, "/v1/bench", {"Authorization": f"Bearer {run.API_KEY}"})
            assert status == 200, f"{name}: warm-up answered {status}"
            calls0 = run.metric(admin, "tollgate_forward_auth_seconds_count")
            cpu0 = run.cpu_seconds(proc.pid)
            r = run.wrk(port, args.seconds, args.connections)
            cpu = run.cpu_seconds(proc.pid) - cpu0
            calls = run.metric(admin, "tollgate_forward_auth_seconds_count") - calls0
            served = max(r["requests"], 1)
            rows.append((name, r["rps"], r["p50"], r["p99"], cpu * 1e6 / served, calls / served, r["errors"]))
            print("{}: {:.0f} req/s, p50 {:.3f} ms, p99 {:.3f} ms, {:.1f} CPU us/request, "
                  "{:.3f} calls/request, {} errors".format(*rows[-1]), flush=True)
            bench.procs.stop(f"tollgate-{len(rows) - 1}")
    finally:
        bench.procs.stop_all()
    print(f"\n`wrk -t1 -c{args.connections} -d{args.seconds}s`, one key, release build, one gateway thread\n")
    print("| mode | req/s | p50 ms | p99 ms | gateway CPU µs/request | service calls/request | errors |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print("| {} | {:.0f} | {:.3f} | {:.3f} | {:.1f} | {:.3f} | {} |".format(*r))


if __name__ == "__main__":
    main()
