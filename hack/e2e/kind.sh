#!/usr/bin/env bash
# `make e2e-kind`: the e2e scenarios (tests/e2e) on a kind cluster: kind from its pinned Go
# module, the project's images loaded with `kind load`, then the same pytest scenarios the
# local cluster runs. Where kind cannot get its node image (no image registry reachable), it
# says exactly that and exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
NAME=${PD_KIND_CLUSTER:-pd-e2e}
REGISTRY=${PD_IMAGE_REGISTRY:-example.com/pd}
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
KIND=$(hack/tools/build.sh kind)
KUBECONFIG_E2E=$(mktemp /tmp/kind-kubeconfig.XXXXXX)
trap '"$KIND" delete cluster --name "$NAME" >/dev/null 2>&1 || true; rm -f "$KUBECONFIG_E2E"' EXIT

NODE_IMAGE=${PD_KIND_NODE_IMAGE:-}
echo "[e2e-kind] creating kind cluster $NAME ($("$KIND" version))"
if ! "$KIND" create cluster --name "$NAME" --kubeconfig "$KUBECONFIG_E2E" ${NODE_IMAGE:+--image "$NODE_IMAGE"} \
     --wait 120s >/tmp/kind-create.log 2>&1; then
  if grep -qiE "pull|registry|manifest|dial tcp|no such host|i/o timeout" /tmp/kind-create.log; then
    node=$(grep -o 'kindest/node:[^ "@)]*' /tmp/kind-create.log | head -1)
    echo "[e2e-kind] kind cannot get its node image ${node:-kindest/node} here: no image registry is reachable" \
         "from this machine. Run this target where Docker Hub is reachable (the e2e-kind GitHub workflow does)," \
         "or set PD_KIND_NODE_IMAGE to a node image present in the local Docker." >&2
  else
    echo "[e2e-kind] kind create cluster failed:" >&2
  fi
  tail -15 /tmp/kind-create.log >&2
  exit 1
fi
for n in pd-operator pd-sim-agent pd-gateway pd-reference-engine; do
  echo "[e2e-kind] kind load docker-image $REGISTRY/$n:$VERSION"
  "$KIND" load docker-image --name "$NAME" "$REGISTRY/$n:$VERSION"
done
kubectl_bin=$(hack/k8s-bins/build.sh --print-dir)/kubectl
"$kubectl_bin" --kubeconfig "$KUBECONFIG_E2E" apply -f crds/ >/dev/null
PD_E2E_KUBECONFIG="$KUBECONFIG_E2E" "$PY" -m pytest tests/e2e -v -p no:cacheprovider
