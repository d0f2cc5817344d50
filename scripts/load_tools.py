"""The serving benchmark with the load tools users run: NVIDIA's aiperf (and vLLM's guidellm)
against `trtspec serve`.

One server per setting of `--block-size` (default: AR, 8 and auto), each driven by `aiperf
profile` (and, with --guidellm, by `guidellm run` after it) at every concurrency (default 1, 4, 8, 16) with HumanEval prompts and a fixed output
length (`ignore_eos` and `min_tokens` pin it, so every setting generates the same tokens); the
figures side by side (requests/s, output tokens/s, TTFT and inter-token latency p50/p99), and per
concurrency how `auto` compares with the better of AR and the best fixed size, in the same run.
Servers start on free loopback ports and are stopped by PID at the end (scripts/serve_load.py).

With --one-server (aiperf only), one server (its default block size) serves every setting, sent as
each request's `block_size` field, and the settings take turns at each concurrency: two server
processes started one after the other differ by about 10% on a small machine, more than the
settings may (docs/benchmarks.md).

The tools are clients, not dependencies of trtspec: give them their own environment,

    python -m venv .venv-load && .venv-load/bin/pip install 'aiperf==0.13.*' 'guidellm==0.8.*'
    python scripts/load_tools.py --aiperf .venv-load/bin/aiperf --guidellm .venv-load/bin/guidellm \
        --concurrency 1,8 --json load.json
    python scripts/load_tools.py --aiperf .venv-load/bin/aiperf -- --engine ENGINE_DIR   # serve args after --
    python scripts/load_tools.py --aiperf .venv-load/bin/aiperf --one-server --concurrency 8
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from serve_load import start_server, stop_server

# aiperf's warnings about its own side (no GPU telemetry endpoint, its event loop on a busy machine)
CLIENT_WARNINGS = ("GPU Telemetry", "gpu_telemetry_manager", "EventLoopMonitor")
ROWS = ("requests/s", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms")


def write_prompts(work: Path, count: int, output_tokens: int) -> tuple[Path, Path]:
    """The first `count` HumanEval prompts as aiperf's single_turn JSONL and as guidellm's JSON
    rows (its output length column pins each request's)."""
    from trtspec.perf.bench import load_prompts

    _, prompts = load_prompts("humaneval", count)
    ours, theirs = work / "humaneval-aiperf.jsonl", work / "humaneval-guidellm.jsonl"
    ours.write_text("".join(json.dumps({"text": p}) + "\n" for p in prompts))
    theirs.write_text("".join(json.dumps({"prompt": p, "output_tokens_count": output_tokens}) + "\n" for p in prompts))
    return ours, theirs


def aiperf(tool: str, url: str, model: str, tokenizer: str, prompts: Path, concurrency: int, requests: int,
           output_tokens: int, artifacts: Path, block_size: str | None = None) -> dict:
    """One aiperf run (`block_size`: every request's field; None: the server's); its figures from
    profile_export_aiperf.json."""
    command = [tool, "profile", "--model", model, "--url", url, "--endpoint-type", "completions", "--streaming",
               "--concurrency", str(concurrency), "--request-count", str(requests),
               "--warmup-request-count", str(concurrency), "--input-file", str(prompts),
               "--custom-dataset-type", "single_turn", "--output-tokens-mean", str(output_tokens),
               "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"min_tokens:{output_tokens}",
               "--extra-inputs", "temperature:0", "--tokenizer", tokenizer, "--artifact-dir", str(artifacts),
               "--ui-type", "none"]
    if block_size is not None:
        command += ["--extra-inputs", f"block_size:{block_size}"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"aiperf failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    report = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    warnings = [line for line in (artifacts / "logs" / "aiperf.log").read_text().splitlines()
                if " WARNING " in line and not any(own in line for own in CLIENT_WARNINGS)]
    ttft, itl = report["time_to_first_token"], report["inter_token_latency"]
    return {"requests/s": report["request_throughput"]["avg"], "output tok/s": report["output_token_throughput"]["avg"],
            "TTFT p50 ms": ttft["p50"], "TTFT p99 ms": ttft["p99"], "ITL p50 ms": itl["p50"], "ITL p99 ms": itl["p99"],
            "output tokens": report["output_sequence_length"]["avg"], "errors": report.get("error_summary") or [],
            "warnings": warnings, "command": " ".join(command)}


def guidellm(tool: str, url: str, prompts: Path, concurrency: int, requests: int, out: Path) -> dict:
    """One guidellm run (its concurrent profile); its figures from the JSON report. It sends
    ignore_eos and max_tokens from the prompts' output length column."""
    command = [tool, "run", "--backend", f"kind=openai_http,target={url}",
               "--profile", f"kind=concurrent,streams={concurrency}", "--constraint", f"kind=max_requests,count={requests}",
               "--data", f"kind=json_file,path={prompts}", "--output", f"kind=json,path={out}", "--disable-progress"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"guidellm failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    benchmark = json.loads(out.read_text())["benchmarks"][0]
    metrics = {name: value["successful"] for name, value in benchmark["metrics"].items()
               if isinstance(value, dict) and "successful" in value}
    ttft, itl = metrics["time_to_first_token_ms"], metrics["inter_token_latency_ms"]
    return {"requests/s": metrics["requests_per_second"]["mean"],
            "output tok/s": metrics["output_tokens_per_second"]["mean"],
            "TTFT p50 ms": ttft["median"], "TTFT p99 ms": ttft["percentiles"]["p99"],
            "ITL p50 ms": itl["median"], "ITL p99 ms": itl["percentiles"]["p99"],
            "output tokens": metrics["output_token_count"]["median"], "warnings": benchmark["warnings"],
            "command": " ".join(command)}


def blockpilot_choices(url: str) -> dict[str, float]:
    """The server's count of auto requests per chosen block size (its /metrics)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return {match.group(1): float(match.group(2)) for match in
            re.finditer(r'^trtspec_blockpilot_choices_total\{block_size="([^"]+)"[^}]*\} (\S+)$', text, re.M)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--aiperf", default=shutil.which("aiperf"), help="aiperf executable (default: on PATH).")
    parser.add_argument("--guidellm", help="Also run guidellm (this executable) at every level.")
    parser.add_argument("--settings", default="AR,8,auto", help="Comma-separated block sizes: each server's --block-size (or, with --one-server, each request's).")
    parser.add_argument("--concurrency", default="1,4,8,16", help="Comma-separated client counts.")
    parser.add_argument("--requests", type=int, default=8, help="Requests per client at each level.")
    parser.add_argument("--output-tokens", type=int, default=128, help="Tokens every request generates.")
    parser.add_argument("--prompts", type=int, default=64, help="First N HumanEval prompts.")
    parser.add_argument("--threads", type=int, help="trtspec --threads for the servers.")
    parser.add_argument("--json", metavar="FILE", help="Also write the figures as JSON.")
    parser.add_argument("--one-server", action="store_true",
                        help="One server for every setting (each request's block_size field), settings in turn.")
    parser.add_argument("server_args", nargs="*", help="Arguments for trtspec serve (after --).")
    args = parser.parse_args()
    if not args.aiperf:
        raise SystemExit("aiperf not found: pip install 'aiperf==0.13.*' (in its own venv) and pass --aiperf PATH")
    from trtspec.assets import resolve_target

    settings, levels = args.settings.split(","), [int(c) for c in args.concurrency.split(",")]
    if args.one_server and args.guidellm:
        raise SystemExit("--one-server sends block_size in aiperf's requests; guidellm cannot: run it without --one-server")
    results: dict[str, dict[str, dict[int, dict]]] = {"aiperf": {}, "guidellm": {}}
    served = dict(zip(args.server_args, args.server_args[1:])).get("--target")  # None: the default target
    tokenizer = str(resolve_target(served))  # the served target's tokenizer
    with tempfile.TemporaryDirectory(prefix="trtspec-load-") as scratch:
        work = Path(scratch)
        prompts, rows = write_prompts(work, args.prompts, args.output_tokens)

        def measure(url: str, model: str, setting: str, level: int, per_request: bool) -> None:
            runs = {"aiperf": lambda: aiperf(args.aiperf, url, model, tokenizer, prompts, level, args.requests * level,
                                             args.output_tokens, work / f"{setting}-c{level}",
                                             setting if per_request else None)}
            if args.guidellm:
                runs["guidellm"] = lambda: guidellm(args.guidellm, url, rows, level, args.requests * level,
                                                    work / f"{setting}-c{level}-guidellm.json")
            for tool, run in runs.items():
                before = blockpilot_choices(url)
                row = results[tool].setdefault(setting, {})[level] = run()
                after = blockpilot_choices(url)  # warm-up requests included
                row["blockpilot choices"] = {b: after[b] - before.get(b, 0) for b in after if after[b] > before.get(b, 0)}
                print(f"{tool:>8} {setting:>5} c={level:<3} " + "  ".join(f"{k} {row[k]:.1f}" for k in ROWS), flush=True)

        servers = [None] if args.one_server else settings
        for server_setting in servers:
            flags = [] if server_setting is None else ["--block-size", server_setting]
            process, url = start_server([*flags, "--max-concurrency", str(max(levels)), *args.server_args], args.threads,
                                        work / f"server-{server_setting or 'one'}.log")
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=30) as response:
                    model = json.loads(response.read())["data"][0]["id"]
                for level in levels:
                    for setting in settings if server_setting is None else [server_setting]:
                        measure(url, model, setting, level, per_request=server_setting is None)
            finally:
                stop_server(process)
    for tool in [t for t in results if results[t]]:
        print(f"\n{tool}, {args.output_tokens} output tokens per request, {args.requests} requests per client")
        print(table(results[tool], settings, levels, tool))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


def table(results: dict, settings: list[str], levels: list[int], tool: str) -> str:
    """Rows: concurrency x figure; columns: the settings; then auto against the best of the others."""
    lines = [f"{'clients':>7} {'figure':<13}" + "".join(f"{s:>10}" for s in settings)]
    for level in levels:
        for figure in ROWS:
            lines.append(f"{level:>7} {figure:<13}" + "".join(f"{results[s][level][figure]:>10.1f}" for s in settings))
        if "auto" in settings and len(settings) > 1:
            rivals = {s: results[s][level]["output tok/s"] for s in settings if s != "auto"}
            best = max(rivals, key=rivals.get)
            auto = results["auto"][level]
            chosen = ", ".join(f"{b}: {n:.0f}" for b, n in sorted(auto["blockpilot choices"].items()))
            lines.append(f"{level:>7} auto / best ({best}): {auto['output tok/s'] / rivals[best]:.2f}x"
                         f" (output tokens per request: {auto['output tokens']:.0f}; auto chose {chosen or '-'})")
    warned = sorted({json.dumps(w) if not isinstance(w, str) else w
                     for s in settings for level in levels for w in results[s][level]["warnings"]})
    lines.append(f"{tool} warnings: " + ("; ".join(warned) if warned else "none"))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
