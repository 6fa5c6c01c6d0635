#!/usr/bin/env python3
"""What the usage ledger costs the gateway per request.

Two release tollgates (one thread each, memory store, one key, a limit that
never refuses, one route to the upstream), the same policy but for one
section: `ledger-off` has no `usage`, `ledger-on` records every admitted
request (`usage: { routes: all, spool: { path, fsync_ms: 100 }, sinks: [a
Redis stream, an HTTP endpoint] }`). On the request path the ledger-on
gateway appends one JSON line to its spool; a thread of its own fsyncs it
every 100 ms and one thread per sink ships it: to a redis-server this
script starts (a Lua script: `SET NX` of the id, `XADD`), and to a small
receiver in this script (an asyncio loop taking CloudEvents batches,
answering 200). Both gateways forward to the same upstream, one NGINX
worker returning a small 200 (`bench/nginx/upstream.conf`, as run.py).

wrk drives the two in interleaved rounds, the order rotated each round.
Each run gives req/s and the gateway's CPU per request (utime + stime from
/proc over the requests served; the ledger's own threads, `usage-*`, shown
apart too), and for ledger-on the Redis server's and the receiver's CPU
per request, apart from the gateway's. After a ledger-on run the script
waits for every sink to hold every record admitted so far, then reads the
CPU: what shipping that run's records cost is in that run's window. Each
round: the ratio on / off of the gateway's CPU per request; the target:
the median ratio <= 1.10.

Before the rounds, the spool's bytes per record: the HTTP receiver refuses
(503) during a short wrk run, so the spool keeps what it wrote (a segment is
deleted only once every sink has passed it); the bytes appended to the
segment files and the records (lines) they gained are read from the spool
directory, with the allocated blocks, and set beside the gateway's
`tollgate_usage_spool_bytes` and one record's JSON length. At the end:
every record admitted (`tollgate_requests_total{outcome="allowed"}`) in
the stream (XLEN) and at the receiver (distinct event ids), or it says
which are missing; and per run, how many times over the gateway sent each
record to each sink (`tollgate_usage_records_total`, shipped + duplicate,
over the records admitted: 1.00 is once). It prints a Markdown section
for bench/NOTES.md.

    python3 bench/ledger.py [--quick] [--duration 10] [--rounds 6] [--connections 32]
                            [--sinks both|redis|http] [--binary PATH] [--spool-dir DIR] [--max-bytes BYTES]

`--sinks redis` or `http` configures one sink instead of both (the target
is both): what each costs alone. With the stream alone the spool is
measured while Redis holds scripts (`CLIENT PAUSE ... WRITE`).

The spool lives in a temporary directory (under --spool-dir if given: its
file system decides what an fsync costs; the section names it), with
`max_bytes` 64 MiB (segments of 8 MiB), as docs/src/usage-ledger.md has
it, rather than the 1 GiB default (segments of 64 MiB), to bound the disk
this run can fill; `--max-bytes 0` leaves it at the default.

Needs a release build, nginx, wrk and redis-server. Loopback only; every
process started here is stopped here, by its pid, and the temporary
directory is removed.
"""

import argparse
import asyncio
import hashlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402

TARGET = 1.10
MAX = 1_000_000_000
FSYNC_MS = 100
STREAM = "tollgate:usage"
INSTANCE = "bench-gw-1"
PATH = "/v1/bench"
NAMES = ["ledger-off", "ledger-on"]

POLICY = """
version: 1
policy_version: "bench-{name}"
server: {{ listen: ["127.0.0.1:{port}"], admin_listen: "127.0.0.1:{admin}", threads: 1 }}
store: {{ backend: memory }}
client_ip: {{ trusted_proxies: ["127.0.0.1/32"], header: x-forwarded-for }}
auth:
  keys:
    - {{ id: bench, tenant: bench-tenant, sha256: "{digest}" }}
limits:
  per-credential: {{ key: [credential], capacity: {max}, refill_per_second: {max} }}
upstreams:
  api: {{ servers: ["127.0.0.1:{upstream}"], max_in_flight: 1024 }}
routes:
  - {{ name: bench, path: "/**", upstream: api, limits: [per-credential] }}
{usage}"""
USAGE = """usage:
  routes: all
  spool: {{ path: "{spool}", fsync_ms: {fsync}{max_bytes} }}
  sinks:
{sinks}"""
ADMITTED = 'tollgate_requests_total{outcome="allowed",route="bench"}'

# ---- the receiver -----------------------------------------------------------


def receive(port):
    """The HTTP sink (`--receive PORT`): takes POSTed CloudEvents batches,
    keeps their ids, answers 200 (503 while paused); GET /pause, /resume,
    /stats for this script. Keep-alive, one asyncio loop."""
    ids = set()
    st = {"paused": False, "events": 0, "batches": 0, "refused": 0, "invalid": 0}

    def answer(method, target, fields, body):
        if method == "POST":
            if st["paused"]:
                st["refused"] += 1
                return "503 Service Unavailable", b""
            try:
                assert fields.get("content-type", "").startswith("application/cloudevents-batch+json")
                events = json.loads(body)
                for e in events:
                    if e.get("specversion") != "1.0" or e.get("type") != "tollgate.request" \
                            or e.get("id") != e.get("data", {}).get("id"):
                        st["invalid"] += 1
                    ids.add(e["id"])
                st["events"] += len(events)
                st["batches"] += 1
                return "200 OK", b""
            except (AssertionError, ValueError, KeyError, TypeError, AttributeError):
                st["invalid"] += 1
                return "400 Bad Request", b""
        if target == "/pause":
            st["paused"] = True
        elif target == "/resume":
            st["paused"] = False
        return "200 OK", json.dumps(dict(st, distinct=len(ids))).encode()

    def chunked(buf, start):
        """A chunked body from `start`: (body, end) or None if incomplete."""
        body, at = b"", start
        while True:
            eol = buf.find(b"\r\n", at)
            if eol < 0:
                return None
            size = int(bytes(buf[at:eol]).split(b";")[0], 16)
            if size == 0:
                end = buf.find(b"\r\n\r\n", eol)
                return (body, end + 4) if end >= 0 else None
            if len(buf) < eol + 2 + size + 2:
                return None
            body += bytes(buf[eol + 2:eol + 2 + size])
            at = eol + 2 + size + 2

    class Receiver(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport, self.buf = transport, bytearray()

        def data_received(self, data):
            self.buf += data
            while (end := self.buf.find(b"\r\n\r\n")) >= 0:
                lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
                method, target = lines[0].split(" ")[:2]
                fields = {}
                for line in lines[1:]:
                    k, _, v = line.partition(":")
                    fields[k.strip().lower()] = v.strip()
                if fields.get("transfer-encoding", "").lower() == "chunked":
                    got = chunked(self.buf, end + 4)
                    if got is None:
                        return
                    body, stop = got
                else:
                    stop = end + 4 + int(fields.get("content-length", 0))
                    if len(self.buf) < stop:
                        return
                    body = bytes(self.buf[end + 4:stop])
                del self.buf[:stop]
                status, reply = answer(method, target, fields, body)
                self.transport.write(f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
                                     f"content-length: {len(reply)}\r\n\r\n".encode() + reply)
                if fields.get("connection", "").lower() == "close":
                    self.transport.close()
                    return

    async def main():
        server = await asyncio.get_running_loop().create_server(Receiver, "127.0.0.1", port, backlog=1024,
                                                                reuse_address=True)
        await server.serve_forever()

    signal.signal(signal.SIGINT, lambda *_: os._exit(0))
    asyncio.run(main())


# ---- measuring --------------------------------------------------------------

def proc_cpu(pid):
    """User and system CPU seconds of one process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def ledger_threads_cpu(pid):
    """CPU seconds of the ledger's own threads (`usage-*`: the fsync and
    the sinks' shipping threads) of `pid`."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        if stat[stat.index("(") + 1:stat.rindex(")")].startswith("usage-"):
            f = stat.rsplit(")", 1)[1].split()
            total += int(f[11]) + int(f[12])
    return total / tick


def wrk(port, duration, connections):
    args = ["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency",
            "-H", f"Authorization: Bearer {run.API_KEY}", "-H", "X-Forwarded-For: 203.0.113.7",
            f"http://127.0.0.1:{port}{PATH}"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=duration + 30)
    try:
        return run.parse_wrk(out.stdout)
    except (AttributeError, ValueError) as e:
        raise RuntimeError(f"unexpected wrk output for {args}: {out.stdout} {out.stderr}") from e


def receiver(port, what="stats"):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/{what}", timeout=5) as r:
        return json.loads(r.read())


def xlen(redis):
    return int(run.redis_cli(redis, "XLEN", STREAM).strip())


class Sinks:
    """The sinks of the ledger-on policy: the stream's Redis (`redis`, a
    port) and the receiver (`recv`), each None when not configured."""

    def __init__(self, redis, recv):
        self.redis, self.recv = redis, recv

    def held(self):
        """Records each configured sink holds (distinct ids)."""
        return {**({"redis_stream": xlen(self.redis)} if self.redis else {}),
                **({"http": receiver(self.recv)["distinct"]} if self.recv else {})}

    def caught_up(self, admitted, timeout):
        """Waits until every sink holds `admitted` records; the seconds it
        took, or None if they did not within `timeout`."""
        start = time.time()
        while True:
            if all(n >= admitted for n in self.held().values()):
                return time.time() - start
            if time.time() - start > timeout:
                return None
            time.sleep(0.05)

    def pause(self, seconds):
        """Stops one sink taking records for at most `seconds`: the receiver
        answers 503, or Redis holds scripts (`CLIENT PAUSE ... WRITE`)."""
        if self.recv:
            receiver(self.recv, "pause")
        else:
            run.redis_cli(self.redis, "CLIENT", "PAUSE", int(seconds * 1000), "WRITE")

    def resume(self):
        if self.recv:
            receiver(self.recv, "resume")
        else:
            run.redis_cli(self.redis, "CLIENT", "UNPAUSE")


def shipped_again(admin):
    """What the ledger-on gateway counted per sink and result
    (`tollgate_usage_records_total`): shipped, duplicate (the stream had
    it), failed."""
    series = 'tollgate_usage_records_total{{result="{}",sink="{}"}}'
    return {(r, s): run.metric(admin, series.format(r, s))
            for r in ("shipped", "duplicate", "failed") for s in ("redis_stream", "http")}


def segments(spool):
    """Each segment file of the spool: its size and allocated bytes."""
    out = {}
    for p in spool.glob("*.seg"):
        try:
            s = p.stat()
        except FileNotFoundError:
            continue
        out[p.name] = (s.st_size, s.st_blocks * 512)
    return out


def appended(spool, before):
    """Bytes, allocated bytes and records (lines) appended to the spool's
    segments since `before` (`segments()`), and its files' size now. Only
    the segment written to grows, and it is never deleted: a file of
    `before` gone since was whole then."""
    now = segments(spool)
    size = lines = blocks = 0
    for name, (length, allocated) in now.items():
        start, start_blocks = before.get(name, (0, 0))
        with open(spool / name, "rb") as f:
            f.seek(start)
            data = f.read(length - start)
        if data and not data.endswith(b"\n"):
            raise RuntimeError(f"{name}: a record cut short after the load stopped")
        size += len(data)
        lines += data.count(b"\n")
        blocks += allocated - start_blocks
    return size, blocks, lines, sum(s for s, _ in now.values())


def fs_type(path):
    """The file system `path` is on, from /proc/mounts (longest mount point)."""
    path, best = os.path.realpath(path), ("?", "?", -1)
    for line in Path("/proc/mounts").read_text().splitlines():
        dev, mount, kind = line.split()[:3]
        if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) > best[2]:
            best = (kind, dev, len(mount))
    return f"{best[0]} ({best[1]})"


def redis_memory(redis):
    return int(re.search(r"used_memory:(\d+)", run.redis_cli(redis, "INFO", "memory")).group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5 s a run, 4 rounds (about a minute)")
    ap.add_argument("--duration", type=int, help="seconds a run (10; 5 with --quick)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds (6; 4 with --quick)")
    ap.add_argument("--connections", type=int, default=32, help="wrk's connections (32, as run.py)")
    ap.add_argument("--sinks", choices=["both", "redis", "http"], default="both",
                    help="the ledger-on gateway's sinks (both: the target's configuration)")
    ap.add_argument("--spool-seconds", type=int, default=2,
                    help="the wrk run that fills the spool while a sink refuses (2)")
    ap.add_argument("--binary", default=str(run.RELEASE / "tollgate"), help="the tollgate build to measure")
    ap.add_argument("--spool-dir", help="the directory the spool's temporary directory is made in "
                                        "(its file system decides what an fsync costs); the system's temp dir")
    ap.add_argument("--max-bytes", type=int, default=64 << 20,
                    help="usage.spool.max_bytes (64 MiB: segments of 8 MiB); 0: the default, 1 GiB")
    ap.add_argument("--receive", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.receive:
        return receive(args.receive)
    args.duration = args.duration or (5 if args.quick else 10)
    args.rounds = args.rounds or (4 if args.quick else 6)
    for tool in ["nginx", "wrk", "redis-server", "redis-cli"]:
        if not shutil.which(tool):
            sys.exit(f"{tool} is missing: run `make bench-deps`")
    binary = Path(args.binary)
    if not binary.exists():
        sys.exit(f"{binary} is missing: cargo build --release --bin tollgate")

    work = Path(tempfile.mkdtemp(prefix="tollgate-ledger-"))
    spool_parent = Path(tempfile.mkdtemp(prefix="tollgate-ledger-spool-", dir=args.spool_dir)) \
        if args.spool_dir else work
    spool = spool_parent / "spool"
    procs = run.Procs(work)
    failed = True
    try:
        disk = os.statvfs(spool_parent)
        free = disk.f_bavail * disk.f_frsize
        if free < (args.max_bytes or 1 << 30) + (64 << 20):
            sys.exit(f"{spool_parent} has {free >> 20} MiB free: the spool may take "
                     f"{(args.max_bytes or 1 << 30) >> 20} MiB; give --spool-dir elsewhere or a smaller --max-bytes")

        upstream = run.free_port()
        conf = work / "upstream.conf"
        conf.write_text(run.render(run.BENCH / "nginx" / "upstream.conf", work=work, upstream_port=upstream))
        procs.start("upstream", ["nginx", "-p", str(work), "-c", str(conf)])
        ports = [upstream]
        redis = rp = recv = xp = None
        if args.sinks in ("both", "redis"):
            redis = run.free_port()
            rp = procs.start("redis", ["redis-server", "--port", str(redis), "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no", "--dir", str(work)])
            ports.append(redis)
        if args.sinks in ("both", "http"):
            recv = run.free_port()
            xp = procs.start("receiver", [sys.executable, __file__, "--receive", str(recv)])
            ports.append(recv)
        for port in ports:
            run.wait_port(port)
        sinks = Sinks(redis, recv)
        configured = [s for s, on in (("redis_stream", redis), ("http", recv)) if on]

        gws, ports, admins = {}, {}, {}
        digest = hashlib.sha256(run.API_KEY.encode()).hexdigest()
        sink_lines = "".join([
            f'    - {{ redis_stream: {{ key: "{STREAM}", urls: ["redis://127.0.0.1:{redis}/0"] }} }}\n'
            if redis else "",
            f'    - {{ http: {{ url: "http://127.0.0.1:{recv}/events" }} }}\n' if recv else ""])
        for name in NAMES:
            ports[name], admins[name] = run.free_port(), run.free_port()
            usage = "" if name == "ledger-off" else USAGE.format(
                spool=spool, fsync=FSYNC_MS, sinks=sink_lines,
                max_bytes=f", max_bytes: {args.max_bytes}" if args.max_bytes else "")
            policy = work / f"{name}.yaml"
            policy.write_text(POLICY.format(name=name, port=ports[name], admin=admins[name], upstream=upstream,
                                            max=MAX, digest=digest, usage=usage))
            check = subprocess.run([str(binary), "check", "--config", str(policy)], capture_output=True, text=True)
            print(f"tollgate check ({name}): {(check.stdout + check.stderr).strip()}", flush=True)
            if check.returncode != 0:
                sys.exit(f"the {name} policy was refused: a build older than the usage ledger refuses `usage`")
            gws[name] = procs.start(name, [str(binary), "run", "--config", str(policy)],
                                    env={"TOLLGATE_KEY_SECRET": run.SECRET, "RUST_LOG": "warn",
                                         "TOLLGATE_INSTANCE": INSTANCE})
        for name in NAMES:
            run.wait_port(ports[name])
            run.wait_port(admins[name])
        on_admin = admins["ledger-on"]

        headers = {"Authorization": f"Bearer {run.API_KEY}", "X-Forwarded-For": "203.0.113.7"}
        memory0 = redis_memory(redis) if redis else 0
        for name in NAMES:
            status, body = run.http_get(ports[name], PATH, headers)
            if status != 200 or body != b"ok\n":
                sys.exit(f"{name} answered {status} {body!r}")
        if sinks.caught_up(1, 10) is None:
            sys.exit(f"the first record never reached every sink: {sinks.held()}")
        lines = list(spool.glob("*.seg"))
        record = lines[0].read_bytes().split(b"\n")[0].decode() if lines else "?"
        print(f"a record ({len(record.encode())} bytes of JSON, + a newline in the spool): {record}", flush=True)

        for name in NAMES:  # warm-up
            wrk(ports[name], 2, args.connections)
        time.sleep(0.2)
        if sinks.caught_up(run.metric(on_admin, ADMITTED), 20) is None:
            sys.exit(f"the warm-up's records never reached every sink: {sinks.held()}")

        # The spool's bytes per record: a sink refuses, so the spool keeps what it writes.
        admitted0 = run.metric(on_admin, ADMITTED)
        before = segments(spool)
        sinks.pause(args.spool_seconds + 2)
        w = wrk(ports["ledger-on"], args.spool_seconds, args.connections)
        time.sleep(3 * FSYNC_MS / 1000)  # an fsync, and the gauge's update
        spool_bytes, spool_blocks, spool_lines, files = appended(spool, before)
        gauge = run.metric(on_admin, "tollgate_usage_spool_bytes")
        spool_admitted = run.metric(on_admin, ADMITTED) - admitted0
        sinks.resume()
        per_record = spool_bytes / max(spool_lines, 1)
        print(f"spool: {spool_lines} records appended ({spool_admitted:.0f} admitted, wrk counted {w['requests']}) "
              f"in {spool_bytes} bytes, {per_record:.1f} bytes a record, {spool_blocks / max(spool_lines, 1):.1f} "
              f"allocated; segment files {files} bytes, tollgate_usage_spool_bytes {gauge:.0f}", flush=True)
        if sinks.caught_up(run.metric(on_admin, ADMITTED), 30) is None:
            sys.exit(f"the spool's records never reached every sink once it answered again: {sinks.held()}")

        load_start = os.getloadavg()[0]
        rows = {name: [] for name in NAMES}
        for r, name in run.interleaved(NAMES, args.rounds):
            gw, on = gws[name], name == "ledger-on"
            admitted_before = run.metric(admins[name], ADMITTED)
            counts0 = shipped_again(on_admin) if on else {}
            user0, sys0 = proc_cpu(gw.pid)
            own0 = ledger_threads_cpu(gw.pid)
            redis0, recv0 = run.cpu_seconds(rp.pid) if rp else 0, run.cpu_seconds(xp.pid) if xp else 0
            w = wrk(ports[name], args.duration, args.connections)
            time.sleep(0.2)
            admitted = run.metric(admins[name], ADMITTED)
            drain = sinks.caught_up(admitted, 30) if on else 0.0
            user1, sys1 = proc_cpu(gw.pid)
            own1 = ledger_threads_cpu(gw.pid)
            redis1, recv1 = run.cpu_seconds(rp.pid) if rp else 0, run.cpu_seconds(xp.pid) if xp else 0
            n = max(w["requests"], 1)
            w.update(user=(user1 - user0) * 1e6 / n, system=(sys1 - sys0) * 1e6 / n, own=(own1 - own0) * 1e6 / n,
                     redis=(redis1 - redis0) * 1e6 / n, receiver=(recv1 - recv0) * 1e6 / n, drain=drain,
                     admitted=admitted - admitted_before, round=r)
            w["total"] = w["user"] + w["system"]
            # Records shipped to each sink per record admitted in the run (1.00: each once).
            if on:
                counts1 = shipped_again(on_admin)
                d = {k: counts1[k] - counts0[k] for k in counts1}
                w["shipped"] = {s: (d["shipped", s] + d["duplicate", s]) / max(w["admitted"], 1) for s in configured}
            rows[name].append(w)
            extra = "" if not on else (
                f", of it the ledger's threads {w['own']:.1f}" +
                (f"; Redis {w['redis']:.1f} µs/request" if redis else "") +
                (f"; receiver {w['receiver']:.1f} µs/request" if recv else "") + "; shipped per record " +
                ", ".join(f"{s} {v:.2f}" for s, v in w["shipped"].items()) + "; sinks caught up " +
                (f"{drain:.2f} s after the run" if drain is not None else "NOT within 30 s"))
            print(f"round {r + 1} {name}: {w['rps']:.0f} req/s, {w['requests']} requests ({w['admitted']:.0f} "
                  f"admitted), gateway {w['total']:.1f} µs/request (user {w['user']:.1f}, system "
                  f"{w['system']:.1f}){extra}, {w['errors']} errors", flush=True)
        load_end = os.getloadavg()[0]

        # Every record admitted, at every sink.
        time.sleep(0.2)
        admitted = run.metric(on_admin, ADMITTED)
        sinks.caught_up(admitted, 30)
        held = sinks.held()
        got = receiver(recv) if recv else {}
        counts = shipped_again(on_admin)
        dropped = run.metric(on_admin, "tollgate_usage_dropped_total")
        unavailable = run.metric(on_admin, 'tollgate_requests_total{outcome="usage_unavailable",route="bench"}')
        memory = redis_memory(redis) - memory0 if redis else 0
        served = sum(w["requests"] for w in rows["ledger-on"])
        log = (work / "ledger-on.log").read_text(errors="replace")
        cursor_errors = log.count("cannot write the usage spool's cursor")

        info = run.machine()
        built = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(binary.stat().st_mtime))
        head = subprocess.run(["git", "-C", str(run.ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip() or "?"
        max_bytes = f"`max_bytes: {args.max_bytes}` ({args.max_bytes >> 20} MiB, segments of " \
                    f"{min(max(args.max_bytes // 8, 64 << 10), 64 << 20) >> 20} MiB)" if args.max_bytes else \
                    "the default `max_bytes` (1 GiB, segments of 64 MiB)"
        described = {"redis_stream": "the stream is on a redis-server of its own",
                     "http": "the HTTP sink is a Python asyncio receiver parsing each CloudEvents batch and keeping "
                             "its ids"}
        lines = [
            f"## What the usage ledger costs per request ({time.strftime('%Y-%m-%d, %H:%M UTC', time.gmtime())})",
            "",
            f"`python3 bench/ledger.py {' '.join(sys.argv[1:])}` (working tree at {head}; `{binary}` built "
            f"{built}). Machine: {info['cpu']}, {info['memory']}, {info['os']}. {info['nginx']}; {info['redis']}; "
            f"{info['wrk']}; {info['rustc']}. Load average {load_start:.2f} at the start, {load_end:.2f} at the end.",
            "",
            f"Two tollgates, one thread each, memory store, one key, one limit that never refuses, one route to one "
            f"NGINX worker returning a small 200. `ledger-on` adds `usage: {{ routes: all, spool: {{ fsync_ms: "
            f"{FSYNC_MS} }}, sinks: [{', '.join(configured)}] }}` (defaults otherwise: `on_full: refuse`"
            f"{', HTTP batches of 500' if recv else ''}), with {max_bytes}; its spool on {fs_type(spool)}; "
            f"{'; '.join(described[s] for s in configured)}. "
            f"`wrk -t1 -c{args.connections} -d{args.duration}s` per contender, {args.rounds} rounds with the order "
            f"rotated each round; medians. CPU per request: each process's utime + stime from /proc over the "
            f"requests wrk counted; after a ledger-on run the window stays open until every sink holds every record "
            f"admitted, so shipping that run's records is in it (Redis's and the receiver's CPU are their own "
            f"columns, not in the gateway's). Shipped per record: what the gateway sent each sink "
            f"(`tollgate_usage_records_total`, shipped + duplicate) over the records admitted in the run; 1.00 is "
            f"each record once.",
            "",
            "| contender | req/s | p99 ms | gateway user µs/request | system µs/request | total µs/request | "
            "of it the ledger's threads | Redis µs/request | receiver µs/request | shipped per record "
            f"({', '.join(configured)}) | sinks caught up after | errors |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        keys = ("rps", "p99", "user", "system", "total", "own", "redis", "receiver")
        med = {name: {k: statistics.median(w[k] for w in rows[name]) for k in keys} for name in NAMES}
        for name in NAMES:
            m = med[name]
            if name == "ledger-off":
                ledger_cols = "— | — | — | — | —"
            else:
                drains = [w["drain"] for w in rows[name]]
                drain = "never" if None in drains else f"{statistics.median(drains):.2f} s"
                again = ", ".join(f"{statistics.median(w['shipped'][s] for w in rows[name]):.2f}" for s in configured)
                ledger_cols = (f"{m['own']:.1f} | {m['redis']:.1f} | " if redis else f"{m['own']:.1f} | — | ") + \
                              (f"{m['receiver']:.1f} | " if recv else "— | ") + f"{again} | {drain}"
            lines.append(f"| {name} | {m['rps']:.0f} | {m['p99']:.2f} | {m['user']:.1f} | {m['system']:.1f} | "
                         f"{m['total']:.1f} | {ledger_cols} | {sum(w['errors'] for w in rows[name])} |")
        ratios = [o["total"] / f["total"] for o, f in zip(rows["ledger-on"], rows["ledger-off"])]
        ratio = statistics.median(ratios)
        extra = med["ledger-on"]["total"] - med["ledger-off"]["total"]
        lines += ["", "| ledger-on / ledger-off, gateway CPU per request | per round | median | on − off | "
                      "target | met |", "|---|---|---:|---:|---|---|",
                  f"| {' and '.join(configured)} | {', '.join(f'{x:.3f}' for x in ratios)} | {ratio:.3f} × | "
                  f"{extra:+.1f} µs | ≤ {TARGET:.2f} × | {'yes' if ratio <= TARGET else 'no'} |"]
        missing = {s: admitted - n for s, n in held.items() if n != admitted}
        at = []
        if redis:
            at.append(f"the stream holds {held['redis_stream']} (XLEN)")
        if recv:
            at.append(f"the receiver {got['distinct']} distinct ids in {got['events']} events over "
                      f"{got['batches']} batches ({got['events'] - got['distinct']} duplicates, {got['invalid']} "
                      f"invalid)")
        sent = "; ".join(f"{s}: {counts['shipped', s]:.0f} shipped, {counts['duplicate', s]:.0f} duplicate, "
                         f"{counts['failed', s]:.0f} in failed tries" for s in configured)
        lines += [
            "",
            f"Records: the ledger-on gateway admitted {admitted:.0f} requests in all (warm-up, the spool's run and "
            f"the rounds; wrk counted {served} in the rounds); {', '.join(at)}. "
            + ("Every record arrived at every sink." if not missing else
               "**Not every record arrived**: " + ", ".join(f"{n:.0f} missing at {s}" for s, n in missing.items())
               + ".")
            + f" The gateway counted ({'`tollgate_usage_records_total`'}) {sent}" +
            (f" (the receiver refused {got['refused']} tries on purpose while the spool was measured)" if recv else
             " (Redis held scripts on purpose while the spool was measured)") +
            f"; {dropped:.0f} dropped, {unavailable:.0f} refused 503 `usage-unavailable`; its log has "
            f"{cursor_errors} errors `cannot write the usage spool's cursor` (each a batch that is read and shipped "
            f"again)." + (f" Redis's memory grew {memory / max(held['redis_stream'], 1):.0f} bytes a record (the "
                          f"stream entry and the id's `SET NX` key, kept a day)." if redis else ""),
            "",
            f"Spool: {per_record:.1f} bytes a record on disk ({spool_blocks / max(spool_lines, 1):.1f} allocated), "
            f"measured from the segment files: while {'the receiver answered 503' if recv else 'Redis held scripts'}, "
            f"a {args.spool_seconds} s wrk run appended {spool_bytes} bytes in {spool_lines} records (lines) to "
            f"them ({spool_admitted:.0f} requests admitted); the gateway's `tollgate_usage_spool_bytes` read "
            f"{gauge:.0f} against the files' {files}. One record is {len(record.encode())} bytes of JSON and a "
            f"newline:",
            "",
            "```json",
            record,
            "```",
        ]
        print("\n" + "\n".join(lines), flush=True)
        failed = False
    finally:
        for name in NAMES + ["receiver", "redis", "upstream"]:
            procs.stop(name)
        procs.stop_all()
        if failed:
            for log in sorted(work.glob("*.log")):
                tail = log.read_text(errors="replace").strip().splitlines()[-5:]
                if tail:
                    print(f"--- {log.name}\n" + "\n".join(tail), file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)
        if spool_parent != work:
            shutil.rmtree(spool_parent, ignore_errors=True)


if __name__ == "__main__":
    main()
