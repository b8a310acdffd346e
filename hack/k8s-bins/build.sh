#!/usr/bin/env bash
# Builds the local control plane's binaries (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl, helm) from the pinned wrapper modules next to this script, into a
# cache outside the repository keyed by version, so a second run is instant. --print-dir: where
# they are; --helm: build helm only and print its path.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
K8S_VERSION=$(awk '$1=="require" && $2=="k8s.io/kubernetes" {print $3}' "$here/kubernetes/go.mod")
ETCD_VERSION=$(awk '$1=="require" && $2=="go.etcd.io/etcd/server/v3" {print $3}' "$here/etcd/go.mod")
HELM_VERSION=$(awk '$1=="require" && $2=="helm.sh/helm/v3" {print $3}' "$here/helm/go.mod")
CACHE_ROOT=${PD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-operator}
BIN_DIR="$CACHE_ROOT/k8s-${K8S_VERSION}-etcd-${ETCD_VERSION}-helm-${HELM_VERSION}"
export GOFLAGS="${GOFLAGS:-} -mod=mod -trimpath" CGO_ENABLED=0

HELM_FLAGS="-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"

if [ "${1:-}" = "--print-dir" ]; then echo "$BIN_DIR"; exit 0; fi
mkdir -p "$BIN_DIR"
start=$(date +%s)
log() { printf '[k8s-bins %4ss] %s\n' "$(( $(date +%s) - start ))" "$*"; }

# build <module dir> <package> <output> [ldflags]
build() {
  local dir=$1 pkg=$2 out=$3 ldflags=${4:-}
  if [ -x "$BIN_DIR/$out" ]; then log "$out: cached"; return; fi
  # two builds at once (two suites, a suite and a benchmark): one builds, the other waits for it;
  # each writes its own temporary file, and the rename is atomic
  exec 9>"$BIN_DIR/.$out.lock"
  flock 9
  if [ -x "$BIN_DIR/$out" ]; then log "$out: built meanwhile"; exec 9>&-; return; fi
  log "$out: building $pkg (first build takes several minutes)"
  local tmp="$BIN_DIR/$out.tmp.$$"
  (cd "$here/$dir" && go build -ldflags "-s -w $ldflags" -o "$tmp" "$pkg")
  mv "$tmp" "$BIN_DIR/$out"
  exec 9>&-
  log "$out: done"
}

# helm alone (what rendering the chart needs, tests/unit/test_kube_score.py): its path on stdout
if [ "${1:-}" = "--helm" ]; then build helm helm.sh/helm/v3/cmd/helm helm "$HELM_FLAGS" >&2; echo "$BIN_DIR/helm"; exit 0; fi

if ! ls "$BIN_DIR"/{etcd,kube-apiserver,kube-controller-manager,kube-scheduler,kubectl,helm} >/dev/null 2>&1; then
  log "downloading Go modules (progress below; cached in $(go env GOMODCACHE))"
  for d in etcd kubernetes helm; do (cd "$here/$d" && go mod download -x 2>&1 | grep --line-buffered -E '^# get .*\.zip$' | sed -u "s/^/  [$d] /" || true); done
fi

minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
vflags=""
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  vflags+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
  vflags+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
done
build etcd go.etcd.io/etcd/server/v3 etcd
for c in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
  build kubernetes "k8s.io/kubernetes/cmd/$c" "$c" "$vflags"
done
build helm helm.sh/helm/v3/cmd/helm helm "$HELM_FLAGS"
log "all binaries in $BIN_DIR"
