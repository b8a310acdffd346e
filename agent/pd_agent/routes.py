"""The agent API's one route table, and the service that answers it.

Two agents serve this API: the single-rank agent (and each rank process of a multi-rank pod)
over its AgentCore (`server.CoreAPI`), and the pod's agent in front of its ranks (`front.Front`).
Each is an `AgentService`: a method a route, named by `Route.op`; `http.api_routes` turns the
table into aiohttp routes over a service. A new route is one row here and its handler in the
services that offer it.

Scopes (the auth middleware reads them from here): `open` needs no token (only paths outside
/v1/); `control` is the operator's token only; `data` also takes the data token (what a router
needs); `peer` also takes the peer token (the other agents' pull notices)."""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar, Literal, Union

from aiohttp import web
from pydantic import BaseModel

from pd_contract.agent_api import (
    AgentPath,
    AgentStatus,
    DecodeRequest,
    DrainRequest,
    FaultsRequest,
    GangRequest,
    LinkRequest,
    NotifyRequest,
    PrefillRequest,
    ProbeRequest,
    PullRequest,
    RegisterRank,
    SwitchRoleRequest,
    UnlinkRequest,
    VerifyRequest,
)

Scope = Literal["open", "control", "data", "peer"]
Reply = Union[BaseModel, dict, None]   # a handler's result: the JSON reply (None: the agent's status)
Where = Literal["agent", "front"]   # who offers a route: the single-rank agent (a rank process), the pod's front


@dataclass(frozen=True)
class Route:
    method: str                      # GET (HEAD too), POST, or * (any)
    path: str
    op: str                          # the AgentService method that answers it
    model: type[BaseModel] | None = None   # the request body, validated (400 naming the field); None: no body
    scope: Scope = "control"
    control_fields: tuple[str, ...] = ()   # body fields only these scopes may set (others: 403)
    control_scopes: tuple[str, ...] = ("control",)
    request: bool = False            # the handler takes the aiohttp request too and answers itself
    changes: bool = False            # the call may change the agent's state: its next status is asked afresh
    on: frozenset[Where] = frozenset({"agent", "front"})
    serving: bool = False            # the agent's serving (an agent built without inference leaves it out)


ONLY_AGENT: frozenset[Where] = frozenset({"agent"})
ONLY_FRONT: frozenset[Where] = frozenset({"front"})

ROUTES: tuple[Route, ...] = (
    # open: readiness (the engine is initialised), liveness (the process answers), metrics
    Route("GET", AgentPath.HEALTHZ, "healthz", scope="open", request=True),
    Route("GET", AgentPath.LIVEZ, "livez", scope="open", request=True),
    Route("GET", AgentPath.METRICS, "metrics", scope="open", request=True),
    Route("GET", AgentPath.STATUS, "get_status", scope="data"),
    # a rank process registers its local API with the pod's agent
    Route("POST", AgentPath.RANKS, "register_rank", RegisterRank, on=ONLY_FRONT),
    # the ranks registered here (an instance's leading pod takes its other pods' on)
    Route("GET", AgentPath.RANKS, "get_ranks", on=ONLY_FRONT),
    Route("POST", AgentPath.GANG, "gang", GangRequest, changes=True, on=ONLY_FRONT),
    Route("POST", AgentPath.INIT, "init", changes=True),
    Route("POST", AgentPath.LINK, "link", LinkRequest, changes=True),
    Route("POST", AgentPath.UNLINK, "unlink", UnlinkRequest, changes=True),
    Route("POST", AgentPath.SWITCH_ROLE, "switch_role", SwitchRoleRequest, changes=True),
    Route("POST", AgentPath.VERIFY, "verify", VerifyRequest, changes=True),
    Route("POST", AgentPath.PROBE, "probe", ProbeRequest),
    Route("POST", AgentPath.DRAIN, "drain", DrainRequest, changes=True),
    Route("POST", AgentPath.UNDRAIN, "undrain", changes=True),
    Route("POST", AgentPath.NOTIFY, "notify", NotifyRequest, scope="peer", control_fields=("released",),
          control_scopes=("control", "peer")),
    Route("POST", AgentPath.FAULTS, "set_faults", FaultsRequest, changes=True),
    Route("GET", AgentPath.FAULTS, "get_faults"),
    Route("POST", AgentPath.PREFILL, "prefill", PrefillRequest, scope="data", control_fields=("admitted",),
          serving=True),
    # plain JSON, or NDJSON as the tokens come (`stream`): the service answers itself
    Route("POST", AgentPath.DECODE, "decode", DecodeRequest, scope="data", control_fields=("admitted", "kv_pulled_ms"),
          request=True, serving=True),
    Route("POST", AgentPath.PULL, "pull", PullRequest, on=ONLY_AGENT, serving=True),
    # a rank of a multi-rank decoder: the shard it pulled for a request, once
    Route("GET", AgentPath.KV, "kv", request=True, on=ONLY_AGENT, serving=True),
    # /r/<rank>/<path>: that rank's own API; outside /v1/, so the proxy checks the token itself
    Route("*", AgentPath.RANK_PROXY, "proxy", scope="open", request=True, on=ONLY_FRONT),
)

DATA_ROUTES = {(r.method, r.path) for r in ROUTES if r.scope == "data"}
PEER_ROUTES = {(r.method, r.path) for r in ROUTES if r.scope == "peer"}


class AgentService(abc.ABC):
    """What answers the agent API. A handler gets the validated body (if its route has a model)
    and the request (if `Route.request`); it returns a model or a dict (the JSON reply), None
    (the reply is `current_status()`), or, for `Route.request`, the response itself. Errors are
    raised (AgentError, web.HTTPException): the error middleware answers them."""

    where: ClassVar[Where]

    def offers(self, route: Route) -> bool:
        return self.where in route.on

    def changed(self) -> None:  # noqa: B027 - a hook; most services keep nothing to refresh
        """A call of a `changes` route succeeded."""

    @abc.abstractmethod
    async def current_status(self) -> AgentStatus:
        """The reply of a call that returns nothing."""

    # ---- open ----
    @abc.abstractmethod
    async def healthz(self, request: web.Request) -> web.Response: ...

    @abc.abstractmethod
    async def livez(self, request: web.Request) -> web.Response: ...

    @abc.abstractmethod
    async def metrics(self, request: web.Request) -> web.Response: ...

    # ---- control (and data: get_status; peer: notify) ----
    @abc.abstractmethod
    async def get_status(self) -> AgentStatus: ...

    @abc.abstractmethod
    async def init(self) -> Reply: ...

    @abc.abstractmethod
    async def link(self, req: LinkRequest) -> Reply: ...

    @abc.abstractmethod
    async def unlink(self, req: UnlinkRequest) -> Reply: ...

    @abc.abstractmethod
    async def switch_role(self, req: SwitchRoleRequest) -> Reply: ...

    @abc.abstractmethod
    async def verify(self, req: VerifyRequest) -> Reply: ...

    @abc.abstractmethod
    async def probe(self, req: ProbeRequest) -> Reply: ...

    @abc.abstractmethod
    async def drain(self, req: DrainRequest) -> Reply: ...

    @abc.abstractmethod
    async def undrain(self) -> Reply: ...

    @abc.abstractmethod
    async def notify(self, req: NotifyRequest) -> Reply: ...

    @abc.abstractmethod
    async def set_faults(self, req: FaultsRequest) -> Reply: ...

    @abc.abstractmethod
    async def get_faults(self) -> Reply: ...

    # ---- serving (data) ----
    @abc.abstractmethod
    async def prefill(self, req: PrefillRequest) -> Reply: ...

    @abc.abstractmethod
    async def decode(self, req: DecodeRequest, request: web.Request) -> web.StreamResponse: ...

    # ---- offered by one side only (`Route.on`): the other never routes them ----
    async def pull(self, req: PullRequest) -> Reply:
        raise web.HTTPNotFound()

    async def kv(self, request: web.Request) -> web.Response:
        raise web.HTTPNotFound()

    async def register_rank(self, req: RegisterRank) -> Reply:
        raise web.HTTPNotFound()

    async def proxy(self, request: web.Request) -> web.Response:
        raise web.HTTPNotFound()

    async def get_ranks(self) -> Reply:
        raise web.HTTPNotFound()

    async def gang(self, req: GangRequest) -> Reply:
        raise web.HTTPNotFound()


# the table and the service agree: every op is a method, and the middleware opens exactly the open routes
assert all(callable(getattr(AgentService, r.op, None)) for r in ROUTES)
assert all((r.scope == "open") == (not r.path.startswith(AgentPath.API)) for r in ROUTES)
