#!/usr/bin/env python3
"""Speed and memory of `tollgate simulate`.

Writes an access log of N lines, in this gateway's JSON and in NGINX's
combined format (20 requests a second from one tenant, spread over 65 536
client addresses) and a policy with a per-address
pre-auth limit and a per-tenant limit, then times the release binary
replaying it (wall time, max RSS from /usr/bin/time). Writes
bench/simulate.md, which bench/run.py includes in RESULTS.md.

    python3 bench/simulate.py [--lines 1000000]
"""

import argparse
import datetime
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=1_000_000)
    args = ap.parse_args()
    binary = ROOT / "target" / "release" / "tollgate"
    if not binary.exists():
        sys.exit("build first: cargo build --release --bin tollgate")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        digest = hashlib.sha256(b"key-c1").hexdigest()
        (tmp / "policy.yaml").write_text(f"""version: 1
auth:
  keys:
    - {{ id: c1, tenant: acme, sha256: "{digest}" }}
limits:
  per-tenant: {{ key: [tenant], capacity: 100, refill_per_second: 10 }}
  per-ip: {{ scope: pre_auth, key: [ip], capacity: 50, refill_per_second: 5 }}
routes:
  - {{ name: api, path: "/v1/**", respond: {{ status: 200 }}, limits: [per-ip, per-tenant] }}
""")
        base = datetime.datetime(2026, 11, 30, tzinfo=datetime.timezone.utc).timestamp()
        # The same requests in both formats: this gateway's JSON lines, and
        # NGINX's combined with the credential id in a trailing field.
        logs = {"tollgate": tmp / "access.jsonl", "combined": tmp / "access.log"}
        with open(logs["tollgate"], "w") as j, open(logs["combined"], "w") as c:
            for i in range(args.lines):
                t = base + i * 0.05
                at = datetime.datetime.fromtimestamp(t, datetime.timezone.utc)
                ts = at.strftime("%Y-%m-%dT%H:%M:%S.") + f"{int(round((t % 1) * 1000)) % 1000:03d}Z"
                addr = f"10.0.{(i // 256) % 256}.{i % 256}"
                j.write(json.dumps({
                    "time": ts, "policy_version": "bench", "method": "GET", "host": "api.test",
                    "path": "/v1/x", "route": "api", "status": 200, "outcome": "allowed",
                    "tenant": "acme", "credential": "c1", "client": f"{addr}/32",
                    "cost": 1, "violated": [], "upstream": None, "duration_ms": 1.0, "bytes_in": 0,
                    "bytes_out": 2}) + "\n")
                c.write(f'{addr} - - [{at.strftime("%d/%b/%Y:%H:%M:%S +0000")}] "GET /v1/x?page=1 HTTP/1.1" '
                        f'200 2 "-" "bench/1.0 (x86_64)" cred=c1\n')
        rows = []
        for fmt, key_field in [("tollgate", None), ("tollgate", "credential"), ("combined", "cred")]:
            log = logs[fmt]
            size = log.stat().st_size
            key_args = ["--key-field", key_field] if key_field else []
            run = subprocess.run(["/usr/bin/time", "-f", "%e %M", str(binary), "simulate", "--config",
                                  str(tmp / "policy.yaml"), "--log", str(log), "--log-format", fmt,
                                  *key_args, "--top", "3"],
                                 capture_output=True, text=True, check=True)
            seconds, rss_kb = run.stderr.strip().splitlines()[-1].split()
            seconds, rss_kb = float(seconds), int(rss_kb)
            replayed = int(re.search(r"(\d+) requests replayed", run.stdout).group(1))
            assert replayed == args.lines, run.stdout
            per_minute = replayed / max(seconds, 1e-9) * 60
            label = f"{fmt}, --key-field {key_field}" if key_field else fmt
            rows.append(f"| {label} | {replayed} | {size / 1e6:.0f} MB | {seconds:.2f} s | "
                        f"{per_minute / 1e6:.1f} million | {rss_kb / 1024:.0f} MiB |")
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = " ".join(["python3", "bench/simulate.py"] + sys.argv[1:])
    text = "\n".join([
        "## Simulate", "",
        f"Measured {when} with `{command}` (release build; load average {os.getloadavg()[0]:.2f}): "
        f"{args.lines} lines of one tenant at 20 requests a second from 65 536 client "
        "addresses, against a per-address pre-auth limit and a per-tenant limit, in each log format "
        "(with `--key-field`, JSON lines are read as a tree to find the named member).", "",
        "| format | lines | size | wall time | lines per minute | max RSS |",
        "|---|---:|---:|---:|---:|---:|",
    ] + rows) + "\n"
    (ROOT / "bench" / "simulate.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
