#!/usr/bin/env python3
"""A stand-in for an API's existing auth service: it knows its callers' keys
and answers `GET /whoami` with who the caller is, in response headers.

    python3 whoami.py [PORT]        # default 8000

200 with `x-tenant-id`, `x-credential-id` and `x-plan` for a known key,
401 for any other. tollgate's `auth.forward_auth` asks it about keys the
gateway does not know itself.
"""

import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# key -> (tenant, caller id, plan): what the API's database would hold.
CALLERS = {
    "sk_live_acme_1": ("acme", "acme-ci", "pro"),
    "sk_live_globex_7": ("globex", "globex-web", "free"),
}


class WhoAmI(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        scheme, _, key = self.headers.get("authorization", "").partition(" ")
        caller = CALLERS.get(key) if scheme.lower() == "bearer" else None
        if self.path != "/whoami" or caller is None:
            self.send_response(401)
        else:
            tenant, caller_id, plan = caller
            self.send_response(200)
            self.send_header("x-tenant-id", tenant)
            self.send_header("x-credential-id", caller_id)
            self.send_header("x-plan", plan)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8000
    ThreadingHTTPServer(("127.0.0.1", port), WhoAmI).serve_forever()
