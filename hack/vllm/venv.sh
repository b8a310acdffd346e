#!/usr/bin/env bash
# A virtualenv with one vLLM release, far enough to import its KV connector base class and its
# OpenAI protocol classes on a machine without GPUs (PyPI's torch is a CUDA build: it imports and
# runs on the CPU), then pd-operator's engine wheel into it as an engine image would install it.
#   hack/vllm/venv.sh VERSION DIR WHEEL
# VERSION is one of the releases vllm-ascend pairs with (docs/engines.md); the pins are what that
# release imports with. Cached: a DIR that already has VERSION is only given the wheel again.
set -euo pipefail
V=$1 D=$2 WHEEL=$3
here=$(cd "$(dirname "$0")" && pwd)
req="$here/requirements-$V.txt"
[ -f "$req" ] || { echo "no $req: the versions tested are $(ls "$here" | sed -n 's/requirements-\(.*\)\.txt/\1/p' | tr '\n' ' ')" >&2; exit 2; }
if [ "$(cat "$D/.vllm-version" 2>/dev/null)" != "$V" ]; then
  echo "[test-vllm] vLLM $V into $D (the first time about 5 minutes and 5 GB: torch and its CUDA libraries)"
  rm -rf "$D"
  python3 -m venv "$D"
  "$D/bin/pip" install -q --upgrade pip
  "$D/bin/pip" install -q --no-deps "vllm==$V"
  # vLLM's own requirements resolve to far more (and backtrack for minutes); these are what it imports
  "$D/bin/pip" install -q -r "$req" 2>&1 | grep -v "requires\|incompatible\|resolver" || true
  echo "$V" > "$D/.vllm-version"
fi
"$D/bin/pip" install -q --force-reinstall --no-deps "$WHEEL"
# the wheel's own dependencies, resolved against what the release's environment already has
"$D/bin/pip" install -q "$WHEEL[standin]" pytest pytest-asyncio pytest-timeout 2>&1 | grep -v "requires\|incompatible" || true
"$D/bin/python" - <<PY
import importlib.metadata as m
print("[test-vllm] vLLM", m.version("vllm"), "torch", m.version("torch"), "numpy", m.version("numpy"),
      "pd-engine", m.version("pd-engine"))
PY
