#!/usr/bin/env python3
"""The full path over TLS, HTTP/1.1 and HTTP/2, beside plain Pingora doing
TLS, in one run.

Uses bench/run.py's set-up (an NGINX upstream returning a small 200, Redis,
tollgate's full-path policy) and adds, on TLS listeners with a certificate
made here by openssl:

  plain Pingora, TLS        the framework's ceiling with the same rustls;
  tollgate, full path, TLS  trusted-proxy client IP, pre-auth IP limit, API
                            key, three shared limits in Redis, pool semaphore;

each driven over HTTP/1.1 by `wrk` and over h2 by `h2load` (one stream at a
time per connection, 32 connections), with CPU per request from the
contender's utime+stime. Writes bench/tls.md, which bench/run.py includes
in RESULTS.md.

    python3 bench/tls.py [--duration 10] [--rounds 3]
"""

import argparse
import datetime
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import run  # noqa: E402

BENCH = Path(__file__).parent


def certificate(work):
    key, cert = work / "tls.key", work / "tls.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    return cert, key


def wrk_tls(port, duration, connections):
    args = ["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency",
            "-H", f"Authorization: Bearer {run.API_KEY}", "-H", "X-Forwarded-For: 203.0.113.7",
            f"https://127.0.0.1:{port}/v1/bench"]
    out = subprocess.run(args, capture_output=True, text=True).stdout
    return run.parse_wrk(out)


def h2load(port, duration, connections):
    args = ["h2load", "-c", str(connections), "-m", "1", "-D", str(duration), "-t", "1",
            "-H", f"authorization: Bearer {run.API_KEY}", "-H", "x-forwarded-for: 203.0.113.7",
            f"https://127.0.0.1:{port}/v1/bench"]
    out = subprocess.run(args, capture_output=True, text=True).stdout
    rps = float(re.search(r"finished in [\d.]+\w+, ([\d.]+) req/s", out).group(1))
    done = int(re.search(r"requests: \d+ total, \d+ started, (\d+) done", out).group(1))
    ok = int(re.search(r"status codes: (\d+) 2xx", out).group(1))
    mean = re.search(r"time for request:\s+\S+\s+\S+\s+(\S+)", out).group(1)
    return {"rps": rps, "requests": done, "errors": done - ok, "mean_ms": run.to_ms(mean)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--connections", type=int, default=32)
    args = ap.parse_args()
    for tool in ["nginx", "wrk", "h2load", "redis-server", "openssl"]:
        if not run.shutil.which(tool):
            sys.exit(f"{tool} is missing: run `make bench-deps`")
    bench = run.Bench(argparse.Namespace(connections=args.connections, duration=args.duration,
                                         rounds=args.rounds, quick=True, skip_micro=True))
    try:
        cert, key = certificate(bench.work)
        bench.start_redis()
        bench.start_nginx("upstream", "upstream.conf")
        # Plain Pingora on TLS, h2 offered by ALPN.
        port = run.free_port()
        bench.procs.start("plain_tls", [str(run.RELEASE / "examples" / "plain_proxy"), f"127.0.0.1:{port}",
                                        f"127.0.0.1:{bench.ports['upstream']}", "1"],
                          env={"PLAIN_TLS_CERT": str(cert), "PLAIN_TLS_KEY": str(key), "PLAIN_H2": "1"})
        run.wait_port(port)
        bench.ports["plain_tls"] = port
        # tollgate's full path with a TLS listener and HTTP/2.
        bench.start_tollgate("tollgate_tls", "redis")
        policy = bench.work / "tollgate_tls.yaml"
        bench.procs.stop("tollgate_tls")
        tls_port = run.free_port()
        text = policy.read_text().replace(
            "threads: 1 }",
            f'threads: 1, http2: true, tls: {{ listen: ["127.0.0.1:{tls_port}"], '
            f'cert_file: "{cert}", key_file: "{key}" }} }}', 1)
        policy.write_text(text)
        bench.procs.start("tollgate_tls", [str(run.RELEASE / "tollgate"), "run", "--config", str(policy)],
                          env={"TOLLGATE_KEY_SECRET": run.SECRET, "RUST_LOG": "warn"})
        run.wait_port(tls_port)
        bench.ports["tollgate_tls"] = tls_port

        contenders = [("plain Pingora, TLS", "plain_tls"), ("tollgate, full path (Redis), TLS", "tollgate_tls")]
        loads = [("HTTP/1.1 (wrk)", wrk_tls), ("h2 (h2load)", h2load)]
        results = {}
        for label, name in contenders:
            for lname, load in loads:
                load(bench.ports[name], 2, args.connections)  # warm-up
        for r in range(args.rounds):
            for label, name in contenders:
                for lname, load in loads:
                    pid = bench.procs.procs[name].pid
                    before = run.cpu_seconds(pid)
                    w = load(bench.ports[name], args.duration, args.connections)
                    w["cpu_us"] = (run.cpu_seconds(pid) - before) * 1e6 / max(w["requests"], 1)
                    results.setdefault((label, lname), []).append(w)
                    print(f"round {r + 1} {label} {lname}: {w}", flush=True)

        def median(xs):
            xs = sorted(xs)
            return xs[len(xs) // 2]

        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        command = " ".join(["python3", "bench/tls.py"] + sys.argv[1:])
        lines = ["## Over TLS, HTTP/1.1 and h2", "",
                 f"Measured {when} with `{command}` (load average {os.getloadavg()[0]:.2f} at the end): "
                 f"{args.connections} connections, one request at a time on each, {args.duration} s per "
                 f"measurement, {args.rounds} rounds, medians. rustls with the ring provider on both sides of "
                 "the comparison; the upstream is plain HTTP/1.1 NGINX. CPU per request is the contender's "
                 "own utime+stime over the requests it served.", "",
                 "| contender | load | req/s | CPU µs per request | errors |", "|---|---|---:|---:|---:|"]
        for (label, lname), ws in results.items():
            lines.append(f"| {label} | {lname} | {median([w['rps'] for w in ws]):.0f} | "
                         f"{median([w['cpu_us'] for w in ws]):.1f} | {sum(w['errors'] for w in ws)} |")
        for lname, _ in loads:
            plain = median([w["cpu_us"] for w in results[("plain Pingora, TLS", lname)]])
            full = median([w["cpu_us"] for w in results[("tollgate, full path (Redis), TLS", lname)]])
            lines.append(f"\nOver {lname}: tollgate's full path costs {full / plain:.2f} × plain Pingora's CPU "
                         "per request.")
        (BENCH / "tls.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    finally:
        bench.procs.stop_all()


if __name__ == "__main__":
    main()
