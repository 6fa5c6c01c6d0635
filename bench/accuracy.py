#!/usr/bin/env python3
"""How exactly tollgate limits: admitted against the ideal, by instances,
mode and fault.

For each run, a fresh redis-server, one shared upstream and 1, 2 or 4
`tollgate run` processes (one thread each, `expected_instances` = the
number of instances) serving one policy with a route per limit mode and
`on_store_error` value. Every route has its own limit, keyed by the one
tenant, so every flow below spends a budget of its own, all at once:

- modes: `token_bucket`, `gcra`, `sliding_window`, `quota`, a token bucket
  with `sync: lease`, a token bucket with `on_limit: delay`, a token bucket
  charged by `cost_from_response`, and `concurrency`;
- `on_store_error`: `open`, `closed` and `local`, one flow each per mode.

Clients (asyncio, one keep-alive HTTP/1.1 connection per worker, workers
spread over the instances) ask at `--demand` times each limit's rate and
count 200 against 429 and 503 themselves. The upstream (this script,
`--serve-upstream`, in a process of its own) counts what it served per
flow, and for the concurrency flows how many requests it holds at every
instant (a request is in flight from its arrival to its answer, or to its
connection closing). During the run one fault is applied:

- `none`;
- `redis_paused`: SIGSTOP of the redis-server 2 s in, SIGCONT 2 s later;
- `redis_restarted`: the redis-server killed 2 s in, and a new, empty one
  started on its port half a second later;
- `instance_killed`: instance 0 killed with SIGKILL 2 s in, and started
  again a second later (its clients go to the next instance meanwhile);
- `flood`: `wrk` on every instance, on a route of its own whose limit
  never denies (one more shared key), from 2 s in for half the run: the
  load generator and the gateways take both cores.

Per cell (instances, mode, fault, `on_store_error`) it prints what was
admitted (served by the upstream; for `cost_from_response` in units, each
request costing what the upstream reported), the ideal computed from the
first request sent to the last admission seen (capacity + refill ×
elapsed, a window's limit + limit / window × elapsed, a quota's limit per
UTC day, `max_in_flight` at every instant), the overage and the
under-use, what the failure mode did (the gateways' decision counters),
and the bound the documentation states, as a formula with its value:

- decided by the store (no fail_open, no local fallback; Redis not
  restarted): no overage for every rate mode, a lease included (never
  over-spent); a cost settled after the response at most `max_debt` plus
  what `tollgate_cost_uncharged_total` counted beyond it; at most
  `max_in_flight` in flight at the upstream at any instant;
- `on_store_error: local`: that, plus each instance's share (1 /
  `expected_instances` of the budget, refilling over the time it decided
  by it), and each instance's fallback admissions, in the limit's units,
  within its share;
- `closed`: every 503 `store-unavailable` the clients saw is a
  `fail_closed` decision, and the reverse (for every cell);
- `open` while the store fails, and a Redis restarted empty: no bound is
  stated; the table shows what was admitted beyond the ideal.

It exits 1 when a measurement breaks a stated bound.

    python3 bench/accuracy.py [--quick] [--binary PATH] [--json OUT.json]
    python3 bench/accuracy.py --grid 1/none,2/redis_paused --modes token_bucket,lease --on-store-error closed

`--quick` (under three minutes): every mode under every fault once, at one
instance (two for `instance_killed`); the full run: 1, 2 and 4 instances
under every fault (about three minutes). Needs redis-server and wrk.
Only loopback addresses are used; every process started here is stopped
here, by its pid.
"""

import argparse
import asyncio
import datetime
import hashlib
import json
import os
import platform
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import run  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "accuracy-key"
TENANT = "acme"

MODES = ["token_bucket", "gcra", "sliding_window", "quota", "lease", "delay", "cost_from_response", "concurrency"]
FAULTS = ["none", "redis_paused", "redis_restarted", "instance_killed", "flood"]
ERRORS = ["open", "closed", "local"]

# The numbers every run uses (rates per second); --rate scales them.
FAULT_AT = 2.0          # seconds into a run
PAUSE = 2.0             # redis_paused: how long Redis is stopped
DOWN = 0.5              # redis_restarted: how long no Redis listens
DEAD = 1.0              # instance_killed: how long the instance is gone
LEASE_UNITS = 5
LEASE_TTL_MS = 1000
MAX_DELAY_MS = 500
COST_ESTIMATE, COST_REPORTED, COST_MAX = 1, 3, 5
IN_FLIGHT = 4           # concurrency: max_in_flight
HOLD_TTL_MS = 3000
HOLD_FOR = 0.1          # seconds the upstream takes for a concurrency request
CONCURRENCY_WORKERS = 6
RETRY_PAUSE = 0.04      # a concurrency worker's pause after a refusal
WORKERS = 4             # per rate flow
POLL = 0.25             # seconds between reads of each gateway's /metrics
SHED = 1503             # a 503 `overloaded` (the gateway shed the decision), told from `store-unavailable`


class Numbers:
    """A run's limit numbers, from `--rate` r: buckets of capacity r
    refilling r a second, a sliding window of r a second, a quota of 2r
    a day (spent within the first second or so of a run)."""

    def __init__(self, rate):
        self.capacity = rate
        self.rate = rate
        self.window_limit = rate
        self.window_s = 1
        self.quota = 2 * rate
        # cost_from_response's default debt bound: 10 × (max − cost), at
        # least the limit's capacity (configuration.md).
        self.max_debt = max(10 * (COST_MAX - COST_ESTIMATE), rate)


def limit_yaml(mode, ose, n):
    """The limit of one flow."""
    common = f"key: [tenant], on_store_error: {ose}"
    bucket = f"capacity: {n.capacity}, refill_per_second: {n.rate}"
    if mode in ("token_bucket", "cost_from_response"):
        return f"{{ {common}, {bucket} }}"
    if mode == "gcra":
        return f"{{ {common}, algorithm: gcra, {bucket} }}"
    if mode == "sliding_window":
        return f"{{ {common}, algorithm: sliding_window, limit: {n.window_limit}, window_seconds: {n.window_s} }}"
    if mode == "quota":
        return f"{{ {common}, algorithm: quota, limit: {n.quota}, period: day }}"
    if mode == "lease":
        return (f"{{ {common}, {bucket}, sync: lease, "
                f"lease: {{ units: {LEASE_UNITS}, ttl_ms: {LEASE_TTL_MS} }} }}")
    if mode == "delay":
        return f"{{ {common}, {bucket}, on_limit: delay, max_delay_ms: {MAX_DELAY_MS} }}"
    if mode == "concurrency":
        return (f"{{ {common}, algorithm: concurrency, max_in_flight: {IN_FLIGHT}, "
                f"hold_ttl_ms: {HOLD_TTL_MS} }}")
    raise ValueError(mode)


def policy(port, admin, redis, upstream, instances, flows, n, timeout_ms):
    limits, routes = [], []
    for mode, ose in flows:
        name = f"{mode}-{ose}"
        limits.append(f"  {name}: {limit_yaml(mode, ose, n)}")
        extra = ""
        if mode == "cost_from_response":
            extra = (f", cost: {COST_ESTIMATE}, cost_from_response: "
                     f"{{ header: x-usage-tokens, max: {COST_MAX} }}")
        routes.append(f'  - {{ name: {name}, path: "/{mode}/{ose}/**", upstream: up, '
                      f"limits: [{name}]{extra} }}")
    return f"""version: 1
server: {{ listen: ["127.0.0.1:{port}"], admin_listen: "127.0.0.1:{admin}", threads: 1 }}
store:
  backend: redis
  urls: ["redis://127.0.0.1:{redis}/0"]
  timeout_ms: {timeout_ms}
  circuit_breaker: {{ failure_threshold: 3, open_ms: 500 }}
  expected_instances: {instances}
auth:
  keys: [ {{ id: accuracy, tenant: {TENANT}, sha256: "{hashlib.sha256(API_KEY.encode()).hexdigest()}" }} ]
limits:
  flood-big: {{ key: [], capacity: 1000000000, refill_per_second: 1000000000, on_store_error: open }}
{chr(10).join(limits)}
upstreams:
  up: {{ servers: ["127.0.0.1:{upstream}"], max_in_flight: 4096 }}
routes:
  - {{ name: warm, path: /warm, respond: {{ status: 200, body: "ok" }} }}
  - {{ name: flood, path: /flood, auth: none, respond: {{ status: 200, body: "ok" }}, limits: [flood-big] }}
{chr(10).join(routes)}
"""


# ---- the upstream ---------------------------------------------------------


def serve_upstream(port):
    """Answers 200 on every path `/MODE/OSE/iN/...`, counting per flow
    (`MODE/OSE`): requests served and when, and the requests it holds at
    once (in flight from arrival to answer, or to the connection closing),
    the most at any instant and the time-weighted sum. Concurrency
    requests take HOLD_FOR; cost_from_response ones report
    COST_REPORTED in `x-usage-tokens`. `/__stats` answers the counts as
    JSON, `/__reset` forgets them."""
    lock = threading.Lock()
    stats = {}

    def flow_of(key):
        s = stats.get(key)
        if s is None:
            s = stats[key] = {"hits": [], "in_flight": 0, "max_in_flight": 0, "area": 0.0,
                              "changed": None, "abandoned": 0, "by_instance": {}, "max_by_instance": {}}
        return s

    def change(s, inst, delta, now):
        if s["changed"] is not None:
            s["area"] += s["in_flight"] * (now - s["changed"])
        s["changed"] = now
        s["in_flight"] += delta
        s["max_in_flight"] = max(s["max_in_flight"], s["in_flight"])
        s["by_instance"][inst] = s["by_instance"].get(inst, 0) + delta
        s["max_by_instance"][inst] = max(s["max_by_instance"].get(inst, 0), s["by_instance"][inst])

    def reply(conn, body, extra=b""):
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: " + str(len(body)).encode() + b"\r\n" + extra +
                     b"\r\n" + body)

    def handle(conn):
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        f = conn.makefile("rb")
        try:
            while True:
                line = f.readline()
                if not line:
                    return
                parts = line.split(b" ")
                if len(parts) < 2:
                    return
                path = parts[1].decode("latin-1")
                while True:
                    h = f.readline()
                    if h in (b"\r\n", b"\n", b""):
                        break
                if path == "/__stats":
                    with lock:
                        body = json.dumps({k: {**v, "changed": None} for k, v in stats.items()}).encode()
                    reply(conn, body)
                    continue
                if path == "/__reset":
                    with lock:
                        stats.clear()
                    reply(conn, b"ok")
                    continue
                seg = path.split("/")
                key, inst = f"{seg[1]}/{seg[2]}" if len(seg) > 2 else path, seg[3] if len(seg) > 3 else "?"
                now = time.monotonic()
                with lock:
                    s = flow_of(key)
                    s["hits"].append(now)
                    change(s, inst, +1, now)
                abandoned = False
                if seg[1:2] == ["concurrency"]:
                    # Wait HOLD_FOR, unless the gateway closes the connection
                    # (its request ended): then it is no longer in flight.
                    r, _, _ = select.select([conn], [], [], HOLD_FOR)
                    if r:
                        try:
                            abandoned = conn.recv(1, socket.MSG_PEEK) == b""
                        except OSError:
                            abandoned = True
                with lock:
                    change(s, inst, -1, time.monotonic())
                    if abandoned:
                        s["abandoned"] += 1
                if abandoned:
                    return
                extra = b"x-usage-tokens: %d\r\n" % COST_REPORTED if seg[1:2] == ["cost_from_response"] else b""
                reply(conn, b"ok", extra)
        except OSError:
            return
        finally:
            conn.close()

    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(4096)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


def upstream_call(port, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
        return r.read()


# ---- the clients ----------------------------------------------------------


class Flow:
    def __init__(self, mode, ose, demand):
        self.mode, self.ose = mode, ose
        self.demand = demand            # requests a second, all workers together
        self.records = []               # (sent, received, status, instance)

    @property
    def name(self):
        return f"{self.mode}/{self.ose}"


async def http_get(reader, writer, path):
    """One GET on a kept-alive connection: (status, keep the connection,
    body)."""
    writer.write(f"GET {path} HTTP/1.1\r\nhost: accuracy\r\nauthorization: Bearer {API_KEY}\r\n\r\n".encode())
    line = await reader.readline()
    if not line:
        raise ConnectionError("closed")
    status = int(line.split()[1])
    length, chunked, close = None, False, False
    while True:
        h = await reader.readline()
        if h in (b"\r\n", b"\n"):
            break
        if not h:
            raise ConnectionError("closed in headers")
        name, _, value = h.decode("latin-1").partition(":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == "content-length":
            length = int(value)
        elif name == "transfer-encoding" and "chunked" in value:
            chunked = True
        elif name == "connection" and "close" in value:
            close = True
    body = b""
    if chunked:
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            body += (await reader.readexactly(size + 2))[:size]
            if size == 0:
                break
    elif length is not None:
        body = await reader.readexactly(length)
    else:
        body = await reader.read()
        close = True
    return status, not close, body


async def worker(flow, k, ports, start, stop):
    """One client of `flow`: paced at its share of the flow's demand (a
    concurrency worker: one request at a time, pausing after a refusal);
    on a connection error it goes on with the next instance."""
    n = len(ports)
    inst = k % n
    conn = None
    workers = CONCURRENCY_WORKERS if flow.mode == "concurrency" else WORKERS
    period = workers / flow.demand if flow.demand else 0
    next_at = start + period * k / workers
    i = 0
    while True:
        now = time.monotonic()
        if now >= stop:
            break
        if period and next_at > now:
            await asyncio.sleep(min(next_at - now, stop - now))
            continue
        next_at = max(next_at + period, now - period) if period else now
        path = f"/{flow.mode}/{flow.ose}/i{inst}/{k}-{i}"
        i += 1
        sent = time.monotonic()
        try:
            if conn is None:
                conn = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", ports[inst]), 10)
            status, keep, body = await asyncio.wait_for(http_get(*conn, path), 10)
            if status == 503 and b"overloaded" in body:
                status = SHED
            if not keep:
                conn[1].close()
                conn = None
        except (OSError, ConnectionError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, IndexError):
            status = 0
            if conn:
                conn[1].close()
            conn = None
        received = time.monotonic()
        flow.records.append((sent, received, status, inst))
        if status == 0:
            await asyncio.sleep(0.05)
            if n > 1:
                inst = (inst + 1) % n
        elif flow.mode == "concurrency" and status != 200:
            await asyncio.sleep(RETRY_PAUSE)
    if conn:
        conn[1].close()


async def drive(flows, ports, seconds, t0):
    stop = t0 + seconds
    tasks = []
    for f in flows:
        workers = CONCURRENCY_WORKERS if f.mode == "concurrency" else WORKERS
        tasks += [asyncio.create_task(worker(f, k, ports, t0, stop)) for k in range(workers)]
    await asyncio.gather(*tasks)


# ---- the gateways' counters ----------------------------------------------


SERIES = re.compile(r'^(tollgate_limit_decisions_total|tollgate_cost_uncharged_total|tollgate_store_errors_total|'
                    r'tollgate_overload_shed_total|tollgate_requests_total|tollgate_cost_reconciled_total)'
                    r'\{([^}]*)\} (\S+)$', re.M)


def read_metrics(admin):
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=2) as r:
        text = r.read().decode()
    out = {}
    for family, labels, value in SERIES.findall(text):
        lab = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if family == "tollgate_limit_decisions_total":
            key = ("decision", lab.get("limit"), lab.get("outcome"))
        elif family == "tollgate_cost_uncharged_total":
            key = ("uncharged", lab.get("route"))
        elif family == "tollgate_requests_total":
            key = ("requests", lab.get("route"), lab.get("outcome"))
        elif family == "tollgate_cost_reconciled_total":
            key = ("reconciled", lab.get("route"), lab.get("direction"))
        else:
            key = (family, ",".join(f"{k}={v}" for k, v in sorted(lab.items())))
        out[key] = out.get(key, 0.0) + float(value)
    return out


class Poller(threading.Thread):
    """Reads every live instance's counters every POLL seconds. Each
    instance has one life per process (a restarted instance starts a new
    one, its counters from zero): when it began, when it was killed (or
    None), and its reads, (time before the read, time after, values)."""

    def __init__(self, admins):
        super().__init__(daemon=True)
        self.admins = admins
        now = time.monotonic()
        self.current = [{"start": now, "killed": None, "reads": []} for _ in admins]
        self.all = list(self.current)
        self.halt = threading.Event()
        self.lock = threading.Lock()

    def read(self, i):
        life = self.current[i]
        if life is None:
            return
        before = time.monotonic()
        try:
            values = read_metrics(self.admins[i])
        except OSError:
            return
        with self.lock:
            if life["killed"] is None:
                life["reads"].append((before, time.monotonic(), values))

    def run(self):
        while not self.halt.wait(POLL):
            for i in range(len(self.admins)):
                self.read(i)

    def killed(self, i):
        with self.lock:
            self.current[i]["killed"] = time.monotonic()
            self.current[i] = None

    def restarted(self, i):
        with self.lock:
            self.current[i] = {"start": time.monotonic(), "killed": None, "reads": []}
            self.all.append(self.current[i])

    def finish(self):
        self.halt.set()
        self.join()
        for i in range(len(self.admins)):
            self.read(i)

    def lives(self):
        """Every life with at least one read."""
        return [life for life in self.all if life["reads"]]

    def total(self, key):
        """`key` summed over every life (each life's last read)."""
        return sum(life["reads"][-1][2].get(key, 0.0) for life in self.lives())

    def family(self, name):
        return sum(v for life in self.lives() for k, v in life["reads"][-1][2].items() if k[0] == name)


def span(life, key):
    """The longest time the counts of `key` of one life can have been made
    in: from before the last read that had not seen the first (or the
    life's start) to after the first read that saw the last (or the
    life's end, when it was killed); None when it counted none."""
    reads = life["reads"]
    values = [v.get(key, 0.0) for _, _, v in reads]
    final = values[-1]
    if final <= 0:
        return None
    first = next(i for i, v in enumerate(values) if v > 0)
    last = next(i for i, v in enumerate(values) if v >= final)
    lo = reads[first - 1][0] if first > 0 else life["start"]
    hi = life["killed"] or reads[last][1]
    return hi - lo


# ---- a run ----------------------------------------------------------------


class Run:
    """One (instances, fault) run: every flow at once."""

    def __init__(self, args, instances, fault, upstream_port, work):
        self.args, self.instances, self.fault = args, instances, fault
        self.upstream = upstream_port
        self.work = work
        self.n = Numbers(args.rate)
        self.flows = [(m, o) for m in args.modes for o in args.on_store_error]
        self.events = {}
        self.flood_rate = None
        self.outage = None

    def start_gateway(self, i):
        log = open(self.work / f"gw{i}.log", "ab")
        p = subprocess.Popen([self.args.binary, "run", "--config", str(self.configs[i])], stdout=log,
                             stderr=subprocess.STDOUT,
                             env={**os.environ, "TOLLGATE_KEY_SECRET": run.SECRET, "RUST_LOG": "error"})
        self.gateways[i] = p
        run.wait_port(self.ports[i], 60)
        run.wait_port(self.admins[i], 60)
        return p

    def execute(self):
        a = self.args
        upstream_call(self.upstream, "/__reset")
        redis_port = self.redis_port = run.free_port()
        self.redis = run.start_redis(redis_port, self.work)
        self.gateways = [None] * self.instances
        self.ports = [run.free_port() for _ in range(self.instances)]
        self.admins = [run.free_port() for _ in range(self.instances)]
        self.configs = []
        for i in range(self.instances):
            path = self.work / f"gw{i}.yaml"
            path.write_text(policy(self.ports[i], self.admins[i], redis_port, self.upstream, self.instances,
                                   self.flows, self.n, a.store_timeout_ms))
            self.configs.append(path)
        flood = []
        try:
            for i in range(self.instances):
                self.start_gateway(i)
            for port in self.ports:
                status, _ = run.http_get(port, "/warm", {"Authorization": f"Bearer {API_KEY}"}, timeout=30)
                assert status == 200, f"warm-up answered {status}"
            poller = Poller(self.admins)
            poller.start()
            flows = {}
            for mode, ose in self.flows:
                demand = 0 if mode == "concurrency" else a.demand * self.n.rate
                flows[(mode, ose)] = Flow(mode, ose, demand)
            t0 = time.monotonic() + 0.2
            self.t0 = t0
            self.load = os.getloadavg()[0]
            failed = []

            def fault():
                try:
                    self.apply_fault(t0, poller, flood)
                except Exception as e:  # noqa: BLE001 (raised again below)
                    failed.append(e)

            faulter = threading.Thread(target=fault)
            faulter.start()
            asyncio.run(drive(list(flows.values()), self.ports, a.seconds, t0))
            faulter.join()
            if failed:
                raise RuntimeError(f"applying the fault {self.fault} failed") from failed[0]
            # Requests still held (a delay) or in flight have ended by now.
            time.sleep(MAX_DELAY_MS / 1000 + 0.3)
            poller.finish()
            ups = json.loads(upstream_call(self.upstream, "/__stats"))
            self.counters = {"store_errors": poller.family("tollgate_store_errors_total"),
                             "shed": poller.family("tollgate_overload_shed_total")}
            for p in flood:
                p.wait(timeout=60)
            # When the clients saw the store fail: the first and the last
            # 503 store-unavailable, against the start of the load.
            refused = [r[1] - t0 for f in flows.values() for r in f.records if r[2] == 503]
            self.outage = (min(refused), max(refused)) if refused else None
            return [self.cell(f, ups.get(f.name, {}), poller) for f in flows.values()]
        finally:
            for p in flood:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for p in self.gateways:
                if p and p.poll() is None:
                    p.send_signal(signal.SIGINT)
                    try:
                        p.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
            self.redis.send_signal(signal.SIGCONT)
            self.redis.kill()
            self.redis.wait()

    def apply_fault(self, t0, poller, flood):
        def at(t):
            delay = t0 + t - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            return time.monotonic()

        f = self.fault
        if f == "none":
            return
        start = at(FAULT_AT)
        if f == "redis_paused":
            self.redis.send_signal(signal.SIGSTOP)
            start = time.monotonic()
            end = at(FAULT_AT + PAUSE)
            self.redis.send_signal(signal.SIGCONT)
        elif f == "redis_restarted":
            self.redis.kill()
            self.redis.wait()
            start = time.monotonic()
            at(FAULT_AT + DOWN)
            self.redis = run.start_redis(self.redis_port, self.work)
            end = time.monotonic()
        elif f == "instance_killed":
            poller.killed(0)
            self.gateways[0].kill()
            self.gateways[0].wait()
            start = time.monotonic()
            at(FAULT_AT + DEAD)
            self.start_gateway(0)
            poller.restarted(0)
            end = time.monotonic()
        elif f == "flood":
            seconds = max(1, int(self.args.seconds / 2))
            per = max(8, 64 // self.instances)
            for port in self.ports:
                flood.append(subprocess.Popen(["wrk", "-t1", f"-c{per}", f"-d{seconds}s",
                                               f"http://127.0.0.1:{port}/flood"],
                                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
            start = time.monotonic()
            total = 0
            for p in flood:
                out = p.communicate(timeout=seconds + 60)[0]
                m = re.search(r"(\d+) requests in", out)
                total += int(m.group(1)) if m else 0
            end = time.monotonic()
            self.flood_rate = total / max(end - start, 1e-9)
        self.events = {"start": start - t0, "end": end - t0}

    # ---- one cell's numbers and bound ----

    def cell(self, flow, up, poller):
        n, N = self.n, self.instances
        limit = f"{flow.mode}-{flow.ose}"
        recs = flow.records
        count = lambda s, rs=recs: sum(1 for r in rs if r[2] == s)  # noqa: E731
        sent = [r[0] for r in recs]
        start = min(sent) if sent else self.t0
        ok_times = [r[1] for r in recs if r[2] == 200]
        hits = up.get("hits", [])
        end = max(ok_times + hits + [start])
        elapsed = end - start
        decisions = {o: poller.total(("decision", limit, o))
                     for o in ("allowed", "limited", "delayed", "fail_open", "fail_closed", "local_fallback")}
        uncharged = poller.total(("uncharged", limit))
        settled = poller.total(("reconciled", limit, "charged"))
        store_errors = poller.family("tollgate_store_errors_total")
        # Per instance life that fell back: how long it decided by its
        # share (dᵢ), and what it admitted so (its admitted requests but
        # those the store, a delay or fail_open admitted).
        fallbacks = []
        for life in poller.lives():
            d = span(life, ("decision", limit, "local_fallback"))
            if d is not None:
                v = life["reads"][-1][2]
                admitted = v.get(("requests", limit, "allowed"), 0.0) - sum(
                    v.get(("decision", limit, o), 0.0) for o in ("allowed", "delayed", "fail_open"))
                fallbacks.append((d, max(0.0, admitted)))
        fallback_spans = [d for d, _ in fallbacks]
        c = {
            "cell": f"{N}/{self.fault}/{flow.mode}/{flow.ose}", "instances": N, "fault": self.fault,
            "mode": flow.mode, "on_store_error": flow.ose, "sent": len(recs), "ok": count(200),
            "limited": count(429), "unavailable": count(503), "shed": count(SHED), "errors": count(0),
            "other": len(recs) - count(200) - count(429) - count(503) - count(SHED) - count(0),
            "served": len(hits), "elapsed": elapsed, "decisions": decisions, "uncharged": uncharged,
            "settled": settled,
            "store_errors": store_errors, "fallback_spans": fallback_spans,
            "fallback_admitted": [a for _, a in fallbacks], "events": self.events,
        }
        if self.events:
            lo, hi = self.t0 + self.events["start"], self.t0 + self.events["end"] + 1.0
            during = [r for r in recs if lo <= r[1] <= hi]
            c["during"] = {s: sum(1 for r in during if r[2] == s) for s in (200, 429, 503, SHED, 0)}
        fo, lf = decisions["fail_open"], decisions["local_fallback"]
        share = lambda x: max(1, x // N)  # noqa: E731
        local_ok = True
        if flow.mode == "concurrency":
            c["admitted"], c["unit"] = up.get("max_in_flight", 0), "in flight"
            c["ideal"] = IN_FLIGHT
            c["overage"] = max(0, c["admitted"] - IN_FLIGHT)
            busy = max(end - min(hits), 1e-9) if hits else 1e-9
            used = up.get("area", 0.0) / busy / IN_FLIGHT
            c["underuse"], c["underuse_pct"] = None, max(0.0, 100 * (1 - used))
            c["served_note"] = f"{len(hits)} served, mean {used * IN_FLIGHT:.2f} in flight" + (
                f", {up['abandoned']} abandoned" if up.get("abandoned") else "")
            bound = (IN_FLIGHT, f"max in flight ≤ M = {IN_FLIGHT}")
            if lf:
                b = IN_FLIGHT + N * share(IN_FLIGHT)
                bound = (b, f"≤ M + N·⌊M/E⌋ = {IN_FLIGHT} + {N}×{share(IN_FLIGHT)} = {b} (local fallback)")
        else:
            cost = COST_REPORTED if flow.mode == "cost_from_response" else 1
            c["unit"] = "units" if cost > 1 else "requests"
            c["admitted"] = len(hits) * cost
            if flow.mode == "quota":
                days = len({datetime.datetime.fromtimestamp(time.time() - time.monotonic() + t,
                                                            datetime.timezone.utc).date() for t in (start, end)})
                ideal, formula = n.quota * days, f"L per UTC day = {n.quota}" + (f" × {days}" if days > 1 else "")
            elif flow.mode == "sliding_window":
                ideal = n.window_limit + n.window_limit / n.window_s * elapsed
                formula = f"L + L/W·t = {n.window_limit} + {n.window_limit / n.window_s:g}×{elapsed:.2f}"
            else:
                ideal = n.capacity + n.rate * elapsed
                formula = f"C + r·t = {n.capacity} + {n.rate}×{elapsed:.2f}"
            c["ideal"] = ideal
            c["overage"] = max(0.0, c["admitted"] - ideal)
            c["underuse"] = max(0.0, ideal - c["admitted"])
            c["underuse_pct"] = 100 * c["underuse"] / ideal if ideal else 0.0
            b, text = ideal, f"≤ {formula} = {ideal:.1f}"
            if flow.mode == "cost_from_response":
                b = ideal + n.max_debt + uncharged
                text = (f"≤ {formula} + max_debt + uncharged = {ideal:.1f} + {n.max_debt} + {uncharged:g} "
                        f"= {b:.1f}")
            if flow.mode == "lease":
                text += f" (never over-spent; under-use ≤ N·units = {N * LEASE_UNITS} held at a time)"
            if lf:
                # Each instance's fallback: 1/E of the budget (in the
                # limit's units), full when first used, refilling over the
                # time it decided in (plus, for a delay, the longest wait).
                extra_t = MAX_DELAY_MS / 1000 if flow.mode == "delay" else 0.0
                if flow.mode == "quota":
                    shares, term = [share(n.quota) for _ in fallbacks], "⌊L/E⌋"
                elif flow.mode == "sliding_window":
                    lw = share(n.window_limit)
                    shares, term = [lw + lw / n.window_s * d for d, _ in fallbacks], "⌊L/E⌋ + ⌊L/E⌋/W·dᵢ"
                else:
                    shares = [n.capacity / N + n.rate / N * (d + extra_t) for d, _ in fallbacks]
                    term = "C/E + r/E·(dᵢ + max_delay)" if extra_t else "C/E + r/E·dᵢ"
                b += sum(shares)
                text += (f" + Σ local share ({term}) = {b:.1f} (dᵢ = {', '.join(f'{d:.2f}' for d in fallback_spans)}"
                         " s)")
                # And each instance's fallback alone within its share (the
                # settlement of a cost beyond the estimate included).
                used = [a * cost for _, a in fallbacks]
                local_ok = all(u <= sh + 1e-9 for u, sh in zip(used, shares))
                text += (f"; fallback admitted {' + '.join(f'{u:g}' for u in used)} {c['unit']} ≤ share "
                         f"{' + '.join(f'{sh:.1f}' for sh in shares)} per instance: "
                         f"{'yes' if local_ok else '**NO**'}")
            bound = (b, text)
        c["overage_pct"] = 100 * c["overage"] / c["ideal"] if c["ideal"] else 0.0
        # What the documentation states, and so what is asserted.
        if self.fault == "redis_restarted":
            c["bound"], c["asserted"] = None, False
            c["bound_text"] = "none stated: Redis restarted empty forgets what was spent"
        elif fo:
            c["bound"], c["asserted"] = None, False
            c["bound_text"] = f"none: on_store_error open admitted {fo:g} decisions without the store"
        else:
            c["bound"], c["bound_text"], c["asserted"] = bound[0], bound[1], True
        measured = c["admitted"]
        # `closed` refuses with 503 store-unavailable, and only it: every
        # 503 the clients saw is a fail_closed decision, and the reverse.
        c["refusals_ok"] = c["unavailable"] == decisions["fail_closed"]
        c["ok"] = c["refusals_ok"] and ((not c["asserted"]) or (measured <= c["bound"] + 1e-9 and
                                                                 (flow.mode == "concurrency" or local_ok)))
        return c


# ---- output ---------------------------------------------------------------


def fmt_cell_row(c):
    d = c["decisions"]
    notes = []
    for k in ("fail_open", "fail_closed", "local_fallback", "delayed"):
        if d[k]:
            notes.append(f"{k} {d[k]:g}")
    if d["fail_closed"] or c["unavailable"]:
        notes.append(f"503 store-unavailable seen {c['unavailable']} "
                     f"{'=' if c['refusals_ok'] else '**≠**'} fail_closed {d['fail_closed']:g}")
    if c.get("during"):
        du = c["during"]
        notes.append(f"in the fault: 200×{du[200]} 429×{du[429]} 503×{du[503]}"
                     + (f" shed×{du[SHED]}" if du[SHED] else "") + (f" err×{du[0]}" if du[0] else ""))
    elif c["store_errors"]:
        notes.append(f"store errors {c['store_errors']:g}")
    if c["shed"]:
        notes.append(f"shed (503 overloaded) {c['shed']}")
    if c["mode"] == "cost_from_response":
        notes.append(f"settlements counted {c['settled']:g} of {c['served']} served, uncharged {c['uncharged']:g}")
    if c["mode"] == "concurrency":
        admitted = f"{c['admitted']} max ({c['served_note']})"
        ideal = f"≤ {c['ideal']} at every instant"
        over = f"{c['overage']:.0f} ({c['overage_pct']:.0f} %)"
        under = f"{c['underuse_pct']:.0f} % idle"
    else:
        admitted = f"{c['admitted']:g}" + (" units" if c["unit"] == "units" else "")
        ideal = f"{c['ideal']:.1f}"
        over = f"{c['overage']:.1f} ({c['overage_pct']:.1f} %)"
        under = f"{c['underuse']:.1f} ({c['underuse_pct']:.1f} %)"
    verdict = "**NO**" if not c["ok"] else "yes" if c["asserted"] else "—"
    return (f"| {c['cell']} | {admitted} | {ideal} | {over} | {under} | {'; '.join(notes) or '—'} | "
            f"{c['bound_text']} | {verdict} |")


HEADER = ["| cell (instances/fault/mode/on_store_error) | admitted | ideal | overage | under-use | "
          "what the failure mode did | bound (docs) | held |",
          "|---|---:|---:|---:|---:|---|---|---|"]


def summary(cells):
    """The worst cell of each mode, fault and on_store_error over the
    instance counts: its overage (and the instances it was measured at),
    and whether every stated bound of them held."""
    modes = [m for m in MODES if any(c["mode"] == m for c in cells)]
    faults = [f for f in FAULTS if any(c["fault"] == f for c in cells)]
    errors = [o for o in ERRORS if any(c["on_store_error"] == o for c in cells)]
    lines = ["## Worst overage by mode and fault (over the instance counts run)", "",
             "| mode | fault | " + " | ".join(f"`{o}`" for o in errors) + " |",
             "|---|---|" + "---|" * len(errors)]
    for m in modes:
        for f in faults:
            row = []
            for o in errors:
                cs = [c for c in cells if (c["mode"], c["fault"], c["on_store_error"]) == (m, f, o)]
                if not cs:
                    row.append("")
                    continue
                w = max(cs, key=lambda c: (c["overage_pct"], c["overage"]))
                unit = " in flight" if m == "concurrency" else " units" if m == "cost_from_response" else ""
                held = all(c["ok"] for c in cs)
                mark = ("" if held else " **bound failed**") if any(c["asserted"] for c in cs) else " (no bound)"
                worst = (f"{w['overage']:.0f}{unit} ({w['overage_pct']:.0f} %, {w['instances']} inst.)"
                         if w["overage"] >= 0.5 else "0")
                row.append(worst + mark)
            lines.append(f"| {m} | {f} | " + " | ".join(row) + " |")
    return lines


def machine():
    cpu = "unknown cpu"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    redis = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.strip()
    return f"{os.cpu_count()} cores, {cpu}; {platform.platform()}; {redis.split(' sha=')[0]}"


def parse_grid(text):
    runs = []
    for part in text.split(","):
        inst, _, fault = part.strip().partition("/")
        if fault not in FAULTS or not inst.isdigit() or int(inst) < 1:
            raise SystemExit(f"--grid: {part!r} is not INSTANCES/FAULT (faults: {', '.join(FAULTS)})")
        runs.append((int(inst), fault))
    return runs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", default=str(ROOT / "target" / "release" / "tollgate"))
    ap.add_argument("--quick", action="store_true", help="every mode under every fault once, at the cheapest "
                    "instance count (under three minutes)")
    ap.add_argument("--grid", help="runs as INSTANCES/FAULT,...: e.g. 1/none,2/instance_killed "
                    "(default: the quick or the full grid)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--on-store-error", default=",".join(ERRORS), help="comma-separated, of open, closed, local")
    ap.add_argument("--seconds", type=float, help="seconds of load per run (8; 6 with --quick)")
    ap.add_argument("--rate", type=int, default=30, help="each limit's capacity and refill per second (30)")
    ap.add_argument("--demand", type=float, default=2.5, help="clients ask this many times the rate (2.5)")
    ap.add_argument("--store-timeout-ms", type=int, default=250, help="store.timeout_ms (250)")
    ap.add_argument("--json", help="also write every cell to this file")
    ap.add_argument("--serve-upstream", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_upstream:
        serve_upstream(args.serve_upstream)
        return
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.on_store_error = [o.strip() for o in args.on_store_error.split(",") if o.strip()]
    for m in args.modes:
        if m not in MODES:
            raise SystemExit(f"--modes: unknown {m!r}")
    for o in args.on_store_error:
        if o not in ERRORS:
            raise SystemExit(f"--on-store-error: unknown {o!r}")
    args.seconds = args.seconds or (6.0 if args.quick else 8.0)
    if args.rate < LEASE_UNITS:
        raise SystemExit(f"--rate must be at least {LEASE_UNITS} (a lease's units fit in the capacity)")
    if args.grid:
        runs = parse_grid(args.grid)
    elif args.quick:
        runs = [(1, "none"), (1, "redis_paused"), (1, "redis_restarted"), (2, "instance_killed"), (1, "flood")]
    else:
        runs = [(i, f) for i in (1, 2, 4) for f in FAULTS]
    for tool in ["redis-server", "wrk"] if any(f == "flood" for _, f in runs) else ["redis-server"]:
        if not shutil.which(tool):
            raise SystemExit(f"{tool} is missing")
    if not Path(args.binary).exists():
        raise SystemExit(f"no tollgate binary at {args.binary}")

    command = "python3 bench/accuracy.py " + " ".join(sys.argv[1:])
    n = Numbers(args.rate)
    binary = Path(args.binary).resolve()
    shown = binary.relative_to(ROOT) if binary.is_relative_to(ROOT) else binary
    print(f"{command}\nmachine: {machine()}; load average {os.getloadavg()[0]:.2f} at the start; "
          f"binary {shown}", flush=True)
    print(f"limits: buckets C = {n.capacity}, r = {n.rate}/s; sliding_window L = {n.window_limit} per "
          f"{n.window_s} s; quota L = {n.quota} a day; lease units {LEASE_UNITS}, ttl {LEASE_TTL_MS} ms; delay "
          f"max_delay_ms {MAX_DELAY_MS}; cost_from_response cost {COST_ESTIMATE}, reported {COST_REPORTED}, "
          f"max {COST_MAX}, max_debt {n.max_debt}; concurrency M = {IN_FLIGHT}, hold_ttl_ms {HOLD_TTL_MS}, "
          f"{HOLD_FOR * 1000:.0f} ms a request. Demand {args.demand} × r per flow ({WORKERS} workers), "
          f"{CONCURRENCY_WORKERS} workers per concurrency flow; {args.seconds:g} s a run; store.timeout_ms "
          f"{args.store_timeout_ms}, breaker 3 failures / 500 ms; expected_instances = instances.", flush=True)
    work = Path(tempfile.mkdtemp(prefix="tollgate-accuracy-"))
    upstream_port = run.free_port()
    upstream = subprocess.Popen([sys.executable, __file__, "--serve-upstream", str(upstream_port)],
                                stdout=subprocess.DEVNULL, stderr=open(work / "upstream.log", "wb"))
    cells, started = [], time.monotonic()
    try:
        run.wait_port(upstream_port)
        for instances, fault in runs:
            r = Run(args, instances, fault, upstream_port, work)
            got = r.execute()
            ev = r.events
            print(f"\nrun: {instances} instance{'s' if instances > 1 else ''}, fault {fault}"
                  + (f" from {ev['start']:.2f} s to {ev['end']:.2f} s" if ev else "")
                  + (f" (wrk answered {r.flood_rate:.0f} requests/s)" if r.flood_rate else "")
                  + (f"; 503 store-unavailable answered from {r.outage[0]:.2f} s to {r.outage[1]:.2f} s"
                     if r.outage else "")
                  + f"; store errors {r.counters['store_errors']:g}, decisions shed {r.counters['shed']:g}"
                  + f"; load average {r.load:.2f}", flush=True)
            for c in got:
                c["load"] = r.load
                print(fmt_cell_row(c), flush=True)
            cells += got
    finally:
        upstream.kill()
        upstream.wait()
        shutil.rmtree(work, ignore_errors=True)
    failed = [c for c in cells if not c["ok"]]
    print(f"\n## Accuracy, {len(cells)} cells in {time.monotonic() - started:.0f} s\n")
    print("\n".join(HEADER + [fmt_cell_row(c) for c in cells]))
    print("\n".join([""] + summary(cells)))
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "machine": machine(), "cells": cells}, indent=1,
                                              default=str))
    if failed:
        print(f"\n{len(failed)} stated bound(s) failed:")
        for c in failed:
            if not c["refusals_ok"]:
                print(f"  {c['cell']}: clients saw {c['unavailable']} 503 store-unavailable, the gateways counted "
                      f"{c['decisions']['fail_closed']:g} fail_closed decisions")
            if c["bound"] is not None and (c["admitted"] > c["bound"] + 1e-9 or "**NO**" in c["bound_text"]):
                print(f"  {c['cell']}: measured {c['admitted']:g} {c['unit']} against {c['bound']:.1f}: "
                      f"{c['bound_text']}")
        sys.exit(1)
    print("\nevery stated bound held")


if __name__ == "__main__":
    main()
