# The images, one target each: pd-operator, pd-sim-agent (the in-pod agent with the llm_datadist
# simulator), pd-gateway (the OpenAI- and Anthropic-compatible entry) and pd-reference-engine (the
# reference engine as an inference server beside the agent, spec.engine).
# `make images` (hack/images/build.sh) builds the wheels on the host first, then:
#   docker build --build-arg BASE=<base> --target pd-operator -t <registry>/pd-operator:<version> .
# BASE defaults to the official python image pinned by digest; where no registry is reachable,
# hack/images/base.sh builds an equivalent from Debian packages.
ARG BASE=python:3.11-slim-bookworm@sha256:2e32f7d302adc1c37428355c1e646897c0c53f4fd60b6a551245fb90ee129f91

FROM ${BASE} AS install
COPY build/wheels /wheels
# offline, from the wheels only; pip and setuptools do not reach the final images
RUN python3 -m venv /opt/pd \
 && /opt/pd/bin/pip install -q --no-index --find-links /wheels --no-compile pd-operator \
 && /opt/pd/bin/pip uninstall -q -y pip setuptools

FROM ${BASE} AS runtime
# USER too: getpass (Kopf's identity) reads it before the passwd database, so an arbitrary
# runAsUser without a passwd entry still works
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp USER=pd \
    PATH=/opt/pd/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
COPY --from=install /opt/pd /opt/pd
RUN echo "pd:x:10001:10001:pd:/tmp:/usr/sbin/nologin" >> /etc/passwd && echo "pd:x:10001:" >> /etc/group
# non-root; the pods run it with a read-only root filesystem (writes go to /tmp, an emptyDir)
USER 10001:10001

FROM runtime AS pd-operator
ENTRYPOINT ["/opt/pd/bin/python", "-m", "pd_operator"]

FROM runtime AS pd-gateway
EXPOSE 8000
ENTRYPOINT ["/opt/pd/bin/python", "-m", "pd_gateway"]

# the reference engine as an ordinary inference server (spec.engine): one process per rank, each
# calling pd_engine.rank.serve_rank; the pod's agent runs beside it from pd-sim-agent
FROM runtime AS pd-reference-engine
ENTRYPOINT ["/opt/pd/bin/python", "-m", "pd_engine.reference_server"]

# last, so a plain `docker build .` gives the agent
FROM runtime AS pd-sim-agent
EXPOSE 8080 26000
ENTRYPOINT ["/opt/pd/bin/python", "-m", "pd_agent"]
