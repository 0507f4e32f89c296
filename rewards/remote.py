"""`remote`: a reward computed by another process over HTTP, and the server side, `serve_reward`.

The client (`RemoteReward`, registered as ``remote``) POSTs the batch to ``url`` and reads one number per
sample back. The server (`serve_reward`, or ``python -m rewards.remote --reward NAME ...``) puts any reward
in a process of its own, e.g. a large reward model on its own GPU.

Wire format (standard library plus ``safetensors``; nothing is ever pickled):

- request, ``payload: json``: ``Content-Type: application/json``, the body
  ``{"batch_size": B, "prompts": [...], "outputs": {...}, "columns": {...}}`` holding the ``fields`` sent
  (``prompts``, and each other field under ``columns`` when it is a dataset column, else under
  ``outputs``). Tensors cannot go as JSON: use ``payload: safetensors``.
- request, ``payload: safetensors``: ``Content-Type: application/x-safetensors``; each tensor field is a
  safetensors tensor named ``outputs.<field>`` or ``columns.<field>``, everything else is the JSON above,
  stored as one string under the metadata key ``mmalign``.
- response: ``application/json`` ``{"rewards": [float or null, ...], "metrics": {...}}`` (``null`` = NaN;
  ``metrics`` optional, becomes the reward's ``last_metrics``), or ``application/x-safetensors`` with a
  ``rewards`` tensor Float[B] (and the metrics as JSON under the metadata key ``mmalign``). Any other
  content type is refused. The server answers in the format of the request.

A missing ``prompts`` field reaches the server's reward as empty strings. A non-200 status, a connection
refused, a timeout or a response of the wrong length is a `RewardError` naming the url.
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import math
import struct
import sys
import threading
import urllib.error
import urllib.request
import warnings
from collections.abc import Mapping, Sequence
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
    "RemoteReward",
    "decode_request",
    "encode_batch",
    "main",
    "serve_reward",
]

JSON_TYPE = "application/json"
SAFETENSORS_TYPE = "application/x-safetensors"
_SAFETENSORS_TYPES = {SAFETENSORS_TYPE, "application/safetensors", "application/vnd.safetensors"}
_META_KEY = "mmalign"
_DEFAULT_FIELDS = ("prompts", "texts")


# ----------------------------------------------------------------------------- encoding
def _safetensors_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors blob (8-byte little-endian header size, then a JSON header)."""
    if len(data) < 8:
        raise ValueError("not a safetensors blob: shorter than its 8-byte header size")
    (size,) = struct.unpack("<Q", data[:8])
    if size > len(data) - 8:
        raise ValueError("not a safetensors blob: header size larger than the data")
    header = json.loads(data[8 : 8 + size].decode("utf-8"))
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


def _decode(body: bytes, content_type: str) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(JSON part, tensors) of a JSON or safetensors body; ValueError for anything else."""
    if content_type == JSON_TYPE:
        info = json.loads(body.decode("utf-8"))
        if not isinstance(info, dict):
            raise ValueError(f"expected a JSON object, got {type(info).__name__}")
        return info, {}
    if content_type in _SAFETENSORS_TYPES:
        from safetensors.torch import load

        tensors = load(body)
        raw = _safetensors_metadata(body).get(_META_KEY)
        info = json.loads(raw) if raw else {}
        if not isinstance(info, dict):
            raise ValueError(f"metadata {_META_KEY!r} must hold a JSON object, got {type(info).__name__}")
        return info, tensors
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


def decode_request(body: bytes, content_type: str) -> RewardBatch:
    """The `RewardBatch` a request carries (JSON or safetensors); ValueError for a bad body."""
    info, tensors = _decode(body, content_type)
    n = info.get("batch_size")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"'batch_size' must be an integer >= 0, got {n!r}")
    prompts = info.get("prompts", [""] * n)
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
            length = value.shape[0] if isinstance(value, Tensor) and value.dim() else len(value)
            if length != n:
                raise ValueError(f"{where} field {key!r} has {length} entries for a batch of {n}")
    return RewardBatch(prompts=[str(p) for p in prompts], outputs=outputs, columns=columns)


# ------------------------------------------------------------------------------- client
@register_reward("remote")
class RemoteReward(Reward):
    """Reward computed by a server over HTTP (`python -m rewards.remote`): POSTs the batch, reads the scores.

    Options: ``url`` (required, http or https), ``payload`` "json" (default) or "safetensors" (needed for
    tensors such as images or videos), ``fields`` (batch keys to send; default ``[prompts, texts]``),
    ``timeout_s`` (socket timeout of the HTTP request: the longest wait to connect or for data, default
    60), ``headers`` (extra HTTP headers, e.g. a token). The scores are an outcome reward (Float[B]);
    ``per_step`` is not supported. ``needs`` is the fields other than ``prompts``.
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
    ) -> None:
        if not isinstance(url, str) or not url.lower().startswith(("http://", "https://")):
            raise ValueError(f"reward 'remote': url must be an http:// or https:// URL, got {url!r}")
        if payload not in ("json", "safetensors"):
            raise ValueError(f"reward 'remote': payload must be 'json' or 'safetensors', got {payload!r}")
        if isinstance(fields, str):
            raise ValueError(
                f"reward 'remote': fields must be a list of batch keys, got the string {fields!r}"
            )
        fields = list(_DEFAULT_FIELDS if fields is None else fields)
        if not fields or not all(isinstance(f, str) and f for f in fields):
            raise ValueError(
                f"reward 'remote': fields must be a non-empty list of batch keys, got {fields!r}"
            )
        if len(set(fields)) != len(fields):
            raise ValueError(f"reward 'remote': fields must be distinct, got {fields!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s > 0:
            raise ValueError(f"reward 'remote': timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        if not math.isfinite(timeout_s):
            raise ValueError(f"reward 'remote': timeout_s must be finite, got {timeout_s!r}")
        headers = dict(headers or {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
            raise ValueError(f"reward 'remote': headers must map strings to strings, got {headers!r}")
        if per_step:
            raise ValueError(
                "reward 'remote': per_step is not supported; the server returns one number per sample "
                "(serve a process reward in-process instead)"
            )
        self.url = url
        self.payload = payload
        self.fields = fields
        self.timeout_s = float(timeout_s)
        self.headers = headers
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
        request = urllib.request.Request(
            self.url,
            data=body,
            method="POST",
            headers={
                **self.headers,
                "Content-Type": content_type,
                "Accept": f"{JSON_TYPE}, {SAFETENSORS_TYPE}",
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                status = response.status
                answer_type = response.headers.get_content_type()
                answer = response.read()
        except urllib.error.HTTPError as e:
            text = e.read().decode("utf-8", "replace") if e.fp is not None else ""
            raise self._fail(f"HTTP {e.code} {e.reason}: {text[:200]}") from e
        except TimeoutError as e:
            raise self._fail(f"no answer within timeout_s = {self.timeout_s:g} s") from e
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                raise self._fail(f"no answer within timeout_s = {self.timeout_s:g} s") from e
            if isinstance(e.reason, ConnectionRefusedError):
                raise self._fail("connection refused (is the server running?)") from e
            raise self._fail(f"request failed: {e.reason}") from e
        except (OSError, http.client.HTTPException) as e:
            raise self._fail(f"request failed: {type(e).__name__}: {e}") from e
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
class _Handler(http.server.BaseHTTPRequestHandler):
    server: _RewardServer

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.log_requests:
            super().log_message(format, *args)

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str) -> None:
        self._send(status, json.dumps({"error": message}).encode("utf-8"), JSON_TYPE)

    def do_GET(self) -> None:
        reward = self.server.reward
        info = {"reward": reward.name, "needs": sorted(getattr(reward, "needs", ()))}
        self._send(200, json.dumps(info).encode("utf-8"), JSON_TYPE)

    def do_POST(self) -> None:
        content_type = self.headers.get_content_type()
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._error(411, "a Content-Length header is required")
            return
        body = self.rfile.read(length)
        if content_type != JSON_TYPE and content_type not in _SAFETENSORS_TYPES:
            self._error(
                415, f"Content-Type {content_type!r} is not read; send {JSON_TYPE} or {SAFETENSORS_TYPE}"
            )
            return
        try:
            batch = decode_request(body, content_type)
        except Exception as e:
            self._error(400, f"bad request: {type(e).__name__}: {e}")
            return
        server = self.server
        try:
            with server.lock:  # one call at a time: reward models are not assumed thread-safe
                scores = server.reward_set(batch)[:, 0]
                prefix = f"reward/{server.reward_set.names[0]}/"
                metrics = {key[len(prefix) :]: value for key, value in server.reward_set.last_metrics.items()}
        except Exception as e:
            self._error(500, f"{type(e).__name__}: {e}")
            return
        if content_type == JSON_TYPE:
            values = [None if math.isnan(v) else v for v in scores.tolist()]
            answer = json.dumps({"rewards": values, "metrics": metrics}).encode("utf-8")
            self._send(200, answer, JSON_TYPE)
        else:
            from safetensors.torch import save

            answer = save(
                {"rewards": scores.contiguous()}, metadata={_META_KEY: json.dumps({"metrics": metrics})}
            )
            self._send(200, answer, SAFETENSORS_TYPE)


class _RewardServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], reward: Reward, log_requests: bool) -> None:
        super().__init__(address, _Handler)
        self.reward = reward
        self.reward_set = RewardSet.from_rewards([reward])  # validates shapes, inf, non-numbers
        self.lock = threading.Lock()
        self.log_requests = log_requests


def serve_reward(
    reward: Reward,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    start: bool = True,
    log_requests: bool = False,
) -> http.server.ThreadingHTTPServer:
    """An HTTP server scoring POSTed batches with `reward` (the ``remote`` reward's wire format).

    Binds `host`:`port` (port 0: a free port; ``server.server_address[1]`` tells which). With `start` the
    server runs in a daemon thread and this returns at once (stop it with ``server.shutdown()`` and
    ``server.server_close()``); else call ``server.serve_forever()``. Calls to the reward are serialized;
    each runs under ``torch.no_grad()``. A failing reward answers HTTP 500 with the error, a body that is
    not JSON or safetensors HTTP 415. A per-step reward is refused (ValueError).
    """
    if getattr(reward, "per_step", False):
        raise ValueError(f"serve_reward: reward {reward.name!r} is per-step; only outcome rewards are served")
    server = _RewardServer((host, port), reward, log_requests)
    if start:
        threading.Thread(target=server.serve_forever, name="reward-server", daemon=True).start()
    return server


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rewards.remote --reward NAME [--kwargs JSON] [--device D] [--host H] [--port P]``."""
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
    try:
        reward = load_reward(args.reward, **options)
        server = serve_reward(reward, args.host, args.port, start=False, log_requests=not args.quiet)
    except (KeyError, TypeError, ValueError, OSError) as e:
        print(f"python -m rewards.remote: error: {e}", file=sys.stderr)
        return 2
    host, port = server.server_address[:2]
    print(f"serving reward {args.reward!r} at http://{host}:{port}/ (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
