"""`python -m pd_localcluster up|down|status|node-agent`: the local control plane."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from .cluster import LocalCluster, default_root
from .devices import DEFAULT_PER_NODE, DEFAULT_RESOURCE

HERE = Path(__file__).resolve()


def bin_dir_default() -> Path:
    build = HERE.parents[2] / "hack" / "k8s-bins" / "build.sh"
    return Path(subprocess.run([str(build), "--print-dir"], check=True, capture_output=True,
                               text=True).stdout.strip())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pd_localcluster", description=__doc__)
    ap.add_argument("--root", type=Path, default=None, help="state directory (default .localcluster)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start etcd, the control plane and the node agent")
    up.add_argument("--bin-dir", type=Path, default=None)
    up.add_argument("--nodes", type=int, default=3)
    up.add_argument("--runtime", choices=["process", "container"], default="process",
                    help="run pods as processes (default) or from their images under Docker")
    up.add_argument("--npus-per-node", type=int, default=None,
                    help=f"NPUs each node advertises (default $PD_LOCAL_NPUS_PER_NODE or {DEFAULT_PER_NODE})")
    up.add_argument("--npu-resource", default=None,
                    help=f"their extended resource name (default $PD_LOCAL_NPU_RESOURCE or {DEFAULT_RESOURCE})")
    sub.add_parser("down", help="stop everything `up` started and remove its state")
    sub.add_parser("status", help="exit 0 if the cluster is up")
    na = sub.add_parser("node-agent", help="(internal) run the local node agent")
    na.add_argument("--nodes", type=int, required=True)
    na.add_argument("--kubelet-port", type=int, required=True)
    na.add_argument("--pod-ip-base", type=int, default=100)
    na.add_argument("--runtime", choices=["process", "container"], default="process")
    na.add_argument("--npus-per-node", type=int, default=DEFAULT_PER_NODE)
    na.add_argument("--npu-resource", default=DEFAULT_RESOURCE)
    args = ap.parse_args(argv)
    root = (args.root or default_root()).resolve()
    if args.cmd == "node-agent":
        from .nodeagent import main as node_main
        node_main(root, args.nodes, args.kubelet_port, args.pod_ip_base, args.runtime,
                  args.npus_per_node, args.npu_resource)
        return 0
    cluster = LocalCluster(root)
    if args.cmd == "up":
        cluster.up(args.bin_dir or bin_dir_default(), nodes=args.nodes, runtime=args.runtime,
                   npus_per_node=args.npus_per_node, npu_resource=args.npu_resource)
    elif args.cmd == "down":
        cluster.down()
    elif args.cmd == "status":
        up_ = cluster.is_up()
        print("up" if up_ else "down")
        return 0 if up_ else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
