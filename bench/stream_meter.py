#!/usr/bin/env python3
"""What reading an LLM API's token usage out of a streamed answer costs.

One release tollgate (one thread, memory store) with two routes in one
policy, the same limits and key: `/metered/**` with
`cost_from_response: { format: openai, max: 100000 }` and `/plain/**`
without it. One upstream answers both with the same bytes: a
`text/event-stream` of OpenAI chat.completion.chunk events (content
deltas of a few dozen bytes), the chunk with `choices: []` and the usage,
then `data: [DONE]`, about 4 KiB or 256 KiB, without a Content-Length
(chunked, so the gateway streams it and the meter reads copies of its
chunks as they pass). wrk drives the four contenders (metered-4k,
plain-4k, metered-256k, plain-256k) in interleaved rounds, the order
rotated each round; each run gives req/s and the gateway's CPU per request
(utime + stime from /proc over the requests served), and each round the
ratio metered / plain per size. The target: the median ratio ≤ 1.10. It
prints a Markdown section ready for bench/RESULTS.md (bench/NOTES.md).

    python3 bench/stream_meter.py [--quick] [--duration 10] [--rounds 5] [--connections 8]
                                  [--upstream python|nginx] [--chunk BYTES] [--binary PATH] [--plain-only]

The upstream, by default (`python`), is this script serving prebuilt
answers from an asyncio loop, one HTTP chunk per event, as an LLM server
writes them (`--chunk N`: chunks of N bytes cut anywhere instead).
`--upstream nginx` serves the same file through `sub_filter` (which drops
the Content-Length, so NGINX sends it chunked), in NGINX's 32 KiB output
buffers: NGINX cannot frame a file per event without Lua, which costs it
about 1.7 µs an event here. The upstream's own CPU per request is in the table.

The policy is checked with `tollgate check` first. A build older than the
meter refuses `format: openai`; `--plain-only` then measures the plain
route alone (a check of the harness, no ratio).

Needs a release build and wrk. Loopback only; every process started here
is stopped here, by its pid.
"""

import argparse
import asyncio
import hashlib
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402

SIZES = {"4k": 4096, "256k": 262144}
TARGET = 1.10
MAX = 1_000_000_000
EVENT_END = b"\n\n"

POLICY = """
version: 1
policy_version: "bench-stream-meter"
server: {{ listen: ["127.0.0.1:{port}"], admin_listen: "127.0.0.1:{admin}", threads: 1 }}
store: {{ backend: memory }}
client_ip: {{ trusted_proxies: ["127.0.0.1/32"], header: x-forwarded-for }}
auth:
  keys:
    - {{ id: bench, tenant: bench-tenant, sha256: "{digest}" }}
limits:
  per-credential: {{ key: [credential], capacity: {max}, refill_per_second: {max} }}
  per-tenant: {{ key: [tenant], capacity: {max}, refill_per_second: {max} }}
upstreams:
  llm: {{ servers: ["127.0.0.1:{upstream}"], max_in_flight: 1024 }}
routes:
{metered}  - {{ name: plain, path: "/plain/**", upstream: llm, limits: [per-credential, per-tenant] }}
"""
METERED_ROUTE = ("  - { name: metered, path: \"/metered/**\", upstream: llm, limits: [per-credential, per-tenant], "
                 "cost_from_response: { format: openai, max: 100000 } }\n")

NGINX = """
worker_processes 1;
daemon off;
pid {work}/upstream.pid;
error_log {work}/upstream.error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  keepalive_requests 1000000;
  keepalive_timeout 75s;
  types {{ }}
  default_type text/event-stream;
  server {{
    listen 127.0.0.1:{port} reuseport backlog=4096;
    # sub_filter drops the Content-Length of what it filters: the file goes out chunked.
    location ~ ^/[a-z]+/(?<size>4k|256k)$ {{
      alias {work}/sse/$size.sse;
      etag off;
      sub_filter_types text/event-stream;
      sub_filter '\\x00never\\x00' '';
    }}
  }}
}}
"""

# ---- the answers ------------------------------------------------------------

WORDS = ("the a of to and in that is for it with as on be this by are from or at which an model token "
         "stream gateway limit budget request answer usage tenant café naïve — budget's").split()


def chunk_event(choices, usage=None):
    data = {"id": "chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG", "object": "chat.completion.chunk",
            "created": 1741569952, "model": "gpt-4o-2024-08-06", "service_tier": "default",
            "system_fingerprint": "fp_f9f4fb6dbf", "choices": choices, "usage": usage}
    return b"data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def stream_events(size):
    """The events of an OpenAI chat/completions stream of about `size`
    bytes (at most), with `stream_options.include_usage`: a first chunk
    with the role, content deltas of a few dozen bytes, the finish chunk,
    the usage chunk (`choices: []`), `data: [DONE]`. Deterministic."""
    rng = random.Random(size)
    first = chunk_event([{"index": 0, "delta": {"role": "assistant", "content": "", "refusal": None},
                          "logprobs": None, "finish_reason": None}])
    deltas = []

    def tail(n):
        return [
            chunk_event([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]),
            chunk_event([], {"prompt_tokens": 1200, "completion_tokens": n * 6, "total_tokens": 1200 + n * 6,
                             "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
                             "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                                                           "accepted_prediction_tokens": 0,
                                                           "rejected_prediction_tokens": 0}}),
            b"data: [DONE]\n\n",
        ]

    total = len(first)
    while True:
        text = " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 8)))
        if rng.random() < 0.05:
            text += ".\n\n"
        if rng.random() < 0.03:
            text += ' "quoted"'
        event = chunk_event([{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}])
        if total + len(event) + sum(map(len, tail(len(deltas) + 1))) > size:
            break
        deltas.append(event)
        total += len(event)
    return [first, *deltas, *tail(len(deltas))]


def framed(events, chunk):
    """A whole HTTP/1.1 answer, chunked: one chunk per event (`chunk` 0) or
    chunks of `chunk` bytes cut anywhere."""
    body = b"".join(events)
    pieces = events if not chunk else [body[i:i + chunk] for i in range(0, len(body), chunk)]
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    return head + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def serve(port, work, chunk):
    """The upstream (`--serve`): prebuilt answers by the last segment of the
    path, keep-alive, from one asyncio loop."""
    answers = {}
    for name in SIZES:
        body = (Path(work) / "sse" / f"{name}.sse").read_bytes()
        events = [e + EVENT_END for e in body.split(EVENT_END) if e]
        assert b"".join(events) == body
        answers[name.encode()] = framed(events, chunk)
    not_found = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"

    class Answer(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport, self.buf = transport, b""

        def data_received(self, data):
            self.buf += data
            while (end := self.buf.find(b"\r\n\r\n")) >= 0:
                head, self.buf = self.buf[:end], self.buf[end + 4:]
                path = head.split(b" ", 2)[1].split(b"?", 1)[0]
                self.transport.write(answers.get(path.rsplit(b"/", 1)[-1], not_found))
                if re.search(rb"(?im)^connection:\s*close", head):
                    self.transport.close()
                    return

    async def main():
        server = await asyncio.get_running_loop().create_server(Answer, "127.0.0.1", port, backlog=4096,
                                                                reuse_address=True)
        await server.serve_forever()

    signal.signal(signal.SIGINT, lambda *_: os._exit(0))
    asyncio.run(main())


# ---- measuring --------------------------------------------------------------

def raw_get(port, path, headers=None):
    """GET over one connection (closed after): status, headers (lower-case
    names), the body decoded, and the number of HTTP chunks it came in (0:
    not chunked)."""
    lines = [f"GET {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        data = b""
        while part := s.recv(1 << 16):
            data += part
    head, _, rest = data.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    fields = {}
    for line in head.decode("latin-1").split("\r\n")[1:]:
        k, _, v = line.partition(":")
        fields[k.strip().lower()] = v.strip()
    if fields.get("transfer-encoding", "").lower() != "chunked":
        return status, fields, rest, 0
    body, chunks = b"", 0
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return status, fields, body, chunks
        body, rest, chunks = body + rest[:size], rest[size + 2:], chunks + 1


def proc_cpu(pid):
    """User and system CPU seconds of one process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def wrk(port, path, duration, connections):
    args = ["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency",
            "-H", f"Authorization: Bearer {run.API_KEY}", "-H", "X-Forwarded-For: 203.0.113.7",
            f"http://127.0.0.1:{port}{path}"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=duration + 30)
    try:
        w = run.parse_wrk(out.stdout)
        n, unit = re.search(r"requests in \S+, ([\d.]+)([KMGT]?B) read", out.stdout).groups()
    except (AttributeError, ValueError) as e:
        raise RuntimeError(f"unexpected wrk output for {args}: {out.stdout} {out.stderr}") from e
    w["bytes"] = float(n) * 1024 ** ["B", "KB", "MB", "GB", "TB"].index(unit)
    return w


def reconciled(admin):
    """The metered route's settlements so far, by direction."""
    _, body = run.http_get(admin, "/metrics")
    out = {}
    for labels, value in re.findall(r"^tollgate_cost_reconciled_total\{([^}]*)\} (\S+)$", body.decode(), re.M):
        fields = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if fields.get("route") == "metered":
            out[fields["direction"]] = out.get(fields["direction"], 0) + float(value)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 s a run, 3 rounds")
    ap.add_argument("--duration", type=int, help="seconds a run (10; 4 with --quick)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds (5; 3 with --quick)")
    ap.add_argument("--connections", type=int, default=8, help="wrk's connections (8)")
    ap.add_argument("--upstream", choices=["python", "nginx"], default="python")
    ap.add_argument("--chunk", type=int, default=0,
                    help="python upstream: HTTP chunks of this many bytes; 0 (the default): one per event")
    ap.add_argument("--binary", default=str(run.RELEASE / "tollgate"), help="the tollgate build to measure")
    ap.add_argument("--plain-only", action="store_true",
                    help="measure the plain route alone (a build that refuses format: openai)")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(args.serve, args.work, args.chunk)
    args.duration = args.duration or (4 if args.quick else 10)
    args.rounds = args.rounds or (3 if args.quick else 5)
    for tool in ["wrk"] + (["nginx"] if args.upstream == "nginx" else []):
        if not shutil.which(tool):
            sys.exit(f"{tool} is missing: run `make bench-deps`")
    binary = Path(args.binary)
    if not binary.exists():
        sys.exit(f"{binary} is missing: cargo build --release --bin tollgate")

    work = Path(tempfile.mkdtemp(prefix="tollgate-stream-meter-"))
    procs = run.Procs(work)
    try:
        # The answers, written once: both routes and both upstreams serve these bytes
        # (readable by NGINX's worker, which runs as nobody when started as root).
        work.chmod(0o755)
        (work / "sse").mkdir(mode=0o755)
        bodies = {}
        for name, size in SIZES.items():
            bodies[name] = b"".join(stream_events(size))
            (work / "sse" / f"{name}.sse").write_bytes(bodies[name])

        upstream = run.free_port()
        if args.upstream == "nginx":
            conf = work / "upstream.conf"
            conf.write_text(NGINX.format(work=work, port=upstream))
            up = procs.start("upstream", ["nginx", "-p", str(work), "-c", str(conf)])
        else:
            up = procs.start("upstream", [sys.executable, __file__, "--serve", str(upstream), "--work", str(work),
                                          "--chunk", str(args.chunk)])
        run.wait_port(upstream)
        framing = {}
        for name, body in bodies.items():
            status, fields, got, chunks = raw_get(upstream, f"/plain/{name}")
            if status != 200 or got != body or not chunks or "content-length" in fields \
                    or not fields.get("content-type", "").startswith("text/event-stream"):
                sys.exit(f"the upstream's /{name} is not the stream expected: {status} {fields} "
                         f"{len(got)} bytes in {chunks} chunks")
            framing[name] = chunks
            events = body.count(EVENT_END)
            print(f"upstream /{name}: {len(body)} bytes, {events} events, {chunks} chunks, chunked, "
                  f"text/event-stream", flush=True)

        port, admin = run.free_port(), run.free_port()
        policy = work / "policy.yaml"
        policy.write_text(POLICY.format(port=port, admin=admin, upstream=upstream, max=MAX,
                                        digest=hashlib.sha256(run.API_KEY.encode()).hexdigest(),
                                        metered="" if args.plain_only else METERED_ROUTE))
        check = subprocess.run([str(binary), "check", "--config", str(policy)], capture_output=True, text=True)
        print(f"tollgate check: {(check.stdout + check.stderr).strip()}", flush=True)
        if check.returncode != 0:
            sys.exit("the policy was refused" + ("" if args.plain_only else
                                                 ": a build older than the meter refuses `format: openai`; "
                                                 "rebuild, or run with --plain-only to check the harness"))
        gw = procs.start("tollgate", [str(binary), "run", "--config", str(policy)],
                         env={"TOLLGATE_KEY_SECRET": run.SECRET, "RUST_LOG": "warn"})
        run.wait_port(port)
        run.wait_port(admin)

        routes = ["plain"] if args.plain_only else ["metered", "plain"]
        names = [f"{route}-{size}" for size in SIZES for route in routes]
        headers = {"Authorization": f"Bearer {run.API_KEY}", "X-Forwarded-For": "203.0.113.7"}
        through = {}
        for name in names:
            route, size = name.split("-")
            status, fields, got, chunks = raw_get(port, f"/{route}/{size}", headers)
            if status != 200 or got != bodies[size]:
                sys.exit(f"{name} through the gateway: {status}, {len(got)} bytes (expected {len(bodies[size])})")
            through[name] = chunks
        if not args.plain_only:
            deadline = time.time() + 5
            while sum(reconciled(admin).values()) < len(SIZES) and time.time() < deadline:
                time.sleep(0.05)
            seen = reconciled(admin)
            if seen.get("missing") or seen.get("charged", 0) < len(SIZES):
                sys.exit(f"the metered answers did not settle at their usage: {seen}")
            print(f"metered answers settled at their usage: {seen}", flush=True)

        for name in names:  # warm-up
            route, size = name.split("-")
            wrk(port, f"/{route}/{size}", 2, args.connections)
        settled_before = reconciled(admin) if not args.plain_only else {}

        load_start = os.getloadavg()[0]
        rows = {name: [] for name in names}
        for r, name in run.interleaved(names, args.rounds):
            route, size = name.split("-")
            user0, sys0 = proc_cpu(gw.pid)
            up0 = run.cpu_seconds(up.pid)
            w = wrk(port, f"/{route}/{size}", args.duration, args.connections)
            user1, sys1 = proc_cpu(gw.pid)
            up1 = run.cpu_seconds(up.pid)
            n = max(w["requests"], 1)
            w.update(user=(user1 - user0) * 1e6 / n, system=(sys1 - sys0) * 1e6 / n,
                     upstream=(up1 - up0) * 1e6 / n, kib=w["bytes"] / 1024 / n, round=r)
            w["total"] = w["user"] + w["system"]
            rows[name].append(w)
            print(f"round {r + 1} {name}: {w['rps']:.0f} req/s, gateway {w['total']:.1f} µs/request "
                  f"(user {w['user']:.1f}, system {w['system']:.1f}), upstream {w['upstream']:.1f} µs/request, "
                  f"{w['kib']:.1f} KiB read/request, {w['errors']} errors", flush=True)
        load_end = os.getloadavg()[0]
        requests = {name: sum(w["requests"] for w in rows[name]) for name in names}
        settled = {}
        if not args.plain_only:
            time.sleep(0.5)
            after = reconciled(admin)
            settled = {d: after.get(d, 0) - settled_before.get(d, 0) for d in after}

        info = run.machine()
        upstream_line = (f"the upstream is one NGINX worker serving the file through `sub_filter` "
                         f"({'; '.join(f'{k}: {v} chunks' for k, v in framing.items())})"
                         if args.upstream == "nginx" else
                         f"the upstream is this script's asyncio loop (Python {platform.python_version()}) "
                         f"writing prebuilt answers, " +
                         ("one HTTP chunk per event" if not args.chunk else f"in chunks of {args.chunk} bytes") +
                         f" ({'; '.join(f'{k}: {v} chunks' for k, v in framing.items())})")
        sizes = ", ".join(f"{k}: {len(v)} bytes, {v.count(EVENT_END)} events" for k, v in bodies.items())
        built = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(binary.stat().st_mtime))
        head = subprocess.run(["git", "-C", str(run.ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip() or "?"
        lines = [
            f"## Reading the usage out of a streamed answer ({time.strftime('%Y-%m-%d, %H:%M UTC', time.gmtime())})",
            "",
            f"`python3 bench/stream_meter.py {' '.join(sys.argv[1:])}` (working tree at {head}; `{binary}` built "
            f"{built}). Machine: {info['cpu']}, {info['memory']}, {info['os']}. {info['wrk']}; {info['rustc']}. "
            f"Load average {load_start:.2f} at the start, {load_end:.2f} at the end.",
            "",
            f"One tollgate thread, memory store, one policy with two routes under the same two limits and key: "
            f"`/metered/**` with `cost_from_response: {{ format: openai, max: 100000 }}`, `/plain/**` without. "
            f"Both answer the same `text/event-stream` of chat.completion.chunk events ending with the usage chunk "
            f"and `data: [DONE]` ({sizes}), "
            f"without a Content-Length; {upstream_line}. `wrk -t1 -c{args.connections} -d{args.duration}s` per "
            f"contender, {args.rounds} rounds with the order rotated each round; medians. CPU per request: the "
            f"process's utime + stime from /proc over the requests served.",
            "",
            "| contender | chunks to the client | req/s | KiB read per request | gateway user µs/request | "
            "system µs/request | total µs/request | upstream µs/request | errors |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        med = {name: {k: statistics.median(w[k] for w in rows[name])
                      for k in ("rps", "kib", "user", "system", "total", "upstream")} for name in names}
        for name in names:
            m = med[name]
            lines.append(f"| {name} | {through[name]} | {m['rps']:.0f} | {m['kib']:.1f} | {m['user']:.1f} | "
                         f"{m['system']:.1f} | {m['total']:.1f} | {m['upstream']:.1f} | "
                         f"{sum(w['errors'] for w in rows[name])} |")
        lines += ["", f"| answer | metered / plain, CPU per request (median of {args.rounds} rounds; range) | "
                      f"metered − plain | target ≤ {TARGET:.2f} × | met |", "|---|---:|---:|---|---|"]
        for size in SIZES:
            if args.plain_only:
                lines.append(f"| {size} | — | — | — | not measured: plain route only (`--plain-only`) |")
                continue
            ratios = [m["total"] / p["total"] for m, p in zip(rows[f"metered-{size}"], rows[f"plain-{size}"])]
            ratio = statistics.median(ratios)
            extra = med[f"metered-{size}"]["total"] - med[f"plain-{size}"]["total"]
            lines.append(f"| {size} | {ratio:.3f} × ({min(ratios):.3f}–{max(ratios):.3f}) | {extra:+.1f} µs | "
                         f"≤ {TARGET:.2f} × | {'yes' if ratio <= TARGET else 'no'} |")
        if not args.plain_only:
            answered = sum(requests[f"metered-{s}"] for s in SIZES)
            lines += ["", f"Settlements of the metered route over the measured runs "
                          f"(`tollgate_cost_reconciled_total`): {settled.get('charged', 0):.0f} charged, "
                          f"{settled.get('refunded', 0):.0f} refunded, {settled.get('missing', 0):.0f} missing usage, "
                          f"for {answered} answers wrk counted (answers cut at the end of a run settle too)."]
        print("\n" + "\n".join(lines), flush=True)
    finally:
        procs.stop_all()


if __name__ == "__main__":
    main()
