"""`trtspec serve --replicas 2` on a real Ray cluster on this machine.

The cluster is started as a separate process (`ray start --head`, two CPUs: one replica each; a
cluster joined over --ray-address, as in production), the server is deployed on it as a
subprocess, driven by the `openai` client, and everything is stopped by the test. One cluster
serves every test of the file. (Until 2026-12-04 a second node joined it, one replica per node:
its start-up cost the suite's time budget, and nothing the tests check relied on it.)
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="the Ray tests need the [test] extra (openai)")
pytest.importorskip("ray.serve", reason="trtspec serve --replicas needs the [ray] extra")

MODEL = "tiny"  # the tiny pair's served name (pair)
# the `ray` command of this interpreter's environment, activated or not
RAY = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray") or "ray"
PROMPTS = [f"def task_{i}(values):\n    " for i in range(32)]


def pair(target_dir, drafter_dir) -> list[str]:
    """The serve options of the suite's tiny pair, served as MODEL."""
    return ["--target", str(target_dir), "--drafter", str(drafter_dir), "--served-model-name", MODEL]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ray_start(*args: str, env: dict) -> int:
    """Start a node; its processes (GCS, raylet, workers, replicas) all stay in the process group of
    `ray start`, started in a session of its own: that group's id is returned."""
    start = subprocess.Popen([RAY, "start", "--num-cpus", "2", "--disable-usage-stats", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    output, _ = start.communicate(timeout=120)
    assert start.returncode == 0, output
    return start.pid


def ray_stop(group: int) -> None:
    """SIGKILL every process of the node, as `ray stop --force` does, and wait until they are gone
    (`ray stop` polls each of its three kinds of process for ~2 s after killing it: 7 s here)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster(target_dir, drafter_dir):
    """(the server's URL, the node's metrics URL, the server process)."""
    # short: Ray's unix sockets live under it, and a socket path is at most 107 bytes (pytest's are long)
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    # a home of its own: Ray keeps the cluster's auth token in ~/.ray, which an earlier cluster may have left
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": str(temp), "HOME": str(temp)}
    port, metrics = free_port(), free_port()
    node = ray_start("--head", "--port", str(port), "--include-dashboard", "false", "--metrics-export-port",
                     str(metrics), "--temp-dir", str(temp), env=env)
    server = None
    try:
        http = free_port()
        log = temp / "serve.log"
        server = subprocess.Popen([sys.executable, "-m", "trtspec", "--threads", "1", "serve", "--replicas", "2",
                                   *pair(target_dir, drafter_dir), "--ray-address", f"127.0.0.1:{port}", "--port",
                                   str(http)],
                                  stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + 240
        while "replicas on Ray Serve" not in log.read_text(errors="replace"):  # deployed and ready
            assert server.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.5)
        yield f"http://127.0.0.1:{http}", f"http://127.0.0.1:{metrics}/metrics", server
    finally:
        if server is not None and server.poll() is None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
        ray_stop(node)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(target_dir, drafter_dir):
    """Each prompt's greedy completion from one process (the engine `trtspec serve` runs)."""
    from trtspec.api import Pipeline
    from trtspec.runtime.request import GenerationConfig

    pipeline = Pipeline(target_dir, drafter_dir)
    config = GenerationConfig(block=pipeline.default_block, max_new_tokens=16)
    return [r.text for r in pipeline.generate_batch(PROMPTS, [config] * len(PROMPTS))]


def client(url: str) -> "openai.OpenAI":
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def replica_counts(metrics_url: str) -> dict[str, float]:
    """Finished requests per replica, from Ray's metrics export of the node."""
    counts = collections.Counter()
    with urllib.request.urlopen(metrics_url, timeout=30) as response:
        text = response.read().decode()
    for match in re.finditer(r'^ray_vllm_request_success_total\{([^}]*)\} (\S+)$', text, re.M):
        replica = re.search(r'replica="([^"]+)"', match.group(1)).group(1)
        counts[replica] += float(match.group(2))
    return counts


def test_two_replicas_serve_32_concurrent_requests_as_one_process_would(reference, cluster):
    """Both replicas take a share (their own metrics count it), and every answer is one process's."""
    # `reference` first: what each replica must answer, decoded by one process (a pair with a BlockPilot
    # policy would time its cost table there, and the replicas would read it from the suite's cache)
    url, metrics_url, _ = cluster
    api = client(url)

    def one(index: int):
        answer = api.completions.create(model=MODEL, prompt=PROMPTS[index], max_tokens=16, temperature=0)
        return answer.choices[0].text, answer.model_extra["trtspec"]["replica"]["id"]

    threads, answers = [], [None] * len(PROMPTS)
    for index in range(len(PROMPTS)):
        threads.append(threading.Thread(target=lambda i=index: answers.__setitem__(i, one(i))))
        threads[-1].start()
    for thread in threads:
        thread.join(300)
    assert [text for text, _ in answers] == reference
    served = collections.Counter(replica for _, replica in answers)
    assert len(served) == 2, served
    deadline = time.monotonic() + 30  # the replicas mirror their metrics into Ray's every 2 s
    while time.monotonic() < deadline and not all(replica_counts(metrics_url).get(r, 0) >= n for r, n in served.items()):
        time.sleep(1)
    counts = replica_counts(metrics_url)
    assert all(counts[replica] >= n for replica, n in served.items()), (counts, served)


def test_serving_survives_a_killed_replica(cluster, reference):
    """The other replica answers meanwhile, no answer is cut short looking complete, and Ray restarts
    the killed one: one kill, the costly part, shows all three."""
    url, _, server = cluster
    api, pids = client(url), {}
    deadline = time.monotonic() + 60
    while len(pids) < 2 and time.monotonic() < deadline:  # concurrent requests reach both replicas
        answers = []
        threads = [threading.Thread(target=lambda: answers.append(
            api.completions.create(model=MODEL, prompt="x", max_tokens=8).model_extra["trtspec"]["replica"]))
            for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        pids.update({replica["id"]: replica["pid"] for replica in answers})
    assert len(pids) == 2, pids
    victim = sorted(pids)[0]
    results: dict[int, tuple] = {}

    def stream(index: int) -> None:
        text, replica, done = "", None, False
        try:
            for chunk in api.completions.create(model=MODEL, prompt=PROMPTS[index], max_tokens=16, temperature=0,
                                                stream=True, extra_body={"block_size": "AR"}):
                if chunk.choices:
                    text += chunk.choices[0].text
                    extension = chunk.model_extra.get("trtspec") or {}
                    replica, done = extension.get("replica", {}).get("id", replica), bool(chunk.choices[0].finish_reason)
            results[index] = ("ok" if done else "cut", text, replica)
        except openai.APIError as error:  # what the client sees is the result
            results[index] = ("error", str(error), replica)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    os.kill(pids[victim], signal.SIGKILL)
    deadline = time.monotonic() + 180
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads)  # nothing hangs
    assert len(results) == 8, results
    for index, (state, text, replica) in results.items():
        # no answer is cut short looking complete: it finishes (on its replica, or retried on the other
        # when nothing had been sent yet) or ends with the replica's error event
        assert state in ("ok", "error"), (index, state, text)
        if state == "ok":  # a finished answer is the right one, whichever replica gave it
            assert text == reference[index], (index, replica)
        else:
            assert "replica serving this request stopped" in text and replica in (victim, None), (index, text)
    assert any(state == "ok" and replica != victim for state, _, replica in results.values()), results
    # Ray restarts the replica: two replicas answer again, one of them new
    deadline, seen = time.monotonic() + 120, set()
    while time.monotonic() < deadline and len(seen - {victim}) < 2:
        answers = []

        def ask() -> None:
            try:
                answers.append(api.completions.create(model=MODEL, prompt="x", max_tokens=8))
            except openai.APIError:
                pass
        threads = [threading.Thread(target=ask) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        seen |= {answer.model_extra["trtspec"]["replica"]["id"] for answer in answers}
        time.sleep(0.5)
    assert len(seen - {victim}) == 2, seen
    assert server.poll() is None


def test_a_bad_engine_directory_is_one_line_before_any_deployment(tmp_path):
    from helpers import assert_one_line_error, trtspec_in_process

    result = trtspec_in_process("serve", "--replicas", "2", "--engine", tmp_path / "nothing")
    assert_one_line_error(result, "nothing")


def test_a_ray_address_without_replicas_is_one_line():
    from helpers import assert_one_line_error, trtspec_in_process

    assert_one_line_error(trtspec_in_process("serve", "--ray-address", "127.0.0.1:1"), "go with --replicas N")


def test_the_serve_deploy_config_builds_the_same_application(tmp_path, target_dir, drafter_dir):
    """--ray-config writes what `serve deploy` needs; its import path builds the application from it."""
    from helpers import trtspec_in_process
    from trtspec.serving.ray_serve import app_builder

    config = tmp_path / "serve.json"
    result = trtspec_in_process("serve", *pair(target_dir, drafter_dir), "--replicas", "3", "--replica-gpus", "1",
                                "--max-concurrency", "4", "--block-size", "4:8", "--ray-config", config)
    assert result.returncode == 0, result.stderr.decode()
    application = json.loads(config.read_text())["applications"][0]
    assert application["import_path"] == "trtspec.serving.ray_serve:app_builder"
    assert application["deployments"][0]["num_replicas"] == 3
    assert application["deployments"][0]["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert application["args"]["options"]["block_size"] == "4:8"  # text in the file, a BlockChoice on the replicas
    built = app_builder(application["args"])
    assert type(built).__name__ == "Application"


def _carrying(tag: str) -> list[int]:
    """The processes whose environment holds `tag`: a server's and every process of its cluster."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if tag.encode() in Path(f"/proc/{pid}/environ").read_bytes():
                found.append(int(pid))
    return found


def test_sigterm_while_deploying_stops_the_local_cluster_it_started(target_dir, drafter_dir):
    """Issue 57, Build 7: SIGTERM while `serve --replicas` started its own cluster and deployed
    printed Ray's stack dump, aborted, and could leave the cluster's agents running. Now: exit 0, no
    Ray lines, and no process of that cluster left."""
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's socket paths
    tag = f"trtspec-test-{os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": str(temp), "HOME": str(temp), "TEST_TAG": tag}
    server = subprocess.Popen([sys.executable, "-m", "trtspec", "--threads", "1", "serve", "--replicas", "1",
                               *pair(target_dir, drafter_dir), "--port", "0"], stdout=open(temp / "serve.log", "wb"),
                              stderr=subprocess.STDOUT,
                              env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while "deploying 1 replicas" not in (temp / "serve.log").read_text(errors="replace"):
            assert server.poll() is None and time.monotonic() < deadline, (temp / "serve.log").read_text()
            time.sleep(0.1)
        time.sleep(3)  # the cluster is starting, its agents with it
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0
        output = (temp / "serve.log").read_text(errors="replace")
        assert "SIGTERM received" not in output and "Traceback" not in output and "(raylet)" not in output, output
        assert _carrying(tag) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        for pid in _carrying(tag):  # what an old trtspec left (Ray's workers leave the process group)
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


def test_more_replicas_than_the_machine_has_cpus_for_is_one_line(target_dir, drafter_dir):
    """Issue 57, Build 7: a local cluster cannot place more replicas than its CPUs / --replica-cpus
    (Ray waited for ever); one line, before Ray starts."""
    from helpers import assert_one_line_error, trtspec_in_process
    from trtspec.limits import cpu_cores

    cores = cpu_cores()
    assert_one_line_error(trtspec_in_process("serve", *pair(target_dir, drafter_dir), "--replicas", 2,
                                             "--replica-cpus", cores),
                          f"--replicas 2 needs {2 * cores} CPUs", f"this machine has {cores}, room for 1")
