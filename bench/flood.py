#!/usr/bin/env python3
"""What a flood does to the limits, and to a tenant that is not flooding.

The release tollgate (two threads, HTTP/2, `store.timeout_ms` 20) in front
of a real redis-server. One tenant floods with `h2load` on both cores: 40
connections of 20 streams on `/big` (a limit it never reaches) and 20 of 10
on `/small` (capacity 10, refill 0.01/s, `on_store_error: open`). A quiet
tenant asks on `/big` with 4 connections of one stream each, once alone and
once during the flood. It prints, per phase:

- the quiet tenant's admitted requests per second, and its share of
  everything the gateway answered beside its share of the streams (1.0:
  it got exactly its per-stream share of the gateway);
- what the flood got on `/small` (2xx, 429, 503), the `fail_open`
  decisions, the decisions shed as overload, the store errors;
- the gateway's CPU seconds per request served (utime+stime from /proc).

    python3 bench/flood.py [--seconds 8] [--rounds 2] [--compare OTHER_BINARY]

With `--compare`, another build runs in the same rounds, interleaved (A B
A B), to hold a change against what came before. The table also goes to
`bench/flood.md`, which RESULTS.md includes.

Needs `cargo build --release --bin tollgate`, `redis-server` and `h2load`
(`make bench-deps`). Check the load average is near zero first.
"""

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import run  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BINARY = ROOT / "target" / "release" / "tollgate"
FLOODER, QUIET = "flood-key", "quiet-key"
QUIET_STREAMS = 4
FLOOD = [("/big", 40, 20), ("/small", 20, 10)]

POLICY = """
version: 1
server: {{ listen: ["127.0.0.1:{port}"], admin_listen: "127.0.0.1:{admin}", threads: 2, http2: true }}
store: {{ backend: redis, urls: ["redis://127.0.0.1:{redis}"], timeout_ms: 20 }}
auth:
  keys:
    - {{ id: flooder, tenant: flood, sha256: "{flooder}" }}
    - {{ id: quiet, tenant: quiet, sha256: "{quiet}" }}
limits:
  small: {{ key: [tenant], capacity: 10, refill_per_second: 0.01, on_store_error: open }}
  big: {{ key: [tenant], capacity: 1000000000, refill_per_second: 1000000000, on_store_error: open }}
routes:
  - {{ name: small, path: /small, respond: {{ status: 200, body: "ok" }}, limits: [small] }}
  - {{ name: big, path: /big, respond: {{ status: 200, body: "ok" }}, limits: [big] }}
"""


def h2load(port, path, key, seconds, clients, streams):
    return subprocess.Popen(
        ["h2load", "-D", str(seconds), "-c", str(clients), "-m", str(streams),
         "-H", f"authorization: Bearer {key}", f"http://127.0.0.1:{port}{path}"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def statuses(proc):
    out = proc.communicate()[0]
    line = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", out)
    if not line:
        raise RuntimeError(f"unexpected h2load output: {out}")
    ok, _, client, server = map(int, line.groups())
    return {"2xx": ok, "4xx": client, "5xx": server}


def metric_total(admin, family, contains=""):
    _, body = run.http_get(admin, "/metrics")
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith(family) and contains in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def phase(port, admin, pid, seconds, flood):
    counters = lambda: {  # noqa: E731
        "answered": metric_total(admin, "tollgate_requests_total"),
        "fail_open": metric_total(admin, "tollgate_limit_decisions_total", "fail_open"),
        "shed": metric_total(admin, "tollgate_overload_shed_total"),
        "store_errors": metric_total(admin, "tollgate_store_errors_total"),
    }
    before, cpu0, t0 = counters(), run.cpu_seconds(pid), time.time()
    floods = [h2load(port, path, FLOODER, seconds, c, m) for path, c, m in FLOOD] if flood else []
    quiet = h2load(port, "/big", QUIET, seconds, QUIET_STREAMS, 1)
    q = statuses(quiet)
    f = [statuses(p) for p in floods]
    elapsed, cpu = time.time() - t0, run.cpu_seconds(pid) - cpu0
    after = counters()
    delta = {k: after[k] - before[k] for k in after}
    streams = QUIET_STREAMS + sum(c * m for _, c, m in FLOOD) if flood else QUIET_STREAMS
    share = (q["2xx"] / delta["answered"]) / (QUIET_STREAMS / streams) if delta["answered"] else 0
    return {
        "quiet_rps": q["2xx"] / seconds, "quiet": q, "share": share,
        "small": f[1] if flood else None, "answered": delta["answered"],
        "gateway_rps": delta["answered"] / elapsed,
        "cpu_us": cpu / delta["answered"] * 1e6 if delta["answered"] else 0,
        **{k: delta[k] for k in ("fail_open", "shed", "store_errors")},
    }


def run_binary(binary, seconds):
    """The three phases against one gateway of `binary`; table rows."""
    port, admin, redis_port = run.free_port(), run.free_port(), run.free_port()
    digest = lambda k: hashlib.sha256(k.encode()).hexdigest()  # noqa: E731
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        redis = run.start_redis(redis_port, tmp)
        gw = None
        try:
            policy = Path(tmp) / "policy.yaml"
            policy.write_text(POLICY.format(port=port, admin=admin, redis=redis_port,
                                            flooder=digest(FLOODER), quiet=digest(QUIET)))
            gw = subprocess.Popen([binary, "run", "--config", policy],
                                  env={**os.environ, "TOLLGATE_KEY_SECRET": "flood-secret", "RUST_LOG": "error"},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            run.wait_port(port)
            run.wait_port(admin)
            for name, flood in [("alone", False), ("flood", True), ("alone again", False)]:
                r = phase(port, admin, gw.pid, seconds, flood)
                small = r["small"]
                small = f'{small["2xx"]}, {small["4xx"]}, {small["5xx"]}' if small else "-"
                rows.append(f'| {name} | {r["quiet_rps"]:.0f} | {r["quiet"]["5xx"]} | {r["share"]:.2f} '
                            f'| {r["gateway_rps"]:.0f} | {r["cpu_us"]:.1f} | {small} '
                            f'| {r["fail_open"]:.0f} | {r["shed"]:.0f} | {r["store_errors"]:.0f} |')
        finally:
            if gw:
                gw.terminate()
                gw.wait()
            redis.kill()
            redis.wait()
    return rows


def earlier_comparisons(text):
    """The runs of an earlier `flood.md` that held one build against
    another, each labelled as earlier; a plain run is left out, superseded
    by the new one."""
    body = text.split("\n", 1)[1] if text.startswith("## ") else text
    runs = re.split(r"\n(?=Measured |\*\*Earlier)", "\n" + body)
    kept = [r.strip() for r in runs if "| compared build |" in r]
    return [r if r.startswith("**Earlier") else "**Earlier.** " + r for r in kept]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--binary", default=str(BINARY), help="the tollgate to run (default: the release build)")
    ap.add_argument("--compare", help="another tollgate build, run in the same rounds")
    args = ap.parse_args()
    binaries = [("this build", args.binary)] + ([("compared build", args.compare)] if args.compare else [])
    command = "python3 bench/flood.py " + " ".join(sys.argv[1:])
    lines = ["## Under a flood", "",
             f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} with `{command}`, "
             f"load average before {os.getloadavg()[0]:.2f}; {args.seconds} s per phase. "
             "The flood: one tenant, `h2load` with 40 connections × 20 streams on `/big` and 20 × 10 on "
             "`/small` (capacity 10, refill 0.01/s, `on_store_error: open`); the quiet tenant: 4 connections "
             "× 1 stream on `/big`. Gateway: two threads, h2c, Redis store, `timeout_ms` 20.", "",
             "| build | round | phase | quiet tenant 2xx/s | quiet 5xx | quiet share / stream share "
             "| gateway answers/s | gateway CPU µs/answer | flood /small 2xx, 4xx, 5xx "
             "| fail_open | shed | store errors |",
             "|---|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for round_ in range(1, args.rounds + 1):
        for label, binary in binaries:
            for row in run_binary(binary, args.seconds):
                lines.append(f"| {label} | {round_} {row}")
                print(lines[-1], flush=True)
    print("\n".join(lines))
    out = Path(__file__).parent / "flood.md"
    earlier = earlier_comparisons(out.read_text()) if out.exists() else []
    out.write_text("\n\n".join(["\n".join(lines)] + earlier) + "\n")


if __name__ == "__main__":
    main()
