"""`trtspec serve` end to end: a real server subprocess on a free loopback port, the suite's tiny
target with the drafter trained for it (tests/conftest.py), driven by the official `openai` client
(and raw HTTP where a client would refuse to send the request). Every wait is bounded; servers are
stopped by PID."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import (LONG_PROMPT, LONG_TOKENS, SERVED_NAME, Server, assert_one_line_error, get, pair_args, post,
                     trtspec_in_process)
from trtspec import __version__

openai = pytest.importorskip("openai", reason="the serve tests need the [test] extra (openai)")
pytest.importorskip("uvicorn", reason="trtspec serve needs the [serve] extra")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

MODEL = SERVED_NAME
PROMPT = "y y else x return print"  # a code prompt held out from the drafter's training: drafts are accepted
MAX_TOKENS = 24


def metrics(server: Server) -> dict[tuple[str, tuple], float]:
    """/metrics parsed by prometheus_client: {(sample name, sorted labels): value}."""
    status, text = get(server.url + "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def series(name: str, **labels) -> tuple[str, tuple]:
    """A sample's key in `metrics()`: every series carries vLLM's model_name and engine labels."""
    return name, tuple(sorted({**labels, "model_name": MODEL, "engine": "0"}.items()))


# vLLM's families that dashboards read (docs.vllm.ai, "Production Metrics"), as sample names
VLLM_FAMILIES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "vllm:num_preemptions_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:time_per_output_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:request_queue_time_seconds_bucket", "vllm:request_inference_time_seconds_bucket",
                 "vllm:request_prefill_time_seconds_bucket", "vllm:request_decode_time_seconds_bucket",
                 "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
                 "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total"]


def wait_for(condition, what: str, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def codec(target_dir):
    from trtspec.tokenizer import TextCodec

    return TextCodec(target_dir)


@pytest.fixture(scope="module")
def eos_bias(codec) -> dict:
    """A logit bias that makes the EOS the target's likeliest token: the request ends at once (the
    tiny target never writes its EOS by itself)."""
    return {str(codec.stop_ids[0]): 100}


@pytest.fixture(scope="module")
def server(tmp_path_factory, target_dir, trained_drafter_dir):
    """The tiny pair with 8 slots (block size auto: the drafter's own BlockPilot policy)."""
    running = Server(tmp_path_factory.mktemp("serve") / "server.log", *pair_args(target_dir, trained_drafter_dir),
                     "--max-concurrency", 8, "--max-queued", 32)
    try:
        yield running
    finally:
        assert running.stop(signal.SIGINT) == 0, running.output()[-3000:]  # as Ctrl-C: exit 0, no traceback
        assert "Traceback" not in running.output(), running.output()[-3000:]


def _run_json(tmp_path_factory, target, drafter, *options) -> dict:
    """`trtspec run --json` of the pair on PROMPT."""
    prompt = tmp_path_factory.mktemp("prompt") / "prompt.txt"
    prompt.write_text(PROMPT)
    result = trtspec_in_process("--threads", 1, "run", prompt, "--target", target, "--drafter", drafter,
                                "--max-new-tokens", MAX_TOKENS, "--json", *options)
    assert result.returncode == 0, result.stderr.decode()
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, target_dir, trained_drafter_dir):
    """`trtspec run --json` on the same prompt: the greedy text and tokens the server must reproduce."""
    return _run_json(tmp_path_factory, target_dir, trained_drafter_dir)


@pytest.fixture(scope="module")
def chat_reference(tmp_path_factory, target_dir, trained_drafter_dir):
    """`trtspec run --chat --json`: PROMPT as a user message in the target's chat template."""
    return _run_json(tmp_path_factory, target_dir, trained_drafter_dir, "--chat")


def test_models_lists_the_served_name(server):
    assert [m.id for m in server.client.models.list().data] == [MODEL]


def test_health_answers_ok(server):
    assert get(server.url + "/health") == (200, '{"status":"ok"}')


def test_an_unknown_route_is_a_404_with_a_message(server):
    status, body = get(server.url + "/v1/nothing")
    assert status == 404 and json.loads(body)["error"]["message"]


def test_greedy_completion_equals_trtspec_run(server, reference):
    response = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    choice = response.choices[0]
    assert choice.text == reference["text"]
    assert choice.finish_reason == reference["stats"]["finish_reason"]
    assert response.usage.prompt_tokens == reference["stats"]["prompt_tokens"]
    assert response.usage.completion_tokens == len(reference["tokens"]) == reference["stats"]["new_tokens"]
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    assert set(response.model_extra["trtspec"]) == set(reference["stats"])  # one serialisation: DecodeStats.to_dict


def test_a_completion_carries_its_decode_statistics(server):
    response = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    extension = response.model_extra["trtspec"]
    assert extension["block_size_auto"] is True  # the drafter's own policy chose it
    assert extension["cycles"] == sum(extension["histogram"]) >= 1
    assert 1 <= extension["tau"] and 0 <= extension["ceiling_fraction"] <= 1


def test_the_block_size_field_sets_the_schedule_without_changing_greedy_text(server, reference):
    for block in ("8", "12:24", "AR"):
        response = server.client.completions.create(model=MODEL, prompt=PROMPT,
                                                    max_tokens=MAX_TOKENS, extra_body={"block_size": block})
        assert response.choices[0].text == reference["text"], block  # greedy is lossless at any block size
        extension = response.model_extra["trtspec"]
        assert extension["block_size"] == block and extension["block_size_auto"] is False
        assert len(extension["histogram"]) == {"8": 8, "12:24": 24, "AR": 1}[block]


def test_a_prompt_of_token_ids_completes_like_its_text(server, reference, codec):
    ids = server.client.completions.create(model=MODEL, prompt=[[int(t) for t in codec.encode(PROMPT)]],
                                           max_tokens=MAX_TOKENS)
    assert ids.choices[0].text == reference["text"]


def _log_softmax(target_dir, ids: list[int]):
    """Row i: log p(. | ids[:i + 1]) under the target (eager PyTorch), in float64."""
    import torch
    from trtspec.models import load_target

    with torch.no_grad():
        logits = load_target(target_dir)(torch.tensor([ids]), 0, None)[0][0]
    return torch.log_softmax(logits.double(), dim=-1)


def test_streamed_completion_pieces_join_to_the_greedy_text(server, reference):
    stream = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, stream=True,
                                              stream_options={"include_usage": True})
    chunks = list(stream)
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert len([p for p in pieces if p]) > 1 and "".join(pieces) == reference["text"]
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["trtspec"]["cycles"] >= 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(reference["tokens"])


def test_a_chat_completion_answers_through_the_chat_template(server, chat_reference):
    messages = [{"role": "user", "content": PROMPT}]
    whole = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == chat_reference["text"]  # through the same chat template
    assert whole.usage.completion_tokens == len(chat_reference["tokens"])


def test_streamed_chat_pieces_join_to_the_whole_reply(server):
    messages = [{"role": "user", "content": PROMPT}]
    whole = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS)
    streamed = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                     stream=True)
    chunks = list(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_a_stop_string_ends_the_text_before_it(server, reference):
    text = reference["text"]
    cut = text.index("(", 1) if "(" in text[1:] else len(text) // 2
    stop = text[cut:cut + 2]
    response = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, stop=[stop])
    assert response.choices[0].text == text[:text.index(stop)] and response.choices[0].finish_reason == "stop"
    streamed = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, stop=stop,
                                                stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == response.choices[0].text


def test_a_stop_token_id_ends_the_completion_at_that_token(server, reference):
    third = reference["tokens"][2]
    by_id = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                             extra_body={"stop_token_ids": [third]})
    assert by_id.usage.completion_tokens == reference["tokens"].index(third) + 1
    assert by_id.choices[0].finish_reason == "stop"


def test_sixteen_concurrent_streams_with_mixed_block_sizes(server, reference):
    blocks = ["auto", "AR", "8", "16", "12:24", "6:16", "24", "12"]

    def one(i: int) -> tuple[str, str | None, dict]:
        stream = server.client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=16 + i % 3 * 8, stream=True, temperature=0 if i % 2 else 0.8,
            seed=i, top_p=0.95, extra_body={"block_size": blocks[i % len(blocks)]})
        pieces, finish, extension = [], None, {}
        for chunk in stream:
            pieces.append(chunk.choices[0].text)
            if chunk.choices[0].finish_reason:
                finish, extension = chunk.choices[0].finish_reason, chunk.model_extra["trtspec"]
        return "".join(pieces), finish, extension

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16), timeout=300))
    for i, (text, finish, extension) in enumerate(results):
        assert finish in ("stop", "length") and extension["cycles"] >= 1, i
        if i % 2 and 16 + i % 3 * 8 == MAX_TOKENS:  # greedy, same length as the reference
            assert text == reference["text"], i


BAD_REQUESTS = [  # (route, body, status, the field named)
    ("completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("completions", {"prompt": "x"}, 400, "model"),
    ("completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("completions", {"model": MODEL, "prompt": "x", "seed": -3}, 400, "seed"),
    ("completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ("completions", {"model": MODEL, "prompt": "x", "block_size": "65"}, 400, "block_size"),
    ("completions", {"model": MODEL, "prompt": "x", "block_size": "16:8"}, 400, "block_size"),
    ("completions", {"model": MODEL, "prompt": "x", "block_size": "huge"}, 400, "block_size"),
    ("completions", {"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop"),
    ("completions", {"model": MODEL, "prompt": "x", "stop": {"a": 1}}, 400, "stop"),
    ("completions", {"model": MODEL, "prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream"),
    ("completions", {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("chat/completions", {"model": MODEL, "messages": [{"content": "x"}]}, 400, "messages"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages"),
]


EOS_PROMPT = "def f():\n    pass\n\n\nif __name__ == '__main__':\n    main()\n"  # ended at once by `eos_bias`


def test_ignore_eos_decodes_exactly_max_tokens(server, eos_bias):
    """vLLM's ignore_eos, which load tools use: a request the EOS would end at once runs to its limit."""
    stopped = server.client.completions.create(model=MODEL, prompt=EOS_PROMPT, max_tokens=30, temperature=0,
                                               logit_bias=eos_bias)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens < 30
    forced = server.client.completions.create(model=MODEL, prompt=EOS_PROMPT, max_tokens=30, temperature=0,
                                              logit_bias=eos_bias, extra_body={"ignore_eos": True})
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 30


def test_usage_counts_no_cached_prompt_tokens(server):
    """No prefix cache: vLLM's prompt_tokens_details says so, for clients that read it."""
    answer = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert answer.usage.prompt_tokens_details.cached_tokens == 0


def test_min_tokens_holds_the_eos_back(server, eos_bias):
    held = server.client.completions.create(model=MODEL, prompt=EOS_PROMPT, max_tokens=30, temperature=0,
                                            logit_bias=eos_bias, extra_body={"min_tokens": 6})
    assert held.usage.completion_tokens >= 6  # the EOS it would end with at once is held back


def test_continuous_usage_stats_put_the_running_counts_in_every_chunk(server):
    chunks = list(server.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 12 and counts[0] < 12
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}


def _tokenized(server) -> dict:
    status, tokenized = post(server.url + "/tokenize", {"model": MODEL, "prompt": PROMPT})
    assert status == 200
    return tokenized


def test_tokenize_counts_a_prompt_as_its_usage_does(server):
    """vLLM's /tokenize, which harnesses use to size prompts: the count a completion's usage reports."""
    tokenized = _tokenized(server)
    usage = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).usage
    assert tokenized["count"] == len(tokenized["tokens"]) == usage.prompt_tokens


def test_detokenize_gives_back_the_tokenized_prompt(server):
    assert post(server.url + "/detokenize", {"tokens": _tokenized(server)["tokens"]}) == (200, {"prompt": PROMPT})


def test_models_tell_the_max_model_len_tokenize_tells(server):
    assert server.client.models.list().data[0].max_model_len == _tokenized(server)["max_model_len"] > 1000


def test_version_is_the_package_version(server):
    assert json.loads(get(server.url + "/version")[1]) == {"version": __version__}


def test_the_utility_routes_refuse_a_bad_body_naming_the_field(server):
    assert post(server.url + "/detokenize", {"tokens": [10**9]})[1]["error"]["param"] == "tokens"
    assert post(server.url + "/tokenize", {"prompt": "x", "echo": 1})[1]["error"]["param"] == "echo"


def _text(server, prompt=PROMPT, stream=False, **fields) -> str:
    """A greedy completion's text; fields other than stop and max_tokens go in the body as vLLM's."""
    extra = {key: fields.pop(key) for key in list(fields) if key not in ("stop", "max_tokens")}
    reply = server.client.completions.create(model=MODEL, prompt=prompt, temperature=0, stream=stream,
                                             max_tokens=fields.get("max_tokens", MAX_TOKENS),
                                             stop=fields.get("stop"), extra_body=extra)
    return "".join(c.choices[0].text for c in reply) if stream else reply.choices[0].text


def test_include_stop_str_in_output_keeps_the_stop_at_the_end(server):
    """Streamed or not, as vLLM."""
    plain = _text(server)
    stop = plain[6:9]
    before = plain[:plain.index(stop)]
    assert _text(server, stop=[stop]) == before
    assert _text(server, stop=[stop], include_stop_str_in_output=True) == before + stop
    assert _text(server, stop=[stop], include_stop_str_in_output=True, stream=True) == before + stop


def test_skip_special_tokens_false_shows_the_special_tokens(server, eos_bias):
    """Here the EOS, which ignore_eos lets through."""
    hidden = _text(server, EOS_PROMPT, max_tokens=3, ignore_eos=True, logit_bias=eos_bias)
    shown = _text(server, EOS_PROMPT, max_tokens=3, ignore_eos=True, logit_bias=eos_bias, skip_special_tokens=False)
    assert "<|endoftext|>" in shown and "<|endoftext|>" not in hidden and shown.replace("<|endoftext|>", "") == hidden


def test_n_choices_are_independent_requests_with_derived_seeds(server):
    """n = 3 at T = 1 with a seed: three choices, choice i sampled like a single request with seed
    seed + i (so the answer reproduces), streamed or not; usage counts every choice's tokens."""
    def ask(n, seed, stream=False):
        return server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=seed,
                                                n=n, stream=stream, extra_body={"block_size": "8"})

    three = ask(3, 40)
    assert [c.index for c in three.choices] == [0, 1, 2]
    singles = [ask(1, 40 + i).choices[0].text for i in range(3)]
    assert [c.text for c in three.choices] == singles and len(set(singles)) > 1
    assert three.usage.completion_tokens == sum(ask(1, 40 + i).usage.completion_tokens for i in range(3))
    pieces = {0: [], 1: [], 2: []}
    finished = set()
    for chunk in ask(3, 40, stream=True):
        for choice in chunk.choices:
            pieces[choice.index].append(choice.text)
            if choice.finish_reason:
                finished.add(choice.index)
    assert ["".join(pieces[i]) for i in range(3)] == singles and finished == {0, 1, 2}


def test_more_than_16_choices_are_refused(server):
    assert post(server.url + "/v1/completions", {"model": MODEL, "prompt": "x", "n": 17})[1]["error"]["param"] == "n"


# vLLM's fields as the openai client sends them
COMMON = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}


def test_echoed_logprobs_are_the_targets_own(server, reference, codec, target_dir):
    """logprobs with echo cover the prompt's tokens too; each value and the top two equal the
    target's log-softmax in eager PyTorch."""
    whole = server.client.completions.create(**COMMON, logprobs=2, echo=True)
    prompt_tokens, completion_tokens = whole.usage.prompt_tokens, whole.usage.completion_tokens
    logprobs = whole.choices[0].logprobs
    assert whole.choices[0].text.startswith(PROMPT)
    assert len(logprobs.tokens) == prompt_tokens + completion_tokens == len(logprobs.token_logprobs)
    assert logprobs.token_logprobs[0] is None and all(v <= 0 for v in logprobs.token_logprobs[1:])
    assert "".join(logprobs.tokens[prompt_tokens:]) == whole.choices[0].text[len(PROMPT):]
    assert logprobs.text_offset[prompt_tokens] == len(PROMPT)
    ids = codec.encode(PROMPT)  # the target's own log-softmax over prompt and output, from eager PyTorch
    sequence = ids + reference["tokens"][:completion_tokens]  # greedy: the same tokens
    rows = _log_softmax(target_dir, sequence)
    assert len(ids) == prompt_tokens
    for position in range(1, prompt_tokens + completion_tokens):
        row = rows[position - 1]
        assert abs(logprobs.token_logprobs[position] - row[sequence[position]].item()) < 1e-4, position
        # the two likeliest, keyed by their text (a token holding part of a character shows U+FFFD,
        # so two such tokens can share a key, as in vLLM)
        top = row.topk(2)
        expected = {codec.decode([t], skip_special_tokens=False): v for t, v in zip(top.indices.tolist(),
                                                                                     top.values.tolist())}
        shown = logprobs.top_logprobs[position]
        assert shown.keys() == expected.keys(), position
        assert all(abs(shown[key] - expected[key]) < 1e-4 for key in expected), position


def test_streamed_logprobs_equal_the_unstreamed_ones(server):
    """The same values up to float32 rounding (a call's arithmetic can depend on the rows it batches,
    and the server may still be finishing an earlier test's request: one of session 33's four suite
    runs read 5e-7 apart on one token); the text is identical."""
    whole = server.client.completions.create(**COMMON, logprobs=2, echo=True)
    logprobs = whole.choices[0].logprobs
    streamed = list(server.client.completions.create(**COMMON, logprobs=2, echo=True, stream=True))
    pieces = [c.choices[0] for c in streamed if c.choices and c.choices[0].logprobs]
    values = [v for p in pieces for v in p.logprobs.token_logprobs]
    assert values == pytest.approx(logprobs.token_logprobs, abs=1e-5) and values[0] is None
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text


def test_chat_logprobs_list_the_top_logprobs_of_every_token(server):
    chat = server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                                 max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in content)
    assert all(e.top_logprobs[0].token == e.token for e in content)  # greedy: each token is the likeliest


def test_penalties_change_the_text_alike_under_speculation_or_ar(server):
    """Penalties, min_p and a bias act on the target's distribution: speculation stays lossless."""
    processed = {"frequency_penalty": 0.8, "presence_penalty": 0.4,
                 "extra_body": {"repetition_penalty": 1.2, "min_p": 0.1}, "logit_bias": {"15": 2.0}}
    outputs = {}
    for block in ("8", "AR"):
        body = dict(processed, extra_body={**processed["extra_body"], "block_size": block})
        outputs[block] = server.client.completions.create(**{**COMMON, "max_tokens": 24}, **body).choices[0].text
    assert outputs["8"] == outputs["AR"]
    assert outputs["AR"] != server.client.completions.create(**{**COMMON, "max_tokens": 24}).choices[0].text


def test_a_json_schema_answer_parses_as_that_schema_at_any_block_size(server):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                        "maxItems": 3}},
              "required": ["name", "tags"], "additionalProperties": False}
    answers = [server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A person as JSON:"}], max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
        extra_body={"block_size": block}) for block in ("8", "AR")]
    answer = answers[0]
    assert answer.choices[0].message.content == answers[1].choices[0].message.content
    value = json.loads(answer.choices[0].message.content)
    assert set(value) == {"name", "tags"} and len(value["tags"]) <= 3 and answer.choices[0].finish_reason == "stop"


def test_a_json_object_response_format_gives_an_object(server):
    anything = server.client.completions.create(**{**COMMON, "max_tokens": 60},
                                                extra_body={"response_format": {"type": "json_object"}})
    text = anything.choices[0].text  # any object: its strings are unbounded, so it may run to its limit
    assert text.startswith("{") and (anything.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict))


def test_chat_template_fields(ort_engine_dir, tmp_path):
    """chat_template_kwargs, add_generation_prompt and continue_final_message reach the chat template
    (the tiny pair's: <|role|>content lines, then <|assistant|> when a generation prompt is asked)."""
    running = Server(tmp_path / "server.log", "--engine", ort_engine_dir)
    try:
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "def"}]

        def rendered(**fields) -> str:
            status, body = post(running.url + "/tokenize", {"messages": messages, **fields})
            assert status == 200, body
            return post(running.url + "/detokenize", {"tokens": body["tokens"]})[1]["prompt"]

        assert rendered() == "<|user|>hi\n<|assistant|>def\n<|assistant|>"
        assert rendered(add_generation_prompt=False) == "<|user|>hi\n<|assistant|>def\n"
        assert rendered(continue_final_message=True, add_generation_prompt=False) == "<|user|>hi\n<|assistant|>def"
        assert rendered(chat_template_kwargs={"enable_thinking": False}) == rendered()  # a variable it does not read
        name = running.client.models.list().data[0].id
        reply = running.client.chat.completions.create(model=name, messages=messages, max_tokens=5, temperature=0,
                                                        extra_body={"continue_final_message": True,
                                                                    "add_generation_prompt": False})
        continued = post(running.url + "/tokenize", {"messages": messages, "continue_final_message": True,
                                                     "add_generation_prompt": False})[1]["count"]
        assert reply.usage.prompt_tokens == continued
    finally:
        assert running.stop() == 0, running.output()[-3000:]


@pytest.mark.parametrize("route, body, status, param", BAD_REQUESTS,
                         ids=[f"{i}-{param}" for i, (*_, param) in enumerate(BAD_REQUESTS)])
def test_a_bad_request_is_refused_naming_its_field(server, route, body, status, param):
    code, answer = post(f"{server.url}/v1/{route}", body)
    assert code == status, (body, answer)
    assert answer["error"]["param"] == param and answer["error"]["message"], (body, answer)


def test_a_body_that_is_not_json_is_refused(server):
    code, answer = post(f"{server.url}/v1/completions", b"{not json")
    assert code == 400 and "JSON" in answer["error"]["message"]


LONG_PROMPT_TEXT = "x = 1\n" * 1500  # more tokens than the target's context (4,096)


def test_a_prompt_longer_than_the_context_is_refused(server):
    with pytest.raises(openai.BadRequestError, match="prompt"):
        server.client.completions.create(model=MODEL, prompt=LONG_PROMPT_TEXT, max_tokens=4)


def test_a_chat_for_an_unknown_model_is_not_found(server):
    with pytest.raises(openai.NotFoundError):
        server.client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])


def test_the_server_serves_on_after_each_bad_request(server):
    """A refusal is its request's alone: the request after it is served as usual."""
    refused = [(route, body) for route, body, *_ in BAD_REQUESTS] + [
        ("completions", b"{not json"), ("completions", {"model": MODEL, "prompt": LONG_PROMPT_TEXT, "max_tokens": 4}),
        ("chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]})]
    for route, body in refused:
        assert post(f"{server.url}/v1/{route}", body)[0] >= 400, body
        ok = server.client.completions.create(model=MODEL, prompt="x = ", max_tokens=2)
        assert ok.choices[0].finish_reason in ("stop", "length")
    assert server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4).usage.completion_tokens == 4


def test_metrics_agree_with_the_responses(server):
    """Each counter's increase over five requests is what their responses' statistics add up to."""
    before = metrics(server)
    served = []
    for block, temperature in (("8", 0.0), ("12:24", 0.0), ("AR", 0.0), ("auto", 0.7), ("16", 0.7)):
        response = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, seed=5,
                                                    temperature=temperature, extra_body={"block_size": block})
        served.append((response, response.model_extra["trtspec"]))
    after = metrics(server)

    def delta(name, **labels):
        return after.get(series(name, **labels), 0.0) - before.get(series(name, **labels), 0.0)

    spec = [e for _, e in served if e["block_size"] != "AR"]
    histograms = [e["histogram"] for e in spec]
    assert delta("vllm:spec_decode_num_drafts_total") == sum(map(sum, histograms))
    assert delta("vllm:spec_decode_num_accepted_tokens_total") == sum(
        a * n for h in histograms for a, n in enumerate(h))
    for position in range(23):
        assert delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(position)) == sum(
            sum(h[position + 1:]) for h in histograms)
    def most_drafts(e):  # B-1 per cycle at B, G-1 per grown cycle at G; fewer where a cycle was narrowed
        size, _, grown = e["block_size"].partition(":")
        return (e["cycles"] - e["grown_cycles"]) * (int(size) - 1) + e["grown_cycles"] * (int(grown or 1) - 1)

    assert delta("vllm:spec_decode_num_draft_tokens_total") == sum(e["draft_tokens"] for e in spec)
    assert all(e["cycles"] <= e["draft_tokens"] <= most_drafts(e) for e in spec)
    assert any(e["draft_tokens"] < most_drafts(e) for e in spec)  # the CPU's draft width narrowed some
    for e in spec:
        if ":" not in e["block_size"] and [o["block_size"] for o in spec].count(e["block_size"]) == 1:
            assert delta("trtspec_spec_decode_ceiling_cycles_total", block_size=e["block_size"]) == e["histogram"][-1]
    for schedule in {e["block_size"] for e in spec}:
        assert delta("trtspec_spec_decode_copied_cycles_total", block_size=schedule) == sum(
            e["copied_cycles"] for e in spec if e["block_size"] == schedule)
    assert sum(e["copied_cycles"] for e in spec) > 0  # prompt lookup copied somewhere, so the counter was read
    # AR: the AR request, and the auto one if load-aware BlockPilot turned speculation off for it.
    assert delta("trtspec_spec_decode_cycles_total", block_size="AR") == sum(
        e["cycles"] for _, e in served if e["block_size"] == "AR")
    chosen = served[3][1]["block_size"]
    assert delta("trtspec_blockpilot_choices_total", block_size=chosen) == 1
    assert delta("vllm:generation_tokens_total") == sum(r.usage.completion_tokens for r, _ in served)
    assert delta("vllm:prompt_tokens_total") == sum(r.usage.prompt_tokens for r, _ in served)
    assert sum(delta("vllm:request_success_total", finished_reason=f) for f in ("stop", "length")) == 5
    assert delta("vllm:time_to_first_token_seconds_count") == 5
    assert delta("vllm:e2e_request_latency_seconds_count") == 5
    assert delta("vllm:request_generation_tokens_count") == 5 and delta("vllm:request_prefill_time_seconds_count") == 5
    # one observation per token after each request's first commit (which may hold several tokens)
    assert 0 < delta("vllm:inter_token_latency_seconds_count") <= sum(r.usage.completion_tokens - 1 for r, _ in served)
    assert after[series("trtspec_spec_decode_tau", block_size="8")] >= 1
    # the stranded estimate pools only requests that ran whole blocks: a narrowed one (the CPU's draft width)
    # is left out
    stranded = series("trtspec_spec_decode_stranded_tau_estimate", block_size="8")
    if any(e["block_size"] == "8" and e["draft_tokens"] < 7 * e["cycles"] for e in spec):
        assert after.get(stranded) == before.get(stranded)  # narrowed: left out of the estimate
    else:
        assert after[stranded] >= 1


def test_an_idle_server_reports_no_load(server):
    idle = metrics(server)
    assert idle[series("vllm:num_requests_running")] == 0 and idle[series("vllm:num_requests_waiting")] == 0
    assert idle[series("vllm:kv_cache_usage_perc")] == 0 and idle[series("vllm:num_preemptions_total")] == 0


def test_metrics_export_the_vllm_families_dashboards_read(server):
    """As vLLM's: the same names, and every series labelled with the served model's name."""
    server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"block_size": "8"})
    after = metrics(server)  # after a speculative request: the labelled series exist
    names = {name for name, _ in after}
    assert not [family for family in VLLM_FAMILIES if family not in names]
    assert all(dict(labels).get("model_name") == MODEL for _, labels in after)  # every series, as vLLM's


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory, target_dir, drafter_dir):
    """A server with one slot and one queue place: the queue fills at three requests."""
    running = Server(tmp_path_factory.mktemp("serve1") / "server.log", *pair_args(target_dir, drafter_dir),
                     "--max-concurrency", 1, "--max-queued", 1,
                     "--block-size", "AR", "--graceful-shutdown", 2)
    try:
        yield running
    finally:
        running.stop()


def _long_stream(server: Server):
    """A streaming request that would run for a long time (AR, LONG_TOKENS): its first chunk has arrived."""
    stream = server.client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=LONG_TOKENS, stream=True)
    iterator = iter(stream)
    next(iterator)
    return stream, iterator


def test_a_disconnect_frees_the_slot(one_slot):
    before = metrics(one_slot)
    stream, _ = _long_stream(one_slot)
    stream.close()  # the client goes away mid-stream
    key = series("trtspec_request_failure_total", reason="cancelled")
    wait_for(lambda: metrics(one_slot).get(key, 0) == before.get(key, 0) + 1, "the cancelled request", 20)
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": LONG_TOKENS}
    with pytest.raises(OSError):  # a non-streamed request whose client gives up after a second
        post(one_slot.url + "/v1/completions", body, timeout=1)
    wait_for(lambda: metrics(one_slot).get(key, 0) == before.get(key, 0) + 2, "the second cancelled request", 20)
    began = time.monotonic()
    ok = one_slot.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8)
    assert ok.usage.completion_tokens == 8 and time.monotonic() - began < 20


def test_a_full_queue_answers_429_until_it_drains(one_slot):
    """429 while the queue is full (one running, one waiting); once they are gone, served as usual."""
    running, _ = _long_stream(one_slot)
    waiting = one_slot.client.completions.with_raw_response.create(model=MODEL, prompt=LONG_PROMPT,
                                                                   max_tokens=LONG_TOKENS, stream=True)
    try:
        wait_for(lambda: metrics(one_slot)[series("vllm:num_requests_waiting")] == 1, "the queued request")
        with pytest.raises(openai.RateLimitError) as error:
            one_slot.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
        assert error.value.status_code == 429 and "queue" in error.value.message
    finally:
        running.close()
        waiting.http_response.close()
    wait_for(lambda: metrics(one_slot)[series("vllm:num_requests_running")] == 0
             and metrics(one_slot)[series("vllm:num_requests_waiting")] == 0, "both to be cancelled", 30)
    assert one_slot.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4).usage.completion_tokens == 4


def test_sigterm_stops_the_server_with_a_request_in_flight(one_slot):
    stream, iterator = _long_stream(one_slot)
    ended, raised = threading.Event(), []

    def drain():
        try:
            for _ in iterator:
                pass
        except Exception as exc:  # noqa: BLE001 - the server cancels it: that is the point
            raised.append(exc)
        ended.set()

    threading.Thread(target=drain, daemon=True).start()
    began = time.monotonic()
    assert one_slot.stop(signal.SIGTERM, timeout=30) == 0, one_slot.output()[-3000:]
    assert time.monotonic() - began < 20  # 2 s of grace, then the request is cancelled
    assert ended.wait(10), "the client's stream did not end"
    stream.close()
    # the grace period over, the request was cancelled and its stream ended with an error event
    assert len(raised) == 1 and isinstance(raised[0], openai.APIError) and "shutting down" in str(raised[0])
    assert "Traceback" not in one_slot.output(), one_slot.output()[-3000:]


def test_a_text_stop_cuts_the_stream_before_the_stop(codec):
    """No piece ever shows part of a stop: a possible beginning of one is held back."""
    from trtspec.tokenizer import TextStream as TextStops

    text = "def add(a, b):\n    return a + b\n"
    ids = codec.encode(text)
    for stop, expected in (("return", "def add(a, b):\n    "), (" + b\n", "def add(a, b):\n    return a"),
                           ("missing", text)):
        stops = TextStops(codec, (stop,))
        pieces = [stops.push([token]) for token in ids]
        pieces.append(stops.finish(ids))
        assert "".join(pieces) == expected, stop
        assert all(stop not in "".join(pieces[:i]) for i in range(len(pieces)))
        assert stops.stopped == (stop != "missing")


def test_accepted_per_position_counts_the_cycles_that_accept_past_it():
    from trtspec.serving.metrics import accepted_per_position

    assert accepted_per_position([2, 1, 0, 3]) == [4, 3, 3]  # position p: cycles accepting > p drafts


def _grown():
    """Statistics of a block of 4 that grew to 8 once, with two cycles at the ceiling."""
    from trtspec.runtime.stats import DecodeStats

    return DecodeStats(block_size=4, grow_to=8, histogram=[1, 0, 0, 2, 0, 0, 0, 1], grown_cycles=1, ceilings=2)


def test_serving_metrics_render_finished_requests_by_block_size():
    from trtspec.runtime.stats import DecodeStats
    from trtspec.serving.metrics import ServingMetrics

    served = ServingMetrics(model_name="m")
    served.observe_finished(_grown(), latency_s=0.5, ttft_s=0.1)
    served.observe_finished(DecodeStats(block_size=4, histogram=[0, 1, 0, 3], finish_reason="length", draft_tokens=12),
                            latency_s=1)
    served.observe_finished(DecodeStats(block_size=8, histogram=[2] + [0] * 7, draft_tokens=6), latency_s=1)  # narrowed
    served.observe_load(2, 3, (4, 4, 8))
    text = served.render().decode()
    assert 'trtspec_spec_decode_ceiling_cycles_total{block_size="4:8",engine="0",model_name="m"} 2.0' in text
    assert 'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0' in text
    assert 'trtspec_num_requests_running_by_block_size{block_size="4",engine="0",model_name="m"} 2.0' in text
    assert 'trtspec_spec_decode_stranded_tau_estimate{block_size="4",engine="0",model_name="m"}' in text
    assert 'trtspec_spec_decode_tau{block_size="8",engine="0",model_name="m"} 1.0' in text
    assert 'trtspec_spec_decode_stranded_tau_estimate{block_size="8"' not in text


def test_a_cycle_of_several_tokens_shares_its_latency_among_them():
    from trtspec.runtime.stats import DecodeStats
    from trtspec.serving.metrics import ServingMetrics

    served = ServingMetrics(model_name="m")
    # a request whose one cycle after its first token committed 4 tokens 20 ms later: 4 tokens of 5 ms each
    served.observe_finished(DecodeStats(block_size=4, new_tokens=5, finish_reason="length"), latency_s=0.1,
                            intervals=[(4, 0.02)])
    text = served.render().decode()
    assert 'vllm:inter_token_latency_seconds_bucket{engine="0",le="0.005",model_name="m"} 4.0' in text
    assert 'vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 4.0' in text


def test_serve_refuses_bad_options_before_loading():
    assert_one_line_error(trtspec_in_process("serve", "--max-concurrency", 0), "--max-concurrency")
    assert_one_line_error(trtspec_in_process("serve", "--block-size", 99), "--block-size")


def test_serve_refuses_a_busy_port_before_loading(target_dir, drafter_dir):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert_one_line_error(trtspec_in_process("serve", *pair_args(target_dir, drafter_dir), "--port", port),
                              f"cannot listen on 127.0.0.1:{port}")
