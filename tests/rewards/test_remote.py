"""rewards/remote.py: the `remote` reward over HTTP against real local servers (port 0, in threads).

Remote scores are compared with the same reward scored in-process, and with numbers worked out by hand.
"""

from __future__ import annotations

import http.server
import json
import math
import pickle
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import torch

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
    msg = remote_error(load_reward("remote", url=url), RewardBatch(prompts=["a"], outputs={"texts": ["x"]}))
    assert url in msg and "connection refused" in msg


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
