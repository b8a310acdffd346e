#!/usr/bin/env bash
# make demo: install the operator with its Helm chart on the local cluster, apply
# examples/sim-small.yaml, wait until its links are up and verified, then drive load.
set -euo pipefail
cd "$(dirname "$0")/.."
export KUBECONFIG="$PWD/.localcluster/kubeconfig"
kubectl="$BIN_DIR/kubectl"
helm="$BIN_DIR/helm"
step() { printf '\n\033[1m==> %s\033[0m\n' "$*"; }

# the namespace it watches first: the chart gives the operator its rights there, in Roles
"$kubectl" create namespace pd-demo --dry-run=client -o yaml | "$kubectl" apply -f - >/dev/null

step "installing the operator (charts/pd-operator) into pd-system, watching pd-demo"
# watching pd-demo only: the cluster is also where `make test` runs, and an operator watching every
# namespace would act on the tests' deployments beside each test's own operator
"$helm" upgrade --install pd-operator charts/pd-operator -n pd-system --create-namespace \
  --set image.repository=example.com/pd/pd-operator --set 'watchNamespaces={pd-demo}' --wait --timeout 120s
"$kubectl" -n pd-system get pods -o wide

step "applying examples/sim-small.yaml (2 prefill + 2 decoder, simulator backend)"
"$kubectl" -n pd-demo apply -f examples/sim-small.yaml

step "waiting for phase Ready (links up, KV path verified)"
"$kubectl" -n pd-demo wait pdd/sim-small --for=jsonpath='{.status.phase}'=Ready --timeout=180s
"$kubectl" -n pd-demo get pdd
"$kubectl" -n pd-demo get pods -o wide -L pdoperator.io/role
echo
"$kubectl" -n pd-demo get pdd sim-small \
  -o jsonpath='{range .status.conditions[*]}{.type}{"\t"}{.status}{"\t"}{.reason}{"\t"}{.message}{"\n"}{end}'

step "events"
"$kubectl" -n pd-demo get events --field-selector involvedObject.kind=PDDeployment \
  --sort-by=.lastTimestamp -o custom-columns=TYPE:.type,REASON:.reason,MESSAGE:.message | tail -n 8

step "10 s of simulated chat traffic through the linked pairs"
# the routers' (data-scope) token: status, prefill and decode only
token=$("$kubectl" -n pd-demo get secret sim-small-agent-data-token -o jsonpath='{.data.token}' | base64 -d)
"$PY" -m pd_agent.loadgen --kubeconfig "$KUBECONFIG" --namespace pd-demo --deployment sim-small \
  --token "$token" --rate 8 --duration 10 --max-prompt 1024 --max-output 32

step "real text: examples/sim-chat.yaml (the reference engine behind pd-gateway, TP 2)"
"$kubectl" -n pd-demo create secret generic sim-chat-keys --from-literal=demo=sk-pd-demo-key-0001 \
  --dry-run=client -o yaml | "$kubectl" apply -f - >/dev/null
"$kubectl" -n pd-demo label secret sim-chat-keys pdoperator.io/keys=true --overwrite >/dev/null
"$kubectl" -n pd-demo apply -f examples/sim-chat.yaml
"$kubectl" -n pd-demo wait pdd/sim-chat --for=jsonpath='{.status.phase}'=Ready --timeout=240s
"$kubectl" -n pd-demo wait pod -l pdoperator.io/gateway=sim-chat --for=condition=Ready --timeout=120s
gw=$("$kubectl" -n pd-demo get pod -l pdoperator.io/gateway=sim-chat -o jsonpath='{.items[0].status.podIP}')
question="What does a decoder pull from a prefill engine?"
echo "Q: $question"
for _ in $(seq 30); do   # the gateway routes once it has seen a linked pair
  answer=$(curl -s --noproxy '*' "http://$gw:8000/v1/chat/completions" -H "Authorization: Bearer sk-pd-demo-key-0001" \
    -H "Content-Type: application/json" \
    -d "{\"model\": \"tiny-chat\", \"max_tokens\": 24, \"temperature\": 0, \"messages\": [{\"role\": \"user\", \"content\": \"$question\"}]}")
  echo "$answer" | grep -q '"choices"' && break
  sleep 1
done
"$PY" -c 'import json, sys; r = json.loads(sys.argv[1]); print("A:", repr(r["choices"][0]["message"]["content"])); print("  usage:", r["usage"])' "$answer"
echo "(a small transformer with seeded weights: its text is not meant to be good; the tokens, the KV each"
echo " rank computed and the pulls are real, and P-D output equals one engine's token for token)"
echo
echo "Done. Try: KUBECONFIG=$KUBECONFIG $kubectl -n pd-demo get pdd -w"
