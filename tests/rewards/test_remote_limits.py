"""rewards/remote.py: the reward server's limits against slow clients, bodies that parse into many objects and
floods of headers (issue 33), on real servers bound to 127.0.0.1 (port 0, in threads).

The memory bounds are the module docstring's, checked with tracemalloc on `decode_request` (what the server
runs on each body), not on the process's RSS.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from safetensors.torch import save as safetensors_save

from rewards import Reward, RewardBatch
from rewards.remote import SAFETENSORS_TYPE, JsonTooLarge, decode_request, serve_reward

TOKEN_ENV = "MMALIGN_TEST_LIMITS_TOKEN"
SECRET = "limits-test-token"
_MB = 1 << 20


class Ones(Reward):
    """1.0 per sample."""

    needs = {"texts"}

    def __call__(self, batch: RewardBatch) -> list[float]:
        return [1.0] * len(batch)


BODY = json.dumps({"batch_size": 1, "outputs": {"texts": ["a"]}}).encode()


def post(port: int, body: bytes, headers: dict[str, str], timeout: float = 5.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/", body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def auth(content_type: str = "application/json") -> dict[str, str]:
    return {"Content-Type": content_type, "Authorization": f"Bearer {SECRET}"}


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """serve(**limits) -> port of a token-guarded server scoring `Ones`; stopped afterwards."""
    monkeypatch.setenv(TOKEN_ENV, SECRET)
    servers: list[Any] = []

    def start(**limits: Any) -> int:
        servers.append(serve_reward(Ones(), token_env=TOKEN_ENV, **limits))
        return servers[-1].server_address[1]

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


# ----------------------------------------------------------------------------------- slow clients
def test_slow_unauthenticated_clients_cannot_crowd_out_a_legitimate_request(server) -> None:
    # 3 x max_connections slow clients, none with the token: silent ones, ones dripping their headers a
    # byte every 0.2 s, and ones that sent complete headers and drip the body. The header deadline (30 s)
    # is far away, so only the connection cap's eviction can make room. Was: every request 503.
    port = server(max_connections=16, max_concurrency=1, read_timeout_s=30, queue_timeout_s=2)
    slow: list[socket.socket] = []
    drippers: list[socket.socket] = []
    unauthenticated: list[socket.socket] = []
    stop = threading.Event()
    try:
        for i in range(48):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            slow.append(sock)
            if i % 3 == 1:
                sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n")
                drippers.append(sock)
            elif i % 3 == 2:
                sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
                sock.sendall(b"Content-Length: 100000\r\n\r\n{")
                unauthenticated.append(sock)

        def drip() -> None:
            while not stop.wait(0.2):
                for sock in drippers:
                    try:
                        sock.sendall(b"X")
                    except OSError:
                        pass  # closed by the server: what it may do

        threading.Thread(target=drip, daemon=True).start()
        for _ in range(5):
            start = time.monotonic()
            status, answer = post(port, BODY, auth())
            assert status == 200 and json.loads(answer)["rewards"] == [1.0], (status, answer)
            assert time.monotonic() - start < 3.0
        # those with complete headers were refused when their headers arrived, never holding the one slot
        for sock in unauthenticated:
            sock.settimeout(5)
            try:
                answer = sock.recv(65536)
            except ConnectionResetError:  # closed by the eviction before its answer was read
                continue
            assert answer == b"" or answer.startswith(b"HTTP/1.1 401 ")
    finally:
        stop.set()
        for sock in slow:
            sock.close()


# ------------------------------------------------------------------------------- parse memory
def empty_objects_body(n: int) -> bytes:
    """A JSON request whose ``outputs.x`` is a list of `n` empty objects: ``[{},{},...]``."""
    return b'{"batch_size": 1, "prompts": ["a"], "outputs": {"x": [' + b"{}," * (n - 1) + b"{}]}}"


def parse_peak(body: bytes, content_type: str, max_json_values: int) -> tuple[Any, int]:
    """(the decoded batch or the exception raised, tracemalloc's peak bytes while decoding)."""
    tracemalloc.start()
    try:
        try:
            result: Any = decode_request(body, content_type, 4096, max_json_values=max_json_values)
        except ValueError as e:
            result = e
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_60_mb_body_of_empty_objects_is_refused_before_parsing() -> None:
    body = empty_objects_body(20_000_000)  # 57 MB; parsed, 1.4 GB (was: 2.0 GB RSS in the server)
    assert len(body) > 57 * _MB
    result, peak = parse_peak(body, "application/json", 1_000_000)
    assert isinstance(result, JsonTooLarge) and "max_json_values = 1000000" in str(result)
    assert peak < 1 * _MB  # nothing was built
    # the same list (2 million {}) as the safetensors metadata, or in the safetensors header itself
    meta = '{"batch_size": 1, "outputs": {"x": [' + "{}," * 1_999_999 + "{}]}}"
    blob = safetensors_save({}, metadata={"mmalign": meta})
    result, peak = parse_peak(blob, SAFETENSORS_TYPE, 1_000_000)
    assert isinstance(result, JsonTooLarge) and "metadata 'mmalign'" in str(result)
    assert peak < 4 * len(blob)  # the header's text and the metadata string only
    header = b'{"t": [' + b"{}," * 1_999_999 + b"{}]}"
    with pytest.raises(JsonTooLarge, match="the safetensors header holds more than max_json_values"):
        decode_request(len(header).to_bytes(8, "little") + header, SAFETENSORS_TYPE, max_json_values=10**6)


@pytest.mark.parametrize("payload", ["json", "safetensors"])
@pytest.mark.parametrize(
    ("item", "counts"),
    [(b"{}", 2), (b'"ab"', 1), (b"1.5", 1), (b'"\xf0\x9f\x98\x80x"', 1)],  # an empty object counts 2
    ids=["empty-objects", "short-strings", "floats", "astral-strings"],  # astral: UCS-4, 4 B a character
)
def test_a_body_just_under_max_json_values_parses_within_the_documented_bound(
    item: bytes, counts: int, payload: str
) -> None:
    limit = 100_000
    n = (limit - 20) // counts  # the request's other values (batch_size, keys, ...) fit in the rest
    text = b'{"batch_size": 1, "prompts": ["a"], "outputs": {"x": [' + b",".join([item] * n) + b"]}}"
    if payload == "json":
        body, content_type = text, "application/json"
    else:  # the same JSON as metadata: in the header, every quote is escaped
        body = safetensors_save({"outputs.t": torch.zeros(4)}, metadata={"mmalign": text.decode()})
        content_type = SAFETENSORS_TYPE
    result, peak = parse_peak(body, content_type, limit)
    assert isinstance(result, RewardBatch) and len(result.outputs["x"]) == n
    # the module docstring's bound: 8 x the body (its text, up to 4 bytes a character, and the strings
    # parsed from it) + 100 bytes per JSON value
    assert peak <= 8 * len(body) + 100 * limit
    # a body of the same size made of {} holds 3 times more values: refused before parsing
    result, peak = parse_peak(empty_objects_body(len(body) // 3), "application/json", limit)
    assert isinstance(result, JsonTooLarge) and peak < _MB


@pytest.mark.parametrize(
    ("text", "values"),  # values: a hand count (a key counts, an empty array or object counts 2)
    [
        # marks and an escaped quote inside a string are not counted: {} a [] 1 {} b "c,d..."
        ('{"a": [1, {"b": "c,d:[{\\"x"}]}', 7),
        # an escaped backslash ends before the quote: {} a "\\" b [] [] {}x2 c ", : [ {"
        ('{"a": "\\\\", "b": [[{}]], "c": ", : [ {"}', 10),
        ('[",", ":", "[", "{", 1e5, true, null]', 8),
    ],
)
def test_max_json_values_counts_what_the_json_holds(text: str, values: int) -> None:
    body = ('{"batch_size": 0, "outputs": {"x": ' + text + "}}").encode()
    assert json.loads(body)["outputs"]["x"] == json.loads(text)
    request_values = 6  # {} batch_size 0 outputs {} x
    decode_request(body, "application/json", max_json_values=request_values + values)
    with pytest.raises(JsonTooLarge):
        decode_request(body, "application/json", max_json_values=request_values + values - 1)


def test_an_unterminated_string_is_a_json_error_found_in_linear_time() -> None:
    # the counter stops at a quote that starts no whole string (json.loads fails there) instead of trying
    # again from each later quote, which would take time quadratic in the body
    body = b'{"batch_size": 1, "x": "' + b'\\"' * 200_000 + b"," * 2_000_000
    start = time.monotonic()
    with pytest.raises(ValueError, match="Unterminated string") as info:
        decode_request(body, "application/json", max_json_values=1000)
    assert not isinstance(info.value, JsonTooLarge)
    assert time.monotonic() - start < 5.0


def test_the_server_answers_413_to_too_many_json_values_and_goes_on(server) -> None:
    port = server(max_json_values=10_000)
    status, answer = post(port, empty_objects_body(20_000), auth())
    assert status == 413
    message = json.loads(answer)["error"]
    assert "max_json_values = 10000" in message and "--max-json-values" in message
    status, answer = post(port, BODY, auth())
    assert status == 200 and json.loads(answer)["rewards"] == [1.0]


# ------------------------------------------------------------------------------------- headers
def raw_exchange(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request)
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer


def test_thousands_of_headers_are_refused(server) -> None:
    port = server()
    head = (
        f"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer {SECRET}\r\n"
        f"Content-Length: {len(BODY)}\r\n"
    )
    # 431 when the header block arrives in one read; when the kernel hands it over in pieces, h11 already
    # refuses more than 16 KiB of incomplete headers with 400 (both are refusals, before the token)
    for fields, statuses in [
        ("".join(f"X-Filler-{i}: v\r\n" for i in range(90)), (b"200",)),  # 95 fields in all: read
        ("".join(f"X-Filler-{i}: v\r\n" for i in range(5000)), (b"431", b"400")),  # was 200 (10,000 fields)
        (f"X-Big: {'v' * 20_000}\r\n", (b"431", b"400")),  # few fields, over 16 KiB
    ]:
        answer = raw_exchange(port, (head + fields + "\r\n").encode() + BODY)
        assert answer[9:12] in statuses and answer.startswith(b"HTTP/1.1 "), answer[:200]
