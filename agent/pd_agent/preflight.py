"""The network preflight of the pod's NPUs, run by the pod's agent before its engines start and
again every RECHECK_S while they serve (pd_contract.preflight names the checks).

On Ascend (backend llm-datadist) each check is `hccn_tool -i <device> -<check> -g` from the
driver the pod mounts; on the simulator, llm_datadist_sim.hccn answers the same text for the
pod's loopback devices. With PD_PREFLIGHT=enforce (the default) the engines start only once every
check passed; `report` runs and reports them only; `off` runs none. The result is the agent's
`status.preflight`; the operator names failures in condition NetworkPreflight and links no pod
whose preflight failed (nor one whose TLS switch differs from the other nodes')."""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from pd_contract import preflight as pf
from pd_contract.agent_api import DeviceCheck, FaultsRequest, PreflightReport
from pd_contract.engine_env import PD_BACKEND, PD_HCCN_TOOL, PD_PREFLIGHT, PD_TENSOR_PARALLEL

from .devices import Device, Devices
from .http import wait_event

log = logging.getLogger("pd_agent.preflight")

RETRY_S = 3.0        # a failed preflight is run again this often
RECHECK_S = 15.0     # a passed one, this often
TOOL_TIMEOUT_S = 10.0
VALUE_CHARS, MESSAGE_CHARS = 256, 512   # pd_contract.agent_api.DeviceCheck's bounds
CONCURRENT_TOOLS = 8     # hccn_tool processes at once (TP 16 x 6 checks would otherwise be 96)
FAILS_TO_HOLD = 2        # a pod that passed is held only after this many failed runs in a row

Reader = Callable[[str, Device], Awaitable[str]]


def evaluate(devices: list[Device], answers: Mapping[tuple[int, str], str], source: str, enforced: bool,
             at: float) -> PreflightReport:
    """The report from every device's answer to every check (pure)."""
    failures: list[DeviceCheck] = []
    tls: dict[int, str | None] = {}
    for d in devices:
        dev = d.device_id if d.device_id is not None else d.rank
        for check in pf.CHECKS:
            value = pf.parse(check, answers.get((d.rank, check), ""))
            if check == "tls":
                tls[dev] = value
            if wrong := pf.judge(check, value, d.ip):   # the tool's text, bounded as the report's fields are
                failures.append(DeviceCheck(device_id=dev, check=check, value=(value or "")[:VALUE_CHARS],
                                            message=wrong[:MESSAGE_CHARS]))
    values = set(tls.values())
    if None not in values and len(values) > 1:
        odd = sorted(tls.items(), key=lambda kv: (str(kv[1]), kv[0]))
        failures.append(DeviceCheck(device_id=odd[0][0], check="tls",
                                    value=",".join(f"{k}:{v}" for k, v in odd)[:VALUE_CHARS],
                                    message="TLS switch differs between the pod's devices"))
    switch = values.pop() if len(values) == 1 else None
    return PreflightReport(state="failed" if failures else "passed", enforced=enforced, source=source,
                           devices=len(devices), tls_switch=(switch or "")[:8], failures=failures[:256],
                           checked_at=at)


def hccn_reader(tool: str) -> Reader:
    gate = asyncio.Semaphore(CONCURRENT_TOOLS)

    async def read(check: str, d: Device) -> str:
        if d.device_id is None:
            return ""
        async with gate:
            proc = await asyncio.create_subprocess_exec(*pf.command(check, d.device_id, tool),
                                                        stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.STDOUT)
            try:
                out, _ = await asyncio.wait_for(proc.communicate(), TOOL_TIMEOUT_S)
            except asyncio.TimeoutError:
                return ""
            finally:   # a hung tool, or the agent stopping: never left behind
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            return out.decode(errors="replace")
    return read


def held(pre: Preflight | None) -> bool:
    """The pod is held out of service: its enforced preflight failed (readiness fails, ranks wait)."""
    return pre is not None and pre.enforced and pre.report.state != "passed"


class Preflight:
    """The pod's preflight: runs the checks, keeps the last report, gates the engines' start."""

    def __init__(self, devices: Devices, enforced: bool, source: str, read: Reader | None,
                 clock: Callable[[], float]):
        self.devices, self.enforced, self.source, self.clock = devices, enforced, source, clock
        self.faults: Any = None
        if read is None:   # the simulator's devices
            from llm_datadist_sim.hccn import NetFaults, answer
            self.faults = NetFaults.from_env()

            async def read(check: str, d: Device) -> str:
                dev = d.device_id if d.device_id is not None else d.rank
                return answer(check, dev, d.rank, d.ip or "", self.faults)
        self.read: Reader = read
        self.report = PreflightReport(enforced=enforced, source=source, devices=len(devices.ranks),
                                      superpod=devices.superpod)
        self.poke = asyncio.Event()             # run again now (the simulated network changed)
        self.task: asyncio.Task | None = None
        self.fails = 0                          # failed runs in a row

    @classmethod
    def from_env(cls, devices: Devices, clock: Callable[[], float],
                 env: Mapping[str, str] | None = None) -> Preflight | None:
        """None when the pod runs no preflight: PD_PREFLIGHT=off, or not a pod the operator runs."""
        env = os.environ if env is None else env
        mode = (env.get(PD_PREFLIGHT) or "enforce").lower()
        if mode == "off" or not env.get(PD_TENSOR_PARALLEL):
            return None
        if mode not in pf.MODES:
            raise ValueError(f"{PD_PREFLIGHT} must be one of {', '.join(pf.MODES)}, got {mode!r}")
        if env.get(PD_BACKEND, "sim") == "sim":
            return cls(devices, mode == "enforce", "sim", None, clock)
        tool = env.get(PD_HCCN_TOOL) or shutil.which(pf.HCCN_TOOL) or next(
            (p for p in pf.HCCN_TOOL_PATHS if os.path.exists(p)), pf.HCCN_TOOL)
        return cls(devices, mode == "enforce", "hccn_tool", hccn_reader(tool), clock)

    async def run(self) -> PreflightReport:
        ranks = list(self.devices.ranks)
        keys = [(d, c) for d in ranks for c in pf.CHECKS]
        outs = await asyncio.gather(*(self.read(c, d) for d, c in keys), return_exceptions=True)
        answers = {(d.rank, c): (o if isinstance(o, str) else "") for (d, c), o in zip(keys, outs)}
        before = self.report.state
        report = evaluate(ranks, answers, self.source, self.enforced, self.clock()).model_copy(
            update={"superpod": self.devices.superpod})
        if outs and all(isinstance(o, OSError) for o in outs):   # the tool itself is missing or cannot run
            first = ranks[0].device_id if ranks and ranks[0].device_id is not None else 0
            report = report.model_copy(update={"failures": [DeviceCheck(
                device_id=first, check="hccn_tool", value=str(outs[0])[:VALUE_CHARS],
                message="hccn_tool cannot run: mount the driver (spec.ascend.driverPath) or name it with "
                        "PD_HCCN_TOOL, or set spec.datadist.preflight Report or Off")]})
        self.fails = self.fails + 1 if report.state == "failed" else 0
        if before == "passed" and 0 < self.fails < FAILS_TO_HOLD:
            return self.report   # one bad run of a pod that serves (a slow tool, a blip): looked at again first
        self.report = report
        if self.report.state != before:
            log.log(logging.INFO if self.report.state == "passed" else logging.WARNING, "network preflight %s%s",
                    self.report.state, "".join(f"; device {f.device_id} {f.check}: {f.message}"
                                               for f in self.report.failures[:8]))
        return self.report

    async def gate(self, stop: asyncio.Event) -> None:
        """Returns once the checks passed (enforced) or ran once (report only), or at stop."""
        while not stop.is_set():
            if (await self.run()).state == "passed" or not self.enforced:
                return
            await wait_event(stop, RETRY_S)

    def start(self, stop: asyncio.Event) -> None:
        """Runs the checks again until `stop`: a port that goes down later is reported."""
        async def watch() -> None:
            while not stop.is_set():
                again = self.report.state == "failed" or self.fails
                woke = asyncio.ensure_future(self.poke.wait())
                halt = asyncio.ensure_future(stop.wait())
                await asyncio.wait({woke, halt}, timeout=RETRY_S if again else RECHECK_S,
                                   return_when=asyncio.FIRST_COMPLETED)
                woke.cancel()
                halt.cancel()
                self.poke.clear()
                if not stop.is_set():
                    await self.run()
        self.task = asyncio.create_task(watch(), name="preflight")

    def set_faults(self, req: FaultsRequest) -> bool:
        """The simulated devices' network faults from an admin call; whether the call named any."""
        named: dict[str, Any] = {k: v for k, v in (("link_down", req.preflight_link_down),
                                                   ("tls_switch", req.preflight_tls_switch),
                                                   ("no_gateway", req.preflight_no_gateway)) if v is not None}
        if named and self.faults is not None:
            self.faults = self.faults.updated(**named)
            self.poke.set()
        return bool(named)


PREFLIGHT_FAULTS = {"preflight_link_down", "preflight_tls_switch", "preflight_no_gateway"}
