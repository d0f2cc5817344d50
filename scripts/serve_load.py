"""A bounded closed-loop load run against `trtspec serve` (loopback only; it stops by itself).

For each concurrency C (default 1, 4, 8, 16), C clients each send streaming completions back to
back (HumanEval prompts in turn) until the level's duration is over or its request budget is spent;
a request in flight at the end still finishes and counts. Reported per level: requests/s, output
tokens/s, p50/p99 end-to-end latency, p50/p99 time to first token (first text chunk), and the mean
tau of the responses' `trtspec` objects.

Without --url the script starts `trtspec serve` itself on a free loopback port with the given
server arguments and stops it by PID at the end; --metrics prints the server's spec-decode
metrics afterwards.

    python scripts/serve_load.py --duration 20 --max-tokens 64 --metrics -- --max-concurrency 16
    python scripts/serve_load.py --url http://127.0.0.1:8000 --concurrency 1,8
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))] if ordered else float("nan")


def start_server(args: list[str], threads: int | None, log: Path) -> tuple[subprocess.Popen, str]:
    root = [sys.executable, "-m", "trtspec", *(["--threads", str(threads)] if threads else [])]
    stream = open(log, "wb")
    process = subprocess.Popen([*root, "serve", "--host", "127.0.0.1", "--port", "0", *args],
                               stdout=stream, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and process.poll() is None:
        found = re.search(r"on (http://127\.0\.0\.1:\d+) ", log.read_text(errors="replace"))
        if found:
            url = found.group(1)
            try:
                with urllib.request.urlopen(url + "/health", timeout=5):
                    return process, url
            except OSError:
                pass
        time.sleep(0.3)
    stop_server(process)
    raise SystemExit(f"trtspec serve did not start:\n{log.read_text(errors='replace')[-2000:]}")


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def one_request(url: str, model: str, prompt: str, max_tokens: int, extra: dict) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    began = time.perf_counter()
    first, tokens, tau = None, 0, None
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk["choices"] and chunk["choices"][0]["text"] and first is None:
                first = time.perf_counter()
            if chunk["choices"] and chunk.get("trtspec"):
                tau = chunk["trtspec"]["tau"]
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    return {"latency": end - began, "ttft": (first or end) - began, "tokens": tokens, "tau": tau, "end": end}


def run_level(url: str, model: str, prompts: list[str], concurrency: int, duration: float, budget: int,
              max_tokens: int, extra: dict) -> dict:
    results, errors, lock = [], [], threading.Lock()
    counter = iter(range(10**9))
    began = time.perf_counter()
    stop_at = began + duration

    def client() -> None:
        while time.perf_counter() < stop_at:
            with lock:
                index = next(counter)
                if index >= budget:
                    return
            try:
                result = one_request(url, model, prompts[index % len(prompts)], max_tokens, extra)
            except Exception as exc:  # noqa: BLE001 - a load run counts failures instead of stopping
                with lock:
                    errors.append(str(exc))
                continue
            with lock:
                results.append(result)

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = max(r["end"] for r in results) - began if results else time.perf_counter() - began
    latencies, ttfts = [r["latency"] for r in results], [r["ttft"] for r in results]
    taus = [r["tau"] for r in results if r["tau"]]
    return {"concurrency": concurrency, "requests": len(results), "errors": len(errors), "seconds": elapsed,
            "requests_per_s": len(results) / elapsed, "tokens_per_s": sum(r["tokens"] for r in results) / elapsed,
            "latency_p50_s": percentile(latencies, 0.5), "latency_p99_s": percentile(latencies, 0.99),
            "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99),
            "mean_tau": statistics.fmean(taus) if taus else None, "first_error": errors[0] if errors else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="A running server (default: start trtspec serve on a free loopback port).")
    parser.add_argument("--model", help="Model name (default: the server's first /v1/models entry).")
    parser.add_argument("--concurrency", default="1,4,8,16", help="Comma-separated client counts.")
    parser.add_argument("--duration", type=float, default=20.0, help="Seconds per level.")
    parser.add_argument("--requests", type=int, default=200, help="At most this many requests per level.")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=32, help="First N HumanEval prompts, used in turn.")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--block-size", help="block_size field of every request (default: the server's).")
    parser.add_argument("--warmup", type=int, default=2, help="Requests sent before measuring.")
    parser.add_argument("--threads", type=int, help="trtspec --threads for the server it starts.")
    parser.add_argument("--json", metavar="FILE", help="Also write the figures as JSON.")
    parser.add_argument("--metrics", action="store_true", help="Print the server's speculative-decoding and request metric lines after.")
    parser.add_argument("server_args", nargs="*", help="Arguments for trtspec serve (after --).")
    args = parser.parse_args()

    from trtspec.perf.bench import load_prompts

    prompts = load_prompts("humaneval", args.prompts)[1]
    extra = {"temperature": args.temperature, **({"block_size": args.block_size} if args.block_size else {})}
    process = None
    scratch = tempfile.TemporaryDirectory(prefix="serve-load-")
    url = args.url
    try:
        if url is None:
            process, url = start_server(args.server_args, args.threads, Path(scratch.name) / "server.log")
        if not re.match(r"http://(127\.0\.0\.1|localhost|\[::1\])[:/]", url):
            raise SystemExit("--url must be a loopback address")
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as response:
            model = args.model or json.load(response)["data"][0]["id"]
        for i in range(args.warmup):
            one_request(url, model, prompts[i % len(prompts)], args.max_tokens, extra)
        levels = []
        print(f"{'clients':>7} {'requests':>8} {'req/s':>7} {'tok/s':>8} {'p50 s':>7} {'p99 s':>7} "
              f"{'TTFT p50':>9} {'TTFT p99':>9} {'tau':>5}")
        for concurrency in map(int, args.concurrency.split(",")):
            level = run_level(url, model, prompts, concurrency, args.duration, args.requests, args.max_tokens, extra)
            levels.append(level)
            tau = f"{level['mean_tau']:.2f}" if level["mean_tau"] else "-"
            print(f"{concurrency:>7} {level['requests']:>8} {level['requests_per_s']:>7.2f} "
                  f"{level['tokens_per_s']:>8.1f} {level['latency_p50_s']:>7.2f} {level['latency_p99_s']:>7.2f} "
                  f"{level['ttft_p50_s']:>9.3f} {level['ttft_p99_s']:>9.3f} {tau:>5}"
                  + (f"  ({level['errors']} errors: {level['first_error']})" if level["errors"] else ""), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"url": url, "max_tokens": args.max_tokens, "levels": levels},
                                                  indent=1))
        if args.metrics:
            with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
                text = response.read().decode()
            print("\n".join(line for line in text.splitlines() if "_created" not in line and "_bucket" not in line
                            and line.startswith(("trtspec_spec_decode", "vllm:spec_decode", "trtspec_blockpilot",
                                                 "vllm:request_success", "trtspec_request_failure",
                                                 "vllm:time_to_first_token_seconds"))))
    finally:
        if process is not None:
            stop_server(process)
        scratch.cleanup()


if __name__ == "__main__":
    main()
