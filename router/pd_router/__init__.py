"""P-D routing, shared by pd-gateway and the load generator (`routing`): the engines of a
deployment as their agents report them, and how a request goes through a prefill and a decoder
with retries elsewhere and nothing sent to a draining or switching engine. It depends on
pd_contract (the agent API's wire models and names) and on nothing else of the project."""
