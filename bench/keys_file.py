#!/usr/bin/env python3
"""A keys file of many credentials: how long the gateway takes to load it and
what each key costs it resident.

For each size, a keys file is generated (YAML and the line format; ids
`ci-<n>`, 1 000 tenants, a plan on every tenth key), then `tollgate run`
starts on a memory-store policy naming it: the time from spawn to a ready
`/healthz` is the load time, and VmRSS once ready, less the same gateway's
with an empty keys file, divided by the keys, is the resident cost per key.
Then `tollgate check` on the same file, with its peak RSS (VmHWM). With
`--reloads N`, the gateway is sent SIGHUP N times and its RSS read over the
3 s after each counted reload.

    python3 bench/keys_file.py [--sizes 100000 1000000] [--formats lines yaml] [--reloads N]

Needs `cargo build --release --bin tollgate`.
"""

import argparse
import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import run  # noqa: E402

POLICY = """
version: 1
server: {{ listen: ["127.0.0.1:{port}"], admin_listen: "127.0.0.1:{admin}", threads: 1 }}
auth: {{ keys_file: {keys} }}
plans: {{ pro: {{}} }}
limits:
  per-tenant: {{ key: [tenant], capacity: 100, refill_per_second: 10 }}
routes:
  - {{ name: r, path: "/**", respond: {{ status: 200 }}, limits: [per-tenant] }}
"""


def write_keys(path, n, fmt):
    with open(path, "w") as f:
        if fmt == "yaml":
            f.write("keys:\n")
        for i in range(n):
            digest = hashlib.sha256(f"key-{i}".encode()).hexdigest()
            plan = " pro" if i % 10 == 0 else ""
            if fmt == "yaml":
                plan = ", plan: pro" if plan else ""
                f.write(f'  - {{ id: ci-{i}, tenant: tenant-{i % 1000}, sha256: "{digest}"{plan} }}\n')
            else:
                f.write(f"{digest} ci-{i} tenant-{i % 1000}{plan}\n")


def status_kib(pid, field):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def reloads_done(admin):
    _, body = run.http_get(admin, "/metrics")
    for line in body.decode().splitlines():
        if line.startswith('tollgate_config_reloads_total{result="ok"}'):
            return int(float(line.split()[-1]))
    return 0


def reload_rss(pid, admin, reloads):
    """VmRSS (MiB) after each of `reloads` SIGHUPs: read once the reload
    has been counted, then every 0.5 s for 3 s; the last reading is the
    settled one, the highest the copy held while the old one goes."""
    out = []
    for i in range(reloads):
        os.kill(pid, signal.SIGHUP)
        deadline = time.monotonic() + 30
        while reloads_done(admin) <= i:
            if time.monotonic() > deadline:
                raise RuntimeError("the reload was not counted within 30 s")
            time.sleep(0.05)
        readings = []
        for _ in range(7):
            readings.append(status_kib(pid, "VmRSS") >> 10)
            time.sleep(0.5)
        out.append((max(readings), readings[-1]))
    return out


def serve(work, keys, reloads=0):
    port, admin = run.free_port(), run.free_port()
    policy = work / "policy.yaml"
    policy.write_text(POLICY.format(port=port, admin=admin, keys=keys))
    started = time.monotonic()
    p = subprocess.Popen([str(run.RELEASE / "tollgate"), "run", "--config", str(policy)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"})
    try:
        while True:
            if p.poll() is not None:
                raise RuntimeError("tollgate exited")
            try:
                status, _ = run.http_get(admin, "/healthz", timeout=1)
                if status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.01)
        loaded = time.monotonic() - started
        time.sleep(0.5)
        rss = status_kib(p.pid, "VmRSS")
        after = reload_rss(p.pid, admin, reloads)
        return loaded, rss, status_kib(p.pid, "VmHWM"), after
    finally:
        p.terminate()
        p.wait()


def check(work, keys):
    policy = work / "policy.yaml"
    policy.write_text(POLICY.format(port=1, admin=2, keys=keys))
    started = time.monotonic()
    out = subprocess.run(["/usr/bin/time", "-f", "%M", str(run.RELEASE / "tollgate"), "check", "--config", str(policy)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    return time.monotonic() - started, int(out.stderr.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument("--formats", nargs="+", default=["lines", "yaml"])
    p.add_argument("--reloads", type=int, default=0,
                   help="SIGHUP the gateway this many times and report its RSS after each")
    args = p.parse_args()
    print(run.machine())
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        rows = []
        for fmt in args.formats:
            ext = "yaml" if fmt == "yaml" else "keys"
            empty = work / f"empty.{ext}"
            write_keys(empty, 0, fmt)
            _, base_rss, _, _ = serve(work, empty)
            for n in args.sizes:
                keys = work / f"keys-{n}.{ext}"
                write_keys(keys, n, fmt)
                size = keys.stat().st_size
                try:
                    loaded, rss, hwm, after = serve(work, keys, args.reloads)
                    checked, check_peak = check(work, keys)
                except RuntimeError as e:
                    print(f"{fmt} {n}: {e}", flush=True)
                    continue
                row = (fmt, n, size >> 20, loaded, (rss - base_rss) * 1024 / n, hwm >> 10, checked, check_peak >> 10)
                rows.append(row)
                print("{} {}: file {} MiB, ready in {:.2f} s, {:.0f} bytes resident per key, peak {} MiB; "
                      "check {:.2f} s, peak {} MiB".format(*row), flush=True)
                for i, (high, settled) in enumerate(after, 1):
                    print(f"{fmt} {n}: reload {i}: RSS {rss >> 10} MiB once ready, at most {high} MiB "
                          f"in the 3 s after, {settled} MiB at their end", flush=True)
                keys.unlink()
    print("\n| format | keys | file MiB | ready s | resident bytes/key | gateway peak MiB | check s | check peak MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print("| {} | {} | {} | {:.2f} | {:.0f} | {} | {:.2f} | {} |".format(*r))


if __name__ == "__main__":
    main()
