"""Run the text trainer with ``rollout.engine: vllm`` and ``trainer.async`` in a fresh interpreter, for
tests/engines/test_vllm_cpu.py.

Why a fresh interpreter: the asynchronous rollout worker is a forked process, and a process forked after vLLM's
CPU engine has run in its parent (the earlier tests' engines: OpenMP threads bound, gloo groups set up) hangs in
its own engine's start-up. A real run never does that (the trainer's process builds no engine in async mode).

    python tests/scripts/vllm_async_run.py MODEL_DIR OUT_DIR MAX_STALENESS STEPS

Prints one JSON line: ``{"history": [...the step metrics...], "engine_in_trainer": bool, "deferred": bool}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines"))

import test_vllm_cpu as t  # noqa: E402  (the test module's config builder and reward)

from mmalign.config import AsyncConfig  # noqa: E402


def main(model_dir: str, out: str, max_staleness: str, steps: str) -> None:
    cfg = t.make_cfg(Path(model_dir), Path(out), steps=int(steps))
    cfg.rewards[0].name = f"{t.__name__}:DigitShare"
    cfg.trainer.async_ = AsyncConfig(max_staleness=int(max_staleness), timeout_s=120)
    trainer = t.make_trainer(cfg)
    history = trainer.train()
    client = trainer.policy.engine_client
    result = {
        "history": history,
        "engine_in_trainer": client.engine is not None,
        "deferred": bool(client.deferred),
    }
    print(json.dumps(result, default=float))


if __name__ == "__main__":
    main(*sys.argv[1:])
