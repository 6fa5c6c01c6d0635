#!/usr/bin/env python3
"""tollgate's benchmark harness: every contender on one machine, in one run.

Starts an upstream (NGINX returning a small 200), Redis, and each
contender with one worker thread, then drives them with wrk, alternating
the contenders across rounds. Also measures Redis work per request,
accuracy of shared against per-instance limits, and memory after 100 000
distinct tenants and IPs. Writes bench/RESULTS.md.

    make bench                      # builds, then runs this
    python3 bench/run.py --duration 10 --rounds 3 --connections 32

Only loopback addresses are used; every process started here is stopped
here, by its pid.
"""

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
RELEASE = ROOT / "target" / "release"
API_KEY = "bench-key"
SECRET = "bench-secret-not-for-production"
MAX = 1_000_000_000


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, timeout=20.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {port}")


def http_get(port, path="/", headers=None, timeout=5):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class Procs:
    """Processes started by this run, stopped by pid at the end."""

    def __init__(self, work):
        self.work = work
        self.procs = {}

    def start(self, name, args, env=None):
        log = open(self.work / f"{name}.log", "wb")
        full_env = dict(os.environ, **(env or {}))
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=full_env)
        self.procs[name] = p
        return p

    def stop(self, name):
        p = self.procs.pop(name, None)
        if p and p.poll() is None:
            p.send_signal(signal.SIGINT)
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def stop_all(self):
        for name in list(self.procs):
            self.stop(name)


def render(template, **values):
    text = Path(template).read_text()
    for k, v in values.items():
        text = text.replace("{" + k + "}", str(v))
    return text


def wrk(port, duration, connections, path="/v1/bench", script=None, key=API_KEY):
    args = ["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency",
            "-H", f"Authorization: Bearer {key}", "-H", "X-Forwarded-For: 203.0.113.7"]
    if script:
        args += ["-s", str(script)]
    args.append(f"http://127.0.0.1:{port}{path}")
    run = subprocess.run(args, capture_output=True, text=True)
    try:
        return parse_wrk(run.stdout)
    except (AttributeError, ValueError) as e:
        raise RuntimeError(f"unexpected wrk output for {args}: {run.stdout} {run.stderr}") from e


def interleaved(names, rounds):
    """(round, name) for every run of `rounds` rounds, the order rotated
    each round so that no contender always goes first: A B C, B C A, ..."""
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            yield r, name


def to_ms(value):
    m = re.match(r"([\d.]+)(us|ms|s)", value)
    n, unit = float(m.group(1)), m.group(2)
    return n / 1000 if unit == "us" else n * 1000 if unit == "s" else n


def metric(admin, series):
    """The value of one series (`name{labels}`, labels in the order the
    gateway prints them: sorted) in an admin listener's /metrics; 0 when
    absent."""
    _, body = http_get(admin, "/metrics")
    m = re.search(rf"^{re.escape(series)} (\S+)$", body.decode(), re.M)
    return float(m.group(1)) if m else 0.0


def parse_wrk(out):
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    # Anchored: "72.50%" in the thread stats must not pass for the 50th percentile.
    p50 = to_ms(re.search(r"^\s+50%\s+(\S+)", out, re.M).group(1))
    p99 = to_ms(re.search(r"^\s+99%\s+(\S+)", out, re.M).group(1))
    total = int(re.search(r"(\d+) requests in", out).group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sockerr = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    errors = (int(non2xx.group(1)) if non2xx else 0) + (sum(map(int, sockerr.groups())) if sockerr else 0)
    return {"rps": rps, "p50": p50, "p99": p99, "errors": errors, "requests": total}


def start_redis(port, directory):
    """A throwaway redis-server on `port`, persisting nothing, answering."""
    redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                              "--save", "", "--appendonly", "no", "--dir", str(directory)],
                             stdout=subprocess.DEVNULL)
    wait_port(port)
    return redis


def redis_cli(port, *args):
    return subprocess.run(["redis-cli", "-p", str(port), *map(str, args)], capture_output=True, text=True, check=True).stdout


def commandstats(port):
    stats = {}
    for line in redis_cli(port, "INFO", "commandstats").splitlines():
        m = re.match(r"cmdstat_(\w+):calls=(\d+),usec=(\d+),usec_per_call=([\d.]+)", line)
        if m:
            stats[m.group(1)] = (int(m.group(2)), int(m.group(3)), float(m.group(4)))
    return stats


def redis_cpu_seconds(port):
    info = redis_cli(port, "INFO", "cpu")
    user = float(re.search(r"used_cpu_user:([\d.]+)", info).group(1))
    sys_ = float(re.search(r"used_cpu_sys:([\d.]+)", info).group(1))
    return user + sys_


def cpu_seconds(pid):
    """User + system CPU time of a process and all its descendants (NGINX's
    work happens in its worker processes)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, IndexError, ValueError):
            pass
    return total


def rss_kib(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def machine():
    cpu = "unknown cpu"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem = int(Path("/proc/meminfo").read_text().split()[1]) // 1024 // 1024
    def version(cmd):
        try:
            r = subprocess.run(cmd, capture_output=True, text=True)
            return (r.stdout + r.stderr).strip().splitlines()[0]
        except (OSError, IndexError):
            return "?"
    return {
        "cpu": f"{os.cpu_count()} cores, {cpu}", "memory": f"{mem} GiB", "os": platform.platform(),
        "nginx": version(["nginx", "-v"]), "redis": version(["redis-server", "--version"]),
        "wrk": version(["wrk", "--version"]), "rustc": version(["rustc", "--version"]),
    }


class Bench:
    def __init__(self, args):
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="tollgate-bench-"))
        self.procs = Procs(self.work)
        self.ports = {}

    # ---- set-up -------------------------------------------------------

    def keys_file(self, count):
        path = self.work / f"keys-{count}.yaml"
        if not path.exists():
            lines = ["keys:"]
            digest = hashlib.sha256(API_KEY.encode()).hexdigest()
            lines.append(f'  - {{ id: bench, tenant: bench-tenant, sha256: "{digest}" }}')
            for i in range(count):
                d = hashlib.sha256(f"k{i}".encode()).hexdigest()
                lines.append(f'  - {{ id: c{i}, tenant: t{i}, sha256: "{d}" }}')
            path.write_text("\n".join(lines) + "\n")
        return path

    def start_redis(self, name="redis", extra=()):
        port = free_port()
        # A cluster node also listens on its port + 10 000 (the cluster bus).
        while "--cluster-enabled" in extra and port > 55535:
            port = free_port()
        self.procs.start(name, ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--dir", str(self.work), *extra])
        wait_port(port)
        self.ports[name] = port
        return port

    def start_nginx(self, name, conf, env=None, **values):
        port = free_port()
        text = render(BENCH / "nginx" / conf, work=self.work, bench=BENCH, port=port,
                      upstream_port=self.ports.get("upstream", port), **values)
        path = self.work / f"{name}.conf"
        path.write_text(text)
        self.procs.start(name, ["nginx", "-p", str(self.work), "-c", str(path)], env=env)
        wait_port(port)
        self.ports[name] = port
        return port

    def start_cluster(self, nodes=3):
        """A Redis Cluster of `nodes` primaries, every slot assigned."""
        ports = [self.start_redis(f"cluster_{i}", ["--cluster-enabled", "yes", "--cluster-config-file",
                                                  f"nodes-{i}.conf"]) for i in range(nodes)]
        subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True)
        deadline = time.time() + 20
        while not all("cluster_state:ok" in redis_cli(p, "CLUSTER", "INFO") for p in ports):
            if time.time() > deadline:
                raise RuntimeError("the cluster never became ok")
            time.sleep(0.05)
        self.ports["cluster"] = ports
        return ports

    def start_tollgate(self, name, backend, capacity=MAX, rate=MAX, keys=0, redis=None, binary=None):
        port, admin = free_port(), free_port()
        if backend == "redis_cluster":
            urls = ", ".join(f'"redis://127.0.0.1:{p}"' for p in self.ports["cluster"])
        else:
            urls = f'"redis://127.0.0.1:{redis or self.ports["redis"]}/0"'
        text = render(BENCH / "tollgate-full.yaml", port=port, admin_port=admin, backend=backend,
                      urls=urls, upstream_port=self.ports["upstream"],
                      keys_file=self.keys_file(keys), capacity=capacity, rate=rate)
        path = self.work / f"{name}.yaml"
        path.write_text(text)
        p = self.procs.start(name, [str(binary or RELEASE / "tollgate"), "run", "--config", str(path)],
                             env={"TOLLGATE_KEY_SECRET": SECRET, "RUST_LOG": "warn"})
        wait_port(port)
        wait_port(admin)
        self.ports[name] = port
        return port, p

    def start_plain(self, contract=False, spin_ns=0, name=None):
        """The plain Pingora proxy; with `contract`, also doing the contract's
        per-request header, timeout and key-hashing work (no limits); with
        `spin_ns`, also doing that many ns of arithmetic per request."""
        name = name or ("pingora_contract" if contract else "plain_pingora")
        port = free_port()
        self.procs.start(name, [str(RELEASE / "examples" / "plain_proxy"), f"127.0.0.1:{port}",
                                f"127.0.0.1:{self.ports['upstream']}", "1"] + (["contract"] if contract else []),
                         env={"PLAIN_SPIN_NS": str(spin_ns)} if spin_ns else None)
        wait_port(port)
        self.ports[name] = port
        return port

    # ---- measurements -------------------------------------------------

    def throughput(self):
        a = self.args
        self.start_redis()
        self.start_nginx("upstream", "upstream.conf")
        self.ports["direct"] = self.ports["upstream"]
        self.start_plain()
        self.start_plain(contract=True)
        self.start_nginx("nginx_limit_req", "limit_req.conf")
        self.start_nginx("nginx_lua_redis", "lua_redis.conf", env={"BENCH_REDIS_PORT": str(self.ports["redis"])})
        self.start_nginx("nginx_lua_redis3", "lua_redis3.conf",
                         env={"BENCH_REDIS_PORT": str(self.ports["redis"]), "BENCH_API_KEY": API_KEY})
        self.start_tollgate("tollgate_full", "redis")
        self.start_tollgate("tollgate_memory", "memory")
        self.start_cluster()
        self.start_tollgate("tollgate_cluster", "redis_cluster")
        contenders = ["direct", "plain_pingora", "pingora_contract", "nginx_limit_req", "nginx_lua_redis",
                      "nginx_lua_redis3", "tollgate_full", "tollgate_cluster", "tollgate_memory"]
        if a.quick:
            contenders = ["plain_pingora", "pingora_contract", "nginx_lua_redis3", "tollgate_full",
                          "tollgate_cluster", "tollgate_memory"]
        headers = {"Authorization": f"Bearer {API_KEY}", "X-Forwarded-For": "203.0.113.7"}
        for c in contenders:
            status, _ = http_get(self.ports[c], "/v1/bench", headers)
            assert status == 200, f"{c} answered {status}"
            wrk(self.ports[c], 2, a.connections)  # warm-up
        pids = {c: self.procs.procs[c].pid for c in contenders if c in self.procs.procs}
        pids["direct"] = self.procs.procs["upstream"].pid
        results = {c: [] for c in contenders}
        for r, c in interleaved(contenders, a.rounds):
            before = cpu_seconds(pids[c])
            w = wrk(self.ports[c], a.duration, a.connections)
            w["cpu_us"] = (cpu_seconds(pids[c]) - before) * 1e6 / max(w["requests"], 1)
            results[c].append(w)
            print(f"round {r + 1} {c}: {results[c][-1]}", flush=True)
        return contenders, results

    def measure_redis(self, port, target, path="/v1/bench", connections=None):
        """Requests, command stats and Redis CPU seconds over a 3 s run."""
        redis_cli(port, "CONFIG", "RESETSTAT")
        cpu = redis_cpu_seconds(port)
        w = wrk(target, 3, connections or self.args.connections, path=path)
        return w["requests"], commandstats(port), redis_cpu_seconds(port) - cpu

    def script_loads(self, connections):
        """The full path's Redis work at each number of connections, keyed
        by its label in the results."""
        port = self.ports["redis"]
        return {script_label(c): self.measure_redis(port, self.ports["tollgate_full"], "/v1/bench", c)
                for c in connections}

    def redis_work(self):
        """Commands, script calls and Redis CPU per admitted and per denied request."""
        port = self.ports["redis"]
        # The contract's targets: at 1, 4 and 32 connections (batches grow
        # with the load).
        out = self.script_loads([1, 4, self.args.connections])
        out["tollgate, 1 shared limit, admitted"] = self.measure_redis(
            port, self.ports["tollgate_full"], "/one/bench")
        out["NGINX + Lua peer, 1 token bucket, admitted"] = self.measure_redis(port, self.ports["nginx_lua_redis"])
        out["NGINX + Lua peer, equal work (3 buckets), admitted"] = self.measure_redis(
            port, self.ports["nginx_lua_redis3"])
        # Denied: a gateway whose shared budgets are spent after one request.
        dport, _ = self.start_tollgate("tollgate_denied", "redis", capacity=1, rate=0.001)
        http_get(dport, "/v1/bench", {"Authorization": f"Bearer {API_KEY}", "X-Forwarded-For": "203.0.113.7"})
        out["tollgate, 3 shared limits, denied"] = self.measure_redis(port, dport)
        self.procs.stop("tollgate_denied")
        return out

    def accuracy(self, instances=4, seconds=5.0, capacity=100, rate=50):
        """Admitted requests against capacity + rate × elapsed."""
        out = {}
        for backend in ["redis", "memory"]:
            redis = self.start_redis(f"redis_acc_{backend}")
            gws = [self.start_tollgate(f"acc_{backend}_{i}", backend, capacity=capacity, rate=rate, redis=redis)[0]
                   for i in range(instances)]
            admitted, lock = [0], threading.Lock()
            start = time.time()

            def client(n):
                i = n
                while time.time() - start < seconds:
                    status, _ = http_get(gws[i % len(gws)], "/v1/acc",
                                         {"Authorization": f"Bearer {API_KEY}", "X-Forwarded-For": f"198.51.100.{n}"})
                    i += 1
                    if status == 200:
                        with lock:
                            admitted[0] += 1

            threads = [threading.Thread(target=client, args=(n,)) for n in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            elapsed = time.time() - start
            out[backend] = (admitted[0], capacity + rate * elapsed, elapsed)
            for i in range(instances):
                self.procs.stop(f"acc_{backend}_{i}")
            self.procs.stop(f"redis_acc_{backend}")
        return out

    def memory(self, identities=100_000):
        """RSS and Redis memory after many distinct tenants and IPs."""
        redis = self.start_redis("redis_mem")
        port, proc = self.start_tollgate("tollgate_mem", "redis", capacity=10, rate=5, keys=identities, redis=redis)
        def wave(n, first_octet):
            script = self.work / f"distinct-{first_octet}.lua"
            script.write_text(f"""
local n = 0
request = function()
  n = n + 1
  local i = n % {identities}
  return wrk.format("GET", "/v1/mem", {{
    ["Authorization"] = "Bearer k" .. i,
    ["X-Forwarded-For"] = string.format("{first_octet}.%d.%d.%d", math.floor(i / 65536) % 256, math.floor(i / 256) % 256, i % 256),
  }})
end
""")
            # Enough requests for every identity to be seen at least once.
            return wrk(port, max(10, identities // 6000), self.args.connections, path="/v1/mem", script=script)

        def redis_state():
            used = int(re.search(r"used_memory:(\d+)", redis_cli(redis, "INFO", "memory")).group(1))
            return int(redis_cli(redis, "DBSIZE").strip()), used

        # Loading 100 000 keys allocates transiently; the allocator returns
        # that memory after a while. Start from the settled figure.
        http_get(port, "/v1/mem", {"Authorization": "Bearer k0", "X-Forwarded-For": "10.0.0.1"})
        time.sleep(3)
        http_get(port, "/v1/mem", {"Authorization": "Bearer k0", "X-Forwarded-For": "10.0.0.1"})
        rss_start = rss_kib(proc.pid)
        w = wave(identities, 10)
        rss_seen = rss_kib(proc.pid)
        keys, used = redis_state()
        # Keys expire once back to their initial state (2 s here) plus 1 s.
        time.sleep(4)
        keys_after, used_after = redis_state()
        # A second wave of 100 000 other addresses: expired in-process
        # entries are swept as it goes, so the process does not grow again.
        w2 = wave(identities, 11)
        rss_second = rss_kib(proc.pid)
        self.procs.stop("tollgate_mem")
        self.procs.stop("redis_mem")
        return {"requests": w["requests"], "requests2": w2["requests"], "rss_start": rss_start, "rss_seen": rss_seen,
                "rss_second": rss_second, "redis_used": used, "redis_keys": keys, "redis_keys_after": keys_after,
                "redis_used_after": used_after}

    def micro(self):
        """Criterion micro-benchmarks of the hot pure functions."""
        subprocess.run(["cargo", "bench", "--bench", "hot_paths", "--", "--warm-up-time", "1",
                        "--measurement-time", "2"], cwd=ROOT, check=True, capture_output=True)
        rows = []
        for est in sorted((ROOT / "target" / "criterion").glob("*/new/estimates.json")):
            data = json.loads(est.read_text())
            rows.append((est.parent.parent.name, data["median"]["point_estimate"]))
        return rows


def script_label(connections):
    return f"tollgate, 3 shared limits, admitted, {connections} connection{'s' if connections > 1 else ''}"


def script_time(measured):
    """Script time per request (µs) of one `measure_redis` result: `usec`
    of the script calls (FCALL and EVALSHA) over the requests served."""
    requests, stats, _ = measured
    usec = sum(stats.get(cmd, (0, 0, 0.0))[1] for cmd in ("evalsha", "fcall"))
    return usec / max(requests, 1)


def targets(med, loads=None, connections=32):
    """The performance targets (listed in docs/src/benchmarks.md) as table
    rows: the gateway's as ratios of CPU per request (each process's utime
    + stime over the requests it served) and p99 in this run; with `loads`
    (the full path's Redis work by `script_label`), the script's time per
    request unbatched and under load."""
    full, memory, plain = med["tollgate_full"], med["tollgate_memory"], med["plain_pingora"]
    floor = med["pingora_contract"]
    rows = ["| target | measured | met |", "|---|---|---|"]

    def row(label, value, ok):
        rows.append(f"| {label} | {value} | {'yes' if ok else 'no'} |")

    cpu_memory, cpu_full = memory["cpu_us"] / plain["cpu_us"], full["cpu_us"] / plain["cpu_us"]
    row("CPU per request, memory store ≤ 1.05 × plain Pingora", f"{cpu_memory:.2f} ×", cpu_memory <= 1.05)
    row("CPU per request, full path ≤ 1.10 × plain Pingora", f"{cpu_full:.2f} ×", cpu_full <= 1.10)
    p99 = full["p99"] - plain["p99"]
    row("full path p99 within +0.5 ms of plain Pingora", f"{p99:+.2f} ms", p99 <= 0.5)
    if "nginx_lua_redis3" in med:
        peer = full["rps"] / med["nginx_lua_redis3"]["rps"]
        row("full path throughput ahead of the equal-work NGINX + Lua + Redis peer", f"{peer:.2f} ×", peer >= 1.0)
    if loads:
        alone, loaded = script_time(loads[script_label(1)]), script_time(loads[script_label(connections)])
        row("script time per request unbatched (1 connection) ≤ 15 µs", f"{alone:.1f} µs", alone <= 15)
        row(f"script time per request under load ({connections} connections) ≤ 3 µs", f"{loaded:.1f} µs",
            loaded <= 3)
    rows.append(f"| (reference) the contract's per-request work alone, CPU × plain Pingora | "
                f"{floor['cpu_us'] / plain['cpu_us']:.2f} × | — |")
    return rows


def write_results(args, info, contenders, results, redis_work, accuracy, memory, micro):
    med = {c: {k: statistics.median(r[k] for r in results[c]) for k in ("rps", "p50", "p99", "cpu_us")}
           for c in contenders}
    errors = {c: sum(r["errors"] for r in results[c]) for c in contenders}
    full, plain, lua = med["tollgate_full"], med["plain_pingora"], med["nginx_lua_redis"]
    lines = [
        "# Benchmark results",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} with:",
        "",
        "```",
        "make bench   # = python3 bench/run.py " + " ".join(sys.argv[1:]),
        "```",
        "",
        f"Machine: {info['cpu']}, {info['memory']}, {info['os']}. {info['nginx']}; {info['redis']}; "
        f"{info['wrk']}; {info['rustc']}.",
        "",
        f"Load: `wrk -t1 -c{args.connections} -d{args.duration}s` per contender, {args.rounds} rounds with the "
        "order rotated each round; medians shown. Every contender runs one worker thread; the upstream is one "
        "NGINX worker returning a small 200; everything shares the machine's cores (wrk, contender, upstream, Redis). "
        "CPU per request is the contender's own processes' user + system time over the requests it served "
        "(for the upstream row, the upstream's; Redis's time is in the next section).",
        "",
        "| contender | req/s | p50 ms | p99 ms | CPU µs per request | errors |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    names = {
        "direct": "upstream directly", "plain_pingora": "plain Pingora proxy (no limits)",
        "pingora_contract": "plain Pingora + the contract's per-request work (no limits)",
        "nginx_limit_req": "NGINX proxy_pass + limit_req", "nginx_lua_redis": "NGINX + Lua + Redis token bucket",
        "nginx_lua_redis3": "NGINX + Lua + Redis, equal work (key table, 3 buckets in one script)",
        "tollgate_full": "tollgate, full path (Redis)", "tollgate_memory": "tollgate, memory store",
        "tollgate_cluster": "tollgate, full path (Redis Cluster, 3 primaries)",
    }
    for c in contenders:
        m = med[c]
        lines.append(f"| {names[c]} | {m['rps']:.0f} | {m['p50']:.2f} | {m['p99']:.2f} | {m['cpu_us']:.1f} | "
                     f"{errors[c]} |")
    r2 = full["rps"] / lua["rps"]
    lines += ["", "## Targets", ""] + targets(med, redis_work, args.connections) + [
        f"| (reference) full path throughput × NGINX + Lua + Redis with one bucket | {r2:.2f} × | — |",
        "",
        "## Redis work per request",
        "",
        "From `INFO commandstats` after `CONFIG RESETSTAT` and the Redis process's CPU time (`INFO cpu`), over a "
        "3 s wrk run each at the same load. Commands run inside a script are counted too. tollgate sends the "
        "requests that wait while a call is in flight together in the next call, so under load one call "
        "decides several requests. On Redis 7 tollgate calls its script as a function (FCALL); the NGINX "
        "peer uses EVALSHA.",
        "",
        "Script time is `usec` of `cmdstat_fcall` plus `cmdstat_evalsha` (time spent running the script, "
        "as `usec_per_call`, "
        "spread over the requests); Redis CPU adds the server's network and protocol work.",
        "",
        "| what | requests | script calls per request | all commands per request | script time per request | "
        "Redis CPU per request |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, (requests, stats, cpu) in redis_work.items():
        ev = [a + b for a, b in zip(stats.get("evalsha", (0, 0, 0.0)), stats.get("fcall", (0, 0, 0.0)))]
        total = sum(s[0] for s in stats.values())
        n = max(requests, 1)
        lines.append(f"| {label} | {requests} | {ev[0] / n:.3f} | {total / n:.2f} | {ev[1] / n:.1f} µs | "
                     f"{cpu * 1e6 / n:.1f} µs |")
    lines += ["", "## Accuracy", "", "4 instances, one credential, token bucket capacity 100 refilling 50/s, "
              "8 clients spread over the instances for 5 s.", "",
              "| store | admitted | ideal (capacity + rate × elapsed) | ratio |", "|---|---:|---:|---:|"]
    for backend, (admitted, ideal, _) in accuracy.items():
        lines.append(f"| {backend} | {admitted} | {ideal:.1f} | {admitted / ideal:.3f} |")
    m = memory
    lines += [
        "", "## Memory", "",
        f"One tollgate (Redis store) after {m['requests']} requests cycling over 100 000 distinct credentials, tenants "
        "and IPs (limits: capacity 10, refill 5/s, so keys return to their initial state after 2 s and expire a "
        "second later; the in-process IP guard sweeps its expired entries as traffic goes on).", "",
        "| measure | value |", "|---|---:|",
        f"| gateway RSS at start | {m['rss_start'] / 1024:.1f} MiB |",
        f"| gateway RSS after the traffic | {m['rss_seen'] / 1024:.1f} MiB |",
        f"| gateway RSS after a second wave of 100 000 other IPs ({m['requests2']} requests) | {m['rss_second'] / 1024:.1f} MiB |",
        f"| Redis keys / used memory after the traffic | {m['redis_keys']} / {m['redis_used'] / 1048576:.1f} MiB |",
        f"| Redis keys / used memory 4 s later | {m['redis_keys_after']} / {m['redis_used_after'] / 1048576:.1f} MiB |",
    ]
    if micro:
        lines += ["", "## Micro-benchmarks (criterion, median)", "", "| function | time |", "|---|---:|"]
        for name, ns in micro:
            lines.append(f"| {name} | {ns:.0f} ns |")
    for extra in ["tls.md", "flood.md", "script_time.md", "connections.md", "simulate.md", "NOTES.md"]:
        if (BENCH / extra).exists():
            lines += ["", (BENCH / extra).read_text().rstrip()]
    (BENCH / "RESULTS.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=int, help="seconds per measurement; 10, or 4 with --quick")
    p.add_argument("--rounds", type=int, help="rounds in rotated order; 5, or 3 with --quick")
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--skip-micro", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="throughput of plain Pingora, the contract floor, the equal-work peer and tollgate, "
                        "and the targets met or not; RESULTS.md is not written")
    args = p.parse_args()
    # A quick check fits in about two minutes.
    args.duration = args.duration or (4 if args.quick else 10)
    args.rounds = args.rounds or (3 if args.quick else 5)
    for tool in ["nginx", "wrk", "redis-server", "redis-cli"]:
        if not shutil.which(tool):
            sys.exit(f"{tool} is missing: run `make bench-deps`")
    bench = Bench(args)
    try:
        info = machine()
        contenders, results = bench.throughput()
        med = {c: {k: statistics.median(r[k] for r in results[c]) for k in ("rps", "p99", "cpu_us")}
               for c in contenders}
        print("\n".join(["", "Medians:"] + [f"  {c}: {med[c]}" for c in contenders]), flush=True)
        if args.quick:
            loads = bench.script_loads([1, args.connections])
            print("\n".join([""] + targets(med, loads, args.connections)), flush=True)
            return
        print("\n".join([""] + targets(med)), flush=True)
        redis_work = bench.redis_work()
        for c in ["tollgate_full", "tollgate_memory", "tollgate_cluster", "nginx_lua_redis", "nginx_lua_redis3",
                  "nginx_limit_req", "plain_pingora", "pingora_contract"]:
            bench.procs.stop(c)
        accuracy = bench.accuracy()
        memory = bench.memory()
        bench.procs.stop_all()
        micro = [] if args.skip_micro else bench.micro()
        write_results(args, info, contenders, results, redis_work, accuracy, memory, micro)
    finally:
        bench.procs.stop_all()


if __name__ == "__main__":
    main()
