#!/usr/bin/env python3
"""Redis script time per decision, without a gateway in the way.

Starts its own redis-server on a free loopback port and, over one
connection, one call at a time (no batching), calls:

  decide.lua     one request with three token buckets (per credential,
                 per tenant, global), admitted: the full path's store work;
  decide.lua     the same, eleven requests in one call (a batch under load);
  decide.lua     one request with one token bucket;
  holds          the full path with a concurrency limit added, as
                 functions: the decision taking a hold, and its release
                 (one, or eleven in one call);
  --compare PATH the same three with other scripts: an earlier lua/
                 directory of this layout (limits.lua and a file per
                 concern), or an earlier single-file decide.lua;
  limit.lua      the reference chapter's single-bucket script (bench/lua);
  floor          TIME + MGET of 3 keys + 3 SET ... PX, and nothing else;
  empty          a script that returns at once.

For each it reports Redis's own script time per call and per request
(`INFO commandstats`, usec of the EVALSHA calls over their count) and the
Redis process's CPU per call (utime+stime from /proc, which adds the
network and protocol work of each call).

    python3 bench/script_time.py [--calls 20000] [--compare old-lua-dir]

The scripts are put together from lua/ as the gateway does
(src/limits/redis/scripts.rs): limits.lua, the concern's file, serve.lua.
"""

import argparse
import datetime
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MICRO = 1_000_000


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Redis:
    """A minimal RESP client: enough for commands with binary arguments."""

    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.buf = b""

    def send(self, *args):
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            if isinstance(a, int):
                a = str(a).encode()
            elif isinstance(a, str):
                a = a.encode()
            out.append(b"$%d\r\n%s\r\n" % (len(a), a))
        self.sock.sendall(b"".join(out))
        return self.read()

    def line(self):
        while b"\r\n" not in self.buf:
            self.buf += self.sock.recv(65536)
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def read(self):
        line = self.line()
        kind, rest = line[:1], line[1:]
        if kind in (b"+", b":"):
            return rest.decode()
        if kind == b"-":
            raise RuntimeError(rest.decode())
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            while len(self.buf) < n + 2:
                self.buf += self.sock.recv(65536)
            data, self.buf = self.buf[:n], self.buf[n + 2:]
            return data
        if kind == b"*":
            return [self.read() for _ in range(int(rest))]
        raise RuntimeError(f"unexpected reply {line!r}")


# A request that repeats the one before it, byte for byte.
SAME = b"\xfe"


def batch(requests, limits_per_request, repeats=True):
    """decide.lua's binary argument: `requests` requests of token buckets,
    one caller's; after the first, each the byte SAME, as the gateway
    encodes a request equal to the one before it (`repeats=False`: written
    out, as a script before SAME reads them)."""
    one = struct.pack("<BHq", 255, limits_per_request, 0)
    for l in range(limits_per_request):
        # A bucket of 1e6 units refilling 1e5/s: always admits.
        one += struct.pack("<IBqqqB", l + 1, 1, 10**6 * MICRO, 100 * MICRO // 1000, 1, 3)
    return one + (SAME if repeats else one) * (requests - 1)


# The files after limits.lua of each concern's script, as
# src/limits/redis/scripts.rs puts them together.
CONCERN_FILES = {"decide": ["decide.lua"], "settle": ["settle.lua"],
                 "inspect": ["settle.lua", "inspect.lua"]}


def lua_files(lua, names):
    return "".join(open(os.path.join(lua, n)).read() for n in names)


def script(concern="decide", lua=os.path.join(ROOT, "lua")):
    """The script the gateway sends by EVALSHA for `concern`; from an
    earlier single-file decide.lua when `lua` is that file."""
    if os.path.isfile(lua):
        return open(lua).read()
    return (f"local PREFIX, CONCERN = nil, '{concern}'\n"
            + lua_files(lua, ["limits.lua", *CONCERN_FILES[concern], "serve.lua"]))


def library(name, lua=os.path.join(ROOT, "lua")):
    """A function library named `name` and the prefix of its functions
    (`{prefix}decide`, `{prefix}settle`, ...), as the gateway loads it;
    from an earlier single-file decide.lua, whose one function decides
    and gives back, when `lua` is that file."""
    prefix = f"{name}_"
    if os.path.isfile(lua):
        return (f"#!lua name={name}\nlocal FUNCTION_NAME = '{prefix}decide'\n" + open(lua).read(),
                prefix)
    body = lua_files(lua, ["limits.lua", "decide.lua", "settle.lua", "inspect.lua", "serve.lua"])
    return f"#!lua name={name}\nlocal PREFIX, CONCERN = '{prefix}', nil\n" + body, prefix


def label(path):
    """How a compared version is named in the tables: its last two path
    parts (`old/lua`, `v1/decide.lua`), never the same as this tree's."""
    path = os.path.normpath(path)
    return os.path.join(os.path.basename(os.path.dirname(path)), os.path.basename(path))


def reads_repeats(script):
    """Whether a decide.lua's text reads SAME (an earlier version, given to
    compare with, may not: its batches are written out)."""
    return "local SAME = 254" in script


HOLDS = 32
CONCURRENCY = 7


def hold_spec(key, member, refund_at=0):
    """One request holding `member` of a concurrency limit (max 10^6 in
    flight, 30 s holds) under key index `key`; with `refund_at`, its
    release."""
    return (struct.pack("<BHq", 255, 1, refund_at)
            + struct.pack("<IBqqqB", key, CONCURRENCY, 10**6, 30000, 1, 3 | HOLDS) + member)


def with_hold(member):
    """The full path's three buckets and a concurrency hold, one request."""
    out = struct.pack("<BHq", 255, 4, 0)
    for l in range(3):
        out += struct.pack("<IBqqqB", l + 1, 1, 10**6 * MICRO, 100 * MICRO // 1000, 1, 3)
    return out + struct.pack("<IBqqqB", 4, CONCURRENCY, 10**6, 30000, 1, 3 | HOLDS) + member


def holds(redis, pid, prefix, keys4, calls):
    """A concurrency limit added to the full path, as functions (FCALL, as
    the gateway calls them on Redis >= 7): `calls` decisions each taking a
    hold (the set grows to `calls` holds), then their releases (settle.lua),
    one a call and then eleven a call (a batch under load)."""
    members = [struct.pack(">QQ", 7, n) for n in range(calls)]

    def timed(label, send, count, requests_per_call):
        redis.send("CONFIG", "RESETSTAT")
        cpu0 = cpu_seconds(pid)
        for i in range(count):
            send(i)
        cpu = cpu_seconds(pid) - cpu0
        n, usec = stats(redis).get("fcall", (0, 0))
        row_of(label, usec / max(n, 1), cpu * 1e6 / max(count, 1), requests_per_call)

    def take(i):
        redis.send("FCALL", f"{prefix}decide", 4, *keys4, 0, 1, with_hold(members[i]))

    def release(per_call):
        def send(i):
            chunk = members[i * per_call:(i + 1) * per_call]
            release = b"".join(hold_spec(1, m, refund_at=1) for m in chunk)
            redis.send("FCALL", f"{prefix}settle", 1, keys4[3], 0, len(chunk), release)
        return send

    redis.send("FLUSHALL")
    timed("decide.lua as a function, 1 request × 3 limits + a concurrency hold", take, calls, 1)
    timed("release of 1 hold a call (FCALL)", release(1), calls, 1)
    for i in range(calls):
        take(i)
    timed("release of 11 holds a call (FCALL)", release(11), calls // 11, 11)


def stats(redis):
    info = redis.send("INFO", "commandstats").decode()
    out = {}
    for line in info.splitlines():
        if line.startswith("cmdstat_"):
            name, fields = line[len("cmdstat_"):].split(":", 1)
            kv = dict(f.split("=") for f in fields.split(","))
            out[name] = (int(kv["calls"]), int(kv["usec"]))
    return out


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


ROWS = []


def measure(redis, pid, label, command, args, calls, requests_per_call, quiet=False):
    """Script time per call and Redis CPU per call of `calls` calls; printed
    as a row unless quiet."""
    redis.send("CONFIG", "RESETSTAT")
    cpu0 = cpu_seconds(pid)
    for _ in range(calls):
        redis.send(command, *args)
    cpu = cpu_seconds(pid) - cpu0
    s = stats(redis)
    name = command.lower()
    n, usec = s.get(name, (0, 0))
    per_call = usec / max(n, 1)
    if not quiet:
        row_of(label, per_call, cpu * 1e6 / calls, requests_per_call)
    return per_call, cpu * 1e6 / calls


def row_of(label, per_call, cpu_per_call, requests_per_call):
    row = (f"| {label} | {per_call:.1f} µs | {per_call / requests_per_call:.1f} µs | "
           f"{cpu_per_call:.1f} µs |")
    print(row)
    ROWS.append(row)


def interleaved(redis, pid, contenders, keys3, calls, rounds):
    """Each contender (label, function name, whether it reads repeats) as
    FCALL, A B A B ...: the median of `rounds` runs per shape."""
    for shape, requests, limits, n in [("1 request × 3 limits", 1, 3, calls),
                                        ("11 requests × 3 limits", 11, 3, calls // 4)]:
        results = {label: [] for label, _, _ in contenders}
        for _ in range(rounds):
            for label, function, repeats in contenders:
                redis.send("FLUSHALL")
                results[label].append(measure(
                    redis, pid, label, "FCALL",
                    [function, limits, *keys3[:limits], 0, requests, batch(requests, limits, repeats)],
                    n, requests, quiet=True))
        for label, _, _ in contenders:
            runs = sorted(results[label])
            per_call, cpu = runs[len(runs) // 2]
            row_of(f"{label} (FCALL, median of {rounds} interleaved), {shape}", per_call, cpu,
                   requests)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--compare", metavar="PATH",
                    help="other scripts measured in the same run: an earlier lua/ directory, "
                         "or an earlier single-file decide.lua")
    ap.add_argument("--rounds", type=int, default=5,
                    help="interleaved rounds of the comparison as functions")
    args = ap.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        server = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", tmp],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.time() + 10
            while True:
                try:
                    redis = Redis(port)
                    redis.send("PING")
                    break
                except OSError:
                    if time.time() > deadline:
                        sys.exit("redis-server did not start")
                    time.sleep(0.05)
            version = redis.send("INFO", "server").decode()
            version = next(l for l in version.splitlines() if l.startswith("redis_version"))
            decide = script("decide")
            # The script text inside the peer's module, between its [[ ]].
            peer = open(os.path.join(ROOT, "bench", "lua", "limit.lua")).read()
            limit = peer.split("[[", 1)[1].split("]]", 1)[0]
            floor = ("local t = redis.call('TIME') local v = redis.call('MGET', KEYS[1], KEYS[2], KEYS[3]) "
                     "for i = 1, 3 do redis.call('SET', KEYS[i], '12345678901234567890123', 'PX', 60000) end "
                     "return 1")
            sha = {name: redis.send("SCRIPT", "LOAD", text).decode()
                   for name, text in [("decide", decide), ("limit", limit), ("floor", floor),
                                      ("empty", "return 1")]}
            keys3 = ["bench:cred", "bench:tenant", "bench:global"]
            print(f"{version}, {args.calls} calls each, one connection, one call at a time; "
                  f"load average {os.getloadavg()[0]:.2f}\n")
            print("| script | script time per call | per request | Redis CPU per call |")
            print("|---|---:|---:|---:|")
            measure(redis, server.pid, "decide.lua, 1 request × 3 limits", "EVALSHA",
                    [sha["decide"], 3, *keys3, 0, 1, batch(1, 3)], args.calls, 1)
            measure(redis, server.pid, "decide.lua, 11 requests × 3 limits (one batch)", "EVALSHA",
                    [sha["decide"], 3, *keys3, 0, 11, batch(11, 3)], args.calls // 4, 11)
            measure(redis, server.pid, "decide.lua, 1 request × 1 limit", "EVALSHA",
                    [sha["decide"], 1, keys3[0], 0, 1, batch(1, 1)], args.calls, 1)
            # The same file loaded once as a function library, as the gateway
            # does on Redis >= 7.
            lib, prefix = library("tollgate_bench")
            redis.send("FUNCTION", "LOAD", "REPLACE", lib)
            fn = f"{prefix}decide"
            measure(redis, server.pid, "decide.lua as a function (FCALL), 1 request × 3 limits", "FCALL",
                    [fn, 3, *keys3, 0, 1, batch(1, 3)], args.calls, 1)
            measure(redis, server.pid, "decide.lua as a function (FCALL), 11 requests × 3 limits", "FCALL",
                    [fn, 3, *keys3, 0, 11, batch(11, 3)], args.calls // 4, 11)
            measure(redis, server.pid, "decide.lua as a function (FCALL), 1 request × 1 limit", "FCALL",
                    [fn, 1, keys3[0], 0, 1, batch(1, 1)], args.calls, 1)
            holds(redis, server.pid, prefix, [*keys3, "bench:inflight"], args.calls)
            if args.compare:
                text = script("decide", args.compare)
                repeats = reads_repeats(text)
                other = redis.send("SCRIPT", "LOAD", text).decode()
                redis.send("FLUSHALL")
                name = label(args.compare)
                measure(redis, server.pid, f"{name}, 1 request × 3 limits", "EVALSHA",
                        [other, 3, *keys3, 0, 1, batch(1, 3, repeats)], args.calls, 1)
                measure(redis, server.pid, f"{name}, 11 requests × 3 limits (one batch)", "EVALSHA",
                        [other, 3, *keys3, 0, 11, batch(11, 3, repeats)], args.calls // 4, 11)
                measure(redis, server.pid, f"{name}, 1 request × 1 limit", "EVALSHA",
                        [other, 1, keys3[0], 0, 1, batch(1, 1, repeats)], args.calls, 1)
                lib, other_prefix = library("tollgate_other", args.compare)
                redis.send("FUNCTION", "LOAD", "REPLACE", lib)
                interleaved(redis, server.pid,
                            [("decide.lua", fn, True),
                             (name, f"{other_prefix}decide", repeats)],
                            keys3, args.calls, args.rounds)
            measure(redis, server.pid, "reference chapter's limit.lua, 1 bucket", "EVALSHA",
                    [sha["limit"], 1, "bench:ref", 100, 50, 1], args.calls, 1)
            measure(redis, server.pid, "floor: TIME + MGET 3 + 3 SET PX", "EVALSHA",
                    [sha["floor"], 3, *keys3], args.calls, 1)
            measure(redis, server.pid, "empty script", "EVALSHA", [sha["empty"], 0], args.calls, 1)
            write_report(args, version)
        finally:
            server.terminate()
            server.wait()


def write_report(args, version):
    """bench/script_time.md, which bench/run.py includes in RESULTS.md."""
    command = " ".join(["python3", "bench/script_time.py"] + sys.argv[1:])
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = ["## Script time per decision", "",
            f"Measured {when} with `{command}` ({version}, one connection, one call at a time, "
            f"{args.calls} calls each; load average {os.getloadavg()[0]:.2f} at the end). Script time is "
            "Redis's own `usec_per_call` of the call; Redis CPU adds the network and protocol work of "
            "each call.", "",
            "| script | script time per call | per request | Redis CPU per call |", "|---|---:|---:|---:|"]
    text += ROWS
    with open(os.path.join(ROOT, "bench", "script_time.md"), "w") as f:
        f.write("\n".join(text) + "\n")


if __name__ == "__main__":
    main()
