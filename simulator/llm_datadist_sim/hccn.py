"""The simulator's `hccn_tool`: what `hccn_tool -i <device> -<check> -g` prints, for the loopback
devices the local cluster gives a pod, so the network preflight runs the same parser on both
backends. Faults (spec.sim.faults.preflight*, or the agent's admin call at run time) make each
check fail: a rank's device link down, the pod's TLS switch flipped, no gateway."""
from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

from pd_contract.engine_env import PD_SIM_FAULT_

_ENV = {"link_down": PD_SIM_FAULT_ + "PREFLIGHT_LINK_DOWN", "tls_switch": PD_SIM_FAULT_ + "PREFLIGHT_TLS_SWITCH",
        "no_gateway": PD_SIM_FAULT_ + "PREFLIGHT_NO_GATEWAY"}


@dataclass(frozen=True)
class NetFaults:
    link_down: tuple[int, ...] = ()   # ranks whose device reports link DOWN (and net health failed)
    tls_switch: int = 0               # what every device of the pod reports
    no_gateway: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> NetFaults:
        seen = os.environ if env is None else env
        down = tuple(int(x) for x in (seen.get(_ENV["link_down"]) or "").split(",") if x.strip())
        return cls(link_down=down, tls_switch=int(seen.get(_ENV["tls_switch"]) or 0),
                   no_gateway=(seen.get(_ENV["no_gateway"]) or "").lower() in ("1", "true", "yes"))

    def updated(self, link_down: list[int] | None = None, tls_switch: int | None = None,
                no_gateway: bool | None = None) -> NetFaults:
        return replace(self, link_down=self.link_down if link_down is None else tuple(link_down),
                       tls_switch=self.tls_switch if tls_switch is None else tls_switch,
                       no_gateway=self.no_gateway if no_gateway is None else no_gateway)


def gateway_of(ip: str) -> str:
    """A device's gateway: .254 of its /24."""
    return str(ipaddress.ip_network(f"{ip}/24", strict=False).network_address + 254)


def answer(check: str, device_id: int, rank: int, ip: str, faults: NetFaults) -> str:
    """What hccn_tool prints for `check` on this device."""
    down = rank in faults.link_down
    if check == "link":
        return f"link status: {'DOWN' if down else 'UP'}\n"
    if check == "net_health":
        return f"net health status: {'Fault' if down or faults.no_gateway else 'Success'}\n"
    if check == "netdetect":
        return f"netdetect address: {gateway_of(ip)}\n"
    if check == "gateway":
        return "default gateway:, ifname:eth%d\n" % device_id if faults.no_gateway else \
            f"default gateway:{gateway_of(ip)}, ifname:eth{device_id}\n"
    if check == "ip":
        return f"ipaddr:{ip}\nnetmask:255.255.255.0\n"
    if check == "tls":
        return (f"dev_id:{device_id}, tls switch[{faults.tls_switch}](0:disable, 1:enable), tls preconfigured[1]"
                f"(0:non-preset, 1:preset), tls alarm time threshold[60]days\n")
    raise ValueError(f"unknown check {check!r}")
