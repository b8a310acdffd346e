"""What crosses process boundaries, in one place: the agent API's paths and wire models
(`agent_api`), the names the operator, agents, gateway and load generator agree on (labels,
annotations, ports, engine roles, link status codes: `names`), the environment of an engine pod
with the engine identity in it (`engine_env`) and of a gateway's pod (`gateway_env`), and MindIE's
rank table and role push (`mindie`): names, types and pure formats, no behaviour (the routing
the gateway and the load generator share is pd_router's). The operator, the agent and
the gateway depend on this package and not on each other."""
