#!/usr/bin/env bash
# make busy-machine / busy-machine-stop: load this machine the way the test suite must survive.
# A second local cluster (its own state directory, ports and pod addresses) runs the operator
# from the chart and examples/sim-small.yaml (2 prefill + 2 decoder) under continuous traffic,
# and stress-ng keeps both cores busy. Then run `bash .ci/run` beside it.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${PY:=.venv/bin/python}" "${BIN_DIR:?BIN_DIR: the k8s-bins directory}"
root=${PD_BUSY_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-operator/busy-machine}
pids="$root/pids"
export KUBECONFIG="$root/localcluster/kubeconfig"
kubectl="$BIN_DIR/kubectl"

stop() {
  if [ -f "$pids" ]; then
    while read -r pid; do kill -- "-$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true; done < "$pids"
    rm -f "$pids"
  fi
  "$PY" -m pd_localcluster --root "$root/localcluster" down || true
}

if [ "${1:-start}" = stop ]; then
  stop
  echo "[busy-machine] stopped"
  exit 0
fi

if ! command -v stress-ng >/dev/null; then
  echo "[busy-machine] installing stress-ng (apt)"
  sudo_=""; [ "$(id -u)" = 0 ] || sudo_=sudo
  $sudo_ apt-get install -y -q stress-ng >/dev/null
fi
mkdir -p "$root"
"$PY" -m pd_localcluster --root "$root/localcluster" up --bin-dir "$BIN_DIR"
"$BIN_DIR/helm" upgrade --install pd-operator charts/pd-operator -n pd-system --create-namespace \
  --set image.repository=example.com/pd/pd-operator --wait --timeout 180s
"$kubectl" create namespace pd-demo --dry-run=client -o yaml | "$kubectl" apply -f - >/dev/null
"$kubectl" -n pd-demo apply -f examples/sim-small.yaml
"$kubectl" -n pd-demo wait pdd/sim-small --for=jsonpath='{.status.phase}'=Ready --timeout=300s
token=$("$kubectl" -n pd-demo get secret sim-small-agent-data-token -o jsonpath='{.data.token}' | base64 -d)

# traffic for as long as the machine stays busy (five-minute loadgen runs, again and again)
setsid bash -c "while :; do '$PY' -m pd_agent.loadgen --kubeconfig '$KUBECONFIG' --namespace pd-demo \
  --deployment sim-small --token '$token' --rate ${PD_BUSY_RATE:-8} --duration 300 --max-prompt 1024 \
  --max-output 64 >> '$root/loadgen.log' 2>&1; done" </dev/null >/dev/null 2>&1 &
echo $! >> "$pids"
setsid stress-ng --cpu "${PD_BUSY_CPUS:-2}" --timeout 0 --quiet </dev/null >/dev/null 2>&1 &
echo $! >> "$pids"
echo "[busy-machine] second cluster $KUBECONFIG: sim-small Ready, traffic at ${PD_BUSY_RATE:-8} req/s," \
     "stress-ng --cpu ${PD_BUSY_CPUS:-2}; stop with: make busy-machine-stop"
