#!/usr/bin/env python3
"""A hot key decided exactly in Redis, leased, and in process, in one run.

Three release gateways with one route behind one global limit (`key: []`,
the key every request touches): `exact` decides every request in Redis,
three with `sync: lease` (units 50 and 200, and 10 growing to 200 with
`max_units`; ttl 1000 ms), `memory` in
process with no store at all. Each gets the same wrk load in turn, rounds rotated;
the script prints req/s, p99, the gateway's CPU per request
(utime + stime from /proc over the requests served) and the Redis script
calls per request (`INFO commandstats`, FCALL or EVALSHA).

Then accuracy: four gateways share a budget of capacity 100 refilling 50 a
second, eight clients send as fast as they can for `--seconds`, and the
admitted count is set against capacity + rate × elapsed (the most any
exact limiter may admit) for exact and for lease (units 50). Then an
abused key: three gateways, capacity 200 refilling 100 a second, lease
units 10, twelve clients (demand many times the refill): overage and
script calls per request, which a refusal remembered until a whole lease
would fit keeps at about refill / units per instance; and the same key
flooded by one wrk per gateway (tens of times the refill).

    python3 bench/lease.py [--duration 8] [--rounds 3] [--connections 32] [--accuracy-only]

Needs `cargo build --release --bin tollgate`, redis-server, wrk and an
upstream (NGINX, as bench/run.py starts it).
"""

import argparse
import hashlib
import re
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import run  # noqa: E402

POLICY = """
version: 1
server: {{ listen: ["127.0.0.1:{port}"], admin_listen: "127.0.0.1:{admin}", threads: 1 }}
store: {{ backend: {backend}, urls: ["redis://127.0.0.1:{redis}/0"], timeout_ms: 50 }}
auth:
  keys: [ {{ id: bench, tenant: bench-tenant, sha256: "{digest}" }} ]
limits:
  global: {{ key: [], capacity: {capacity}, refill_per_second: {rate}{sync} }}
upstreams:
  api: {{ servers: ["127.0.0.1:{upstream}"], max_in_flight: 1024 }}
routes:
  - {{ name: bench, path: "/**", upstream: api, limits: [global] }}
"""
LEASE = ", sync: lease, lease: {{ units: {units}, ttl_ms: 1000, max_units: {most} }}"


def start(bench, name, backend, lease, capacity=run.MAX, rate=run.MAX):
    """A gateway; `lease` is the lease's units (or units and max_units), or
    0 for none."""
    units, most = lease if isinstance(lease, tuple) else (lease, lease)
    port, admin = run.free_port(), run.free_port()
    text = POLICY.format(port=port, admin=admin, backend=backend, redis=bench.ports["redis"],
                         digest=hashlib.sha256(run.API_KEY.encode()).hexdigest(),
                         capacity=capacity, rate=rate, sync=LEASE.format(units=units, most=most) if units else "",
                         upstream=bench.ports["upstream"])
    path = bench.work / (re.sub(r"\W+", "-", name) + ".yaml")
    path.write_text(text)
    p = bench.procs.start(name, [str(run.RELEASE / "tollgate"), "run", "--config", str(path)],
                          env={"TOLLGATE_KEY_SECRET": run.SECRET, "RUST_LOG": "warn"})
    run.wait_port(port)
    bench.ports[name] = port
    bench.ports[name + "/admin"] = admin
    return port, p


def lease_calls(admin):
    """The gateway's lease store calls by kind (take, renew, return)."""
    calls = {}
    _, body = run.http_get(admin, "/metrics")
    for line in body.decode().splitlines():
        m = re.match(r'tollgate_lease_calls_total\{.*kind="(\w+)".*\} (\S+)', line)
        if m:
            calls[m[1]] = calls.get(m[1], 0) + float(m[2])
    return calls


def script_calls(port):
    stats = run.commandstats(port)
    return sum(stats.get(c, (0, 0, 0))[0] for c in ("fcall", "evalsha"))


def throughput(bench, args):
    contenders = {"exact": ("redis", 0), "lease, units 50": ("redis", 50), "lease, units 200": ("redis", 200),
                  "lease, units 10 growing to 200": ("redis", (10, 200)), "memory": ("memory", 0)}
    procs = {name: start(bench, name, backend, lease)[1] for name, (backend, lease) in contenders.items()}
    for name in contenders:
        run.wrk(bench.ports[name], 2, args.connections, path="/x")  # warm-up
    results = {name: [] for name in contenders}
    names = list(contenders)
    for r, name in run.interleaved(names, args.rounds):
        calls, cpu = script_calls(bench.ports["redis"]), run.cpu_seconds(procs[name].pid)
        w = run.wrk(bench.ports[name], args.duration, args.connections, path="/x")
        w["cpu_us"] = (run.cpu_seconds(procs[name].pid) - cpu) * 1e6 / max(w["requests"], 1)
        w["calls"] = (script_calls(bench.ports["redis"]) - calls) / max(w["requests"], 1)
        results[name].append(w)
        print(f"round {r + 1} {name}: {w}", flush=True)
    for name in contenders:
        bench.procs.stop(name)
    return results


def accuracy(bench, args, instances=4, capacity=100, rate=50, units=50, clients=8):
    out = {}
    for lease in (0, units):
        label = f"lease, units {lease}" if lease else "exact"
        redis = bench.ports["redis"]
        run.redis_cli(redis, "FLUSHALL")
        ports = [start(bench, f"acc_{label}_{i}", "redis", lease, capacity, rate)[0] for i in range(instances)]
        admitted, lock = [0], threading.Lock()
        calls = script_calls(redis)
        start_at = time.time()
        sent = [0]

        def client(n):
            i = n
            while time.time() - start_at < args.seconds:
                status, _ = run.http_get(ports[i % len(ports)], "/x", {"Authorization": f"Bearer {run.API_KEY}"})
                i += 1
                with lock:
                    sent[0] += 1
                    admitted[0] += status == 200

        threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.time() - start_at
        out[label] = (admitted[0], capacity + rate * elapsed, sent[0], (script_calls(redis) - calls) / sent[0])
        print(f"accuracy {label}: admitted {admitted[0]} of at most {capacity + rate * elapsed:.0f} "
              f"({sent[0]} sent, {out[label][3]:.3f} script calls per request)", flush=True)
        if lease:
            kinds = {}
            for i in range(instances):
                for kind, n in lease_calls(bench.ports[f"acc_{label}_{i}/admin"]).items():
                    kinds[kind] = kinds.get(kind, 0) + n
            print("  lease calls per request by kind: " +
                  ", ".join(f"{k} {n / sent[0]:.3f}" for k, n in sorted(kinds.items())), flush=True)
        for i in range(instances):
            bench.procs.stop(f"acc_{label}_{i}")
    return out


def flooded(bench, args, instances=3, capacity=200, rate=100, units=10, connections=4):
    """The abused key under wrk: one wrk per gateway at once, so demand is
    tens of times the refill. Admitted = the 2xx answers."""
    out = {}
    for lease in (0, units):
        label = f"lease, units {lease}" if lease else "exact"
        redis = bench.ports["redis"]
        run.redis_cli(redis, "FLUSHALL")
        ports = [start(bench, f"flood_{label}_{i}", "redis", lease, capacity, rate)[0] for i in range(instances)]
        calls = script_calls(redis)
        results = [None] * instances
        start_at = time.time()

        def load(i):
            results[i] = run.wrk(ports[i], int(args.seconds), connections, path="/x")

        threads = [threading.Thread(target=load, args=(i,)) for i in range(instances)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.time() - start_at
        sent = sum(r["requests"] for r in results)
        admitted = sent - sum(r["errors"] for r in results)
        per_request = (script_calls(redis) - calls) / sent
        out[label] = (admitted, capacity + rate * elapsed, sent, per_request, sent / elapsed / rate)
        print(f"flooded {label}: admitted {admitted} of at most {capacity + rate * elapsed:.0f} "
              f"({sent} sent, {sent / elapsed / rate:.0f} × the refill, {per_request:.4f} script calls per request)",
              flush=True)
        for i in range(instances):
            bench.procs.stop(f"flood_{label}_{i}")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--accuracy-only", action="store_true", help="skip the throughput rounds")
    args = p.parse_args()
    bench = run.Bench(argparse.Namespace(connections=args.connections))
    try:
        bench.start_redis()
        bench.start_nginx("upstream", "upstream.conf")
        results = {} if args.accuracy_only else throughput(bench, args)
        acc = accuracy(bench, args)
        abused = accuracy(bench, args, instances=3, capacity=200, rate=100, units=10, clients=12)
        flood = flooded(bench, args)
    finally:
        bench.procs.stop_all()
    print("\n| Hot key decided | req/s (median) | p99 ms | CPU µs/request | script calls/request |")
    print("|---|---|---|---|---|")
    memory_rps = sorted(w["rps"] for w in results.get("memory", [{"rps": 1}]))[len(results.get("memory", [1])) // 2]
    for name, ws in results.items():
        med = lambda k: sorted(w[k] for w in ws)[len(ws) // 2]  # noqa: E731
        print(f"| {name} | {med('rps'):.0f} ({med('rps') / memory_rps:.2f} × memory) | {med('p99'):.2f} | "
              f"{med('cpu_us'):.1f} | {med('calls'):.4f} |")
    print("\n| Accuracy (4 gateways, capacity 100, 50/s) | admitted | at most | overage | calls/request |")
    print("|---|---|---|---|---|")
    for label, (admitted, bound, sent, calls) in acc.items():
        print(f"| {label} | {admitted} | {bound:.0f} | {max(0, admitted - int(bound))} | {calls:.3f} |")
    print("\n| Abused key (3 gateways, capacity 200, 100/s, 12 clients) | admitted | at most | overage | sent | calls/request |")
    print("|---|---|---|---|---|---|")
    for label, (admitted, bound, sent, calls) in abused.items():
        print(f"| {label} | {admitted} | {bound:.0f} | {max(0, admitted - int(bound))} | {sent} | {calls:.3f} |")
    print("\n| Flooded key (3 gateways × wrk -c4, capacity 200, 100/s) | admitted | at most | overage | sent "
          "| × refill | calls/request |")
    print("|---|---|---|---|---|---|---|")
    for label, (admitted, bound, sent, calls, times) in flood.items():
        print(f"| {label} | {admitted} | {bound:.0f} | {max(0, admitted - int(bound))} | {sent} | {times:.0f} "
              f"| {calls:.4f} |")


if __name__ == "__main__":
    main()
