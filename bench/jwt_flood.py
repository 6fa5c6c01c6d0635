#!/usr/bin/env python3
"""What a flood of forged tokens costs the gateway, beside bad API keys.

One release gateway (one thread, memory store) with a JWT issuer whose
key set holds an ES256 and an RS256 key, a `respond` route behind a
pre-auth IP guard (capacity 100, refilling 1 a second) and a
per-credential limit. One client floods it under `wrk -t1` for the given
seconds, from one address, with:

- `bad API key`: a key no source knows (the baseline: a SHA-256 and a
  table lookup, then 401 or 429);
- `forged ES256` / `forged RS256`: well-formed tokens naming a `kid` the
  gateway holds, their signature random bytes.

Almost all of the flood is beyond the client's IP guard. The gateway
verifies a token only once the pre-auth limits admitted its request, so
what a refused forged token costs should be what a refused bad key costs:
the target is a gateway CPU per request of at most 1.5 x the bad key's.
Reported for each: requests a second, the statuses, the gateway's CPU per
request (utime+stime over the requests served), the signatures checked
(`tollgate_auth_lookups_total{source="jwt"}`), and the ratio.

    python3 bench/jwt_flood.py [--seconds 5] [--connections 8] [--rounds 2]

Needs `cargo build --release --bin tollgate`, `wrk`, and Python's
`cryptography` (to write the key set).
"""

import argparse
import base64
import json
import os
import sys
import time
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric import ec, rsa

sys.path.insert(0, str(Path(__file__).parent))
import run  # noqa: E402

POLICY = """
version: 1
server: {{ listen: ["127.0.0.1:{port}"], admin_listen: "127.0.0.1:{admin}", threads: 1 }}
store: {{ backend: memory }}
auth:
  jwt:
    - {{ name: main, issuer: "https://auth.example.com/", audiences: [api.example.com],
        jwks_file: "{jwks}", algorithms: [RS256, ES256], tenant_claim: org_id }}
limits:
  guard: {{ scope: pre_auth, key: [ip], capacity: 100, refill_per_second: 1 }}
  per-credential: {{ key: [credential], capacity: 1000, refill_per_second: 1000 }}
routes:
  - {{ name: bench, path: /v1/bench, limits: [guard, per-credential], respond: {{ status: 200 }} }}
"""


def b64(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def uint(n, size=None):
    size = size or (n.bit_length() + 7) // 8
    return b64(n.to_bytes(size, "big"))


def key_set():
    """A JWKS with one ES256 (`ec-1`) and one RS256 (`rsa-1`) public key."""
    ec_pub = ec.generate_private_key(ec.SECP256R1()).public_key().public_numbers()
    rsa_pub = rsa.generate_private_key(public_exponent=65537, key_size=2048).public_key().public_numbers()
    return {"keys": [
        {"kty": "EC", "crv": "P-256", "kid": "ec-1", "alg": "ES256", "use": "sig",
         "x": uint(ec_pub.x, 32), "y": uint(ec_pub.y, 32)},
        {"kty": "RSA", "kid": "rsa-1", "alg": "RS256", "use": "sig",
         "n": uint(rsa_pub.n), "e": uint(rsa_pub.e)},
    ]}


def forged(alg, kid, signature_bytes):
    header = b64(json.dumps({"alg": alg, "kid": kid, "typ": "JWT"}).encode())
    claims = b64(json.dumps({"iss": "https://auth.example.com/", "aud": "api.example.com",
                             "sub": "mallory", "org_id": "acme",
                             "exp": int(time.time()) + 3600}).encode())
    return f"{header}.{claims}.{b64(os.urandom(signature_bytes))}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=int, default=5)
    p.add_argument("--connections", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    print(run.machine())
    bench = run.Bench(args)
    keys = {
        "bad API key": "tg_not_a_key_" + b64(os.urandom(12)),
        "forged ES256": forged("ES256", "ec-1", 64),
        "forged RS256": forged("RS256", "rsa-1", 256),
    }
    results = {name: [] for name in keys}
    try:
        jwks = bench.work / "jwks.json"
        jwks.write_text(json.dumps(key_set()))
        for rnd, name in run.interleaved(list(keys), args.rounds):
            port, admin = run.free_port(), run.free_port()
            policy = bench.work / f"policy-{rnd}-{len(results[name])}.yaml"
            policy.write_text(POLICY.format(port=port, admin=admin, jwks=jwks))
            tag = f"tollgate-{rnd}-{name.replace(' ', '-')}"
            proc = bench.procs.start(tag, [str(run.RELEASE / "tollgate"), "run", "--config", str(policy)])
            run.wait_port(port)
            lookups = 'tollgate_auth_lookups_total{result="miss",source="jwt"}'
            cpu0, checked0 = run.cpu_seconds(proc.pid), run.metric(admin, lookups)
            limited0 = run.metric(admin, 'tollgate_requests_total{outcome="limited",route="bench"}')
            r = run.wrk(port, args.seconds, args.connections, key=keys[name])
            requests, rps = r["requests"], r["rps"]
            cpu = run.cpu_seconds(proc.pid) - cpu0
            checked = run.metric(admin, lookups) - checked0
            limited = run.metric(admin, 'tollgate_requests_total{outcome="limited",route="bench"}') - limited0
            row = (rps, requests, limited, checked, cpu * 1e6 / max(requests, 1))
            results[name].append(row)
            print(f"round {rnd} {name}: {rps:.0f} req/s, {requests} requests, {limited:.0f} limited, "
                  f"{checked:.0f} signatures checked, {row[4]:.1f} CPU us/request", flush=True)
            bench.procs.stop(tag)
    finally:
        bench.procs.stop_all()
    base = min(r[4] for r in results["bad API key"])
    print(f"\n`wrk -t1 -c{args.connections} -d{args.seconds}s`, one client beyond its IP guard, "
          f"release build, one gateway thread, best of {args.rounds} interleaved rounds\n")
    print("| flood | req/s | requests | refused by the guard (429) | signatures checked | "
          "gateway CPU µs/request | × bad API key |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, rows in results.items():
        rps, requests, limited, checked, us = min(rows, key=lambda r: r[4])
        print(f"| {name} | {rps:.0f} | {requests} | {limited:.0f} | {checked:.0f} | {us:.1f} | {us / base:.2f} |")


if __name__ == "__main__":
    main()
