"""``python -m sglang.launch_server --attention-backend latentspeed`` serving a streaming
OpenAI-compatible completion (issue #3), on the GPU host with SGLang staged.

Starts the server on a model with a tokenizer (the reference model), waits for ``/health``, asks
``/v1/completions`` for the same greedy completion streamed and not streamed, and checks that the
stream arrives in several chunks, ends with a finish reason, and spells the same text. Writes the
texts, chunk count, time to first chunk and rate as JSON; exits non-zero on any failed check.

    python tests/gpu/sglang_serve.py --model /tmp/refmodel --out serve.json [-- extra server args]
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request


def post(url: str, body: dict, stream: bool):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    response = urllib.request.urlopen(request, timeout=120)
    if not stream:
        return json.loads(response.read())
    return response


def wait_ready(base: str, server: subprocess.Popen, timeout_s: float) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode} before it was ready; its log is above")
        try:
            urllib.request.urlopen(f"{base}/health", timeout=5)
            return time.perf_counter() - start
        except (urllib.error.URLError, ConnectionError):
            time.sleep(2)
    raise SystemExit(f"the server was not ready after {timeout_s:.0f} s")


def streamed_completion(base: str, body: dict) -> dict:
    t0 = time.perf_counter()
    chunks, text, first, finish = 0, "", None, None
    for raw in post(f"{base}/v1/completions", {**body, "stream": True}, stream=True):
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        choice = json.loads(line[len("data:"):])["choices"][0]
        if choice.get("text"):
            first = first if first is not None else time.perf_counter() - t0
            chunks += 1
            text += choice["text"]
        finish = choice.get("finish_reason") or finish
    return {"text": text, "chunks": chunks, "first_chunk_s": first, "total_s": time.perf_counter() - t0,
            "finish_reason": finish}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a model directory with a tokenizer")
    parser.add_argument("--port", type=int, default=30111)
    parser.add_argument("--prompt", default="def fibonacci(n):\n    ")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", required=True)
    parser.add_argument("server_args", nargs="*", help="more launch_server arguments (after --)")
    args = parser.parse_args()
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model, "--port", str(args.port),
               "--attention-backend", "latentspeed", "--page-size", "64", "--mem-fraction-static", "0.5",
               *args.server_args]
    print("[serve]", " ".join(command), flush=True)
    server = subprocess.Popen(command, start_new_session=True)
    base = f"http://127.0.0.1:{args.port}"
    try:
        ready_s = wait_ready(base, server, timeout_s=420)
        body = {"model": args.model, "prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": 0.0}
        streamed = streamed_completion(base, body)
        whole = post(f"{base}/v1/completions", body, stream=False)["choices"][0]["text"]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    result = {"command": command, "ready_s": ready_s, "prompt": args.prompt, "streamed": streamed, "not_streamed": whole,
              "same_text": streamed["text"] == whole}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("[serve]", json.dumps(result, indent=1), flush=True)
    problems = [what for what, bad in (("fewer than two chunks", streamed["chunks"] < 2),
                                       ("no finish reason", streamed["finish_reason"] is None),
                                       ("streamed and whole texts differ", not result["same_text"])) if bad]
    if problems:
        raise SystemExit(f"streaming check failed: {', '.join(problems)}")


if __name__ == "__main__":
    main()
