#!/usr/bin/env python3
"""Keys provisioned in the store cost a gateway nothing until they are used.

A release gateway on a real redis-server with `auth.store_keys` and a
million credentials provisioned into the store: 1 000 through
`POST /admin/credentials` (timed), the rest written straight into Redis in
the same layout (records under the HMAC of the key's SHA-256, keyed by the
store secret), so that provisioning a million does not take the admin
API's per-actor write budget. The gateway's VmRSS is read once ready,
after the million are in the store, and after requests with N distinct
provisioned keys (each looked up once, then cached); then `wrk -c8` with
one cached key beside a key of the policy's own keys.

    python3 bench/store_keys.py [--keys 1000000] [--used 10000] [--seconds 5]

Needs `cargo build --release --bin tollgate`, `redis-server` and `wrk`.
"""

import argparse
import hashlib
import hmac
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import run  # noqa: E402

TOKEN = "bench-admin-token"
POLICY = """
version: 1
server:
  listen: ["127.0.0.1:{port}"]
  admin_listen: "127.0.0.1:{admin}"
  threads: 1
  admin_tokens: [{{ name: bench, sha256: "{token}", role: write }}]
store: {{ backend: redis, urls: ["redis://127.0.0.1:{redis}/0"] }}
auth:
  keys: [{{ id: file-key, tenant: bench, sha256: "{file_digest}" }}]
  store_keys: {{ cache_entries: 100000 }}
limits:
  per-credential: {{ key: [credential], capacity: {max}, refill_per_second: {max} }}
routes:
  - {{ name: bench, path: /v1/bench, limits: [per-credential], respond: {{ status: 200 }} }}
"""


def sha(text):
    return hashlib.sha256(text.encode()).hexdigest()


def field(secret, material):
    mac = hmac.new(secret.encode(), b"record\x1f" + material.encode(), hashlib.sha256)
    return mac.hexdigest()[:32]


def resp(*args):
    out = [f"*{len(args)}\r\n".encode()]
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def provision_direct(redis_port, secret, first, count):
    """HSETs in the store's layout, piped through redis-cli --pipe."""
    by_key = "tg:{tollgate-admin}:credentials"
    by_id = "tg:{tollgate-admin}:credential_ids"
    chunks = []
    for i in range(first, first + count):
        cid = f"sk-{i}"
        key_field = field(secret, sha(f"store-key-{i}"))
        cred = json.dumps({"id": cid, "tenant": f"t{i % 1000}"}, separators=(",", ":"))
        chunks.append(resp("HSET", by_key, key_field, cred))
        chunks.append(resp("HSET", by_id, field(secret, cid),
                           json.dumps({"id": cid, "tenant": f"t{i % 1000}", "key_field": key_field},
                                      separators=(",", ":"))))
    subprocess.run(["redis-cli", "-p", str(redis_port), "--pipe"], input=b"".join(chunks),
                   check=True, capture_output=True)


def admin_post(admin, body):
    req = urllib.request.Request(f"http://127.0.0.1:{admin}/admin/credentials", data=body.encode(),
                                 method="POST", headers={"authorization": f"Bearer {TOKEN}",
                                                         "content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keys", type=int, default=1_000_000)
    p.add_argument("--used", type=int, default=10_000)
    p.add_argument("--seconds", type=int, default=5)
    args = p.parse_args()
    print(run.machine())
    bench = run.Bench(args)
    try:
        redis = bench.start_redis()
        port, admin = run.free_port(), run.free_port()
        policy = bench.work / "policy.yaml"
        policy.write_text(POLICY.format(port=port, admin=admin, redis=redis, token=sha(TOKEN),
                                        file_digest=sha(run.API_KEY), max=run.MAX))
        gw = bench.procs.start("tollgate", [str(run.RELEASE / "tollgate"), "run", "--config", str(policy)],
                               env={"TOLLGATE_KEY_SECRET": run.SECRET, "RUST_LOG": "warn"})
        run.wait_port(port)
        run.wait_port(admin)
        ready = run.rss_kib(gw.pid)

        by_api = min(1_000, args.keys)
        started = time.monotonic()
        for i in range(by_api):
            body = json.dumps({"id": f"sk-{i}", "tenant": f"t{i % 1000}", "sha256": sha(f"store-key-{i}")})
            status = admin_post(admin, body)
            while status == 429:  # the per-actor write budget: 10 a second
                time.sleep(0.05)
                status = admin_post(admin, body)
            assert status == 201, status
        api_s = time.monotonic() - started
        started = time.monotonic()
        provision_direct(redis, run.SECRET, by_api, args.keys - by_api)
        direct_s = time.monotonic() - started
        stored = int(run.redis_cli(redis, "HLEN", "tg:{tollgate-admin}:credentials"))
        time.sleep(2)  # two admin_refresh_ms rounds: the gateway reads the feed
        provisioned = run.rss_kib(gw.pid)

        started = time.monotonic()
        for i in range(0, args.keys, max(1, args.keys // args.used))[: args.used]:
            status, _ = run.http_get(port, "/v1/bench", {"Authorization": f"Bearer store-key-{i}"})
            assert status == 200, (i, status)
        used_s = time.monotonic() - started
        used = run.rss_kib(gw.pid)

        results = {}
        for name, key in [("keys", run.API_KEY), ("store, cached", "store-key-0")]:
            args_wrk = ["wrk", "-t1", "-c8", f"-d{args.seconds}s", "--latency", "-H", f"Authorization: Bearer {key}",
                        f"http://127.0.0.1:{port}/v1/bench"]
            cpu0 = run.cpu_seconds(gw.pid)
            out = run.parse_wrk(subprocess.run(args_wrk, capture_output=True, text=True).stdout)
            out["cpu_us"] = (run.cpu_seconds(gw.pid) - cpu0) * 1e6 / max(out["requests"], 1)
            results[name] = out
    finally:
        bench.procs.stop_all()
    print(f"\ncredentials in the store: {stored} ({by_api} through the admin API in {api_s:.1f} s, "
          f"the rest written directly in {direct_s:.1f} s)")
    print("| gateway VmRSS | MiB |")
    print("|---|---:|")
    print(f"| ready | {ready / 1024:.1f} |")
    print(f"| {stored} credentials in the store | {provisioned / 1024:.1f} |")
    print(f"| after {args.used} of them were used ({used_s:.1f} s, one request each) | {used / 1024:.1f} |")
    print(f"\nresident per cached credential: {(used - provisioned) * 1024 / args.used:.0f} bytes\n")
    print(f"| caller (wrk -t1 -c8 -d{args.seconds}s) | req/s | p50 ms | p99 ms | gateway CPU µs/request |")
    print("|---|---:|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['rps']:.0f} | {r['p50']:.3f} | {r['p99']:.3f} | {r['cpu_us']:.1f} |")


if __name__ == "__main__":
    main()
