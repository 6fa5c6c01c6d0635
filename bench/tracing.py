#!/usr/bin/env python3
"""What tracing costs a request, measured as gateway CPU per request.

Contenders, each a gateway on the memory store forwarding to the same
upstream (another tollgate answering a fixed response), under the same
`h2load` run, interleaved A B C ... for `--rounds` rounds (medians
reported):

  before       --before BINARY: a build without traces (optional);
  untraced     this build, no `server.tracing` (traceparent still
               continued or started, forwarded, and logged);
  sample 0     `server.tracing` set, nothing sampled (the exporter idles);
  sample 1     every request exported to a collector that reads and
               discards the posts.

CPU per request is the gateway's utime+stime from /proc over the requests
it served.

    python3 bench/tracing.py [--before /tmp/tollgate-before] [--requests 40000] [--rounds 3]
"""

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from run import free_port, wait_port  # noqa: E402


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def collector():
    """An OTLP/HTTP endpoint that reads each post and answers 200."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)

    def serve(conn):
        buf = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, buf = buf.split(b"\r\n\r\n", 1)
                length = next((int(l.split(b":")[1]) for l in head.split(b"\r\n")
                               if l.lower().startswith(b"content-length:")), 0)
                while len(buf) < length:
                    buf += conn.recv(65536)
                buf = buf[length:]
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")

    def accept():
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return listener.getsockname()[1]


GATEWAY = """
version: 1
server: {{ listen: ["127.0.0.1:{port}"], admin_listen: "127.0.0.1:{admin}", threads: 1{tracing} }}
limits:
  per-ip: {{ key: [ip], capacity: 1000000000, refill_per_second: 1000000000 }}
upstreams:
  api: {{ servers: ["127.0.0.1:{upstream}"], max_in_flight: 1024 }}
routes:
  - {{ name: api, path: "/**", auth: none, upstream: api, limits: [per-ip] }}
"""

UPSTREAM = """
version: 1
server: {{ listen: ["127.0.0.1:{port}"], threads: 1 }}
routes:
  - {{ name: ok, path: "/**", auth: none, respond: {{ status: 200, body: "ok" }} }}
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", default=str(ROOT / "target" / "release" / "tollgate"))
    ap.add_argument("--before", help="a build without traces, measured in the same rounds")
    ap.add_argument("--requests", type=int, default=40000)
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tollgate-tracing-"))
    procs = []

    def start(name, binary, text):
        (work / f"{name}.yaml").write_text(text)
        p = subprocess.Popen([binary, "run", "--config", str(work / f"{name}.yaml")],
                             stdout=subprocess.DEVNULL, stderr=open(work / f"{name}.log", "wb"),
                             env=dict(os.environ, RUST_LOG="warn"))
        procs.append(p)
        return p

    try:
        up = free_port()
        start("upstream", args.binary, UPSTREAM.format(port=up))
        wait_port(up)
        otlp = collector()
        contenders = []
        tracing_of = {
            "untraced": "",
            "sample 0": f', tracing: {{ otlp_endpoint: "http://127.0.0.1:{otlp}/v1/traces", sample: 0 }}',
            "sample 1": f', tracing: {{ otlp_endpoint: "http://127.0.0.1:{otlp}/v1/traces", sample: 1 }}',
        }
        names = (["before"] if args.before else []) + list(tracing_of)
        for name in names:
            port, admin = free_port(), free_port()
            binary = args.before if name == "before" else args.binary
            text = GATEWAY.format(port=port, admin=admin, upstream=up, tracing=tracing_of.get(name, ""))
            p = start(name.replace(" ", "-"), binary, text)
            wait_port(port)
            contenders.append((name, port, p))
        load = os.getloadavg()[0]
        results = {name: [] for name in names}
        for _ in range(args.rounds):
            for name, port, p in contenders:
                url = f"http://127.0.0.1:{port}/x"
                subprocess.run(["h2load", "--h1", "-n", "2000", "-c", str(args.connections), url],
                               capture_output=True)
                cpu0, t0 = cpu_seconds(p.pid), time.time()
                out = subprocess.run(["h2load", "--h1", "-n", str(args.requests), "-c", str(args.connections), url],
                                     capture_output=True, text=True).stdout
                cpu, wall = cpu_seconds(p.pid) - cpu0, time.time() - t0
                done = int(next(l for l in out.splitlines() if l.startswith("requests:")).split()[7])
                results[name].append((cpu * 1e6 / max(done, 1), done / wall, done))
        print(f"{args.rounds} interleaved rounds of {args.requests} requests, {args.connections} connections, "
              f"h2load --h1, one gateway thread; load average {load:.2f} at the start\n")
        print("| gateway | CPU µs per request (median) | req/s (median) | each round (µs) |")
        print("|---|---:|---:|---|")
        for name in names:
            rows = results[name]
            cpu = statistics.median(r[0] for r in rows)
            rps = statistics.median(r[1] for r in rows)
            each = ", ".join(f"{r[0]:.1f}" for r in rows)
            print(f"| {name} | {cpu:.1f} | {rps:,.0f} | {each} |")
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait()


if __name__ == "__main__":
    sys.exit(main())
