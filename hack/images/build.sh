#!/usr/bin/env bash
# `make images`: build pd-operator, pd-sim-agent, pd-gateway, pd-reference-engine, and the engine
# wheel in vendors' images (vllm-ascend-pd, pd-ascend-agent, mindie-pd-agent) with Docker. Wheels are built on the host (pip's cache and index) and installed offline in the
# image, so no image step needs the network or this machine's CA bundle. Tags match the chart's
# (the project's version); the vendors' images', the vendor's release they are built on.
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
# The engine wheel in vendors' images (hack/images/vendor.Dockerfile): NAME:TAG TARGET BASE. The bases
# are the vendors' published images (set the variables to your registry's copies); where one cannot
# be pulled, a stand-in with vllm-ascend 0.9.1's Python packages (hack/images/vendor-standin.Dockerfile),
# and the image's tag says so (`...:v0.9.1-standin`): it is no image to run.
VENDOR_IMAGES=(
  "vllm-ascend-pd:v0.9.1 engine ${VLLM_ASCEND_BASE:-quay.io/ascend/vllm-ascend:v0.9.1}"
  "pd-ascend-agent:8.0 agent ${CANN_BASE:-quay.io/ascend/cann:8.0.0-910b-ubuntu22.04-py3.10}"
  "mindie-pd-agent:2.1 agent ${MINDIE_BASE:-swr.cn-south-1.myhuaweicloud.com/ascendhub/mindie:2.1.RC1-800I-A2-py311-openeuler24.03-lts}"
)
STANDIN=pd-local/vendor-standin:vllm-ascend-0.9.1
"$PY" hack/engine-wheel/build.py --out dist >/dev/null
standin() {
  if ! docker image inspect "$STANDIN" >/dev/null 2>&1; then
    rm -rf build/vllm-standin-wheels
    "$PY" -m pip download -q --only-binary=:all: --python-version 3.11 -d build/vllm-standin-wheels \
      numpy==1.26.4 aiohttp httpx "pydantic>=2.5" prometheus-client >/dev/null
    docker build -q --network host -f hack/images/vendor-standin.Dockerfile --build-arg "BASE=$BASE" \
      -t "$STANDIN" . >build/docker-build.log 2>&1 || { cat build/docker-build.log >&2; exit 1; }
  fi
  echo "$STANDIN"
}
vendor_tags=()
for entry in "${VENDOR_IMAGES[@]}"; do
  read -r image target base <<<"$entry"
  if ! docker image inspect "$base" >/dev/null 2>&1 && ! timeout 30 docker pull -q "$base" >/dev/null 2>&1; then
    # tagged as what it is: never the name of the image built on the vendor's release
    image="$image-standin"
    echo "[images] $base cannot be pulled here: $REGISTRY/$image FROM a stand-in"
    base=$(standin)
  fi
  echo "[images] $REGISTRY/$image (FROM $base)"
  docker build -q --network host -f hack/images/vendor.Dockerfile --target "$target" --build-arg "BASE=$base" \
    --label "org.opencontainers.image.version=$VERSION" --label "org.opencontainers.image.revision=$REV" \
    -t "$REGISTRY/$image" . >build/docker-build.log 2>&1 || { cat build/docker-build.log >&2; exit 1; }
  vendor_tags+=("$REGISTRY/$image")
done
echo "[images] built in $(( $(date +%s) - T0 )) s:"
docker image ls --format '  {{.Repository}}:{{.Tag}}  {{.Size}}' \
  | grep -E "$REGISTRY/pd-(operator|sim-agent|gateway|reference-engine):$VERSION" || true
for t in "${vendor_tags[@]}"; do docker image ls --format '  {{.Repository}}:{{.Tag}}  {{.Size}}' "$t"; done
