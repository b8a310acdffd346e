"""What crosses process boundaries, in one place: the agent API's wire models
(`agent_api`), the names the operator, agents, gateway and load generator agree on (labels,
annotations, ports, link status codes: `names`), and the P-D routing the gateway and the load
generator share (`routing`). The operator, the agent and the gateway depend on this package
and not on each other."""
