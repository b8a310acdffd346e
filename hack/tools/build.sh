#!/usr/bin/env bash
# Build a pinned Go tool (actionlint, kind, kube-score) from the module next to this script into a cache
# outside the repository keyed by its version; print the binary's path.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tool=${1:?usage: build.sh actionlint|kind|kube-score}
case "$tool" in
  actionlint) mod=github.com/rhysd/actionlint; pkg=github.com/rhysd/actionlint/cmd/actionlint ;;
  kind) mod=sigs.k8s.io/kind; pkg=sigs.k8s.io/kind ;;
  kube-score) mod=github.com/zegl/kube-score; pkg=github.com/zegl/kube-score/cmd/kube-score ;;
  *) echo "unknown tool $tool" >&2; exit 2 ;;
esac
version=$(awk -v m="$mod" '$1==m {print $2}' "$here/go.mod")
out="${PD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-operator}/tools/$tool-$version"
if [ ! -x "$out" ]; then
  echo "[tools] building $tool $version" >&2
  mkdir -p "$(dirname "$out")"
  (cd "$here" && CGO_ENABLED=0 GOFLAGS="-mod=mod -trimpath" go build -ldflags "-s -w" -o "$out.tmp" "$pkg")
  mv "$out.tmp" "$out"
fi
echo "$out"
