"""Names other processes and users rely on (DESIGN.md §7): keep them stable."""
from __future__ import annotations

GROUP = "pdoperator.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# pod labels: the first two are immutable (StatefulSet selectors), the role follows switches
LABEL_DEPLOYMENT = f"{GROUP}/deployment"
LABEL_GROUP = f"{GROUP}/group"
LABEL_ROLE = f"{GROUP}/role"
LABEL_GATEWAY = f"{GROUP}/gateway"
LABEL_PDGATEWAY = f"{GROUP}/pdgateway"   # on the pods of a PDGateway (a gateway shared by deployments)
LABEL_KEYS = f"{GROUP}/keys"         # "true" on a Secret that may serve as a gateway's API keys
# the role an engine starts in, read at every container start (survives restarts mid-switch)
ANNOTATION_ROLE = f"{GROUP}/assigned-role"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
GANG_GATE = f"{GROUP}/gang"
# a prefill an instance could not make whole (a rank of it gone): it kept nothing, another instance may take it
INSTANCE_INCOMPLETE = "INSTANCE_INCOMPLETE"             # the scheduling gate an instance of several pods waits behind
SWITCHING = "switching"      # the role label while a pod is out of both role Services

# llm-d's labels, kept true through switches for the inference gateways people already run (GIE
# InferencePools, llm-d's P/D scheduler): the role an engine serves now, and whether it serves at
# all. Both go when a switch starts (before the drain) and come back after relink and verify.
LLMD_ROLE = "llm-d.ai/role"
LLMD_SERVING = "llm-d.ai/inferenceServing"
LLMD_ROLE_OF = {"prefill": "prefill", "decoder": "decode"}


def llmd_labels(role_label: str) -> dict[str, str | None]:
    """The llm-d labels of a pod whose pdoperator.io/role label is `role_label` (None: absent)."""
    role = LLMD_ROLE_OF.get(role_label)
    return {LLMD_ROLE: role, LLMD_SERVING: "true" if role else None}

# the engine roles (LLM-DataDist's names), and the one each of the operator's groups starts in
PROMPT = "prompt"
DECODER = "decoder"
ENGINE_ROLES = (PROMPT, DECODER)
ENGINE_ROLE = {"prefill": PROMPT, "decoder": DECODER}

FIELD_MANAGER = "pd-operator"   # the operator's one field manager (server-side apply)
AGENT_PORT = 8080            # the agent's HTTP API
GATEWAY_PORT = 8000          # pd-gateway
# pd-gateway's /metrics and /stats: per-key names and usage, so not on the public API port
GATEWAY_METRICS_PORT = 9090
# the agent's /metrics alone (it is on AGENT_PORT too): scrapers are admitted here, not to the API
AGENT_METRICS_PORT = 9091
DATADIST_PORT = 26000        # LLM-DataDist's listen port (the default of spec.datadist.port)

# LLM-DataDist's status codes (LLMStatusCode's names): what an agent may answer for a link
STATUS_CODES = frozenset({
    "LLM_SUCCESS", "LLM_FAILED", "LLM_PARAM_INVALID", "LLM_WAIT_PROCESS_TIMEOUT", "LLM_KV_CACHE_NOT_EXIST",
    "LLM_REPEAT_REQUEST", "LLM_REQUEST_ALREADY_COMPLETED", "LLM_ENGINE_FINALIZED", "LLM_NOT_YET_LINK",
    "LLM_ALREADY_LINK", "LLM_LINK_FAILED", "LLM_UNLINK_FAILED", "LLM_NOTIFY_PROMPT_UNLINK_FAILED",
    "LLM_CLUSTER_NUM_EXCEED_LIMIT", "LLM_PROCESSING_LINK", "LLM_DEVICE_OUT_OF_MEMORY", "LLM_PREFIX_ALREADY_EXIST",
    "LLM_PREFIX_NOT_EXIST", "LLM_SEQ_LENOVERLIMIT", "LLM_NO_FREE_BLOCK", "LLM_BLOCKS_OUT_OF_MEMORY",
    "LLM_EXIST_LINK", "LLM_FEATURE_NOT_ENABLED", "LLM_TIMEOUT", "LLM_LINK_BUSY", "LLM_OUT_OF_MEMORY",
    "LLM_DEVICE_MEM_ERROR", "LLM_SUSPECT_REMOTE_ERROR", "LLM_UNKNOWN_ERROR"})
# link_clusters answers: the link is up
LINKED_CODES = frozenset({"LLM_SUCCESS", "LLM_ALREADY_LINK"})
# A link is broken only when the engine says so: LLM_LINK_BUSY (a pull is running on it) and
# LLM_PROCESSING_LINK (it is being made) are a healthy link at work.
BROKEN_CODES = frozenset({"LLM_NOT_YET_LINK", "LLM_LINK_FAILED", "LLM_WAIT_PROCESS_TIMEOUT"})

# Ascend NPUs: the device plugin's annotation (which devices a pod got, and their IPs), read by
# the engine pod through a downwardAPI volume at PODINFO_DIR/PODINFO_ASCEND (it follows changes)
ASCEND_ANNOTATION = "ascend.kubectl.kubernetes.io/ascend-910-configuration"
NPU_RESOURCE = "huawei.com/Ascend910"     # the operator's default; its chart value npuResource
PODINFO_DIR = "/etc/pd-podinfo"
PODINFO_ASCEND = "ascend-910-configuration"
HCCN_CONF = "/etc/hccn.conf"
MAX_LINKS_PER_ENGINE = 512                # llm_datadist: links one engine holds at most
