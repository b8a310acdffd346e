#!/usr/bin/env bash
# `make images`: build pd-operator, pd-sim-agent, pd-gateway and pd-reference-engine with Docker. Wheels are built on
# the host (pip's cache and index) and installed offline in the image, so no image step needs
# the network or this machine's CA bundle. Tags match the chart's (the project's version).
set -euo pipefail
cd "$(dirname "$0")/../.."
REGISTRY=${PD_IMAGE_REGISTRY:-example.com/pd}
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
PY=${PY:-.venv/bin/python}
T0=$(date +%s)

hack/images/docker.sh
BASE=$(hack/images/base.sh)
echo "[images] base $BASE"

rm -rf build/wheels
mkdir -p build/wheels
echo "[images] building wheels"
"$PY" -m pip wheel -q --wheel-dir build/wheels . >/dev/null

REV=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
for name in pd-operator pd-sim-agent pd-gateway pd-reference-engine; do
  echo "[images] $REGISTRY/$name:$VERSION"
  if ! docker build -q --network host --target "$name" --build-arg "BASE=$BASE" \
      --label "org.opencontainers.image.source=https://github.com/pd-operator/pd-operator" \
      --label "org.opencontainers.image.version=$VERSION" --label "org.opencontainers.image.revision=$REV" \
      -t "$REGISTRY/$name:$VERSION" . >build/docker-build.log 2>&1; then
    cat build/docker-build.log >&2
    exit 1
  fi
done
echo "[images] built in $(( $(date +%s) - T0 )) s:"
docker image ls --format '  {{.Repository}}:{{.Tag}}  {{.Size}}' | grep -E "$REGISTRY/pd-(operator|sim-agent|gateway|reference-engine):$VERSION"
