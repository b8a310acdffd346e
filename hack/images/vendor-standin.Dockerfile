# A stand-in for a vendor's image (vllm-ascend, CANN, MindIE), to build the images of
# hack/images/vendor.Dockerfile FROM where the real one cannot be pulled (no registry here): the
# project's Python base with what pd-engine's dependencies meet in vllm-ascend 0.9.1's image (numpy
# below 2, aiohttp, httpx, pydantic 2, prometheus-client) in a python3 that `pip` installs into, as
# the vendors' images have it. No vLLM, no torch, no CANN: it proves the wheel installs beside a
# release's pins without changing them and imports, not that the vendor's software runs.
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}
COPY build/vllm-standin-wheels /tmp/wheels
RUN python3 -m venv /opt/vllm \
 && /opt/vllm/bin/pip install -q --no-index --find-links /tmp/wheels numpy==1.26.4 aiohttp httpx pydantic \
      prometheus-client \
 && rm -rf /tmp/wheels
ENV PATH=/opt/vllm/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
