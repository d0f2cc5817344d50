"""`trtspec run --stop`: stop text is text, matched in the decoded text; token ids only through
`--stop-token-id`; text that is not text (lone surrogates from argv or JSON) refused in one line."""

import json
import subprocess
import sys

import pytest
from helpers import assert_one_line_error, trtspec_in_process

from trtspec.tokenizer import TextCodec

COMMON = ("--backend", "eager", "--block-size", 4, "--max-new-tokens", 40, "--json")


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompt.txt"
    path.write_text("def add(a, b):\n")
    return path


@pytest.fixture(scope="module")
def pair(target_dir, drafter_dir, prompt_file):
    """The tiny pair's arguments and its plain output (no extra stops)."""
    args = ("run", prompt_file, "--target", target_dir, "--drafter", drafter_dir, *COMMON)
    plain = trtspec_in_process(*args)
    assert plain.returncode == 0, plain.stderr.decode()
    return args, json.loads(plain.stdout), TextCodec(target_dir)


def _run(args, *extra) -> dict:
    result = trtspec_in_process(*args, *extra)
    assert result.returncode == 0, result.stderr.decode()
    return json.loads(result.stdout)


def test_a_raw_vocabulary_key_is_text_not_a_token(pair):
    """Before: `--stop Ġs` looked 'Ġs' up as a vocabulary key and stopped at the token ' s' (as
    `--stop Ċ` stopped at a newline). Now it is the text 'Ġs', which the output never holds."""
    args, plain, codec = pair
    token = next(t for t in plain["tokens"] if codec.tokenizer.id_to_token(t) != codec.decode([t])
                 and codec.decode([t]).strip())
    key = codec.tokenizer.id_to_token(token)
    assert key not in plain["text"]
    assert _run(args, "--stop", key)["tokens"] == plain["tokens"]


def test_stop_text_ends_the_output_before_it(pair):
    """A stop string of several tokens is found in the text (before: refused as 'not a single
    token'); one that is exactly one token also ends decoding at that token."""
    args, plain, codec = pair
    text, tokens = plain["text"], plain["tokens"]
    multi = next(text[i:i + 4] for i in range(3, len(text) - 4)
                 if len(codec.tokenizer.encode(text[i:i + 4]).ids) > 1 and "\ufffd" not in text[i:i + 4])
    cut = _run(args, "--stop", multi)
    assert cut["text"] == text[:text.index(multi)] and cut["stats"]["finish_reason"] == "stop"
    assert cut["tokens"] == tokens[:len(cut["tokens"])] and len(cut["tokens"]) < len(tokens)
    assert cut["stats"]["new_tokens"] == len(cut["tokens"])  # decoding ended at the stop: its rate counts these
    single = next(t for t in tokens[2:] if codec.decode([t]).strip() and "\ufffd" not in codec.decode([t])
                  and len(codec.tokenizer.encode(codec.decode([t])).ids) == 1)
    word = codec.decode([single])
    stopped = _run(args, "--stop", word)
    assert stopped["text"] == text[:text.index(word)]
    assert stopped["tokens"] == tokens[:tokens.index(single) + 1]
    assert stopped["stats"]["new_tokens"] == tokens.index(single) + 1  # decoding ended at that token
    by_id = _run(args, "--stop-token-id", single)  # an id: the output ends after the token
    assert by_id["tokens"] == tokens[:tokens.index(single) + 1] and by_id["text"] == codec.decode(by_id["tokens"])


@pytest.mark.parametrize("extra, message", [
    (("--stop", "\udcff"), r"--stop '\udcff' is not valid text: it holds a lone surrogate (U+DCFF"),
    (("--stop", ""), "a stop string holds 1 to 1024 characters, got 0"),
    (("--stop", "x" * 1025), "a stop string holds 1 to 1024 characters, got 1025"),
    (tuple(a for i in range(17) for a in ("--stop", f"s{i}")), "at most 16 stop strings, got 17"),
    (("--stop-token-id", "²"), "--stop-token-id must be an integer"),
    (("--stop-token-id", 100_000), "--stop-token-id: 100000 is not a token id in 0.."),
])
def test_stops_that_cannot_be_used_are_refused_in_one_line(pair, extra, message):
    assert_one_line_error(trtspec_in_process(*pair[0], *extra), message)


def test_stop_bytes_that_are_not_utf8_in_argv(target_dir, drafter_dir, prompt_file):
    """The real entry point: argv's byte 0xff arrives as the lone surrogate U+DCFF (before: a
    UnicodeEncodeError traceback from the tokenizer)."""
    result = subprocess.run([sys.executable.encode(), b"-m", b"trtspec", b"run", str(prompt_file).encode(),
                             b"--target", str(target_dir).encode(), b"--drafter", str(drafter_dir).encode(),
                             b"--stop", b"\xff"], capture_output=True, timeout=120)
    assert_one_line_error(result, "is not valid text: it holds a lone surrogate (U+DCFF")


def test_prompts_that_are_not_text_are_refused_in_one_line(pair, tmp_path):
    """A JSON "\\ud800" escape in a --batch file (before: a TypeError traceback from the tokenizer),
    with --chat too, and a prompt file holding an encoded surrogate or invalid UTF-8."""
    args = [a for a in pair[0] if a != "--json"]
    batch = tmp_path / "prompts.jsonl"
    batch.write_text(json.dumps({"prompt": "def f():\n"}) + "\n" + json.dumps({"prompt": "x = '\ud800'"}) + "\n")
    for chat in ((), ("--chat",)):
        assert_one_line_error(trtspec_in_process("run", "--batch", batch, *args[2:], *chat))
    for name, data in (("surrogate.txt", b"x = '\xed\xa0\x80'\n"), ("latin1.txt", b"caf\xe9\n")):
        (tmp_path / name).write_bytes(data)
        assert_one_line_error(trtspec_in_process("run", tmp_path / name, *args[2:]), "is not valid UTF-8")


# -- the engine's output processor, as every front end uses it (GenerationConfig's stop, keep_stop, skip_special)

@pytest.fixture(scope="module")
def pipeline(target_dir, drafter_dir):
    from trtspec.api import Pipeline

    return Pipeline(target_dir, drafter_dir)


def _config(**options):
    from trtspec.runtime.request import GenerationConfig
    from trtspec.runtime.schedule import BlockChoice

    return GenerationConfig(block=BlockChoice(4), **{"max_new_tokens": 40, **options})


def test_keep_stop_ends_the_text_with_the_stop_string(pipeline):
    """vLLM's include_stop_str_in_output, in the engine: decoding ends at the stop as without it."""
    plain = pipeline.generate("def add(a, b):\n", _config())
    text = plain.text
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3) if "\ufffd" not in text[i:i + 3])
    cut = pipeline.generate("def add(a, b):\n", _config(stop=(stop,)))
    kept = pipeline.generate("def add(a, b):\n", _config(stop=(stop,), keep_stop=True))
    assert kept.text == text[:text.index(stop) + len(stop)] and kept.generation.stats.finish_reason == "stop"
    assert kept.tokens == cut.tokens and cut.text == text[:text.index(stop)]


def test_special_tokens_decode_to_their_text_only_when_asked(pipeline):
    from trtspec.runtime.processing import Processing

    eos = pipeline.codec.stop_ids[0]
    forced = dict(max_new_tokens=3, ignore_eos=True, processing=Processing(logit_bias=((eos, 100.0),)))
    assert pipeline.generate("def f():\n", _config(**forced)).text == ""
    shown = pipeline.generate("def f():\n", _config(skip_special=False, **forced))
    assert shown.tokens == [eos] * 3 and shown.text == pipeline.codec.decode([eos] * 3, skip_special_tokens=False)
