#!/usr/bin/env python3
"""Memory held by idle, half-finished and keep-alive client connections.

Starts the release tollgate on the memory store (one worker thread) in
front of a small upstream on loopback, lets its RSS settle, then measures
what each kind of connection adds to it, and what is left once they close:

  fresh      N connections that send nothing (within header_read_ms);
  heads      N connections that each send an unfinished request head of
             --head-bytes (4.1 KB by default) and stall, as an attacker would;
  keepalive  N connections that each made one request and stay open, as a
             browser or SDK pool leaves them.

It reports RSS before, with the connections open, and after the client
closed them, in MiB and in KiB per connection, and writes the report to
bench/connections.md (which `bench/run.py` includes in RESULTS.md).

    python3 bench/idle_connections.py [--count 2000] [--head-bytes 4100] [--binary PATH]

With `--binary`, another build (an earlier commit's) is measured, and the
table is printed without replacing `bench/connections.md`.

Needs `cargo build --release --bin tollgate` first.
"""

import argparse
import datetime
import http.server
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import run  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINARY = os.path.join(ROOT, "target", "release", "tollgate")

POLICY = """
version: 1
server:
  listen: ["127.0.0.1:{port}"]
  admin_listen: "127.0.0.1:{admin}"
  threads: 1
  limits: {{ max_connections: 20000, max_connections_per_ip: 20000, max_header_bytes: 65536 }}
  timeouts: {{ header_read_ms: 60000, keepalive_idle_ms: 60000 }}
store: {{ backend: memory }}
upstreams:
  api: {{ servers: ["127.0.0.1:{upstream}"], max_in_flight: 64 }}
routes:
  - {{ name: api, path: "/**", auth: none, upstream: api }}
"""


class Quiet(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


def rss_mib(pid):
    return run.rss_kib(pid) / 1024


def settle(pid, seconds=2.0):
    """RSS once it stops moving (or after `seconds`)."""
    last = rss_mib(pid)
    deadline = time.time() + seconds
    while time.time() < deadline:
        time.sleep(0.25)
        now = rss_mib(pid)
        if abs(now - last) < 0.1:
            return now
        last = now
    return last


def open_fresh(port, n, _):
    return [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]


def open_heads(port, n, head_bytes):
    pad = b"x-pad: " + b"a" * max(head_bytes - 40, 0) + b"\r\n"
    conns = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"GET /x HTTP/1.1\r\nhost: t\r\n" + pad)
        conns.append(s)
    return conns


def open_keepalive(port, n, _):
    conns = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"GET /x HTTP/1.1\r\nhost: t\r\n\r\n")
        s.recv(4096)
        conns.append(s)
    return conns


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--head-bytes", type=int, default=4100)
    ap.add_argument("--binary", help="another tollgate build to measure; the table is only printed")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))

    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    upstream.request_queue_size = 128
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    rows = []
    for allocator, env in [("default", {}), ("MIMALLOC_PURGE_DELAY=0", {"MIMALLOC_PURGE_DELAY": "0"})]:
        rows += measure(args, upstream.server_address[1], allocator, env)
    upstream.shutdown()
    command = " ".join(["python3", "bench/idle_connections.py"] + sys.argv[1:])
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = ["## Connections at the edge", "",
            f"Measured {when} with `{command}` (release build, one worker thread, memory store, "
            f"`max_header_bytes: 65536`, {os.cpu_count()} cores, load average "
            f"{os.getloadavg()[0]:.2f}): gateway RSS (VmRSS) once settled, a fresh gateway per allocator "
            "setting.", "",
            "| allocator | connections | count | RSS before, MiB | RSS with them open, MiB | KiB each | "
            "RSS after they closed and 50 requests passed, MiB |",
            "|---|---|---:|---:|---:|---:|---:|"] + rows
    text += ["", "A connection waits for its first complete head in the edge alone: no proxy session or "
             "request state is made before (about 15 KiB a connection is Pingora's and tokio's own). A head's "
             "buffer grows with what arrives (4 KiB, then doubling, never past `max_header_bytes` + 4 KiB); a "
             "stalled head is answered 408 after `header_read_ms`. What connections free goes back to the "
             "allocator at once, which hands it to the system after a delay of its own heap's activity "
             "(mimalloc's purge delay); `MIMALLOC_PURGE_DELAY=0` in the environment hands it back at once."]
    if not args.binary:
        with open(os.path.join(ROOT, "bench", "connections.md"), "w") as f:
            f.write("\n".join(text) + "\n")
    print("\n".join(text))


def measure(args, upstream_port, allocator, env):
    port, admin = run.free_port(), run.free_port()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        policy = os.path.join(tmp, "policy.yaml")
        with open(policy, "w") as f:
            f.write(POLICY.format(port=port, admin=admin, upstream=upstream_port))
        gw = subprocess.Popen(
            [args.binary or BINARY, "run", "--config", policy], env={**os.environ, **env},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            run.wait_port(port)
            for name, opener in [("fresh (nothing sent)", open_fresh),
                                 (f"half-sent heads ({args.head_bytes} B)", open_heads),
                                 ("keep-alive (one request done)", open_keepalive)]:
                before = settle(gw.pid)
                conns = opener(port, args.count, args.head_bytes)
                held = settle(gw.pid, 4.0)
                for s in conns:
                    s.close()
                # A little ordinary traffic afterwards: the allocator hands
                # freed pages back to the system as it works, after a delay.
                time.sleep(0.1)
                for _ in range(50):
                    run.http_get(port, "/x")
                    time.sleep(0.02)
                after = settle(gw.pid, 4.0)
                rows.append(f"| {allocator} | {name} | {args.count} | {before:.1f} | {held:.1f} | "
                            f"{(held - before) * 1024 / args.count:.1f} | {after:.1f} |")
                print(rows[-1], flush=True)
        finally:
            gw.terminate()
            gw.wait()
    return rows


if __name__ == "__main__":
    main()
