"""Turn llm_datadist status codes into condition reasons and messages an engineer can act on."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Diagnosis:
    reason: str
    message: str


def link_failure(code: str, decoder: str, prefill: str, ip: str, port: int, timeout_ms: int) -> Diagnosis:
    where = f"{prefill} ({ip}:{port})"
    if code == "LLM_TIMEOUT":
        return Diagnosis("LinkTimeout",
                         f"link from {decoder} to {where} timed out after {timeout_ms} ms: raise "
                         f"spec.datadist.linkTimeoutMs (>200 ms advised) and check that the prompt side "
                         f"is initialised and listening")
    if code == "LLM_LINK_FAILED":
        return Diagnosis("EndpointUnreachable",
                         f"{where} refused or did not answer the link from {decoder}: check that {prefill} "
                         f"listens on port {port} and that no NetworkPolicy or firewall blocks it")
    if code == "LLM_CLUSTER_NUM_EXCEED_LIMIT":
        return Diagnosis("LinkLimit", f"{decoder} asked for more clusters than one link_clusters call allows "
                                      f"(16); the operator batches links, so this points at an engine limit")
    if code == "LLM_PROCESSING_LINK":
        return Diagnosis("LinkInProgress", f"{decoder} is still processing another link; retrying")
    if code == "LLM_ALREADY_LINK":
        return Diagnosis("AlreadyLinked", f"{decoder} already holds a link to {where}")
    return Diagnosis("LinkFailed", f"link from {decoder} to {where} failed with {code}")


def verify_failure(code: str, decoder: str, prefill: str, message: str, model_id: int) -> Diagnosis:
    pair = f"{decoder} <- {prefill}"
    if code == "LLM_KV_CACHE_NOT_EXIST":
        return Diagnosis("CacheKeyMismatch",
                         f"{pair}: the prompt side has no cache for the probe key; prompt_cluster_id, req_id "
                         f"and model_id (spec.model.modelId={model_id}) must match what it allocated. {message}")
    if code == "LLM_PARAM_INVALID":
        return Diagnosis("CacheDescMismatch",
                         f"{pair}: the two sides' CacheDescs differ (num_tensors/shape/dtype); both must come "
                         f"from the same spec.model.kvCache. {message}")
    if code in ("LLM_WAIT_PROCESS_TIMEOUT", "LLM_TIMEOUT"):
        return Diagnosis("PullTimeout", f"{pair}: the pull did not finish within spec.datadist.syncKvTimeoutMs; "
                                        f"the link is broken and will be re-made. {message}")
    if code in ("LLM_NOT_YET_LINK", "LLM_LINK_FAILED"):
        return Diagnosis("NotLinked", f"{pair}: no usable link for the probe. {message}")
    if code == "PEER_AGENT_UNREACHABLE":
        return Diagnosis("AgentUnreachable", f"{pair}: {message}")
    if code == "KV_CONTENT_MISMATCH":
        return Diagnosis("KVContentMismatch",
                         f"{pair}: the content probe's KV crossed the link wrong; {message}. The link reports "
                         f"success, so look at the prefill's engine and memory, not the network")
    if code == "ENGINE_MISMATCH":
        return Diagnosis("EngineMismatch", f"{pair}: {message}")
    if code == "DATA_MISMATCH":
        return Diagnosis("DataMismatch", f"{pair}: pulled bytes differ from the prefill's probe")
    return Diagnosis("VerifyFailed", f"{pair}: {code} {message}")


def proxy_warning(pods: dict[str, dict[str, str]]) -> Diagnosis:
    listed = "; ".join(f"{p}: {', '.join(sorted(v))}" for p, v in sorted(pods.items()))
    return Diagnosis("ProxyEnvironment",
                     f"proxy variables are set in {listed}; they can reroute datadist and agent traffic. "
                     f"Unset them in the pod spec or list the peers in no_proxy")
