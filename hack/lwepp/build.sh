#!/usr/bin/env bash
# Builds the Gateway API Inference Extension's reference endpoint picker (cmd/lwepp, the version
# go.mod pins) and pool-probe (an ext_proc client that asks a picker as Envoy does) into a cache
# outside the repository, keyed by that version and the probe's source, beside the InferencePool
# CRD of the same version. A second run is instant. --print-dir: where they are.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
GIE_VERSION=$(awk '$1=="sigs.k8s.io/gateway-api-inference-extension" {print $2; exit}' "$here/go.mod")
key=$(cat "$here/go.mod" "$here/go.sum" "$here/probe/main.go" | sha256sum | cut -c1-12)
CACHE_ROOT=${PD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-operator}
OUT="$CACHE_ROOT/lwepp-${GIE_VERSION}-${key}"
if [ "${1:-}" = "--print-dir" ]; then echo "$OUT"; exit 0; fi
if [ -x "$OUT/lwepp" ] && [ -x "$OUT/pool-probe" ] && [ -f "$OUT/inferencepools.yaml" ]; then
  echo "[lwepp] cached in $OUT"; exit 0
fi
mkdir -p "$OUT"
exec 9>"$OUT/.lock"
flock 9   # two builds at once: one builds, the other waits and finds it done
if [ -x "$OUT/lwepp" ] && [ -x "$OUT/pool-probe" ] && [ -f "$OUT/inferencepools.yaml" ]; then exit 0; fi
export GOFLAGS="${GOFLAGS:-} -mod=mod -trimpath" CGO_ENABLED=0
start=$(date +%s)
echo "[lwepp] building GIE $GIE_VERSION cmd/lwepp and pool-probe (first build takes about two minutes)"
cd "$here"
go build -ldflags "-s -w" -o "$OUT/lwepp.tmp.$$" sigs.k8s.io/gateway-api-inference-extension/cmd/lwepp
go build -ldflags "-s -w" -o "$OUT/pool-probe.tmp.$$" ./probe
dir=$(go list -m -f '{{.Dir}}' sigs.k8s.io/gateway-api-inference-extension)
cp "$dir/config/crd/bases/inference.networking.k8s.io_inferencepools.yaml" "$OUT/inferencepools.yaml.tmp.$$"
mv "$OUT/lwepp.tmp.$$" "$OUT/lwepp"
mv "$OUT/pool-probe.tmp.$$" "$OUT/pool-probe"
mv "$OUT/inferencepools.yaml.tmp.$$" "$OUT/inferencepools.yaml"
echo "[lwepp] built in $(( $(date +%s) - start ))s: $OUT"
