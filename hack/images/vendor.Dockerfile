# pd-operator's engine wheel (pd-engine: the KV connector pd_engine.vllm_connector, the rank runtime
# and the agent) installed into a vendor's image, offline, changing nothing the vendor's image has
# (the wheel's dependencies are ranges its Python already meets). `make images` builds three:
#   --target engine FROM a vllm-ascend release -> vllm-ascend-pd   (spec.engine.image, adapter vLLM)
#   --target agent  FROM a CANN image          -> pd-ascend-agent  (spec.image, backend llm-datadist)
#   --target agent  FROM a MindIE image        -> mindie-pd-agent  (spec.image with spec.mindie)
# By hand:
#   python hack/engine-wheel/build.py --out dist
#   docker build --network host -f hack/images/vendor.Dockerfile --target engine \
#     --build-arg BASE=quay.io/ascend/vllm-ascend:v0.9.1 -t <registry>/vllm-ascend-pd:v0.9.1 .
# Build for the nodes' architecture (arm64 or x86_64) from the base published for it.
ARG BASE
FROM ${BASE} AS engine
COPY dist/pd_engine-*.whl /tmp/pd-engine/
RUN python3 -m pip install --no-index --find-links /tmp/pd-engine --no-compile pd-engine \
 && rm -rf /tmp/pd-engine \
 && python3 -c "import pd_engine.vllm_connector, pd_engine.rank, pd_agent.core; print('pd-engine', pd_engine.__file__)"

# the pod's agent beside the vendor's engine: its identity, ports, probes and the engines' links
FROM engine AS agent
ENTRYPOINT ["python3", "-m", "pd_agent"]
