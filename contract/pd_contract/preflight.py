"""The network preflight of an engine pod's NPUs, as Ascend's P-D deployment guides run it before
anything links: `hccn_tool -i <device> -<check> -g` for every device. The checks, the command
lines, what each answer looks like and what a failure means. Pure: names and formats only; the
pod's agent runs the checks (pd_agent.preflight), the simulator answers them for its loopback
devices (llm_datadist_sim.hccn), the operator reports them (condition NetworkPreflight)."""
from __future__ import annotations

import re

# check -> hccn_tool's option; in the order they are run and reported
CHECKS: dict[str, str] = {"link": "-link", "net_health": "-net_health", "netdetect": "-netdetect",
                          "gateway": "-gateway", "ip": "-ip", "tls": "-tls"}
HCCN_TOOL = "hccn_tool"
# where the driver puts it (spec.ascend.driverPath is mounted at the same path)
HCCN_TOOL_PATHS = ("/usr/local/Ascend/driver/tools/hccn_tool", "/usr/local/bin/hccn_tool")
MODES = ("enforce", "report", "off")     # PD_PREFLIGHT; the CRD's Enforce | Report | Off
RUNBOOK = "docs/operations.md#networkpreflight"

# what to do about a failed check (the condition's and kubectl pdd verify's text)
HINTS: dict[str, str] = {
    "link": "the device's port is down: check the cable and the switch port (hccn_tool -i N -lldp -g names it)",
    "net_health": "the device cannot reach its detect address: check the switch, the VLAN and the detect "
                  "address (hccn_tool -i N -netdetect -s address ...)",
    "netdetect": "no detect address is set: set one (hccn_tool -i N -netdetect -s address <gateway>)",
    "gateway": "no gateway is set: set it (hccn_tool -i N -gateway -s gateway <ip>) or KV links across "
               "subnets time out",
    "ip": "the device's IP differs from the one the pod was given (device plugin annotation or /etc/hccn.conf)",
    "tls": "the TLS switch differs between devices or nodes: make it equal everywhere (hccn_tool -i N -tls -s "
           "enable 0|1); link_clusters times out across a difference",
    "hccn_tool": "the pod cannot run hccn_tool: mount the driver (spec.ascend.driverPath) or set PD_HCCN_TOOL",
}

_VALUE = {
    "link": re.compile(r"link\s*status\s*:\s*(\w+)", re.I),
    "net_health": re.compile(r"net\s*health\s*status\s*:\s*([\w ]+?)\s*$", re.I | re.M),
    "netdetect": re.compile(r"netdetect\s*address\s*:\s*(\S*)", re.I),
    "gateway": re.compile(r"gateway\s*:\s*([0-9a-fA-F.:]*)", re.I),
    "ip": re.compile(r"ipaddr\s*:\s*(\S+)", re.I),
    "tls": re.compile(r"tls\s*switch\s*\[\s*(\d)\s*\]", re.I),
}


def command(check: str, device_id: int, tool: str = HCCN_TOOL) -> list[str]:
    return [tool, "-i", str(device_id), CHECKS[check], "-g"]


def parse(check: str, text: str) -> str | None:
    """The value a check's answer gives (e.g. "UP", "Success", an address, "0"), or None when the
    answer holds none (an empty gateway is "")."""
    m = _VALUE[check].search(text or "")
    return m.group(1).strip() if m else None


def judge(check: str, value: str | None, expected_ip: str | None = None) -> str:
    """"" when the check passed, else what is wrong (short, for the condition)."""
    if value is None:
        return "no answer"
    if check == "link":
        return "" if value.upper() == "UP" else f"link {value}"
    if check == "net_health":
        return "" if value.lower() == "success" else f"net health {value}"
    if check in ("netdetect", "gateway"):
        return "" if value and value not in ("0.0.0.0", "::") else f"no {check} address"
    if check == "ip":
        return "" if expected_ip is None or value == expected_ip else f"ip {value}, expected {expected_ip}"
    return ""   # tls: judged across devices and nodes
