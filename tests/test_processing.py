"""vLLM's per-position processing, exact logprobs and structured output, through the engine.

Greedy: speculative output equals AR output under the same processing, token for token, and both
equal a plain oracle that recomputes the whole sequence at every step and processes its logits
written out directly (the statistical checks at T = 1 are in test_sampling.py). Logprobs equal the
target's own log-softmax over the whole sequence, prompt and output. A JSON schema's grammar gives
JSON of that schema, the same speculatively as autoregressively.
"""

import ctypes
import json

import pytest
import torch

from helpers import processed_logits
from trtspec.api import Pipeline
from trtspec.runtime.processing import Processing
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.schedule import BlockChoice

PROMPT = "def fibonacci(n):"
SIZES = (BlockChoice(1), BlockChoice(8), BlockChoice(16))


@pytest.fixture(scope="module")
def pair(target_dir, trained_drafter_dir):
    """The tiny target and a drafter trained for it: drafts are accepted (on PROMPT too)."""
    return Pipeline(target_dir, trained_drafter_dir)


def oracle_greedy(target, prompt: list[int], count: int, processing: Processing) -> list[int]:
    """AR decoding by full recomputation, every position processed given the output before it."""
    output: list[int] = []
    with torch.no_grad():
        for _ in range(count):
            logits = target(torch.tensor([prompt + output]), 0, None)[0][0, -1]
            output.append(int(processed_logits(logits, prompt, output, processing).argmax()))
    return output


@pytest.mark.parametrize("processing", [Processing(repetition_penalty=1.3),
                                        Processing(frequency_penalty=0.8, presence_penalty=0.5),
                                        # (a bias of 2 would send the tiny target into a loop of token 15 that
                                        # its drafter never saw: no draft accepted)
                                        Processing(logit_bias=((15, 0.5), (222, -100.0)), presence_penalty=-0.3)],
                         ids=["repetition", "frequency+presence", "bias+negative-presence"])
def test_greedy_processing_is_lossless_and_matches_the_oracle(pair, processing):
    ids = pair.codec.encode(PROMPT)
    plain = pair.generate(PROMPT, GenerationConfig(block=BlockChoice(8), max_new_tokens=32)).tokens
    outputs = {c.name: pair.generate(PROMPT, GenerationConfig(block=c, max_new_tokens=32, processing=processing,
                                                              ignore_eos=True)).generation
               for c in SIZES}
    ar = outputs["AR"].tokens
    assert ar != plain  # the processing changes the output
    assert ar == oracle_greedy(pair.target, ids, 32, processing)
    assert outputs["8"].tokens == ar and outputs["16"].tokens == ar
    assert sum(outputs["16"].stats.histogram[1:]) > 0  # drafts were accepted under the processing


def test_logprobs_are_the_targets_own_for_output_and_prompt(pair):
    """Logprobs of output tokens (with the top 3) and of a prompt longer than the prefill returns
    logits for at once (so it is prefilled in several chunks), alone and in a batch."""
    prompt = "import os\nimport sys\n\n\ndef main(argv):\n    " * 6 + "'''Parse the arguments.'''\n"
    ids = pair.codec.encode(prompt)
    assert len(ids) > 64 + 10
    config = GenerationConfig(block=BlockChoice(8), max_new_tokens=24, logprobs=3, prompt_logprobs=2)
    alone = pair.generate(prompt, config).generation
    batch = [r.generation for r in pair.generate_batch([prompt, PROMPT], [config, config], max_running=2)]
    with torch.no_grad():
        logits = pair.target(torch.tensor([ids + alone.tokens]), 0, None)[0][0]
    expected = torch.log_softmax(logits.double(), dim=-1)
    for generation in (alone, batch[0]):
        assert generation.tokens == alone.tokens
        assert [e.token for e in generation.logprobs] == alone.tokens
        for position, entry in enumerate(generation.logprobs):
            row = expected[len(ids) - 1 + position]
            assert entry.logprob == pytest.approx(row[entry.token].item(), abs=1e-4)
            assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()  # greedy: the chosen is the first
            assert entry.top[0][0] == entry.token
        prompt_entries = generation.prompt_logprobs
        assert len(prompt_entries) == len(ids) and prompt_entries[0] is None
        for position in range(1, len(ids)):
            entry = prompt_entries[position]
            assert entry.token == ids[position] and len(entry.top) == 2
            assert entry.logprob == pytest.approx(expected[position - 1][ids[position]].item(), abs=1e-4)
    assert len(batch[1].logprobs) == len(batch[1].tokens) and batch[1].prompt_logprobs[0] is None


def test_a_json_schema_gives_that_json_speculatively_and_autoregressively(pair):
    from trtspec.runtime.grammar import grammar_tokenizer, response_format_grammar

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "size": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["name", "size"], "additionalProperties": False}
    grammar = response_format_grammar({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
                                      grammar_tokenizer(pair.codec, pair.target.config.vocab_size))
    outputs = [pair.generate(PROMPT, GenerationConfig(block=c, max_new_tokens=64, processing=Processing(grammar=grammar)))
               for c in SIZES]
    assert outputs[1].tokens == outputs[0].tokens and outputs[2].tokens == outputs[0].tokens
    value = json.loads(outputs[0].text)
    assert set(value) == {"name", "size"} and isinstance(value["size"], int) and len(value["name"]) <= 12
    assert outputs[0].generation.stats.finish_reason == "stop"  # the grammar ended it with EOS


class _GivingUp:
    """A grammar whose matcher allows every token and gives up once its request has committed
    `after` tokens (what a grammar engine that hits one of its limits mid-request looks like)."""

    forced = 0

    def __init__(self, after: int):
        self.after = after

    def matcher(self):
        return _GivingUpMatcher(self.after)


class _GivingUpMatcher:
    def __init__(self, after: int):
        self.after, self.seen = after, 0

    def consume_tokens(self, tokens) -> bool:
        self.seen += len(tokens)
        return self.seen < self.after

    def is_error(self) -> bool:
        return self.seen >= self.after

    def get_error(self) -> str:
        return "lexer error: too many expressions constructed\n<state>\n" + "parser state\n" * 1000

    def validate_tokens(self, tokens) -> int:
        return len(tokens)

    def consume_token(self, token) -> bool:
        return True

    def rollback(self, count: int) -> bool:
        return True

    def unsafe_compute_mask_ptr(self, pointer: int, size: int) -> None:
        ctypes.memset(pointer, 0xFF, size)


def test_a_requests_own_grammar_error_ends_that_request_alone(pair):
    """Issue 57, Build 1: a request whose grammar fails mid-decode, beside two plain ones in one batch
    (speculative, sampled, AR): it ends with its own one-line error, the others decode as alone."""
    from dataclasses import replace

    from trtspec.errors import TrtspecError
    from trtspec.runtime.engine import EngineConfig
    from trtspec.runtime.sampling import SamplingConfig

    ids = pair.codec.encode(PROMPT)
    local = pair.stepped_engine(EngineConfig(max_running=4), load_aware=False)
    plain = [GenerationConfig(block=BlockChoice(8), max_new_tokens=16, ignore_eos=True),
             GenerationConfig(block=BlockChoice(1), max_new_tokens=16, ignore_eos=True,
                              sampling=SamplingConfig(temperature=1.0, seed=5))]
    alone = [pair.generate(PROMPT, config).tokens for config in plain]
    for block in (BlockChoice(8), BlockChoice(1)):
        failing = replace(plain[0], block=block, processing=Processing(grammar=_GivingUp(after=3)))
        requests = [local.submit(ids, config) for config in (plain[0], failing, plain[1])]
        while local.busy:
            local.step()
        with pytest.raises(TrtspecError, match="too many expressions constructed") as refused:
            requests[1].result()
        assert "\n" not in str(refused.value)
        assert [requests[0].result().tokens, requests[2].result().tokens] == alone
