"""The `openai` Python package as the client of tests/llm_usage.rs.

Makes one chat completion as JSON and one streamed, without asking for the
stream's usage (the gateway is to ask for it), and prints one JSON line for
each: its content and its usage's total_tokens (null when it has none).
Exits non-zero on any error. `make test` installs the package in
target/pylib (run with PYTHONPATH=target/pylib).
"""

import argparse
import json
import sys

try:
    import openai
except ImportError as e:
    sys.exit(f"openai_client.py: {e}: run `make test` (it installs openai in target/pylib)")

MESSAGES = [{"role": "user", "content": "Say hi"}]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    # No retry, and a bound on a stalled answer (the default is ten minutes).
    client = openai.OpenAI(
        base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=30
    )

    answer = client.chat.completions.create(model=args.model, messages=MESSAGES, max_tokens=64)
    usage = answer.usage.total_tokens if answer.usage else None
    content = answer.choices[0].message.content
    print(json.dumps({"mode": "json", "content": content, "total_tokens": usage}), flush=True)

    stream = client.chat.completions.create(
        model=args.model, messages=MESSAGES, max_tokens=64, stream=True
    )
    content, usage, chunks = "", None, 0
    for chunk in stream:
        chunks += 1
        for choice in chunk.choices:
            content += choice.delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage.total_tokens
    print(json.dumps({"mode": "stream", "content": content, "total_tokens": usage, "chunks": chunks}))


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # noqa: BLE001: any error fails the test, with its message
        sys.exit(f"openai_client.py: {type(e).__name__}: {e}")
