"""Prompts for training the demo drafter, disjoint from the target's corpus and from HumanEval.

The target was trained on the standard library *without* its test suites, IDE and GUI code, so
those left-out files are a source of real Python that the target never saw: each prompt is the
text of such a file up to the end of a `def ...:` line, trimmed to its last PROMPT_TOKENS tokens
(equal lengths let `trtspec generate-data` decode them in batches). The script checks, and
refuses to write, any overlap: no prompt comes from a corpus file or occurs in the corpus text,
and no HumanEval prompt occurs in the corpus or among the drafter prompts.

    python scripts/demo/drafter_prompts.py --tokenizer trtspec/assets/demo-target/tokenizer.json \
        -o build/demo/drafter-prompts.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

from tokenizers import Tokenizer

from trtspec.perf.bench import load_prompts
from trtspec.fileio import atomic_write_text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import all_corpus_files, corpus_files, humaneval_leaks, read_text, stdlib_root  # noqa: E402

PROMPT_TOKENS = 64
DEF_LINE = re.compile(r"^[ \t]*def [^\n]*:[ \t]*\n", re.MULTILINE)


def source_files() -> list[Path]:
    """Standard-library Python files left out of the target's corpus (tests, idlelib, tkinter...)."""
    root = stdlib_root()
    in_corpus = set(corpus_files(root))
    return sorted((p for p in root.rglob("*.py")
                   if p.is_file() and p not in in_corpus and "site-packages" not in p.parts
                   and "__pycache__" not in p.parts), key=lambda p: p.relative_to(root).as_posix())


def make_prompts(tokenizer: Tokenizer, count: int) -> list[dict]:
    root = stdlib_root()
    candidates = {}
    for path in source_files():
        text = read_text(path)
        for match in DEF_LINE.finditer(text):
            ids = tokenizer.encode(text[max(0, match.end() - 4 * PROMPT_TOKENS * 4):match.end()]).ids
            if len(ids) < PROMPT_TOKENS:
                continue
            ids = ids[-PROMPT_TOKENS:]
            prompt = tokenizer.decode(ids)
            line = text.count("\n", 0, match.start()) + 1
            candidates.setdefault(prompt, {"prompt": prompt, "prompt_ids": ids,
                                           "source": f"{path.relative_to(root).as_posix()}:{line}"})
    # a fixed, spread-out choice: order by content hash, no random state
    ranked = sorted(candidates.values(), key=lambda r: hashlib.sha256(r["prompt"].encode()).hexdigest())
    return ranked[:count]


def check_disjoint(prompts: list[dict]) -> dict:
    """Raise if the drafter prompts, the target corpus and HumanEval overlap; return the counts."""
    root = stdlib_root()
    corpus = "\n".join(read_text(p) for p in all_corpus_files())  # stdlib and package files
    in_corpus = set(corpus_files(root))
    from_corpus = [r["source"] for r in prompts if root / r["source"].rsplit(":", 1)[0] in in_corpus]
    if from_corpus:
        raise SystemExit(f"drafter prompts taken from corpus files: {from_corpus[:3]}")
    texts = [r["prompt"] for r in prompts]
    leaked = [t for t in texts if t in corpus]
    if leaked:
        raise SystemExit(f"{len(leaked)} drafter prompts occur verbatim in the target corpus")
    if humaneval_leaks([corpus]):
        raise SystemExit("a HumanEval prompt occurs in the target corpus")
    humaneval = load_prompts("humaneval")[1]
    if any(h in t or t in h for h in humaneval for t in texts):
        raise SystemExit("a HumanEval prompt overlaps a drafter prompt")
    return {"drafter_prompts": len(texts), "humaneval_prompts": len(humaneval), "corpus_chars": len(corpus)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True, help="the demo target's tokenizer.json")
    parser.add_argument("--count", type=int, default=2400)
    parser.add_argument("-o", "--output", required=True)
    args = parser.parse_args()
    prompts = make_prompts(Tokenizer.from_file(args.tokenizer), args.count)
    counts = check_disjoint(prompts)
    out = atomic_write_text(args.output, "".join(json.dumps(r) + "\n" for r in prompts))
    print(json.dumps({**counts, "output": str(out)}))


if __name__ == "__main__":
    main()
