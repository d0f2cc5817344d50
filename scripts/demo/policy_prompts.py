"""HumanEval-shaped prompts for training the demo pair's BlockPilot policy, disjoint from HumanEval.

Like HumanEval (imports, then a function's signature and docstring), each prompt is a documented
function from a standard-library file that the demo target never saw (tests, IDE and GUI code,
see drafter_prompts.py): the file's top-level imports, a blank line, and the function's `def`
line(s) and docstring, dedented. Prompts vary in length as HumanEval's do. The choice is fixed
(ordered by content hash) and checked for overlap with the corpus and HumanEval like the
drafter prompts.

    python scripts/demo/policy_prompts.py -o build/demo/policy-prompts.jsonl
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import sys
import textwrap
from pathlib import Path

from trtspec.fileio import atomic_write_text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import read_text, stdlib_root  # noqa: E402
from drafter_prompts import check_disjoint, source_files  # noqa: E402

MAX_PROMPT_CHARS = 1500


def documented_functions(path: Path) -> list[dict]:
    text = read_text(path)
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    imports = "".join(ast.get_source_segment(text, node) + "\n" for node in tree.body
                      if isinstance(node, (ast.Import, ast.ImportFrom)))
    prompts = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or ast.get_docstring(node) is None:
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        docstring = node.body[0]
        head = textwrap.dedent("".join(lines[first:docstring.end_lineno]))
        prompt = (imports + "\n\n" if imports else "") + head
        if len(prompt) <= MAX_PROMPT_CHARS:
            line = node.lineno
            prompts.append({"prompt": prompt, "source": f"{path.relative_to(stdlib_root()).as_posix()}:{line}"})
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=400)
    parser.add_argument("-o", "--output", required=True)
    args = parser.parse_args()
    candidates = {}
    for path in source_files():
        for record in documented_functions(path):
            candidates.setdefault(record["prompt"], record)
    ranked = sorted(candidates.values(), key=lambda r: hashlib.sha256(r["prompt"].encode()).hexdigest())
    prompts = ranked[:args.count]
    counts = check_disjoint(prompts)
    out = atomic_write_text(args.output, "".join(json.dumps(r) + "\n" for r in prompts))
    print(json.dumps({**counts, "candidates": len(candidates), "output": str(out)}))


if __name__ == "__main__":
    main()
