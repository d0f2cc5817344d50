"""Prompts for the SmolLM2 drafter's training data: code and chat requests, never HumanEval.

The target is an instruct model, so every prompt is one user message in its chat template (the
form users send it). Two sources, both offline and deterministic:

* code: public functions of the Python standard library, asked for by signature and summary
  ("Write a Python function ..."), explained, tested or refactored;
* chat: a fixed list of everyday and technical subjects crossed with instruction templates.

`--form stubs` writes a second set: each such function as a bare stub (its `def` line and its
docstring, no request around it), the form in which code assistants are handed a function to
complete (and in which the benchmark's HumanEval prompts reach the model).

HumanEval is the benchmark, so the script refuses to write a prompt that names a HumanEval entry
point or holds a line of a HumanEval prompt (40+ characters). The order is a fixed shuffle, so
any prefix of the file (the shards generated so far) is a mix of both kinds.

    python scripts/drafter/prompts.py --target smollm2 -o data/smollm2/prompts.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import pkgutil
import random
import re
import sys
import warnings

from trtspec.assets import resolve_target
from trtspec.fileio import atomic_write_text
from trtspec.perf.bench import load_prompts
from trtspec.tokenizer import TextCodec

CODE_TASKS = (
    "Write a Python function `{name}{signature}` that {summary}",
    "Implement `{name}{signature}` in Python: {summary} Add a docstring and type hints.",
    "Explain what the Python function `{module}.{name}` does and show a short example of using it.",
    "Write three pytest tests for `{module}.{name}`, whose job is: {summary}",
    "How would you write `{name}` yourself? It {summary_lower} Show the code.",
)
CHAT_TASKS = (
    "Explain {subject} to a beginner in a few paragraphs.",
    "Give me five practical tips about {subject}.",
    "What are the most common mistakes people make with {subject}?",
    "Write a short story that involves {subject}.",
    "Summarize the key ideas of {subject} in a bulleted list.",
    "Compare two different approaches to {subject} and say when to use each.",
    "Write a friendly email to a colleague about {subject}.",
    "What questions should I ask an expert on {subject}?",
    "Write a haiku and a limerick about {subject}.",
    "Plan a one-week learning schedule for {subject}.",
)
SUBJECTS = (
    "baking bread", "saving money", "learning a new language", "time management", "climate change",
    "the water cycle", "photosynthesis", "black holes", "the French revolution", "healthy sleep",
    "running a marathon", "growing tomatoes", "public speaking", "job interviews", "writing a resume",
    "recursion in programming", "binary search", "hash tables", "linked lists", "sorting algorithms",
    "unit testing", "version control with git", "regular expressions", "SQL joins", "REST APIs",
    "Python decorators", "Python generators", "list comprehensions", "exception handling", "type hints",
    "object-oriented design", "functional programming", "concurrency and threads", "async and await",
    "memory management", "caching", "databases and indexes", "web security", "password hashing",
    "machine learning", "neural networks", "linear regression", "probability", "prime numbers",
    "the Pythagorean theorem", "fractions", "compound interest", "the stock market", "inflation",
    "volcanoes", "earthquakes", "the solar system", "the moon landing", "ancient Rome",
    "the printing press", "electric cars", "renewable energy", "recycling", "ocean tides",
    "meditation", "healthy breakfast ideas", "houseplants", "training a puppy", "birdwatching",
    "chess openings", "playing the guitar", "painting with watercolors", "photography", "camping",
    "traveling on a budget", "moving to a new city", "making friends as an adult", "team meetings",
    "giving feedback", "negotiating a salary", "starting a small business", "writing a novel",
    "reading more books", "the scientific method", "vaccines", "the human heart", "DNA",
    "the internet", "how compilers work", "operating systems", "command-line tools", "JSON",
    "data visualization", "spreadsheets", "cloud computing", "open-source software", "code review",
)
HUMANEVAL_LINE = 40  # a prompt holding a HumanEval line this long (or longer) is a leak


def _summary(obj) -> str | None:
    doc = inspect.getdoc(obj)
    if not doc:
        return None
    first = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
    if not 20 <= len(first) <= 300 or first.startswith(("Deprecated", ">>>")) or "(" in first[:1]:
        return None
    return first if first.endswith(".") else first + "."


STUB = 'def {name}{signature}:\n    """{doc}\n    """\n'
STUB_DOC_CHARS = 600  # the docstring's first paragraphs, up to this many characters


def _stub_doc(obj) -> str:
    """The docstring's leading paragraphs that fit STUB_DOC_CHARS, indented as in a function body."""
    kept: list[str] = []
    for paragraph in inspect.getdoc(obj).strip().split("\n\n"):
        if kept and sum(len(p) + 2 for p in kept) + len(paragraph) > STUB_DOC_CHARS:
            break
        kept.append(paragraph)
    return "\n\n".join(kept)[:STUB_DOC_CHARS].replace("\n", "\n    ")


STDLIB_SKIPPED = ("antigravity", "this", "idlelib", "tkinter", "turtle")
NOT_API = ("tests", "test", "testing", "conftest", "benchmarks", "sandbox")  # submodules `pkg.*` leaves out


def with_submodules(modules: list[str]) -> list[str]:
    """`modules` with each `pkg.*` spelled out: the package and its public submodules, in
    pkgutil's order (tests, private and unimportable ones left out)."""
    names = []
    for name in modules:
        if not name.endswith(".*"):
            names.append(name)
            continue
        package = name[:-2]
        names.append(package)
        with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):  # modules that print on import
            warnings.simplefilter("ignore")
            try:
                path = importlib.import_module(package).__path__
            except Exception:  # noqa: BLE001 - a package absent here (or a module, which has no submodules)
                continue
            for info in pkgutil.walk_packages(path, package + ".", onerror=lambda _: None):
                if not any(part.startswith("_") or part in NOT_API for part in info.name.split(".")[1:]):
                    names.append(info.name)
    return names


def documented_functions(modules: list[str] | None = None):
    """(module name, function name, function, summary) of every documented public function of
    `modules` (the functions their packages define; `pkg.*`: the package and its submodules) or, by
    default, of the standard library's top-level modules (the functions each defines itself)."""
    stdlib = modules is None
    names = [m for m in sorted(sys.stdlib_module_names) if not m.startswith("_") and m not in STDLIB_SKIPPED] \
        if stdlib else with_submodules(modules)
    for module_name in names:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with contextlib.redirect_stdout(sys.stderr):  # a module that prints on import
                    module = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001 - modules absent from this build (or needing a display) are skipped
            continue
        package = module_name.split(".")[0]
        seen = set()
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not inspect.isfunction(obj):
                continue
            defined_in = obj.__module__ or ""
            if stdlib and defined_in != module_name:
                continue
            if not stdlib:  # a package's own functions, each alias once (the committed stdlib sets keep theirs)
                if defined_in.split(".")[0] != package or id(obj) in seen:
                    continue
                seen.add(id(obj))
            summary = _summary(obj)
            if summary is None:
                continue
            yield module_name, name, obj, summary


def _signature(obj) -> str | None:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return None


def code_requests() -> list[str]:
    """One request per (public stdlib function, task), in a fixed order."""
    requests = []
    for module_name, name, obj, summary in documented_functions():
        signature = _signature(obj)
        if signature is not None:
            values = {"name": name, "signature": signature, "summary": summary, "module": module_name,
                      "summary_lower": summary[0].lower() + summary[1:]}
            requests += [task.format(**values) for task in CODE_TASKS]
    return requests


def stub_requests(modules: list[str] | None = None) -> list[str]:
    """One bare stub (def line and docstring) per documented public function (`documented_functions`),
    in a fixed order; object addresses left out of signatures, and a function whose default is this
    run's command line (`args=sys.argv`) left out, so the set is the same on every run."""
    argv = repr(sys.argv)
    return [STUB.format(name=name, signature=re.sub(r" at 0x[0-9a-f]+", "", signature), doc=_stub_doc(obj))
            for _, name, obj, _ in documented_functions(modules)
            if (signature := _signature(obj)) is not None and argv not in signature]


def chat_requests() -> list[str]:
    return [task.format(subject=subject) for subject in SUBJECTS for task in CHAT_TASKS]


def humaneval_leaks(requests: list[str]) -> list[str]:
    """Requests that name a HumanEval entry point or hold a line of a HumanEval prompt."""
    names, lines = set(), set()
    for prompt in load_prompts("humaneval")[1]:
        names.update(re.findall(r"^def (\w+)\(", prompt, re.MULTILINE))
        lines.update(line.strip() for line in prompt.splitlines() if len(line.strip()) >= HUMANEVAL_LINE)
    return [r for r in requests
            if any(re.search(rf"\b{re.escape(n)}\b", r) for n in names) or any(line in r for line in lines)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2", help="Target whose chat template and tokenizer are used.")
    parser.add_argument("-o", "--output", required=True)
    parser.add_argument("--form", default="requests", choices=("requests", "stubs"),
                        help="requests: code and chat requests; stubs: bare function stubs to complete.")
    parser.add_argument("--modules", default=None, metavar="A,B,...",
                        help="Stubs of these packages' functions (e.g. networkx,sympy) instead of the standard library's.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the fixed shuffle.")
    parser.add_argument("--max-prompt-tokens", type=int, default=192, help="Longer prompts are left out.")
    parser.add_argument("--exclude", action="append", default=[], metavar="FILE",
                        help="Leave out the prompts of this set (repeatable), and each repeat within this one: "
                             "a set of further packages adds only functions no earlier set holds.")
    args = parser.parse_args()
    codec = TextCodec(resolve_target(args.target))
    if args.form == "requests":
        kinds = {"code": code_requests(), "chat": chat_requests()}
    else:
        kinds = {"stub": stub_requests(args.modules.split(",") if args.modules else None)}
    kind_of = {text: kind for kind, texts in kinds.items() for text in texts}
    every = [text for texts in kinds.values() for text in texts]  # duplicates kept: the committed sets hold them
    leaks = set(humaneval_leaks(every))
    requests = [text for text in every if text not in leaks]
    random.Random(args.seed).shuffle(requests)
    records = []
    seen = {json.loads(line)["prompt"] for path in args.exclude for line in open(path, encoding="utf-8") if line.strip()}
    for text in requests:
        messages = [{"role": "user", "content": text}]
        prompt = codec.apply_chat_template(messages)
        if args.exclude:
            if prompt in seen:
                continue
            seen.add(prompt)
        ids = codec.encode_chat(messages)
        if len(ids) <= args.max_prompt_tokens:
            records.append({"prompt": prompt, "prompt_ids": ids, "kind": kind_of[text]})
    atomic_write_text(args.output, "".join(json.dumps(r) + "\n" for r in records))
    counts = ", ".join(f"{sum(r['kind'] == kind for r in records)} {kind}" for kind in kinds)
    print(f"{args.output}: {len(records)} prompts ({counts}); {len(leaks)} dropped as HumanEval leaks")


if __name__ == "__main__":
    main()
