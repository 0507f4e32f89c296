"""rewards/remote.py: the `remote` reward over HTTP against real local servers (port 0, in threads).

Remote scores are compared with the same reward scored in-process, and with numbers worked out by hand.
"""

from __future__ import annotations

import http.client
import http.server
import json
import logging
import math
import os
import pickle
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from safetensors.torch import save as safetensors_save

import rewards
from rewards import Reward, RewardBatch, RewardError, RewardSet, load_reward
from rewards.remote import SAFETENSORS_TYPE, RemoteReward, decode_request, encode_batch, serve_reward


class TextScore(Reward):
    """len(text) + 0.5 * len(prompt) + the `bonus` column; NaN for an empty text. Counts its calls."""

    needs = {"texts"}

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, batch: RewardBatch) -> list[float]:
        self.sizes.append(len(batch))
        self.last_metrics = {"calls": float(len(self.sizes))}
        bonus = batch.columns.get("bonus", [0.0] * len(batch))
        return [
            math.nan if not t else len(t) + 0.5 * len(p) + b
            for t, p, b in zip(batch.texts, batch.prompts, bonus, strict=True)
        ]


class RedMinusBlue(Reward):
    """Mean of the red channel minus the mean of the blue one, times the `scale` column."""

    needs = {"images"}

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        images = batch.outputs["images"]
        scale = torch.tensor(batch["scale"], dtype=torch.float32)
        return (images[:, 0].mean(dim=(1, 2)) - images[:, 2].mean(dim=(1, 2))) * scale


@pytest.fixture
def serve() -> Iterator[Any]:
    """serve(reward) -> url of a server scoring with `reward`; every server is stopped afterwards."""
    servers: list[Any] = []

    def start(reward: Reward) -> str:
        server = serve_reward(reward)
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/score"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def raw_server() -> Iterator[Any]:
    """raw_server(status, body, content_type) -> url of a server answering every POST with exactly that."""
    servers: list[Any] = []

    def start(status: int, body: bytes, content_type: str) -> str:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def text_batch() -> RewardBatch:
    return RewardBatch(
        prompts=["ab", "abcd", "", "xy"],
        outputs={"texts": ["hello", "", "abc", "z"]},
        columns={"bonus": [1.0, 2.0, 3.0, 4.0]},
    )


def remote_error(reward: Reward, batch: RewardBatch) -> str:
    with pytest.raises(RewardError) as info:
        reward(batch)
    return str(info.value)


# --------------------------------------------------------------------------- round trips
def test_json_round_trip_equals_in_process_scoring(serve) -> None:
    served = TextScore()
    url = serve(served)
    remote = load_reward("remote", url=url, fields=["prompts", "texts", "bonus"])
    assert isinstance(remote, RemoteReward) and remote.needs == {"texts", "bonus"}
    batch = text_batch()
    got = remote(batch)
    # hello: 5 + 0.5 * 2 + 1 = 7; "": NaN (null on the wire); abc: 3 + 0 + 3 = 6; z: 1 + 1 + 4 = 6
    assert got.dtype == torch.float32
    assert got[[0, 2, 3]].tolist() == [7.0, 6.0, 6.0] and math.isnan(got[1].item())
    expected = torch.tensor(TextScore()(batch), dtype=torch.float32)
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got.nan_to_num(), expected.nan_to_num())
    assert remote.last_metrics == {"calls": 1.0}  # the server's reward metrics come back
    assert served.sizes == [4]


def test_safetensors_round_trip_with_an_image_tensor(serve) -> None:
    url = serve(RedMinusBlue())
    images = torch.rand(3, 3, 5, 4, generator=torch.Generator().manual_seed(0))
    images[1, 0], images[1, 2] = 0.75, 0.25  # red 0.75, blue 0.25, scale 2 -> exactly 1.0
    batch = RewardBatch(
        prompts=["a", "b", "c"], outputs={"images": images}, columns={"scale": [1.0, 2.0, -1.0]}
    )
    remote = load_reward("remote", url=url, payload="safetensors", fields=["images", "scale"])
    got = remote(batch)
    assert got[1].item() == 1.0
    assert torch.equal(got, RedMinusBlue()(batch))
    # JSON cannot carry the tensor: a clear error before anything is sent
    as_json = load_reward("remote", url=url, fields=["images"])
    msg = remote_error(as_json, batch)
    assert url in msg and "field 'images' is a tensor" in msg and "payload: safetensors" in msg


def test_wire_format_decodes_back_to_the_batch() -> None:
    images = torch.arange(24, dtype=torch.float32).reshape(2, 3, 2, 2)
    outputs = {"images": images, "texts": ["x", "y"], "scale": 3.0}  # a batch-wide value too
    batch = RewardBatch(prompts=["p", "q"], outputs=outputs, columns={"k": [1, 2]})
    body, content_type = encode_batch(batch, ["prompts", "images", "texts", "scale", "k"], "safetensors")
    assert content_type == SAFETENSORS_TYPE
    back = decode_request(body, content_type)
    assert back.prompts == ["p", "q"] and back.texts == ["x", "y"] and back.columns == {"k": [1, 2]}
    assert back.outputs["scale"] == 3.0
    assert torch.equal(back.outputs["images"], images)
    body, content_type = encode_batch(batch, ["texts"], "json")
    assert json.loads(body) == {"batch_size": 2, "outputs": {"texts": ["x", "y"]}, "columns": {}}
    assert decode_request(body, content_type).prompts == ["", ""]  # prompts not sent


# ------------------------------------------------------------------------ bad responses
@pytest.mark.parametrize(
    ("status", "body", "content_type", "message"),
    [
        (200, b'{"rewards": [1.0, null, 2.5]}', "application/json", None),
        (200, b'{"rewards": [1.0, 2.0]}', "application/json", "returned 2 rewards for a batch of 3"),
        (500, b"Traceback: model exploded " + b"x" * 300, "text/plain", "HTTP 500"),
        (200, pickle.dumps({"rewards": [1.0, 2.0, 3.0]}), "application/python-pickle", "refusing to decode"),
        (200, b"\x80\x04garbage", "application/octet-stream", "refusing to decode"),
        (200, b"not json", "application/json", "bad response"),
        (200, b'{"rewards": [1.0, "a", 2.0]}', "application/json", "'rewards'[1] is 'a'"),
    ],
    ids=["nulls", "wrong-length", "http-500", "pickle", "octet-stream", "bad-json", "non-number"],
)
def test_responses(raw_server, status: int, body: bytes, content_type: str, message: str | None) -> None:
    url = raw_server(status, body, content_type)
    remote = load_reward("remote", url=url, fields=["texts"])
    batch = RewardBatch(prompts=["a", "b", "c"], outputs={"texts": ["1", "2", "3"]})
    if message is None:  # null is NaN
        got = remote(batch)
        assert got[0].item() == 1.0 and math.isnan(got[1].item()) and got[2].item() == 2.5
        return
    msg = remote_error(remote, batch)
    assert url in msg and message in msg
    if status == 500:  # the first 200 characters of the body, not more
        assert "Traceback: model exploded" in msg and "x" * 170 in msg and "x" * 190 not in msg


def test_a_server_that_never_answers_times_out() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)  # connections are accepted by the kernel, and nothing ever answers
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/"
        remote = load_reward("remote", url=url, timeout_s=0.3)
        msg = remote_error(remote, RewardBatch(prompts=["a"], outputs={"texts": ["x"]}))
        assert url in msg and "no answer within timeout_s = 0.3 s" in msg
    finally:
        listener.close()


def test_a_refused_connection() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    url = f"http://127.0.0.1:{port}/"
    remote = load_reward("remote", url=url, retries=2, retry_backoff_s=0.01)
    msg = remote_error(remote, RewardBatch(prompts=["a"], outputs={"texts": ["x"]}))
    assert url in msg and "connection refused" in msg and "gave up after 3 attempt(s)" in msg


def test_the_server_refuses_pickle_and_reports_reward_failures(serve) -> None:
    url = serve(TextScore())
    request = urllib.request.Request(
        url,
        data=pickle.dumps({"texts": ["x"]}),
        method="POST",
        headers={"Content-Type": "application/python-pickle"},
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    assert info.value.code == 415
    # a reward failing on the server side: HTTP 500 with its error, named by the client with the url
    remote = load_reward("remote", url=url, fields=["prompts"])  # no texts: the served reward raises
    msg = remote_error(remote, RewardBatch(prompts=["a"], outputs={"texts": ["x"]}))
    assert url in msg and "HTTP 500" in msg and "texts" in msg


# ------------------------------------------------------------------------ with RewardSet
def test_batch_size_splits_into_several_requests(serve) -> None:
    served = TextScore()
    url = serve(served)
    spec = {
        "name": "remote",
        "kwargs": {"url": url, "fields": ["prompts", "texts", "bonus"]},
        "batch_size": 3,
    }
    rs = RewardSet([spec])
    batch = RewardBatch(
        prompts=["p"] * 7, outputs={"texts": ["a" * i for i in range(1, 8)]}, columns={"bonus": [0.0] * 7}
    )
    got = rs(batch)[:, 0]
    assert served.sizes == [3, 3, 1]  # three HTTP requests reached the server
    assert got.tolist() == [i + 0.5 for i in range(1, 8)]  # len + 0.5 * len("p")
    # the metrics of the three calls ("calls" = 1, 2, 3) combined weighted by size: (3 + 6 + 3) / 7
    assert rs.last_metrics["reward/remote/calls"] == pytest.approx(12 / 7)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"url": "file:///etc/passwd"}, "url must be an http:// or https:// URL"),
        ({"url": "http://x", "payload": "pickle"}, "payload must be 'json' or 'safetensors'"),
        ({"url": "http://x", "per_step": True}, "per_step is not supported"),
        ({"url": "http://x", "timeout_s": 0}, "timeout_s must be a number of seconds > 0"),
        ({"url": "http://x", "fields": []}, "fields must be a non-empty list"),
    ],
)
def test_bad_options_name_the_key(kwargs: dict[str, Any], message: str) -> None:
    from mmalign.config import ConfigError

    with pytest.raises(ConfigError) as info:
        RewardSet([{"name": "remote", "kwargs": kwargs}], source="run.yaml")
    assert str(info.value).startswith("run.yaml: key 'rewards[0].kwargs': ") and message in str(info.value)
    with pytest.raises(ConfigError, match=r"key 'rewards\[0\]\.device'.*'remote' takes no `device`"):
        RewardSet([{"name": "remote", "kwargs": {"url": "http://x"}, "device": "cpu"}], source="run.yaml")


def test_registered_and_listed() -> None:
    assert rewards.get("remote") is RemoteReward
    assert "remote" in rewards.names()
    with pytest.raises(ValueError, match="per-step"):
        serve_reward(rewards.SamplerProcessReward())


def test_the_serve_command_checks_its_arguments(capsys) -> None:
    from rewards.remote import main

    with pytest.raises(SystemExit) as info:
        main(["--reward", "overlong", "--device", "cuda:1"])
    assert info.value.code == 2 and "reward 'overlong' takes no `device` option" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--reward", "jpeg_compressibility", "--device", "cpu", "--kwargs", '{"device": "cpu"}'])
    assert "given twice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--reward", "format", "--kwargs", "[1]"])
    assert "--kwargs must be a JSON object" in capsys.readouterr().err
    assert main(["--reward", "no_such_reward"]) == 2
    assert "unknown reward 'no_such_reward'" in capsys.readouterr().err


# =========================================================================== hardening (issue 23)
TOKEN_ENV = "MMALIGN_TEST_REWARD_TOKEN"
SECRET = "s3cret-token-for-tests-only"
ONE = RewardBatch(prompts=["a"], outputs={"texts": ["x"]})


def proc_status(pid: int, key: str) -> int:
    """A number from /proc/<pid>/status (VmRSS in kB, Threads)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def rss_mb(pid: int) -> float:
    return proc_status(pid, "VmRSS") / 1024


def post(url: str, body: bytes, headers: dict[str, str], timeout: float = 10.0) -> tuple[int, dict, bytes]:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("POST", parts.path or "/", body=body, headers=headers)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def json_headers(token: str | None = SECRET) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, bool]:
    """(what the peer sent, whether it closed the connection within `limit_s`)."""
    sock.settimeout(limit_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        return data, False
    except ConnectionResetError:
        pass
    return data, True


@pytest.fixture(scope="module")
def proc_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """(url, pid) of `python -m rewards.remote` in a subprocess with a token and small limits, for the
    tester's probes; its memory is read from /proc/<pid>/status."""
    if not os.path.exists("/proc/self/status"):
        pytest.skip("needs /proc")
    log = tmp_path_factory.mktemp("server") / "stderr.log"
    env = {**os.environ, TOKEN_ENV: SECRET, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "rewards.remote", "--reward", "format", "--kwargs", '{"pattern": "a.*"}',
        "--port", "0", "--token-env", TOKEN_ENV, "--max-body-mb", "8", "--read-timeout-s", "1",
        "--keep-alive-s", "1", "--queue-timeout-s", "2", "--quiet",
    ]  # fmt: skip
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=err)
    try:
        line = proc.stdout.readline().decode() if proc.stdout else ""
        match = re.search(r"at (http://\S+/)", line)
        assert match, f"no address in {line!r}; stderr: {log.read_text()[-2000:]}"
        assert SECRET not in line
        yield match.group(1) + "score", proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert SECRET not in log.read_text()  # the token is never logged


def warm_up(url: str) -> None:
    body = json.dumps({"batch_size": 2, "outputs": {"texts": ["ab", "b"]}, "columns": {}}).encode()
    status, _, answer = post(url, body, json_headers())
    assert status == 200 and json.loads(answer)["rewards"] == [1.0, 0.0]


# ------------------------------------------------------------------ the tester's probes
def test_probe_a_huge_batch_size_is_422_before_any_allocation(proc_server) -> None:
    url, pid = proc_server
    warm_up(url)
    before = rss_mb(pid)
    for body, content_type in [
        (b'{"batch_size": 100000000}', "application/json"),  # the tester's 54-byte request
        (safetensors_save({}, metadata={"mmalign": json.dumps({"batch_size": 10**8})}), SAFETENSORS_TYPE),
    ]:
        start = time.monotonic()
        status, _, answer = post(url, body, {**json_headers(), "Content-Type": content_type})
        assert time.monotonic() - start < 2.0
        assert status == 422 and "max_batch_size = 4096" in json.loads(answer)["error"]
    assert rss_mb(pid) - before < 100  # was 2.35 GB


def _send_big_body(url: str, headers: bytes, chunks: Iterator[bytes]) -> tuple[bytes, int, float]:
    """Send `headers` then `chunks` (from a thread, until the server stops reading); (answer, bytes sent,
    seconds)."""
    parts = urllib.parse.urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    sent = [0]

    def send() -> None:
        try:
            for chunk in chunks:
                sock.sendall(chunk)
                sent[0] += len(chunk)
        except OSError:
            pass  # the server closed the connection: expected

    start = time.monotonic()
    sock.sendall(headers)
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        answer, closed = read_until_closed(sock, 10)
        assert closed
        sender.join(timeout=10)
        return answer, sent[0], time.monotonic() - start
    finally:
        sock.close()


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_probe_a_200_mb_body_is_413_without_reading_it(proc_server, framing: str) -> None:
    url, pid = proc_server
    warm_up(url)
    before = rss_mb(pid)
    total, piece = 200 * 1024 * 1024, b"x" * (1024 * 1024)
    head = f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer {SECRET}\r\n"
    if framing == "content-length":  # refused from the header, before reading any of the body
        head += f"Content-Length: {total}\r\n\r\n"
        chunks = (piece for _ in range(total // len(piece)))
    else:  # no length: refused once 8 MB (--max-body-mb 8) have been read
        head += "Transfer-Encoding: chunked\r\n\r\n"
        frame = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        chunks = (frame for _ in range(total // len(piece)))
    answer, sent, seconds = _send_big_body(url, head.encode(), chunks)
    assert answer.startswith(b"HTTP/1.1 413 ")
    # the server closes with the rest of the body unread, so the kernel may reset the connection before the
    # answer's body arrives (headers only); when it arrived, it names the cap
    _, _, body = answer.partition(b"\r\n\r\n")
    assert not body or b"max_body_mb = 8" in body
    assert sent < 64 * 1024 * 1024 and seconds < 10  # the server stopped reading early
    assert rss_mb(pid) - before < 100  # was +650 MB
    warm_up(url)  # and it still serves


def test_probe_held_connections_are_closed(proc_server) -> None:
    url, pid = proc_server
    warm_up(url)
    threads = proc_status(pid, "Threads")
    parts = urllib.parse.urlsplit(url)
    held = []
    try:
        for i in range(200):  # silent, half a request line + headers, complete headers and no body
            sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
            if i % 4 == 1:
                sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\n")
            elif i % 4 == 2:
                sock.sendall(
                    f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    f"Authorization: Bearer {SECRET}\r\nContent-Length: 1000\r\n\r\n{{".encode()
                )
            held.append(sock)
        assert proc_status(pid, "Threads") <= threads + 2  # no thread per connection (was 202)
        start = time.monotonic()
        answers = [read_until_closed(sock, max(0.1, 10 - (time.monotonic() - start))) for sock in held]
        assert all(closed for _, closed in answers)  # --read-timeout-s 1, queued ones 503 after 2 s
        assert time.monotonic() - start < 8
        statuses = {a[:12] for a, _ in answers if a}
        assert statuses <= {b"HTTP/1.1 408", b"HTTP/1.1 503"}, statuses
    finally:
        for sock in held:
            sock.close()
    warm_up(url)


def test_probe_64_clients_times_20_requests(proc_server, monkeypatch) -> None:
    url, pid = proc_server
    warm_up(url)
    monkeypatch.setenv(TOKEN_ENV, SECRET)
    before = rss_mb(pid)
    texts = [f"{c}{i}" for i, c in enumerate("abcabcab")]
    batch = RewardBatch(prompts=[""] * 8, outputs={"texts": texts})
    expected = [1.0 if t.startswith("a") else 0.0 for t in texts]
    failures: list[str] = []
    done = [0]
    lock = threading.Lock()

    def client() -> None:
        remote = load_reward("remote", url=url, token_env=TOKEN_ENV, timeout_s=20)
        for _ in range(20):
            try:
                got = remote(batch).tolist()
                assert got == expected, got
            except Exception as e:  # counted, not raised: the thread must go on
                with lock:
                    failures.append(repr(e))
            else:
                with lock:
                    done[0] += 1

    start = time.monotonic()
    clients = [threading.Thread(target=client, daemon=True) for _ in range(64)]
    for t in clients:
        t.start()
    for t in clients:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in clients)
    assert failures == [] and done[0] == 64 * 20  # was 8-22 % ConnectionResetError
    assert rss_mb(pid) - before < 100
    assert time.monotonic() - start < 60


def test_probe_the_token(proc_server, tmp_path, monkeypatch) -> None:
    url, _ = proc_server
    body = json.dumps({"batch_size": 1, "outputs": {"texts": ["a"]}}).encode()
    for headers in [
        json_headers(None),
        json_headers("wrong"),
        {**json_headers(None), "Authorization": SECRET},
    ]:
        status, answer_headers, answer = post(url, body, headers)
        assert status == 401 and answer_headers.get("www-authenticate") == "Bearer"
        assert SECRET not in answer.decode()
    assert post(url, body, json_headers())[0] == 200
    # the reward reads it from a file or an environment variable; the config holds the name / path only
    path = tmp_path / "token"
    path.write_text(SECRET + "\n")
    assert load_reward("remote", url=url, token_file=str(path))(ONE).tolist() == [0.0]
    monkeypatch.setenv(TOKEN_ENV, "not-" + SECRET)
    rs = RewardSet([{"name": "remote", "kwargs": {"url": url, "token_env": TOKEN_ENV}}])
    with pytest.raises(RewardError) as info:
        rs(ONE)
    msg = str(info.value)
    assert "HTTP 401" in msg and url in msg and SECRET not in msg and "not-" not in msg
    remote = load_reward("remote", url=url, token_env=TOKEN_ENV)
    assert SECRET not in repr(remote) and remote.token_env == TOKEN_ENV


# ------------------------------------------------------------------------- client side
def drip_server(instant: bytes, drip: bytes, every_s: float) -> tuple[str, list[int], Any]:
    """(url, [connections accepted], stop) of a server that reads the request, sends `instant`, then
    `drip` one byte every `every_s` seconds."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.1)
    accepted = [0]
    stop = threading.Event()

    def send(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            try:
                conn.recv(65536)
                conn.sendall(instant)
                for i in range(len(drip)):
                    if stop.wait(every_s):
                        return
                    conn.sendall(drip[i : i + 1])
            except OSError:
                return

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            accepted[0] += 1
            threading.Thread(target=send, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()

    def close() -> None:
        stop.set()
        listener.close()

    return f"http://127.0.0.1:{listener.getsockname()[1]}/", accepted, close


@pytest.mark.parametrize("where", ["headers", "body"])
def test_a_dripping_server_cannot_hold_the_client_past_timeout_s(where: str) -> None:
    body = b'{"rewards": [1.0]}' + b" " * 200
    head = (
        f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    )
    instant, drip = (b"", head + body) if where == "headers" else (head, body)
    url, accepted, close = drip_server(instant, drip, 0.05)  # the whole answer would take 10+ s
    try:
        remote = load_reward("remote", url=url, timeout_s=1.0)
        start = time.monotonic()
        msg = remote_error(remote, ONE)
        elapsed = time.monotonic() - start
        assert "no answer within timeout_s = 1 s" in msg and url in msg
        assert 0.9 < elapsed < 1.5  # was 14.6 s for a 2 s timeout_s
        assert accepted[0] == 1  # a timeout is not retried
    finally:
        close()


class Scripted:
    """A server whose i-th connection gets actions[i]: 'reset' (RST), '503', 'ok' (valid JSON scores)."""

    def __init__(self, actions: list[str], answer: bytes = b'{"rewards": [2.5]}') -> None:
        self.actions = list(actions)
        self.answer = answer
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/"
        self.seen: list[str] = []
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                action = self.actions.pop(0) if self.actions else "ok"
                self.seen.append(action)
                conn.settimeout(5)
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, rest = data.partition(b"\r\n\r\n")
                length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
                while len(rest) < length:
                    rest += conn.recv(65536)
                if action == "reset":
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    continue
                status, body = ("200 OK", self.answer) if action == "ok" else ("503 Busy", b"busy")
                conn.sendall(
                    f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                    f"Connection: close\r\n\r\n".encode()
                    + body
                )

    def close(self) -> None:
        self.listener.close()


def test_resets_and_503s_are_retried_with_backoff() -> None:
    server = Scripted(["reset", "503", "reset", "ok"])
    try:
        remote = load_reward("remote", url=server.url, retries=3, retry_backoff_s=0.01)
        assert remote(ONE).tolist() == [2.5]
        assert server.seen == ["reset", "503", "reset", "ok"]
    finally:
        server.close()
    server = Scripted(["reset", "503", "ok"])
    try:
        remote = load_reward("remote", url=server.url, retries=1, retry_backoff_s=0.01)
        msg = remote_error(remote, ONE)
        assert (
            server.url in msg
            and "HTTP 503 (server busy): busy" in msg
            and "gave up after 2 attempt(s)" in msg
        )
    finally:
        server.close()


def test_the_response_size_is_capped(raw_server) -> None:
    url = raw_server(200, b'{"rewards": [' + b" " * (2 * 1024 * 1024) + b"1.0]}", "application/json")
    msg = remote_error(load_reward("remote", url=url, max_response_mb=1), ONE)
    assert url in msg and "over max_response_mb = 1" in msg
    assert load_reward("remote", url=url, max_response_mb=4)(ONE).tolist() == [1.0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"token_env": "MMALIGN_SURELY_UNSET_VAR"},
            "environment variable MMALIGN_SURELY_UNSET_VAR, which is not set",
        ),
        ({"token_file": "/nonexistent/token"}, "cannot read token_file '/nonexistent/token'"),
        ({"token_env": "A", "token_file": "b"}, "give token_env or token_file, not both"),
        ({"retries": -1}, "retries must be an integer >= 0"),
        ({"max_response_mb": 0}, "max_response_mb must be > 0"),
        ({"url": "http://user:pw@127.0.0.1:1/"}, "must not carry a user or password"),
    ],
)
def test_bad_client_options(kwargs: dict[str, Any], message: str) -> None:
    from mmalign.config import ConfigError

    with pytest.raises(ConfigError) as info:
        RewardSet([{"name": "remote", "kwargs": {"url": "http://127.0.0.1:1/", **kwargs}}], source="run.yaml")
    assert message in str(info.value) and "pw" not in str(info.value)


# ------------------------------------------------------------------------- server side
class Slow(Reward):
    """1.0 per sample after 0.6 s; `started` is set once a call began."""

    needs = {"texts"}

    def __init__(self) -> None:
        self.started = threading.Event()

    def __call__(self, batch: RewardBatch) -> list[float]:
        self.started.set()
        time.sleep(0.6)
        return [1.0] * len(batch)


def test_server_limits_answer_413_422_and_503() -> None:
    big = RewardBatch(prompts=["p"] * 4, outputs={"texts": ["x" * 400_000] * 4})
    with serve_reward(TextScore(), max_body_mb=1, max_batch_size=3) as server:
        url = server.url + "score"
        msg = remote_error(load_reward("remote", url=url), big)  # 1.6 MB: refused from Content-Length
        assert "HTTP 413" in msg and "max_body_mb = 1" in msg
        msg = remote_error(load_reward("remote", url=url), text_batch())
        assert "HTTP 422" in msg and "batch_size 4 is over this server's max_batch_size = 3" in msg
        rs = RewardSet([{"name": "remote", "kwargs": {"url": url, "fields": ["texts"]}, "batch_size": 3}])
        assert rs(text_batch())[:, 0].tolist()[2:] == [3.0, 1.0]  # chunks of 3 pass
    # one slot, a 0.2 s queue: the second of two concurrent requests is 503 with Retry-After ...
    slow = Slow()
    with serve_reward(slow, max_concurrency=1, queue_timeout_s=0.2) as server:
        body = json.dumps({"batch_size": 1, "outputs": {"texts": ["a"]}}).encode()
        first = threading.Thread(target=post, args=(server.url, body, json_headers(None)))
        first.start()
        assert slow.started.wait(10)  # the first request holds the only slot for 0.6 s
        status, headers, answer = post(server.url, body, json_headers(None))
        first.join()
        assert status == 503 and headers.get("retry-after") == "1" and b"max_concurrency" in answer
        # ... which the client retries, honouring Retry-After
        scores: list[Any] = []
        first = threading.Thread(target=lambda: scores.append(load_reward("remote", url=server.url)(ONE)))
        first.start()
        time.sleep(0.1)
        assert load_reward("remote", url=server.url, retry_backoff_s=0.01)(ONE).tolist() == [1.0]
        first.join()
        assert scores[0].tolist() == [1.0]


def test_a_non_loopback_bind_warns(capsys, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="rewards.remote"):
        server = serve_reward(TextScore(), host="0.0.0.0", start=False)  # bound, never listening
        server.server_close()
    err = capsys.readouterr().err
    for text in (err, caplog.text):
        assert "0.0.0.0" in text and "not a loopback address" in text and "no token is set" in text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rewards.remote"):
        serve_reward(TextScore(), start=False).server_close()
    assert "loopback" not in capsys.readouterr().err + caplog.text


def test_the_serve_command_takes_one_token_source(capsys) -> None:
    from rewards.remote import main

    with pytest.raises(SystemExit):
        main(["--reward", "format", "--token-env", "A", "--token-file", "b"])
    assert "not allowed with argument" in capsys.readouterr().err
    assert (
        main(["--reward", "format", "--kwargs", '{"pattern": "a"}', "--token-env", "MMALIGN_SURELY_UNSET"])
        == 2
    )
    assert "MMALIGN_SURELY_UNSET, which is not set" in capsys.readouterr().err
