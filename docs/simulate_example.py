#!/usr/bin/env python3
"""The example report of "Rolling out a policy" (docs/src/rolling-out.md).

Writes two hours of an access log for three tenants (globex bursts from
00:45 to 00:50), a live policy and a stricter candidate, runs
`tollgate simulate --config live --config candidate --report`, and, when
Chromium is installed, takes a screenshot of the page headless:

    python3 docs/simulate_example.py   # -> docs/simulate-report.{html,png}

Deterministic: the traffic comes from a seeded generator.
"""

import datetime
import hashlib
import json
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

# Tenant: its credential id, requests a second and client address.
TENANTS = {
    "acme": ("c-acme", 5.0, "198.51.100.10"),
    "globex": ("c-globex", 2.0, "198.51.100.20"),
    "initech": ("c-initech", 8.0, "203.0.113.30"),
}

POLICY = """version: 1
policy_version: "{name}"
auth:
  keys:
{keys}
limits:
  per-tenant: {{ key: [tenant], capacity: {capacity}, refill_per_second: {rate} }}
  per-ip: {{ scope: pre_auth, key: [ip], capacity: 300, refill_per_second: 30 }}
routes:
  - {{ name: export, methods: [POST], path: /v1/export, cost: 5, respond: {{ status: 200 }}, limits: [per-ip, per-tenant] }}
  - {{ name: api, path: "/v1/**", respond: {{ status: 200 }}, limits: [per-ip, per-tenant] }}
"""


def traffic(out):
    rng = random.Random(7)
    base = datetime.datetime(2026, 11, 30, tzinfo=datetime.timezone.utc).timestamp()
    events = []
    for tenant, (cred, rate, client) in TENANTS.items():
        t = 0.0
        while t < 7200:
            burst = tenant == "globex" and 2700 <= t < 3000
            # initech grows through the two hours.
            r = 40.0 if burst else rate * (1 + t / 7200 if tenant == "initech" else 1)
            t += rng.expovariate(r)
            export = rng.random() < 0.03
            events.append((t, cred, client, "POST" if export else "GET",
                           "/v1/export" if export else "/v1/items"))
    events.sort()
    with open(out, "w") as f:
        for t, cred, client, method, path in events:
            at = datetime.datetime.fromtimestamp(base + t, datetime.timezone.utc)
            f.write(json.dumps({
                "time": at.strftime("%Y-%m-%dT%H:%M:%S.") + f"{at.microsecond // 1000:03d}Z",
                "method": method, "host": "api.example", "path": path,
                "credential": cred, "client": f"{client}/32",
            }) + "\n")
    return len(events)


def main():
    built = [p for p in (ROOT / "target/release/tollgate", ROOT / "target/debug/tollgate") if p.exists()]
    binary = max(built, key=lambda p: p.stat().st_mtime, default=None)
    if binary is None:
        sys.exit("build first: cargo build --bin tollgate")
    keys = "\n".join(
        f'    - {{ id: {cred}, tenant: {t}, sha256: "{hashlib.sha256(cred.encode()).hexdigest()}" }}'
        for t, (cred, _, _) in TENANTS.items())
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "live.yaml").write_text(POLICY.format(name="live", keys=keys, capacity=300, rate=12))
        (tmp / "candidate.yaml").write_text(POLICY.format(name="candidate", keys=keys, capacity=120, rate=10))
        lines = traffic(tmp / "access.jsonl")
        report = DOCS / "simulate-report.html"
        cmd = [str(binary), "simulate", "--config", "live.yaml", "--config", "candidate.yaml",
               "--log", "access.jsonl", "--top", "3", "--report", str(report)]
        text = subprocess.run(cmd, cwd=tmp, check=True, capture_output=True, text=True).stdout
        print(f"{lines} lines\n{text}")
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        print("no chromium: skipped the screenshot (apt-get install chromium)")
        return
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=980,1500", f"--screenshot={DOCS / 'simulate-report.png'}",
                    report.as_uri()], check=True, capture_output=True)
    print(f"screenshot: {DOCS / 'simulate-report.png'}")


if __name__ == "__main__":
    main()
