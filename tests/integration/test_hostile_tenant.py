"""A tenant whose engine pods answer the operator with hostile code, beside a healthy deployment
in another namespace under one operator: the hostile agents answer 80 MiB bodies, drip a byte
every two seconds, nest JSON 200,000 deep, report a 40 MiB last_error and 100,000 invented link
codes, in turn. The operator's memory stays bounded and the healthy deployment keeps
reconciling, switching and serving with no failed request."""
from __future__ import annotations

import time
import uuid

import pytest

from tests.conftest import Cluster, wait_for
from tests.integration.conftest import OperatorProc, pdd, sample, wait_phase
from tests.integration.test_switching import REBALANCE, set_prefill, switched
from tests.integration.test_traffic import TRAFFIC_SPEC, Load

pytestmark = pytest.mark.integration

# the hostile agent: stdlib only, on the pod's address and the agent port; /healthz is answered
# (the pod is Ready), every other path in turn with one of the attacks
HOSTILE = r'''
import http.server, itertools, json, os, socketserver, time
turn = itertools.count()
def status(**kw):
    return {"pod": os.environ.get("HOSTNAME", "x"), "role": "decoder", "cluster_id": 1, "boot_id": "b",
            "backend": "sim", "initialized": True, "ip": "127.0.0.1", "port": 26000, "model_id": 0,
            "draining": False, "links": [], **kw}
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def send(self, body, length=None):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)
    def answer(self):
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            self.rfile.read(n)
        if self.path == "/healthz":
            return self.send(b'{"ok": true}')
        kind = next(turn) % 5
        if kind == 0:
            self.send(b"", 80 << 20)
            chunk = b" " * (1 << 20)
            for _ in range(80):
                self.wfile.write(chunk)
        elif kind == 1:
            self.send(b"", 1000)
            for _ in range(30):
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(2)
        elif kind == 2:
            self.send(b"[" * 200000 + b"]" * 200000)
        elif kind == 3:
            self.send(json.dumps(status(last_error="x" * (40 << 20))).encode())
        else:
            links = [{"name": f"p{i}", "cluster_id": i, "code": f"LLM_INVENTED_{i}"} for i in range(100000)]
            self.send(json.dumps(status(links=links)).encode())
    def do_GET(self):
        try:
            self.answer()
        except OSError:
            pass
    do_POST = do_GET
class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
S((os.environ["LLM_DATADIST_IP"], 8080), H).serve_forever()
'''
RSS_LIMIT_MIB = 300


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident set (VmHWM), in MiB."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


@pytest.mark.timeout(900)
def test_a_hostile_tenant_cannot_stall_or_bloat_the_operator(cluster: Cluster, crd, namespace: str, tmp_path):
    assert len(HOSTILE) < 4096, "one argument of spec.prefill.args"
    hostile_ns = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", hostile_ns)
    op = OperatorProc(cluster, f"{namespace},{hostile_ns}", tmp_path)
    try:
        wait_for(f"default ServiceAccount in {hostile_ns}",
                 lambda: cluster.kubectl("get", "sa", "default", "-n", hostile_ns, check=False).returncode == 0)
        op.start()
        hostile = sample(name="hostile", **{"prefill.replicas": 2, "decoder.replicas": 2})
        for g in ("prefill", "decoder"):
            hostile["spec"][g].update(command=["python3", "-c", HOSTILE])
        cluster.apply(hostile, hostile_ns)
        cluster.apply(sample(**TRAFFIC_SPEC, rebalance=REBALANCE), namespace)
        wait_phase(cluster, namespace, "Ready", timeout=180, extra=lambda o: o["status"]["linksSummary"] == "4/4")

        def hostile_asked():
            members = (pdd(cluster, hostile_ns, "hostile").get("status") or {}).get("members") or []
            errors = [m.get("lastError") or "" for m in members]
            # each agent was asked, answered, and its answer refused (not merely unreachable)
            return len([e for e in errors if "answered" in e or "within" in e]) >= 4 and errors
        errors = wait_for("every hostile agent asked and its answer refused", hostile_asked, timeout=180)
        assert all(len(e) <= 2048 for e in errors), [len(e) for e in errors]
        time.sleep(20)   # a few more rounds of every attack

        load = Load(cluster, namespace, duration=300)
        time.sleep(3)
        with load.change("decoder -> prefill beside the hostile tenant"):
            set_prefill(cluster, namespace, 3)
            switched(cluster, namespace, "prefill", None, "3/3", timeout=180)
        time.sleep(3)
        s = load.stop()
        assert s["failed"] == 0, s["failed_by_reason"]
        assert s["completed"] == s["requests"] > 0, s
        load.assert_traffic_through_changes()
        peak = peak_rss_mib(op.proc.pid)
        print(f"\noperator peak RSS {peak:.0f} MiB beside the hostile tenant; its members' errors: "
              f"{sorted({e[:80] for e in errors})}")
        assert peak < RSS_LIMIT_MIB, f"the operator's peak RSS was {peak:.0f} MiB"
        assert op.proc.poll() is None
    finally:
        op.stop()
        cluster.kubectl("delete", "namespace", hostile_ns, "--wait=false", check=False)
