"""`judge`: rewards scored by a VLM judge behind an OpenAI-compatible chat-completions server.

Two rewards share one HTTP client (`ChatClient`, ``POST {url}/chat/completions``): ``openai_judge`` scores a
generated image against its prompt (by default UnifiedReward's format as Flow-GRPO sends it: the first
``Final Score: s`` divided by 5) and ``editscore`` scores (source, instruction, edit) with EditScore's own
prompts and rules (`EditScore`). ``timeout_s`` bounds each attempt; 429, 5xx and refused / reset connections
are retried with backoff; other failures are a `RewardError` naming the URL. The API key comes from the
variable named by ``api_key_env`` and is never shown. Needs ``httpx``. Protocol and options:
docs/reward_plugins.md, "Judges and scoring servers"; score formulas: docs/algorithms.md.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import io
import json
import math
import os
import random
import re
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from .base import Reward, RewardBatch, RewardError, register_reward
from .edit import source_images
from .image import to_pil

__all__ = [
    "EDITSCORE_COMPONENTS",
    "JUDGE_TEMPLATES",
    "ChatClient",
    "EditScore",
    "JudgeTemplate",
    "OpenAIJudge",
    "editscore_prompts",
    "image_data_url",
    "parse_editscore_scores",
    "parse_judge_score",
]

_MAX_BACKOFF_S = 30.0
_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
_MB = 1 << 20


# ----------------------------------------------------------------------------- the HTTP client
def _import_httpx() -> Any:
    try:
        import httpx
    except ImportError as e:  # pragma: no cover - httpx is in the dev environment
        raise ImportError(f"the judge rewards need httpx ({e}); install it with pip install httpx") from e
    return httpx


def _positive(who: str, name: str, value: Any, *, integer: bool = False, zero: bool = False) -> None:
    kind = (int,) if integer else (int, float)
    ok = not isinstance(value, bool) and isinstance(value, kind) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not zero):
        bound = ">= 0" if zero else "> 0"
        raise ValueError(
            f"{who}: {name} must be {'an integer' if integer else 'a number'} {bound}, got {value!r}"
        )


def _api_key(who: str, env: str | None) -> str | None:
    """The secret in the environment variable NAMED `env` (None: no key). Errors name the variable only."""
    if env is None:
        return None
    if not isinstance(env, str) or not env:
        raise ValueError(f"{who}: api_key_env must be the NAME of an environment variable, got {env!r}")
    key = os.environ.get(env, "").strip()
    if not key:
        raise ValueError(f"{who}: api_key_env names the environment variable {env}, which is not set")
    return key


def _endpoint(who: str, url: Any) -> str:
    """``url`` as the chat-completions endpoint: ``http://host:port/v1`` gets ``/chat/completions`` appended."""
    if not isinstance(url, str) or not url.lower().startswith(("http://", "https://")):
        raise ValueError(
            f"{who}: url must be an http:// or https:// URL such as http://127.0.0.1:8000/v1, got {url!r}"
        )
    parts = urllib.parse.urlsplit(url)
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"{who}: url must not carry a user or password; put the key in api_key_env")
    if not parts.hostname:
        raise ValueError(f"{who}: url {url!r} names no host")
    base = url.rstrip("/")
    return base if base.endswith("/chat/completions") else f"{base}/chat/completions"


class _Retry(Exception):
    def __init__(self, problem: str, retry_after: float | None = None) -> None:
        super().__init__(problem)
        self.problem = problem
        self.retry_after = retry_after


class ChatClient:
    """Sends chat-completion requests to an OpenAI-compatible server and returns the reply texts.

    `complete(bodies)` POSTs each body (``model`` is filled in) to `endpoint`, at most `max_concurrency` at
    once, and returns ``choices[0].message.content`` of each reply in order; see the module docstring for
    the timeout, retry and error rules. `who` names the reward in errors."""

    def __init__(
        self,
        who: str,
        url: str,
        model: str,
        *,
        api_key_env: str | None = None,
        timeout_s: float = 60.0,
        retries: int = 4,
        retry_backoff_s: float = 0.5,
        max_concurrency: int = 8,
        max_response_mb: float = 16.0,
    ) -> None:
        self.who = who
        self.endpoint = _endpoint(who, url)
        if not isinstance(model, str) or not model:
            raise ValueError(
                f"{who}: model must be the served model's name (as in `vllm serve NAME`), got {model!r}"
            )
        _positive(who, "timeout_s", timeout_s)
        _positive(who, "retries", retries, integer=True, zero=True)
        _positive(who, "retry_backoff_s", retry_backoff_s, zero=True)
        _positive(who, "max_concurrency", max_concurrency, integer=True)
        _positive(who, "max_response_mb", max_response_mb)
        self.model = model
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        self.retry_backoff_s = float(retry_backoff_s)
        self.max_concurrency = int(max_concurrency)
        self.max_response_bytes = int(max_response_mb * _MB)
        self._key = _api_key(who, api_key_env)  # never in repr, errors or logs
        self._random = random.Random()  # backoff jitter; leaves the global RNG alone

    def __repr__(self) -> str:
        return f"ChatClient(endpoint={self.endpoint!r}, model={self.model!r})"

    def fail(self, what: str) -> RewardError:
        return RewardError(f"{self.who} at {self.endpoint}: {what}")

    def complete(self, bodies: Sequence[Mapping[str, Any]]) -> list[str]:
        """The reply text of each request body (the body's ``model`` is set to `model`)."""
        if not bodies:
            return []
        payloads = [json.dumps({**body, "model": self.model}).encode("utf-8") for body in bodies]

        def run() -> list[str]:
            return asyncio.run(self._complete_all(payloads))

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return run()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # an event loop runs in this thread
            return pool.submit(run).result()

    async def _complete_all(self, payloads: list[bytes]) -> list[str]:
        httpx = _import_httpx()
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._key is not None:
            headers["Authorization"] = f"Bearer {self._key}"
        limits = httpx.Limits(
            max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency
        )
        slots = asyncio.Semaphore(self.max_concurrency)
        async with httpx.AsyncClient(limits=limits, timeout=self.timeout_s, headers=headers) as client:
            tasks = [asyncio.create_task(self._one(client, slots, p)) for p in payloads]
            try:
                return list(await asyncio.gather(*tasks))
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

    async def _one(self, client: Any, slots: asyncio.Semaphore, payload: bytes) -> str:
        attempts = self.retries + 1
        problem = ""
        async with slots:
            for attempt in range(attempts):
                try:
                    status, body, retry_after = await asyncio.wait_for(
                        self._post(client, payload), self.timeout_s
                    )
                except asyncio.TimeoutError:
                    raise self.fail(f"no answer within timeout_s = {self.timeout_s:g} s") from None
                except _Retry as e:
                    problem, wait = e.problem, e.retry_after
                else:
                    if status == 200:
                        return self._reply_text(body)
                    text = body.decode("utf-8", "replace")[:300]
                    if status not in _RETRY_STATUS:
                        raise self.fail(f"HTTP {status}: {text}")
                    problem, wait = f"HTTP {status}: {text}", retry_after
                if attempt + 1 < attempts:
                    delay = min(self.retry_backoff_s * 2**attempt, _MAX_BACKOFF_S) * self._random.uniform(
                        0.5, 1.0
                    )
                    if wait is not None:
                        delay = max(delay, min(wait, _MAX_BACKOFF_S))
                    await asyncio.sleep(delay)
        raise self.fail(f"{problem}; gave up after {attempts} attempt(s) (retries = {self.retries})")

    async def _post(self, client: Any, payload: bytes) -> tuple[int, bytes, float | None]:
        """(status, body, Retry-After seconds) of one POST; `_Retry` for a refused or reset connection."""
        httpx = _import_httpx()
        try:
            async with client.stream("POST", self.endpoint, content=payload) as response:
                chunks, size = [], 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > self.max_response_bytes:
                        raise self.fail(
                            f"the response is over max_response_mb = {self.max_response_bytes / _MB:g}"
                        )
                    chunks.append(chunk)
                retry_after = response.headers.get("retry-after")
                try:
                    wait = float(retry_after) if retry_after is not None else None
                except ValueError:
                    wait = None
                return (
                    response.status_code,
                    b"".join(chunks),
                    wait if wait is not None and wait >= 0 else None,
                )
        except httpx.TimeoutException:
            raise asyncio.TimeoutError from None
        except (httpx.ConnectError, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError) as e:
            raise _Retry(f"connection failed ({type(e).__name__}: {e or 'no detail'})") from None
        except httpx.HTTPError as e:
            raise self.fail(f"request failed: {type(e).__name__}: {e}") from e

    def _reply_text(self, body: bytes) -> str:
        try:
            data = json.loads(body.decode("utf-8"))
            content = data["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise self.fail(
                f"malformed reply, expected a chat completion with choices[0].message.content "
                f"({type(e).__name__}: {e}): {body[:200].decode('utf-8', 'replace')!r}"
            ) from None
        if isinstance(content, list):  # content parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise self.fail(
                f"malformed reply: choices[0].message.content is {type(content).__name__}, not text"
            )
        return content


# ----------------------------------------------------------------------------- images
IMAGE_FORMATS = {"png": ("PNG", "image/png"), "jpeg": ("JPEG", "image/jpeg")}


def image_data_url(image: Tensor, fmt: str = "png", size: int | None = None) -> str:
    """A ``data:image/...;base64,`` URL of `image` (Float[3,H,W] in [0, 1]), resized to `size` x `size`
    (PIL's default filter) when `size` is given."""
    if fmt not in IMAGE_FORMATS:
        raise ValueError(f"image_format must be one of {sorted(IMAGE_FORMATS)}, got {fmt!r}")
    pil = to_pil(image)
    if size is not None and pil.size != (size, size):
        pil = pil.resize((size, size))
    buf = io.BytesIO()
    pil_format, mime = IMAGE_FORMATS[fmt]
    pil.save(buf, format=pil_format)
    return f"data:{mime};base64,{base64.b64encode(buf.getvalue()).decode('ascii')}"


def _image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def _batch_images(who: str, batch: RewardBatch) -> Tensor:
    images = batch.outputs.get("images")
    if not isinstance(images, Tensor) or images.dim() != 4 or images.shape[1] != 3:
        got = tuple(images.shape) if isinstance(images, Tensor) else type(images).__name__
        raise ValueError(f"{who} needs outputs['images'] as Float[B,3,H,W] in [0, 1], got {got}")
    return images


def _texts(who: str, batch: RewardBatch, column: str | None) -> list[str]:
    if column is None:
        return list(batch.prompts)
    if column not in batch.columns:
        raise KeyError(
            f"{who} reads the dataset column {column!r}; columns: {sorted(batch.columns) or 'none'}"
        )
    return ["" if v is None else str(v) for v in batch.columns[column]]


# ----------------------------------------------------------------------------- shared options
@dataclass(kw_only=True, eq=False, repr=False)
class _JudgeReward(Reward):
    """Options every judge reward has: where the server is and how it is called (see `ChatClient`)."""

    url: str
    model: str
    api_key_env: str | None = None
    timeout_s: float = 60.0
    retries: int = 4
    retry_backoff_s: float = 0.5
    max_concurrency: int = 8
    max_response_mb: float = 16.0
    image_format: str = "png"
    extra_params: dict[str, Any] | None = None

    needs: ClassVar[set[str]] = {"images"}

    def _setup(self) -> None:
        who = f"reward {self.name!r}"
        self.client = ChatClient(
            who,
            self.url,
            self.model,
            api_key_env=self.api_key_env,
            timeout_s=self.timeout_s,
            retries=self.retries,
            retry_backoff_s=self.retry_backoff_s,
            max_concurrency=self.max_concurrency,
            max_response_mb=self.max_response_mb,
        )
        if self.image_format not in IMAGE_FORMATS:
            raise ValueError(
                f"{who}: image_format must be one of {sorted(IMAGE_FORMATS)}, got {self.image_format!r}"
            )
        extra = dict(self.extra_params or {})
        clash = sorted(set(extra) & {"model", "messages"})
        if clash:
            raise ValueError(f"{who}: extra_params must not set {clash}; use the model option")
        self._extra = extra
        self.last_metrics: dict[str, float] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, url={self.url!r}, model={self.model!r})"


# ----------------------------------------------------------------------------- pointwise judge
@dataclass(frozen=True)
class JudgeTemplate:
    """A pointwise judge prompt: `text` holds ``{prompt}``; the score is group 1 of the first match of
    `pattern` in the reply, divided by `score_max` when the reward normalises."""

    text: str
    pattern: str
    score_max: float


# The question UnifiedReward was trained to answer, as Flow-GRPO sends it (flow_grpo/rewards.py,
# unifiedreward_score_sglang): the model expects these words, so they are kept verbatim.
_UNIFIEDREWARD_TEXT = (
    "<image>\nYou are given a text caption and a generated image based on that caption. Your task is to "
    "evaluate this image based on two key criteria:\n1. Alignment with the Caption: Assess how well this image "
    "aligns with the provided caption. Consider the accuracy of depicted objects, their relationships, and "
    "attributes as described in the caption.\n2. Overall Image Quality: Examine the visual quality of this "
    "image, including clarity, detail preservation, color accuracy, and overall aesthetic appeal.\nBased on the "
    "above criteria, assign a score from 1 to 5 after 'Final Score:'.\nYour task is provided as follows:\n"
    "Text Caption: [{prompt}]"
)

JUDGE_TEMPLATES: dict[str, JudgeTemplate] = {
    "unifiedreward": JudgeTemplate(_UNIFIEDREWARD_TEXT, r"Final Score:\s*([1-5](?:\.\d+)?)", 5.0),
}
"""Named prompt presets of ``openai_judge`` (``template: NAME``)."""


def parse_judge_score(reply: str, pattern: str) -> float | None:
    """Group 1 of the first match of `pattern` in `reply` as a float; None when there is none."""
    m = re.search(pattern, reply)
    if m is None:
        return None
    try:
        return float(m.group(1))
    except (IndexError, ValueError):
        return None


@register_reward("openai_judge")
@dataclass(kw_only=True, eq=False, repr=False)
class OpenAIJudge(_JudgeReward):
    """VLM judge over an OpenAI-compatible server (vLLM, SGLang): UnifiedReward pointwise score by default.

    Each sample is one chat request: the image (``outputs["images"]``, a base64 ``image_format`` data URL,
    resized to ``image_size`` x ``image_size``; None keeps its size) then the text of ``template`` with
    ``{prompt}`` = the prompt (or the ``prompt_column`` column). ``template`` is a name of
    `JUDGE_TEMPLATES` ("unifiedreward": the question and ``Final Score: s`` rule Flow-GRPO uses) or a text
    holding ``{prompt}`` (then ``score_pattern`` and ``score_max`` are required). The reward is the parsed
    score, divided by ``score_max`` when ``normalize`` (UnifiedReward: s / 5 in [0.2, 1]). A reply without
    a score gives ``unparsed`` (None: NaN) and counts in ``last_metrics["unparsed_frac"]``. Sampling:
    ``temperature`` (0), ``max_tokens`` (None: the server's), ``extra_params`` (more request keys, e.g.
    ``top_k``). Server options: ``url`` (``http://host:port/v1``), ``model``, ``api_key_env``,
    ``timeout_s``, ``retries``, ``retry_backoff_s``, ``max_concurrency`` (see `ChatClient`).
    """

    template: str = "unifiedreward"
    score_pattern: str | None = None
    score_max: float | None = None
    normalize: bool = True
    prompt_column: str | None = None
    image_size: int | None = 512
    temperature: float = 0.0
    max_tokens: int | None = None
    unparsed: float | None = None

    def __post_init__(self) -> None:
        self._setup()
        who = f"reward {self.name!r}"
        if self.template in JUDGE_TEMPLATES:
            preset = JUDGE_TEMPLATES[self.template]
            text, pattern, score_max = preset.text, preset.pattern, preset.score_max
        elif "{prompt}" in self.template:
            text, pattern, score_max = self.template, None, None
        else:
            raise ValueError(
                f"{who}: template must be one of {sorted(JUDGE_TEMPLATES)} or a text holding {{prompt}}, "
                f"got {self.template[:80]!r}"
            )
        pattern = self.score_pattern or pattern
        score_max = self.score_max if self.score_max is not None else score_max
        if pattern is None:
            raise ValueError(
                f"{who}: a custom template needs score_pattern (a regex whose group 1 is the score)"
            )
        try:
            if re.compile(pattern).groups < 1:
                raise ValueError("it has no group")
        except (re.error, ValueError) as e:
            raise ValueError(f"{who}: score_pattern {pattern!r} is not a regex with a group: {e}") from None
        if self.normalize:
            if score_max is None:
                raise ValueError(f"{who}: normalize needs score_max (the best score) with a custom template")
            _positive(who, "score_max", score_max)
        if self.image_size is not None:
            _positive(who, "image_size", self.image_size, integer=True)
        self._text, self._pattern, self._score_max = text, pattern, score_max

    def request(self, image: Tensor, prompt: str) -> dict[str, Any]:
        """The chat-completion body (without ``model``) that asks about one image."""
        content = [
            _image_part(image_data_url(image, self.image_format, self.image_size)),
            {"type": "text", "text": self._text.replace("{prompt}", prompt)},
        ]
        body: dict[str, Any] = {
            "messages": [{"role": "user", "content": content}],
            "temperature": self.temperature,
        }
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        return {**body, **self._extra}

    def score(self, reply: str) -> float:
        """The reward of one reply (NaN or ``unparsed`` when it holds no score)."""
        s = parse_judge_score(reply, self._pattern)
        if s is None:
            return math.nan if self.unparsed is None else float(self.unparsed)
        return s / self._score_max if self.normalize and self._score_max else s

    def __call__(self, batch: RewardBatch) -> Tensor:
        who = f"reward {self.name!r}"
        images = _batch_images(who, batch)
        prompts = _texts(who, batch, self.prompt_column)
        replies = self.client.complete([self.request(img, p) for img, p in zip(images, prompts, strict=True)])
        parsed = [parse_judge_score(r, self._pattern) is not None for r in replies]
        self.last_metrics = {"unparsed_frac": 1.0 - sum(parsed) / len(parsed)} if parsed else {}
        return torch.tensor([self.score(r) for r in replies], dtype=torch.float32)


# ----------------------------------------------------------------------------- EditScore
# EditScore's prompts (editscore/vie_prompts.py of the `editscore` package, v0.2; VIEScore's rules), kept
# verbatim because the EditScore judges were trained on them. The semantic-consistency (SC) prompt is
# CONTEXT + TWO_IMAGE_RULE + SC_RULE, the perceptual-quality (PQ) prompt CONTEXT + PQ_RULE (joined by
# newlines); every "10" of the rules becomes the score range and "<instruction>" the instruction.
_ES_CONTEXT = """You are a professional digital artist. You will have to evaluate the effectiveness of the AI-generated image(s) based on given rules.
All the input images are AI-generated. All human in the images are AI-generated too. so you need not worry about the privacy confidentials.

IMPORTANT: You will have to give your output in this way (Keep your reasoning concise and short.):
{
"reasoning" : "...",
"score" : [...]
}
"""  # noqa: E501
_ES_TWO_IMAGE_RULE = """RULES:

Two images will be provided: The first being the original AI-generated image and the second being an edited version of the first.
The objective is to evaluate how successfully the editing instruction has been executed in the second image.

Note that sometimes the two images might look identical due to the failure of image edit.
"""  # noqa: E501
_ES_SC_RULE = """
From scale 0 to 10: 
A score from 0 to 10 will be given based on the success of the editing. (0 indicates that the scene in the edited image does not follow the editing instruction at all. 10 indicates that the scene in the edited image follow the editing instruction text perfectly.)
A second score from 0 to 10 will rate the degree of overediting in the second image. (0 indicates that the scene in the edited image is completely different from the original. 10 indicates that the edited image can be recognized as a minimal edited yet effective version of original.)
Put the score in a list such that output score = [score1, score2], where 'score1' evaluates the editing success and 'score2' evaluates the degree of overediting.

Editing instruction: <instruction>
"""  # noqa: E501, W291
_ES_PQ_RULE = """RULES:

The image is an AI-generated image.
The objective is to evaluate how successfully the image has been generated.

From scale 0 to 10: 
A score from 0 to 10 will be given based on image naturalness. 
(
    0 indicates that the scene in the image does not look natural at all or give a unnatural feeling such as wrong sense of distance, or wrong shadow, or wrong lighting. 
    10 indicates that the image looks natural.
)
A second score from 0 to 10 will rate the image artifacts. 
(
    0 indicates that the image contains a large portion of distortion, or watermark, or scratches, or blurred faces, or unusual body parts, or subjects not harmonized. 
    10 indicates the image has no artifacts.
)
Put the score in a list such that output score = [naturalness, artifacts]
"""  # noqa: E501, W291

EDITSCORE_COMPONENTS = ("overall", "semantic", "quality")
"""What ``editscore`` returns: O = sqrt(SC * PQ), SC (instruction following / over-editing) or PQ."""


def editscore_prompts(instruction: str, score_range: int = 25) -> tuple[str, str]:
    """(SC prompt for `instruction`, PQ prompt) as EditScore builds them for a score range of `score_range`."""
    sc = "\n".join([_ES_CONTEXT, _ES_TWO_IMAGE_RULE, _ES_SC_RULE.replace("10", str(score_range))])
    pq = "\n".join([_ES_CONTEXT, _ES_PQ_RULE.replace("10", str(score_range))])
    return sc.replace("<instruction>", instruction), pq


_SCORE_LIST = re.compile(r"""["']?score["']?\s*:\s*\[([^\]]*)\]""", re.IGNORECASE)
_NUMBER = re.compile(r"[-+]?\d*\.?\d+")


def parse_editscore_scores(reply: str) -> list[float]:
    """The ``score`` list of an EditScore reply ``{"reasoning": "...", "score": [a, b]}``: the JSON object
    between the first ``{`` and the last ``}`` when it parses (a bare number counts as a list of one), else
    the numbers of the first ``score: [...]`` in the text; [] when neither is there."""
    start, end = reply.find("{"), reply.rfind("}")
    if start != -1 and end > start:
        try:
            data = json.loads(reply[start : end + 1])
        except ValueError:
            data = None
        if isinstance(data, dict) and "score" in data:
            value = data["score"]
            values = value if isinstance(value, list) else [value]
            try:
                return [float(v) for v in values if not isinstance(v, bool)]
            except (TypeError, ValueError):
                return []
    m = _SCORE_LIST.search(reply)
    return [float(x) for x in _NUMBER.findall(m.group(1))] if m else []


@register_reward("editscore")
@dataclass(kw_only=True, eq=False, repr=False)
class EditScore(_JudgeReward):
    """EditScore for image editing, from an EditScore judge behind an OpenAI-compatible server (vLLM).

    Per sample and pass, two requests in EditScore's Qwen2.5-VL layout (``<img1>: `` image ``<img2>: ``
    image, then the prompt; ``image_labels: false`` drops the labels): SC with the source image and the
    edit and the instruction (the prompt, or the ``instruction_column`` column), PQ with the edit alone.
    Each reply's ``score`` list (`parse_editscore_scores`) gives min(list) / (``score_range`` / 10), on
    0..10; O = sqrt(SC * PQ); the passes (``num_pass``, seeds ``seed + i``) are averaged. ``component``
    picks "overall" (O, default), "semantic" (SC) or "quality" (PQ); all three means are in
    ``last_metrics``. A reply without scores, or one outside 0..10 after scaling, gives ``fallback`` for
    that part (None: NaN; EditScore itself uses the midpoint 5); ``unparsed_frac`` counts such replies.
    The source image is ``outputs["source_images"]`` or the ``source_column`` column
    (`rewards.edit.source_images`); a row without one is NaN. Sampling defaults are EditScore's
    (temperature 0.7, top_p 0.9, top_k 20, max_tokens 512, seed 42); server options as ``openai_judge``.
    """

    instruction_column: str | None = None
    source_column: str = "source_image"
    score_range: int = 25
    component: str = "overall"
    num_pass: int = 1
    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 20
    max_tokens: int = 512
    seed: int = 42
    image_labels: bool = True
    image_size: int | None = None
    fallback: float | None = None

    def __post_init__(self) -> None:
        self._setup()
        who = f"reward {self.name!r}"
        if self.component not in EDITSCORE_COMPONENTS:
            raise ValueError(
                f"{who}: component must be one of {EDITSCORE_COMPONENTS}, got {self.component!r}"
            )
        _positive(who, "score_range", self.score_range, integer=True)
        _positive(who, "num_pass", self.num_pass, integer=True)
        if self.image_size is not None:
            _positive(who, "image_size", self.image_size, integer=True)

    def request(self, images: Sequence[Tensor], text: str, seed: int) -> dict[str, Any]:
        """The chat-completion body (without ``model``) for `images` (source then edit, or the edit) and `text`."""
        content: list[dict[str, Any]] = []
        for i, image in enumerate(images, start=1):
            if self.image_labels:
                content.append({"type": "text", "text": f"<img{i}>: "})
            content.append(_image_part(image_data_url(image, self.image_format, self.image_size)))
        content.append({"type": "text", "text": text})
        body = {
            "messages": [{"role": "user", "content": content}],
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_tokens": self.max_tokens,
            "seed": seed,
        }
        return {**body, **self._extra}

    def part(self, reply: str) -> float:
        """SC or PQ of one reply on 0..10: min(score list) / (score_range / 10); `fallback` / NaN when unusable."""
        scores = parse_editscore_scores(reply)
        value = min(scores) / (self.score_range / 10) if scores else math.nan
        if math.isnan(value) or not 0.0 <= value <= 10.0:
            return math.nan if self.fallback is None else float(self.fallback)
        return value

    def __call__(self, batch: RewardBatch) -> Tensor:
        who = f"reward {self.name!r}"
        edits = _batch_images(who, batch).float()
        sources, has_source = source_images(self, batch, edits, self.source_column)
        instructions = _texts(who, batch, self.instruction_column)
        rows = [i for i in range(len(batch)) if has_source[i]]
        pq_text = editscore_prompts("", self.score_range)[1]
        bodies = []
        for p in range(self.num_pass):
            for i in rows:
                sc_text = editscore_prompts(instructions[i], self.score_range)[0]
                bodies.append(self.request([sources[i], edits[i]], sc_text, self.seed + p))
                bodies.append(self.request([edits[i]], pq_text, self.seed + p))
        replies = self.client.complete(bodies)
        n = len(batch)
        sc = torch.zeros(self.num_pass, n, dtype=torch.float64)
        pq = torch.zeros(self.num_pass, n, dtype=torch.float64)
        k = 0
        for p in range(self.num_pass):
            for i in rows:
                sc[p, i], pq[p, i] = self.part(replies[k]), self.part(replies[k + 1])
                k += 2
        overall = (sc * pq).sqrt().mean(0)  # EditScore's "average_last": the mean of each pass's O
        sc, pq = sc.mean(0), pq.mean(0)
        missing = ~has_source
        for t in (overall, sc, pq):
            t[missing] = math.nan
        unparsed = sum(not parse_editscore_scores(r) for r in replies)
        self.last_metrics = {"unparsed_frac": unparsed / len(replies)} if replies else {}
        for key, t in (("overall", overall), ("semantic", sc), ("quality", pq)):
            good = t[~t.isnan()]
            if good.numel():
                self.last_metrics[key] = float(good.mean())
        out = {"overall": overall, "semantic": sc, "quality": pq}[self.component]
        return out.to(torch.float32)
