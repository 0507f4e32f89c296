"""`remote`: a reward computed by another process over HTTP, and the server side, `serve_reward`.

The client (`RemoteReward`, registered as ``remote``) POSTs the chosen batch fields to ``url`` (JSON, or
safetensors for tensors; nothing is ever pickled) and reads one number per sample back; ``timeout_s`` bounds
each attempt, refused / reset connections and 503 are retried, any other failure is a `RewardError` naming
the url. The server (`serve_reward`, or ``python -m rewards.remote --reward NAME ...``, FastAPI + uvicorn from
``pip install 'mmalign[serve]'``) puts any reward in a process of its own, behind an optional bearer token and
bounded connections, body size, JSON values, concurrency and batch size. Wire format, authentication, every
limit and the memory bound: docs/reward_plugins.md, "Rewards on another device or process".
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import http.client
import ipaddress
import json
import logging
import math
import os
import random
import re
import socket
import struct
import sys
import threading
import time
import urllib.parse
import warnings
from collections.abc import Callable, Mapping, Sequence, Sized
from typing import Any

import torch
from torch import Tensor

from .base import Reward, RewardBatch, RewardError, RewardSet, load_reward, register_reward, takes_option

if __name__ == "__main__":  # `python -m rewards.remote`: the package already imported (and registered) us
    from rewards.remote import main as _main

    raise SystemExit(_main())

# runpy warns that `rewards.remote` was imported by its package before `python -m` ran it: expected here
warnings.filterwarnings("ignore", message=r"'rewards\.remote' found in sys\.modules", category=RuntimeWarning)

__all__ = [
    "JSON_TYPE",
    "SAFETENSORS_TYPE",
    "BatchTooLarge",
    "JsonTooLarge",
    "RemoteReward",
    "RewardServer",
    "decode_request",
    "encode_batch",
    "main",
    "serve_reward",
]

logger = logging.getLogger(__name__)

JSON_TYPE = "application/json"
SAFETENSORS_TYPE = "application/x-safetensors"
_SAFETENSORS_TYPES = {SAFETENSORS_TYPE, "application/safetensors", "application/vnd.safetensors"}
_META_KEY = "mmalign"
_DEFAULT_FIELDS = ("prompts", "texts")
_MB = 1 << 20
_MAX_BACKOFF_S = 30.0
_MAX_HEADERS = 100  # header fields of a request (a client sends about 6); more is 431
_MAX_HEADER_BYTES = 16 * 1024  # their names and values together; more is 431


class BatchTooLarge(ValueError):
    """A request's ``batch_size`` is over the server's ``max_batch_size`` (HTTP 422)."""


class JsonTooLarge(ValueError):
    """A request's JSON holds more values than the server's ``max_json_values`` (HTTP 413)."""


# ----------------------------------------------------------------------------- tokens
def _read_token(token_env: str | None, token_file: str | None, who: str) -> str | None:
    """The secret named by `token_env` (an environment variable's NAME) or `token_file` (a path); None for
    neither. Errors name the variable or the path, never the value."""
    if token_env is not None and token_file is not None:
        raise ValueError(f"{who}: give token_env or token_file, not both")
    if token_env is not None:
        if not isinstance(token_env, str) or not token_env:
            raise ValueError(
                f"{who}: token_env must be the NAME of an environment variable, got {token_env!r}"
            )
        token = os.environ.get(token_env, "").strip()
        if not token:
            raise ValueError(f"{who}: token_env names the environment variable {token_env}, which is not set")
        return token
    if token_file is not None:
        if not isinstance(token_file, str | os.PathLike) or not str(token_file):
            raise ValueError(f"{who}: token_file must be a path, got {token_file!r}")
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as e:
            raise ValueError(f"{who}: cannot read token_file {str(token_file)!r}: {e.strerror}") from None
        if not token:
            raise ValueError(f"{who}: token_file {str(token_file)!r} is empty")
        return token
    return None


def _check_number(who: str, name: str, value: Any, *, integer: bool = False, minimum: float = 0.0) -> None:
    kind = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value) or value < minimum:
        what = "an integer" if integer else "a finite number"
        raise ValueError(f"{who}: {name} must be {what} >= {minimum:g}, got {value!r}")


# ----------------------------------------------------------------------------- encoding
# A JSON value outside a string is announced by one of ",", ":", "[", "{" (or is the whole text), so counting
# those outside strings, plus 1, bounds the values a text holds. A token is a run of text outside strings, a
# whole string (possessive: no backtracking, so linear time and constant memory), or a quote that starts no
# whole string.
_JSON_TOKENS = re.compile(rb'([^"]+)|"(?:[^"\\]++|\\.)*+"|(")', re.DOTALL)
_JSON_TOKENS_STR = re.compile(_JSON_TOKENS.pattern.decode("ascii"), re.DOTALL)


def _json_values(data: bytes | str, limit: int) -> int:
    """How many JSON values (scalars, arrays, objects, object keys) `data` holds, counted without building
    them, in linear time and constant memory: 1 + the ``,`` ``:`` ``[`` ``{`` outside strings (an empty
    array or object counts 2), or any larger number up to `limit`; the count stops past `limit`. Exact for
    valid JSON. For invalid JSON it counts up to the first point where ``json.loads`` raises, at the latest
    (an unterminated string ends it), and ``json.loads`` builds nothing past that point."""
    if isinstance(data, str):
        tokens, marks, one = _JSON_TOKENS_STR, (",", ":", "[", "{"), {",", ":", "[", "{"}
    else:
        tokens, marks, one = _JSON_TOKENS, (b",", b":", b"[", b"{"), {ord(c) for c in ",:[{"}
    n = 1 + sum(data.count(m) for m in marks)  # those inside strings too: an upper bound
    if n <= limit:
        return n
    n = 1
    for token in tokens.finditer(data):
        if token.lastindex == 1:  # text outside strings
            start, end = token.span()
            n += data[start] in one if end - start == 1 else sum(data.count(m, start, end) for m in marks)
            if n > limit:
                break
        elif token.lastindex == 2:  # an unterminated string: json.loads raises there
            break
    return n


def _loads(data: bytes | str, max_json_values: int | None, what: str) -> Any:
    """``json.loads(data)``, refused (`JsonTooLarge`) before parsing when `data` holds more than
    `max_json_values` values. `what` names the text in the error."""
    if max_json_values is not None and _json_values(data, max_json_values) > max_json_values:
        raise JsonTooLarge(
            f"{what} holds more than max_json_values = {max_json_values} JSON values (numbers, strings, "
            f"lists, objects); send smaller batches (the reward entry's batch_size), tensors as "
            f"payload: safetensors, or start the server with a larger --max-json-values"
        )
    return json.loads(data.decode("utf-8") if isinstance(data, bytes) else data)


def _safetensors_metadata(data: bytes, max_json_values: int | None = None) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors blob (8-byte little-endian header size, then a JSON header)."""
    if len(data) < 8:
        raise ValueError("not a safetensors blob: shorter than its 8-byte header size")
    (size,) = struct.unpack("<Q", data[:8])
    if size > len(data) - 8:
        raise ValueError("not a safetensors blob: header size larger than the data")
    header = _loads(data[8 : 8 + size], max_json_values, "the safetensors header")
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return dict(meta) if isinstance(meta, dict) else {}


def _encode(
    info: dict[str, Any], tensors: dict[str, Tensor], payload: str
) -> tuple[bytes, str]:  # (body, content type)
    if payload == "json":
        return json.dumps(info).encode("utf-8"), JSON_TYPE
    from safetensors.torch import save

    blobs = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    return save(blobs, metadata={_META_KEY: json.dumps(info)}), SAFETENSORS_TYPE


def _batch_size(info: dict[str, Any], max_batch_size: int | None) -> int:
    n = info.get("batch_size")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"'batch_size' must be an integer >= 0, got {n!r}")
    if max_batch_size is not None and n > max_batch_size:
        raise BatchTooLarge(
            f"batch_size {n} is over this server's max_batch_size = {max_batch_size}; send smaller "
            f"batches (the reward entry's batch_size) or start the server with a larger --max-batch-size"
        )
    return n


def _decode(
    body: bytes,
    content_type: str,
    max_batch_size: int | None = None,
    *,
    request: bool = False,
    max_json_values: int | None = None,
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(JSON part, tensors) of a JSON or safetensors body; ValueError for anything else. With `request`,
    the ``batch_size`` is checked (against `max_batch_size` too) before the tensors are loaded; every JSON
    text is checked against `max_json_values` before it is parsed (`JsonTooLarge`)."""
    if content_type == JSON_TYPE:
        info = _loads(body, max_json_values, "the JSON body")
        if not isinstance(info, dict):
            raise ValueError(f"expected a JSON object, got {type(info).__name__}")
        if request:
            _batch_size(info, max_batch_size)
        return info, {}
    if content_type in _SAFETENSORS_TYPES:
        from safetensors.torch import load

        raw = _safetensors_metadata(body, max_json_values).get(_META_KEY)
        info = _loads(raw, max_json_values, f"the metadata {_META_KEY!r}") if raw else {}
        if not isinstance(info, dict):
            raise ValueError(f"metadata {_META_KEY!r} must hold a JSON object, got {type(info).__name__}")
        if request:
            _batch_size(info, max_batch_size)
        return info, load(body)
    raise ValueError(
        f"refusing to decode Content-Type {content_type!r}: only {JSON_TYPE} and {SAFETENSORS_TYPE} are read "
        f"(never pickle)"
    )


def encode_batch(batch: RewardBatch, fields: Sequence[str], payload: str) -> tuple[bytes, str]:
    """The request body and content type for the `fields` of `batch` (see the module docstring)."""
    info: dict[str, Any] = {"batch_size": len(batch), "outputs": {}, "columns": {}}
    tensors: dict[str, Tensor] = {}
    for f in fields:
        if f == "prompts":
            info["prompts"] = list(batch.prompts)
            continue
        where = "columns" if f in batch.columns else "outputs"
        value = batch[f]  # RewardKeyError listing the keys when missing
        if isinstance(value, Tensor):
            if payload != "safetensors":
                raise ValueError(
                    f"field {f!r} is a tensor of shape {tuple(value.shape)}; tensors are sent only with "
                    f"payload: safetensors"
                )
            tensors[f"{where}.{f}"] = value
        else:
            if isinstance(value, tuple):
                value = list(value)
            try:
                json.dumps(value)
            except (TypeError, ValueError) as e:
                raise ValueError(f"field {f!r} cannot be sent as JSON: {e}") from e
            info[where][f] = value
    return _encode(info, tensors, payload)


def decode_request(
    body: bytes,
    content_type: str,
    max_batch_size: int | None = None,
    *,
    max_json_values: int | None = None,
) -> RewardBatch:
    """The `RewardBatch` a request carries (JSON or safetensors); ValueError for a bad body, `BatchTooLarge`
    (a ValueError) for a ``batch_size`` over `max_batch_size`, raised before anything that size exists, and
    `JsonTooLarge` (a ValueError) for a JSON text (body, safetensors header or metadata) of more than
    `max_json_values` values, raised before it is parsed: that bounds what parsing allocates (see the module
    docstring)."""
    info, tensors = _decode(body, content_type, max_batch_size, request=True, max_json_values=max_json_values)
    n = _batch_size(info, max_batch_size)
    prompts = info["prompts"] if "prompts" in info else [""] * n
    outputs = info.get("outputs", {})
    columns = info.get("columns", {})
    if not isinstance(prompts, list) or not isinstance(outputs, dict) or not isinstance(columns, dict):
        raise ValueError("'prompts' must be a list, 'outputs' and 'columns' objects")
    for name, tensor in tensors.items():
        where, _, key = name.partition(".")
        if where not in ("outputs", "columns") or not key:
            raise ValueError(f"tensor {name!r}: expected a name 'outputs.<field>' or 'columns.<field>'")
        (outputs if where == "outputs" else columns)[key] = tensor
    # prompts and columns hold one value per sample; outputs may also hold batch-wide values (a scalar)
    for where, values in (("prompts", {"prompts": prompts}), ("columns", columns)):
        for key, value in values.items():
            if isinstance(value, Tensor):
                length = value.shape[0] if value.dim() else 0
            elif isinstance(value, Sized):
                length = len(value)
            else:
                raise ValueError(f"{where} field {key!r} must be a list, got {type(value).__name__}")
            if length != n:
                raise ValueError(f"{where} field {key!r} has {length} entries for a batch of {n}")
    return RewardBatch(prompts=[str(p) for p in prompts], outputs=outputs, columns=columns)


# ------------------------------------------------------------------------------- client
class _Timeout(Exception):
    """The total deadline of one HTTP attempt passed."""


class _Retryable(Exception):
    """One HTTP attempt failed in a way worth another try (refused, reset, 503)."""

    def __init__(self, problem: str, retry_after: float | None = None) -> None:
        super().__init__(problem)
        self.problem = problem
        self.retry_after = retry_after


_RETRYABLE_ERRORS = (ConnectionRefusedError, ConnectionResetError, ConnectionAbortedError, BrokenPipeError)


@register_reward("remote")
class RemoteReward(Reward):
    """Reward computed by a server over HTTP (`python -m rewards.remote`): POSTs the batch, reads the scores.

    Options: ``url`` (required, http or https), ``payload`` "json" (default) or "safetensors" (needed for
    tensors such as images or videos), ``fields`` (batch keys to send; default ``[prompts, texts]``),
    ``timeout_s`` (total deadline of one HTTP attempt: connect, send, wait and read; default 60),
    ``token_env`` (NAME of the environment variable holding the server's token) or ``token_file`` (a file
    holding it), sent as ``Authorization: Bearer``; ``retries`` (default 4) and ``retry_backoff_s``
    (default 0.5): a refused or reset connection or HTTP 503 is retried that many times, waiting
    ``retry_backoff_s * 2**k`` (jittered, at most 30 s); ``max_response_mb`` (default 16): a larger
    response is an error; ``headers`` (extra HTTP headers, e.g. for a proxy; they are written to
    config.yaml, so a secret belongs in ``token_env`` / ``token_file``). The scores are an outcome reward
    (Float[B]); ``per_step`` is not supported. ``needs`` is the fields other than ``prompts``.
    """

    def __init__(
        self,
        *,
        url: str,
        payload: str = "json",
        fields: Sequence[str] | None = None,
        timeout_s: float = 60.0,
        headers: Mapping[str, str] | None = None,
        per_step: bool = False,
        token_env: str | None = None,
        token_file: str | None = None,
        retries: int = 4,
        retry_backoff_s: float = 0.5,
        max_response_mb: float = 16.0,
    ) -> None:
        who = "reward 'remote'"
        if not isinstance(url, str) or not url.lower().startswith(("http://", "https://")):
            raise ValueError(f"{who}: url must be an http:// or https:// URL, got {url!r}")
        parts = urllib.parse.urlsplit(url)
        if parts.username is not None or parts.password is not None:
            raise ValueError(
                f"{who}: url must not carry a user or password (it shows in logs and errors); "
                f"use token_env or token_file"
            )
        try:
            port = parts.port
        except ValueError as e:
            raise ValueError(f"{who}: url {url!r} has a bad port: {e}") from None
        if not parts.hostname:
            raise ValueError(f"{who}: url {url!r} names no host")
        if payload not in ("json", "safetensors"):
            raise ValueError(f"{who}: payload must be 'json' or 'safetensors', got {payload!r}")
        if isinstance(fields, str):
            raise ValueError(f"{who}: fields must be a list of batch keys, got the string {fields!r}")
        fields = list(_DEFAULT_FIELDS if fields is None else fields)
        if not fields or not all(isinstance(f, str) and f for f in fields):
            raise ValueError(f"{who}: fields must be a non-empty list of batch keys, got {fields!r}")
        if len(set(fields)) != len(fields):
            raise ValueError(f"{who}: fields must be distinct, got {fields!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s > 0:
            raise ValueError(f"{who}: timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        if not math.isfinite(timeout_s):
            raise ValueError(f"{who}: timeout_s must be finite, got {timeout_s!r}")
        _check_number(who, "retries", retries, integer=True)
        _check_number(who, "retry_backoff_s", retry_backoff_s)
        _check_number(who, "max_response_mb", max_response_mb)
        if not max_response_mb > 0:
            raise ValueError(f"{who}: max_response_mb must be > 0, got {max_response_mb!r}")
        headers = dict(headers or {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
            # the values may be secrets: name the keys only
            raise ValueError(
                f"{who}: headers must map strings to strings (keys: {sorted(map(str, headers))})"
            )
        token = _read_token(token_env, token_file, who)
        has_auth_header = any(k.lower() == "authorization" for k in headers)
        if token is not None and has_auth_header:
            raise ValueError(f"{who}: the token is given twice, in headers and as token_env/token_file")
        if has_auth_header:
            warnings.warn(
                f"{who}: headers carry an Authorization value, which is saved with the config (config.yaml); "
                f"put the secret in an environment variable or a file and name it with token_env or token_file",
                UserWarning,
                stacklevel=2,
            )
        if per_step:
            raise ValueError(
                f"{who}: per_step is not supported; the server returns one number per sample "
                "(serve a process reward in-process instead)"
            )
        self.url = url
        self.payload = payload
        self.fields = fields
        self.timeout_s = float(timeout_s)
        self.headers = headers
        self.retries = int(retries)
        self.retry_backoff_s = float(retry_backoff_s)
        self.max_response_bytes = int(max_response_mb * _MB)
        self.token_env = token_env
        self.token_file = token_file
        self._token = token  # never in repr, errors or logs
        self._https = parts.scheme.lower() == "https"
        self._host = parts.hostname
        self._port = port
        self._path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._random = random.Random()  # backoff jitter; leaves the global RNG (seeded runs) alone
        self.needs = {f for f in fields if f != "prompts"}
        self.last_metrics: dict[str, float] = {}

    def __repr__(self) -> str:
        return f"RemoteReward(url={self.url!r}, payload={self.payload!r}, fields={self.fields!r})"

    def _fail(self, what: str) -> RewardError:
        return RewardError(f"remote reward at {self.url}: {what}")

    def __call__(self, batch: RewardBatch) -> Tensor:
        n = len(batch)
        try:
            body, content_type = encode_batch(batch, self.fields, self.payload)
        except (ValueError, KeyError) as e:
            raise self._fail(str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)) from e
        status, answer_type, answer = self._post(body, content_type)
        if status != 200:
            raise self._fail(f"HTTP {status}: {answer.decode('utf-8', 'replace')[:200]}")
        try:
            info, tensors = _decode(answer, answer_type)
        except Exception as e:
            raise self._fail(f"bad response: {type(e).__name__}: {e}") from e
        scores = self._scores(info, tensors, n)
        metrics = info.get("metrics") or {}
        if not isinstance(metrics, dict):
            raise self._fail(f"'metrics' must be an object, got {type(metrics).__name__}")
        try:
            self.last_metrics = {str(k): float(v) for k, v in metrics.items()}
        except (TypeError, ValueError) as e:
            raise self._fail(f"'metrics' must map names to numbers: {e}") from e
        return scores

    # -- HTTP
    def _post(self, body: bytes, content_type: str) -> tuple[int, str, bytes]:
        """(status, content type, body) of the first attempt that is not refused, reset or 503."""
        attempts = self.retries + 1
        problem = ""
        for attempt in range(attempts):
            try:
                return self._attempt(body, content_type)
            except _Timeout:
                raise self._fail(f"no answer within timeout_s = {self.timeout_s:g} s") from None
            except _Retryable as e:
                problem, retry_after = e.problem, e.retry_after
            if attempt + 1 < attempts:
                delay = min(self.retry_backoff_s * 2**attempt, _MAX_BACKOFF_S) * self._random.uniform(
                    0.5, 1.0
                )
                if retry_after is not None:
                    delay = max(delay, min(retry_after, _MAX_BACKOFF_S))
                time.sleep(delay)
        raise self._fail(f"{problem}; gave up after {attempts} attempt(s) (retries = {self.retries})")

    def _attempt(self, body: bytes, content_type: str) -> tuple[int, str, bytes]:
        """One POST under a total deadline of ``timeout_s``: a timer shuts the socket down when it passes,
        which ends any blocked connect, send or receive at once."""
        deadline = time.monotonic() + self.timeout_s
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = cls(self._host, self._port, timeout=self.timeout_s)
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            sock = conn.sock
            if sock is not None:
                try:  # the plain socket's shutdown, also under TLS: it wakes a blocked recv/send
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)
                except OSError:
                    pass

        timer = threading.Timer(self.timeout_s, expire)
        timer.daemon = True
        headers = {
            **self.headers,
            "Content-Type": content_type,
            "Accept": f"{JSON_TYPE}, {SAFETENSORS_TYPE}",
        }
        if self._token is not None:
            headers["Authorization"] = f"Bearer {self._token}"
        timer.start()
        try:
            conn.connect()  # bounded by the socket timeout; the timer cannot reach a socket not made yet
            remaining = deadline - time.monotonic()
            if expired.is_set() or remaining <= 0:
                raise _Timeout
            conn.sock.settimeout(remaining)
            send_error: OSError | None = None
            try:
                conn.request("POST", self._path, body=body, headers=headers)
            except (BrokenPipeError, ConnectionResetError) as e:
                # the server may have answered (401, 413, 503) and closed before reading the whole body
                if conn.sock is None:
                    raise
                send_error = e
            try:
                response = conn.getresponse()
            except (OSError, http.client.HTTPException):
                if send_error is not None:
                    raise send_error from None
                raise
            if expired.is_set():
                raise _Timeout
            status = response.status
            answer_type = response.headers.get_content_type()
            declared = response.getheader("Content-Length")
            if (
                declared is not None
                and declared.strip().isdigit()
                and int(declared) > self.max_response_bytes
            ):
                raise self._fail(
                    f"the response is {int(declared)} bytes, over max_response_mb = "
                    f"{self.max_response_bytes / _MB:g}"
                )
            chunks, size = [], 0
            while chunk := response.read(65536):
                size += len(chunk)
                if size > self.max_response_bytes:
                    raise self._fail(
                        f"the response is over max_response_mb = {self.max_response_bytes / _MB:g}"
                    )
                chunks.append(chunk)
            answer = b"".join(chunks)
            if expired.is_set():  # cut short by the deadline: whatever was parsed is incomplete
                raise _Timeout
            if status == 503:
                retry_after = response.getheader("Retry-After")
                try:
                    wait = float(retry_after) if retry_after is not None else None
                except ValueError:
                    wait = None
                text = answer.decode("utf-8", "replace")[:200]
                raise _Retryable(f"HTTP 503 (server busy): {text}", wait if wait and wait > 0 else None)
            return status, answer_type, answer
        except (OSError, http.client.HTTPException) as e:
            if expired.is_set() or time.monotonic() >= deadline:
                raise _Timeout from None
            if isinstance(e, ConnectionRefusedError):
                raise _Retryable("connection refused (is the server running?)") from None
            if isinstance(e, _RETRYABLE_ERRORS):  # http.client.RemoteDisconnected is a ConnectionResetError
                raise _Retryable(f"connection reset ({type(e).__name__}: {e})") from None
            raise self._fail(f"request failed: {type(e).__name__}: {e}") from e
        finally:
            timer.cancel()
            conn.close()

    def _scores(self, info: dict[str, Any], tensors: dict[str, Tensor], n: int) -> Tensor:
        if "rewards" in tensors:
            scores = tensors["rewards"]
            if scores.dim() != 1 or scores.dtype.is_complex or scores.dtype == torch.bool:
                raise self._fail(
                    f"'rewards' must be a real Float[B] tensor, got {scores.dtype} {tuple(scores.shape)}"
                )
            scores = scores.to(torch.float32)
        else:
            values = info.get("rewards")
            if not isinstance(values, list):
                raise self._fail(f"the response has no 'rewards' list; its keys: {sorted(info)}")
            out = []
            for i, v in enumerate(values):
                if v is None:
                    out.append(math.nan)
                elif isinstance(v, int | float) and not isinstance(v, bool):
                    out.append(float(v))
                else:
                    raise self._fail(f"'rewards'[{i}] is {v!r}, not a number or null")
            scores = torch.tensor(out, dtype=torch.float32)
        if scores.shape[0] != n:
            raise self._fail(f"returned {scores.shape[0]} rewards for a batch of {n}")
        return scores


# ------------------------------------------------------------------------------- server
def _import_server_stack() -> tuple[Any, Any]:
    try:
        import fastapi
        import uvicorn
    except ImportError as e:
        raise ImportError(
            f"serving a reward needs fastapi and uvicorn ({e}); install them with pip install 'mmalign[serve]'"
        ) from e
    return fastapi, uvicorn


def _protocol_class(request_timeout_s: float, max_connections: int) -> type:
    """uvicorn's h11 protocol, plus a deadline for each request's headers and a connection cap that slow
    clients cannot fill.

    Deadline: uvicorn closes a kept-alive connection that stays idle, but a fresh connection that sends
    nothing, or drips its headers, would stay open for ever. Here each connection must deliver a request's
    headers within `request_timeout_s` of opening, and of each answer; else it is closed.

    Cap: past `max_connections` open connections, a new connection closes the one that has waited longest
    for a request's headers (a slow-loris client, an idle kept-alive one); connections with a request in
    progress are never closed for this. So clients dripping their headers, with or without the token, can
    hold connections only until newer clients need them, and a client that sends its request at once is
    served. When every connection has a request in progress, uvicorn answers the new one 503
    (``limit_concurrency`` is ``max_connections + 1``)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class _GuardedProtocol(H11Protocol):
        _request_deadline: asyncio.TimerHandle | None = None
        _cycle_then: Any = None  # the request cycle when it began waiting: a new one = a request began
        _waiting_since = 0.0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._await_request()
            while len(self.connections) > max_connections and self._close_longest_waiting():
                pass

        def on_response_complete(self) -> None:
            self._await_request()  # before: a pipelined request may start inside
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._request_deadline is not None:
                self._request_deadline.cancel()
                self._request_deadline = None
            super().connection_lost(exc)

        def _await_request(self) -> None:
            """From now on the connection waits for a request's headers: arm the deadline."""
            self._cycle_then = self.cycle
            self._waiting_since = self.loop.time()
            if self._request_deadline is not None:
                self._request_deadline.cancel()
            self._request_deadline = self.loop.call_later(request_timeout_s, self._on_deadline)

        def _waiting(self) -> bool:
            return self.cycle is self._cycle_then and not self.transport.is_closing()

        def _on_deadline(self) -> None:
            self._request_deadline = None
            if self._waiting():  # no new request began
                self.transport.close()

        def _close_longest_waiting(self) -> bool:
            """Close the other connection waiting longest for a request's headers; False if there is none."""
            waiting = [
                c
                for c in self.connections
                if c is not self and isinstance(c, _GuardedProtocol) and c._waiting()
            ]
            if not waiting:
                return False
            oldest = min(waiting, key=lambda c: c._waiting_since)
            oldest.transport.close()
            self.connections.discard(oldest)  # now, not when the loop reports it lost
            return True

    return _GuardedProtocol


def _header_guard(app: Any, refuse: Callable[[int, str], Any]) -> Any:
    """An ASGI app that answers 431 (``refuse(431, message)``) to a request with more than `_MAX_HEADERS`
    header fields or `_MAX_HEADER_BYTES` of them, before `app` (and so before the token) sees it."""

    async def guarded(scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = scope.get("headers", ())
        if scope.get("type") == "http" and (
            len(headers) > _MAX_HEADERS or sum(len(k) + len(v) for k, v in headers) > _MAX_HEADER_BYTES
        ):
            message = (
                f"request headers too large: {len(headers)} fields, at most {_MAX_HEADERS} fields and "
                f"{_MAX_HEADER_BYTES} bytes are read"
            )
            await refuse(431, message)(scope, receive, send)
            return
        await app(scope, receive, send)

    return guarded


class _App:
    """The request handling of a `RewardServer` (an ASGI app built with FastAPI)."""

    def __init__(
        self,
        reward: Reward,
        *,
        token: str | None,
        max_body_bytes: int,
        max_batch_size: int,
        max_json_values: int,
        max_concurrency: int,
        queue_timeout_s: float,
        read_timeout_s: float,
        log_requests: bool,
    ) -> None:
        self.reward = reward
        self.reward_set = RewardSet.from_rewards([reward])  # validates shapes, inf, non-numbers
        self.prefix = f"reward/{self.reward_set.names[0]}/"
        self.lock = threading.Lock()  # one call at a time: reward models are not assumed thread-safe
        self.token = token.encode("utf-8") if token is not None else None
        self.max_body_bytes = max_body_bytes
        self.max_batch_size = max_batch_size
        self.max_json_values = max_json_values
        self.max_concurrency = max_concurrency
        self.queue_timeout_s = queue_timeout_s
        self.read_timeout_s = read_timeout_s
        self.log_requests = log_requests
        self.slots: asyncio.Semaphore | None = None  # made on the server's event loop

    def build(self) -> Any:
        fastapi, _ = _import_server_stack()
        app = fastapi.FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

        async def handle(request: Any) -> Any:  # a plain Starlette endpoint: no dependency injection
            start = time.monotonic()
            response = await self.handle(request)
            if self.log_requests:
                client = request.client.host if request.client else "-"
                logger.info(
                    '%s "%s %s" %d %.3f s',
                    client,
                    request.method,
                    request.url.path,
                    response.status_code,
                    time.monotonic() - start,
                )
            return response

        app.add_route("/{path:path}", handle, methods=["GET", "POST"])
        return _header_guard(app, lambda status, message: self._error(status, message, True))

    @staticmethod
    def _answer(status: int, body: bytes, content_type: str, close: bool = False, **headers: str) -> Any:
        from fastapi.responses import Response

        all_headers = {k.replace("_", "-"): v for k, v in headers.items()}
        if close:  # the body may be unread: do not read the rest of it, close the connection
            all_headers["Connection"] = "close"
        return Response(content=body, status_code=status, media_type=content_type, headers=all_headers)

    def _error(self, status: int, message: str, close: bool = False, **headers: str) -> Any:
        return self._answer(
            status, json.dumps({"error": message}).encode("utf-8"), JSON_TYPE, close, **headers
        )

    def _authorized(self, header: str | None) -> bool:
        if self.token is None:
            return True
        scheme, _, given = (header or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(given.strip().encode("utf-8"), self.token)

    async def handle(self, request: Any) -> Any:
        if not self._authorized(request.headers.get("authorization")):
            return self._error(
                401, "missing or wrong token: send the header 'Authorization: Bearer <token>'", True,
                WWW_Authenticate="Bearer",
            )  # fmt: skip
        if request.method == "GET":
            info = {"reward": self.reward.name, "needs": sorted(getattr(self.reward, "needs", ()))}
            return self._answer(200, json.dumps(info).encode("utf-8"), JSON_TYPE)
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type != JSON_TYPE and content_type not in _SAFETENSORS_TYPES:
            return self._error(
                415,
                f"Content-Type {content_type!r} is not read; send {JSON_TYPE} or {SAFETENSORS_TYPE}",
                True,
            )
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                return self._error(400, f"bad Content-Length {declared[:40]!r}", True)
            if int(declared) > self.max_body_bytes:
                return self._too_large(int(declared))
        if self.slots is None:
            self.slots = asyncio.Semaphore(self.max_concurrency)
        try:
            await asyncio.wait_for(self.slots.acquire(), self.queue_timeout_s)
        except asyncio.TimeoutError:
            return self._error(
                503,
                f"server busy: {self.max_concurrency} requests in progress (max_concurrency) for "
                f"{self.queue_timeout_s:g} s; retry later",
                True,
                Retry_After="1",
            )
        try:
            return await self._score_request(request, content_type)
        finally:
            self.slots.release()

    def _too_large(self, size: int | None) -> Any:
        what = f"{size} bytes" if size is not None else "more"
        return self._error(
            413,
            f"request body of {what} is over this server's max_body_mb = {self.max_body_bytes / _MB:g}; send "
            f"smaller batches (the reward entry's batch_size) or start the server with a larger --max-body-mb",
            True,
        )

    async def _read_body(self, request: Any) -> bytes | None:
        """The body, or None when it grows over ``max_body_bytes`` (read no further)."""
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    async def _score_request(self, request: Any, content_type: str) -> Any:
        from starlette.concurrency import run_in_threadpool
        from starlette.requests import ClientDisconnect

        try:
            body = await asyncio.wait_for(self._read_body(request), self.read_timeout_s)
        except asyncio.TimeoutError:
            return self._error(408, f"the request body did not arrive within {self.read_timeout_s:g} s", True)
        except ClientDisconnect:
            return self._error(400, "the client disconnected before sending the whole body", True)
        if body is None:
            return self._too_large(None)
        return await run_in_threadpool(self._score, body, content_type)

    def _score(self, body: bytes, content_type: str) -> Any:
        try:
            batch = decode_request(
                body, content_type, self.max_batch_size, max_json_values=self.max_json_values
            )
        except BatchTooLarge as e:
            return self._error(422, str(e))
        except JsonTooLarge as e:
            return self._error(413, str(e))
        except Exception as e:
            return self._error(400, f"bad request: {type(e).__name__}: {e}")
        del body
        try:
            with self.lock, torch.no_grad():
                scores = self.reward_set(batch)[:, 0]
                metrics = {
                    key[len(self.prefix) :]: value for key, value in self.reward_set.last_metrics.items()
                }
        except Exception as e:
            return self._error(500, f"{type(e).__name__}: {e}")
        if content_type == JSON_TYPE:
            values = [None if math.isnan(v) else v for v in scores.tolist()]
            answer = json.dumps({"rewards": values, "metrics": metrics}).encode("utf-8")
            return self._answer(200, answer, JSON_TYPE)
        from safetensors.torch import save

        answer = save(
            {"rewards": scores.contiguous()}, metadata={_META_KEY: json.dumps({"metrics": metrics})}
        )
        return self._answer(200, answer, SAFETENSORS_TYPE)


def _is_loopback(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


class RewardServer:
    """A reward served over HTTP by uvicorn (see `serve_reward`).

    ``server_address`` is the bound (host, port); `start` serves in a daemon thread, `serve_forever` in the
    calling thread (Ctrl-C / SIGTERM stop it there); `shutdown` stops serving and waits, `server_close`
    releases the socket. Also a context manager (start on enter, stop on exit)."""

    def __init__(
        self,
        reward: Reward,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        log_requests: bool = False,
        token_env: str | None = None,
        token_file: str | None = None,
        max_body_mb: float = 64.0,
        max_batch_size: int = 4096,
        max_json_values: int = 1_000_000,
        max_concurrency: int = 8,
        max_connections: int = 256,
        queue_timeout_s: float = 30.0,
        read_timeout_s: float = 30.0,
        keep_alive_s: float = 5.0,
    ) -> None:
        who = "serve_reward"
        if getattr(reward, "per_step", False):
            raise ValueError(f"{who}: reward {reward.name!r} is per-step; only outcome rewards are served")
        for name, value, integer in (
            ("max_body_mb", max_body_mb, False),
            ("max_batch_size", max_batch_size, True),
            ("max_json_values", max_json_values, True),
            ("max_concurrency", max_concurrency, True),
            ("max_connections", max_connections, True),
            ("queue_timeout_s", queue_timeout_s, False),
            ("read_timeout_s", read_timeout_s, False),
            ("keep_alive_s", keep_alive_s, False),
        ):
            _check_number(who, name, value, integer=integer)
            if not value > 0:
                raise ValueError(f"{who}: {name} must be > 0, got {value!r}")
        token = _read_token(token_env, token_file, who)
        self.reward = reward
        self.token_env = token_env
        self.token_file = token_file
        self._app = _App(
            reward,
            token=token,
            max_body_bytes=int(max_body_mb * _MB),
            max_batch_size=int(max_batch_size),
            max_json_values=int(max_json_values),
            max_concurrency=int(max_concurrency),
            queue_timeout_s=float(queue_timeout_s),
            read_timeout_s=float(read_timeout_s),
            log_requests=log_requests,
        )
        _, uvicorn = _import_server_stack()
        self._config = uvicorn.Config(
            self._app.build(),
            http=_protocol_class(float(read_timeout_s), int(max_connections)),
            ws="none",
            lifespan="off",
            log_config=None,  # leave the process's logging alone
            access_log=False,  # requests are logged by the app itself (log_requests)
            limit_concurrency=int(max_connections) + 1,  # reached only with every connection busy
            h11_max_incomplete_event_size=_MAX_HEADER_BYTES,  # headers arriving in pieces
            backlog=2048,
            timeout_keep_alive=keep_alive_s,  # type: ignore[arg-type]
            timeout_graceful_shutdown=5,
            server_header=False,
            proxy_headers=False,
        )
        self._server = uvicorn.Server(self._config)
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        self.socket = socket.socket(info[0], socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind(info[4])  # listening starts with serving
        except OSError:
            self.socket.close()
            raise
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        bound = self.server_address[0]
        if not _is_loopback(bound):
            message = (
                f"serving reward {reward.name!r} on {bound}:{self.server_address[1]}, which is not a loopback "
                f"address: every machine that can reach it can send batches to it"
                + (
                    "; no token is set, so ANYONE can use it (set --token-env or --token-file)"
                    if token is None
                    else ", guarded by the token only (HTTP, not encrypted)"
                )
                + ". Prefer --host 127.0.0.1 with an SSH tunnel, or a firewall."
            )
            logger.warning(message)
            print(f"WARNING: {message}", file=sys.stderr, flush=True)

    @property
    def server_address(self) -> tuple[str, int]:
        host, port = self.socket.getsockname()[:2]
        return host, port

    @property
    def url(self) -> str:
        host, port = self.server_address
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/"

    def serve_forever(self) -> None:
        """Serve in this thread until `shutdown` (from another thread) or Ctrl-C / SIGTERM."""
        self._server.should_exit = False
        self._app.slots = None  # an asyncio semaphore belongs to one event loop
        self._server.run(sockets=[self.socket])

    def start(self, timeout_s: float = 30.0) -> RewardServer:
        """Serve in a daemon thread; returns once the server accepts connections."""

        def run() -> None:
            try:
                self.serve_forever()
            except BaseException as e:  # reported by start()
                self._error = e

        self._thread = threading.Thread(target=run, name="reward-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.shutdown()
                raise RuntimeError(f"the reward server did not start: {self._error!r}")
            time.sleep(0.01)
        return self

    def shutdown(self) -> None:
        """Stop serving (running requests get up to 5 s to finish) and wait for the serving thread."""
        self._server.should_exit = True
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=15)

    def server_close(self) -> None:
        self.socket.close()

    def __enter__(self) -> RewardServer:
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
        self.server_close()


def serve_reward(
    reward: Reward,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    start: bool = True,
    log_requests: bool = False,
    **options: Any,
) -> RewardServer:
    """An HTTP server scoring POSTed batches with `reward` (the ``remote`` reward's wire format).

    Binds `host`:`port` (port 0: a free port; ``server.server_address[1]`` tells which). With `start` the
    server runs in a daemon thread and this returns once it accepts connections (stop it with
    ``server.shutdown()`` and ``server.server_close()``); else call ``server.serve_forever()``. Calls to the
    reward are serialized; each runs under ``torch.no_grad()``. `options` are the `RewardServer` limits
    and token: ``token_env`` / ``token_file``, ``max_body_mb`` (64), ``max_batch_size`` (4096),
    ``max_json_values`` (1,000,000), ``max_concurrency`` (8), ``max_connections`` (256), ``queue_timeout_s`` (30), ``read_timeout_s`` (30),
    ``keep_alive_s`` (5); see the module docstring. A failing reward answers HTTP 500 with the error, a
    body that is not JSON or safetensors HTTP 415. A per-step reward is refused (ValueError).
    """
    server = RewardServer(reward, host, port, log_requests=log_requests, **options)
    if start:
        try:
            server.start()
        except BaseException:
            server.server_close()
            raise
    return server


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rewards.remote --reward NAME [--kwargs JSON] [--device D] [--host H] [--port P] ...``."""
    parser = argparse.ArgumentParser(
        prog="python -m rewards.remote", description="Serve a reward over HTTP for the `remote` reward."
    )
    parser.add_argument(
        "--reward", required=True, help="registered name, entry point or package.module:Class"
    )
    parser.add_argument("--kwargs", default="{}", help="the reward's options as a JSON object")
    parser.add_argument("--device", default=None, help="passed to the reward's constructor as device=")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, default=8000, help="port to bind (default 8000; 0: any free port)"
    )
    parser.add_argument("--quiet", action="store_true", help="do not log each request")
    auth = parser.add_mutually_exclusive_group()
    auth.add_argument(
        "--token-env",
        default=None,
        help="NAME of the environment variable holding the token clients must send",
    )
    auth.add_argument("--token-file", default=None, help="file holding the token clients must send")
    limits = parser.add_argument_group("limits")
    limits.add_argument(
        "--max-body-mb", type=float, default=64.0, help="largest request body (413; default 64)"
    )
    limits.add_argument(
        "--max-batch-size", type=int, default=4096, help="largest batch_size of a request (422; default 4096)"
    )
    limits.add_argument(
        "--max-json-values",
        type=int,
        default=1_000_000,
        help="most JSON values (numbers, strings, lists, objects) in a request, counted before parsing "
        "(413; default 1000000)",
    )
    limits.add_argument(
        "--max-concurrency", type=int, default=8, help="requests read, decoded and scored at once (default 8)"
    )
    limits.add_argument(
        "--max-connections",
        type=int,
        default=256,
        help="open connections; past it the one waiting longest for its request's headers is closed (256)",
    )
    limits.add_argument(
        "--queue-timeout-s", type=float, default=30.0, help="longest wait for a free slot before 503 (30)"
    )
    limits.add_argument(
        "--read-timeout-s", type=float, default=30.0, help="deadline for a request's headers, and body (30)"
    )
    limits.add_argument(
        "--keep-alive-s", type=float, default=5.0, help="idle keep-alive connections close (5)"
    )
    args = parser.parse_args(argv)
    try:
        options = json.loads(args.kwargs)
    except json.JSONDecodeError as e:
        parser.error(f"--kwargs is not JSON: {e}")
    if not isinstance(options, dict):
        parser.error(f"--kwargs must be a JSON object, got {args.kwargs!r}")
    if args.device is not None:
        if "device" in options:
            parser.error("the device is given twice, as --device and in --kwargs; keep one")
        from .base import resolve

        try:
            takes_device = takes_option(resolve(args.reward), "device")
        except (KeyError, ImportError, AttributeError) as e:
            parser.error(str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e))
        if not takes_device:
            parser.error(f"reward {args.reward!r} takes no `device` option; drop --device")
        options["device"] = args.device
    limits_kwargs = {
        "token_env": args.token_env,
        "token_file": args.token_file,
        "max_body_mb": args.max_body_mb,
        "max_batch_size": args.max_batch_size,
        "max_json_values": args.max_json_values,
        "max_concurrency": args.max_concurrency,
        "max_connections": args.max_connections,
        "queue_timeout_s": args.queue_timeout_s,
        "read_timeout_s": args.read_timeout_s,
        "keep_alive_s": args.keep_alive_s,
    }
    try:
        reward = load_reward(args.reward, **options)
        server = serve_reward(
            reward, args.host, args.port, start=False, log_requests=not args.quiet, **limits_kwargs
        )
    except (KeyError, TypeError, ValueError, OSError, ImportError) as e:
        print(f"python -m rewards.remote: error: {e}", file=sys.stderr)
        return 2
    if not logging.getLogger().handlers:  # request lines and uvicorn's warnings to stderr
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    auth_note = (
        f"token from ${args.token_env}" if args.token_env else
        f"token from {args.token_file}" if args.token_file else "no token"
    )  # fmt: skip
    server.socket.listen(2048)  # connections made from now on wait in the backlog until uvicorn runs
    print(f"serving reward {args.reward!r} at {server.url} ({auth_note}; Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
