"""The judge rewards (`rewards.judge`: ``openai_judge``, ``editscore``) against a fake OpenAI-compatible server
on 127.0.0.1 (Starlette served by uvicorn in a thread) that records each request and answers as a test says."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from PIL import Image

import rewards
from rewards.base import RewardBatch, RewardError, load_reward
from rewards.judge import (
    EditScore,
    OpenAIJudge,
    editscore_prompts,
    parse_editscore_scores,
    parse_judge_score,
)

uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
pytest.importorskip("httpx")


def completion(text: str) -> dict[str, Any]:
    return {
        "id": "x",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
    }


class FakeServer:
    """``POST /v1/chat/completions``: ``handler(body, n) -> (status, body bytes or JSON, headers, delay_s)``
    decides each answer (n = the request's number, from 0); every request body and header is recorded."""

    def __init__(self) -> None:
        from starlette.applications import Starlette
        from starlette.responses import Response
        from starlette.routing import Route

        self.handler: Callable[[dict[str, Any], int], tuple[int, Any, dict[str, str], float]] = lambda b, n: (
            200, completion("Final Score: 5"), {}, 0.0,
        )  # fmt: skip
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()

        async def chat(request: Any) -> Any:
            body = json.loads(await request.body())
            with self.lock:
                n = len(self.bodies)
                self.bodies.append(body)
                self.headers.append(dict(request.headers))
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                status, answer, headers, delay = self.handler(body, n)
                if delay:
                    await asyncio.sleep(delay)
            finally:
                with self.lock:
                    self.in_flight -= 1
            data = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
            return Response(data, status_code=status, media_type="application/json", headers=headers)

        app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        config = uvicorn.Config(
            app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=1
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "the fake server did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}/v1"

    def reset(self) -> None:
        deadline = time.monotonic() + 10  # let the answers a previous test gave up on finish
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        self.bodies.clear()
        self.headers.clear()
        self.max_in_flight = 0

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServer]:
    s = FakeServer()
    yield s
    s.close()


@pytest.fixture
def fake(server: FakeServer) -> FakeServer:
    server.reset()
    return server


def image_batch(n: int, prompts: list[str] | None = None, size: int = 8, **columns: Any) -> RewardBatch:
    g = torch.Generator().manual_seed(0)
    images = torch.rand(n, 3, size, size, generator=g)
    return RewardBatch(
        prompts=prompts or [f"caption {i}" for i in range(n)], outputs={"images": images}, columns=columns
    )


def decode_data_url(url: str) -> Image.Image:
    head, _, data = url.partition(",")
    assert head == "data:image/png;base64"
    return Image.open(io.BytesIO(base64.b64decode(data)))


def judge(fake: FakeServer, **options: Any) -> OpenAIJudge:
    return load_reward("openai_judge", url=fake.url, model="UnifiedReward-7b-v1.5", **options)  # type: ignore[return-value]


# ----------------------------------------------------------------------------- parsing
def test_parse_judge_score_follows_the_unifiedreward_rule() -> None:
    pattern = rewards.judge.JUDGE_TEMPLATES["unifiedreward"].pattern
    assert parse_judge_score("The image is fine.\nFinal Score: 4.5", pattern) == 4.5
    assert parse_judge_score("Final Score:3 and later Final Score: 1", pattern) == 3.0  # the first one
    assert parse_judge_score("Final Score: 7", pattern) is None  # outside 1..5: no match
    assert parse_judge_score("score 4", pattern) is None


def test_parse_editscore_scores() -> None:
    assert parse_editscore_scores('sure: {"reasoning": "ok", "score": [20, 15]} done') == [20.0, 15.0]
    assert parse_editscore_scores('{"reasoning": "a "quoted" word", "score": [7, 8.5]}') == [
        7.0,
        8.5,
    ]  # bad JSON
    assert parse_editscore_scores('{"reasoning": "x", "score": 12}') == [12.0]
    assert parse_editscore_scores("no scores here") == []


def test_editscore_prompts_match_editscore_construction() -> None:
    sc, pq = editscore_prompts("make the sky red", 25)
    assert "Editing instruction: make the sky red" in sc and "<instruction>" not in sc
    assert "From scale 0 to 25" in sc and "10" not in sc  # every 10 of the rules became the range
    assert "Two images will be provided" in sc and "Two images" not in pq
    assert "[naturalness, artifacts]" in pq and "From scale 0 to 25" in pq
    assert sc.startswith("You are a professional digital artist.") and pq.startswith("You are a professional")


# ----------------------------------------------------------------------------- openai_judge
def test_request_format_score_and_api_key(fake: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JUDGE_TEST_KEY", "s3cret")
    replies = {"caption 0": "ok\nFinal Score: 4.5", "caption 1": "Final Score: 3"}
    fake.handler = lambda body, n: (
        200,
        completion(replies[body["messages"][0]["content"][1]["text"].split("[")[-1][:-1]]),
        {},
        0.0,
    )
    reward = judge(fake, api_key_env="JUDGE_TEST_KEY")
    batch = image_batch(2)
    out = reward(batch)
    assert out.tolist() == pytest.approx([4.5 / 5, 3 / 5])
    assert reward.last_metrics == {"unparsed_frac": 0.0}
    assert len(fake.bodies) == 2
    assert all(h["authorization"] == "Bearer s3cret" for h in fake.headers)
    body = next(b for b in fake.bodies if b["messages"][0]["content"][1]["text"].endswith("[caption 0]"))
    assert body["model"] == "UnifiedReward-7b-v1.5" and body["temperature"] == 0.0
    (message,) = body["messages"]
    assert message["role"] == "user"
    image_part, text_part = message["content"]
    assert image_part["type"] == "image_url" and text_part["type"] == "text"
    assert text_part["text"].startswith("<image>\nYou are given a text caption")
    assert "assign a score from 1 to 5 after 'Final Score:'" in text_part["text"]
    sent = decode_data_url(image_part["image_url"]["url"])
    assert sent.size == (512, 512)  # resized as Flow-GRPO does
    expected = rewards.image.to_pil(batch.outputs["images"][0]).resize((512, 512))
    assert list(sent.convert("RGB").getdata())[:50] == list(expected.getdata())[:50]
    assert "s3cret" not in repr(reward)


def test_unparsed_reply_is_nan_and_counted(fake: FakeServer) -> None:
    fake.handler = lambda body, n: (
        200,
        completion("Final Score: 2" if "[a]" in body["messages"][0]["content"][1]["text"] else "no idea"),
        {},
        0.0,
    )
    reward = judge(fake)
    out = reward(image_batch(2, ["a", "b"]))
    assert out[0].item() == pytest.approx(0.4) and math.isnan(out[1].item())
    assert reward.last_metrics["unparsed_frac"] == 0.5
    assert judge(fake, unparsed=0.0)(image_batch(1, ["b"])).item() == 0.0


def test_custom_template_and_columns(fake: FakeServer) -> None:
    fake.handler = lambda body, n: (200, completion("Rating: 7/10"), {}, 0.0)
    reward = judge(
        fake,
        template="Rate {prompt} from 0 to 10.",
        score_pattern=r"Rating:\s*(\d+)",
        score_max=10,
        prompt_column="caption",
        image_size=None,
        max_tokens=64,
        extra_params={"top_k": 5},
    )
    out = reward(image_batch(1, ["ignored"], caption=["a red cube"]))
    assert out.item() == pytest.approx(0.7)
    body = fake.bodies[0]
    assert body["messages"][0]["content"][1]["text"] == "Rate a red cube from 0 to 10."
    assert body["max_tokens"] == 64 and body["top_k"] == 5
    assert decode_data_url(body["messages"][0]["content"][0]["image_url"]["url"]).size == (8, 8)


def test_503_then_200_is_retried(fake: FakeServer) -> None:
    fake.handler = lambda body, n: (
        (503, {"error": "busy"}, {}, 0.0) if n == 0 else (200, completion("Final Score: 5"), {}, 0.0)
    )
    out = judge(fake, retry_backoff_s=0.01)(image_batch(1))
    assert out.item() == 1.0 and len(fake.bodies) == 2


def test_429_honours_retry_after(fake: FakeServer) -> None:
    fake.handler = lambda body, n: (
        (429, {"error": "slow down"}, {"Retry-After": "0.3"}, 0.0)
        if n == 0
        else (200, completion("Final Score: 1"), {}, 0.0)
    )
    start = time.monotonic()
    assert judge(fake, retry_backoff_s=0.0)(image_batch(1)).item() == pytest.approx(0.2)
    assert time.monotonic() - start >= 0.3 and len(fake.bodies) == 2


def test_retries_are_bounded_and_the_error_names_url_and_status(fake: FakeServer) -> None:
    fake.handler = lambda body, n: (502, b"bad gateway", {}, 0.0)
    with pytest.raises(
        RewardError,
        match=r"(?s)at http://127\.0\.0\.1:\d+/v1/chat/completions: HTTP 502.*gave up after 3 attempt",
    ):
        judge(fake, retries=2, retry_backoff_s=0.01)(image_batch(1))
    assert len(fake.bodies) == 3


def test_client_error_is_not_retried(fake: FakeServer) -> None:
    fake.handler = lambda body, n: (400, {"error": "bad model"}, {}, 0.0)
    with pytest.raises(RewardError, match=r"/v1/chat/completions: HTTP 400: .*bad model"):
        judge(fake, retry_backoff_s=0.01)(image_batch(1))
    assert len(fake.bodies) == 1


def test_connection_refused_is_retried_then_fails() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    reward = load_reward(
        "openai_judge", url=f"http://127.0.0.1:{port}/v1", model="m", retries=1, retry_backoff_s=0.01
    )
    with pytest.raises(
        RewardError, match=rf"127\.0\.0\.1:{port}/v1/chat/completions: connection failed.*gave up after 2"
    ):
        reward(image_batch(1))


def test_timeout_is_a_clear_error_within_the_bound(fake: FakeServer) -> None:
    fake.handler = lambda body, n: (200, completion("Final Score: 5"), {}, 3.0)
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"/v1/chat/completions: no answer within timeout_s = 0\.3 s"):
        judge(fake, timeout_s=0.3)(image_batch(2))
    assert time.monotonic() - start < 2.0


def test_concurrency_is_bounded(fake: FakeServer) -> None:
    fake.handler = lambda body, n: (200, completion("Final Score: 4"), {}, 0.15)
    start = time.monotonic()
    out = judge(fake, max_concurrency=2)(image_batch(6))
    elapsed = time.monotonic() - start
    assert out.tolist() == pytest.approx([0.8] * 6)
    assert fake.max_in_flight == 2  # never more than max_concurrency, and the requests do overlap
    assert elapsed >= 3 * 0.15


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        (b"<html>oops</html>", "malformed reply"),
        ({"choices": []}, "malformed reply"),
        ({"choices": [{"message": {"content": None}}]}, "not text"),
    ],
)
def test_malformed_replies_are_errors(fake: FakeServer, answer: Any, match: str) -> None:
    fake.handler = lambda body, n: (200, answer, {}, 0.0)
    with pytest.raises(RewardError, match=match):
        judge(fake)(image_batch(1))


def test_works_inside_a_running_event_loop(fake: FakeServer) -> None:
    fake.handler = lambda body, n: (200, completion("Final Score: 2.5"), {}, 0.0)
    reward = judge(fake)

    async def call() -> float:
        return reward(image_batch(1)).item()

    assert asyncio.run(call()) == pytest.approx(0.5)


def test_option_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_SUCH_JUDGE_KEY", raising=False)
    with pytest.raises(
        ValueError, match="api_key_env names the environment variable NO_SUCH_JUDGE_KEY, which is not set"
    ):
        load_reward("openai_judge", url="http://127.0.0.1:1/v1", model="m", api_key_env="NO_SUCH_JUDGE_KEY")
    with pytest.raises(ValueError, match="template must be one of"):
        load_reward("openai_judge", url="http://127.0.0.1:1/v1", model="m", template="no placeholder")
    with pytest.raises(ValueError, match="needs score_pattern"):
        load_reward("openai_judge", url="http://127.0.0.1:1/v1", model="m", template="x {prompt}")
    with pytest.raises(ValueError, match="url must be an http"):
        load_reward("openai_judge", url="127.0.0.1:1", model="m")
    with pytest.raises(ValueError, match="must not carry a user or password"):
        load_reward("openai_judge", url="http://me:pw@127.0.0.1:1/v1", model="m")
    with pytest.raises(TypeError, match="unknown option"):
        load_reward("openai_judge", url="http://127.0.0.1:1/v1", model="m", api_key="sk-no")
    with pytest.raises(ValueError, match="max_concurrency must be an integer > 0"):
        load_reward("openai_judge", url="http://127.0.0.1:1/v1", model="m", max_concurrency=0)


def test_registered() -> None:
    assert {"openai_judge", "editscore"} <= set(rewards.names())
    assert rewards.get("openai_judge") is OpenAIJudge and rewards.get("editscore") is EditScore


# ----------------------------------------------------------------------------- editscore
def editscore_handler(body: dict[str, Any], n: int) -> tuple[int, Any, dict[str, str], float]:
    content = body["messages"][0]["content"]
    images = [p for p in content if p["type"] == "image_url"]
    if len(images) == 2:  # SC: source and edit
        return 200, completion('{"reasoning": "followed", "score": [20, 15]}'), {}, 0.0
    return 200, completion('||V^=^V||{"reasoning" : "natural", "score" : [25, 22.5]}||V^=^V||'), {}, 0.0


def test_editscore_hand_checked_score_and_request_layout(fake: FakeServer) -> None:
    fake.handler = editscore_handler
    reward = load_reward("editscore", url=fake.url, model="editscore-7b")
    batch = image_batch(1, ["turn the cube blue"])
    batch.outputs["source_images"] = torch.zeros(1, 3, 8, 8)
    out = reward(batch)
    # SC = min(20, 15) / (25 / 10) = 6, PQ = min(25, 22.5) / 2.5 = 9, O = sqrt(6 * 9) = 7.3484692...
    assert out.item() == pytest.approx(math.sqrt(54.0), rel=1e-6)
    assert reward.last_metrics["semantic"] == pytest.approx(6.0) and reward.last_metrics[
        "quality"
    ] == pytest.approx(9.0)
    assert len(fake.bodies) == 2
    sc = next(b for b in fake.bodies if len(b["messages"][0]["content"]) == 5)
    pq = next(b for b in fake.bodies if len(b["messages"][0]["content"]) == 3)
    parts = sc["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["text", "image_url", "text", "image_url", "text"]
    assert parts[0]["text"] == "<img1>: " and parts[2]["text"] == "<img2>: "
    source = decode_data_url(parts[1]["image_url"]["url"])
    assert set(source.convert("RGB").getdata()) == {(0, 0, 0)}  # the source comes first
    assert parts[4]["text"] == editscore_prompts("turn the cube blue", 25)[0]
    assert pq["messages"][0]["content"][2]["text"] == editscore_prompts("", 25)[1]
    assert (sc["temperature"], sc["top_p"], sc["top_k"], sc["max_tokens"], sc["seed"]) == (
        0.7,
        0.9,
        20,
        512,
        42,
    )
    semantic = load_reward("editscore", url=fake.url, model="m", component="semantic")(batch)
    assert semantic.item() == pytest.approx(6.0)


def test_editscore_unusable_reply_and_missing_source(fake: FakeServer) -> None:
    fake.handler = lambda body, n: (200, completion('{"score": [40, 30]}'), {}, 0.0)  # 16 and 12: over 10
    batch = image_batch(2, ["a", "b"], source_image=[None, None])
    batch.outputs.pop("images")
    batch.outputs["images"] = torch.rand(2, 3, 8, 8)
    out = load_reward("editscore", url=fake.url, model="m")(batch)
    assert torch.isnan(out).all() and fake.bodies == []  # no source: nothing sent
    batch.outputs["source_images"] = torch.rand(2, 3, 8, 8)
    out = load_reward("editscore", url=fake.url, model="m")(batch)
    assert torch.isnan(out).all()
    out = load_reward("editscore", url=fake.url, model="m", fallback=5.0)(batch)
    assert out.tolist() == pytest.approx([5.0, 5.0])


def test_editscore_passes_average_with_their_seeds(fake: FakeServer) -> None:
    def handler(body: dict[str, Any], n: int) -> tuple[int, Any, dict[str, str], float]:
        s = 10 if body["seed"] == 42 else 20  # pass 0: SC = PQ = 4; pass 1: SC = PQ = 8
        return 200, completion(json.dumps({"reasoning": "", "score": [s, s]})), {}, 0.0

    fake.handler = handler
    batch = image_batch(1)
    batch.outputs["source_images"] = torch.rand(1, 3, 8, 8)
    out = load_reward("editscore", url=fake.url, model="m", num_pass=2)(batch)
    assert out.item() == pytest.approx((4.0 + 8.0) / 2)
    assert sorted(b["seed"] for b in fake.bodies) == [42, 42, 43, 43]
