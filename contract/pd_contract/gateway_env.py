"""The environment the operator sets on pd-gateway's pods (a deployment's own gateway, or a
PDGateway serving several deployments), which the gateway reads at start. Named as the
variables they hold, as in `engine_env` (which has the names both pods get: PD_MODEL_NAME,
PD_AGENT_DATA_TOKEN); the gateway's own limits are its own and stay in pd_gateway."""
from __future__ import annotations

import hashlib

# a deployment's own gateway
PD_GATEWAY_DEPLOYMENT = "PD_GATEWAY_DEPLOYMENT"          # the PDDeployment whose engines it routes to
PD_MODEL_ALIASES = "PD_MODEL_ALIASES"                    # JSON list: other names the model answers to
PD_GATEWAY_RPM = "PD_GATEWAY_RPM"                        # JSON {key name: requests per minute}
# the engines' own OpenAI port (spec.engine.port with adapter vLLM): requests go there with vLLM's P-D
# protocol, not to the agents (a PDGateway's route carries it as `enginePort`)
PD_GATEWAY_ENGINE_PORT = "PD_GATEWAY_ENGINE_PORT"
# "1": those engines run vllm-ascend's layerwise Mooncake connector: decoder first, the decoder posting
# its blocks to this gateway's metaserver, at POD_IP (a PDGateway's route carries `decoderFirst`)
PD_GATEWAY_DECODER_FIRST = "PD_GATEWAY_DECODER_FIRST"
POD_IP = "POD_IP"
# the model's own tokenizer (spec.model.tokenizer): tokenizer.json's path, the chat template and
# its special tokens (a PDGateway's route carries them as `tokenizer`, `chatTemplateEnv` (the
# variable holding the template: each in one of its own, within the kernel's bound on one variable),
# `bosToken` and `eosToken`)
PD_GATEWAY_TOKENIZER = "PD_GATEWAY_TOKENIZER"
PD_GATEWAY_CHAT_TEMPLATE = "PD_GATEWAY_CHAT_TEMPLATE"
PD_GATEWAY_BOS_TOKEN = "PD_GATEWAY_BOS_TOKEN"
PD_GATEWAY_EOS_TOKEN = "PD_GATEWAY_EOS_TOKEN"
PD_CHAT_TEMPLATE_ = "PD_CHAT_TEMPLATE_"


def route_template_env(deployment: str) -> str:
    """The variable holding a served deployment's chat template (a route's chatTemplateEnv)."""
    return PD_CHAT_TEMPLATE_ + hashlib.sha256(deployment.encode()).hexdigest()[:12].upper()
# either gateway
PD_GATEWAY_KEYS_SECRET = "PD_GATEWAY_KEYS_SECRET"        # the Secret of the API keys
# a PDGateway
PD_GATEWAY_ROUTES = "PD_GATEWAY_ROUTES"                  # JSON [{model, aliases, deployment, tokenEnv}]
PD_GATEWAY_KEY_POLICY = "PD_GATEWAY_KEY_POLICY"          # JSON {key name: {models, requestsPerMinute, ...}}
PD_GATEWAY_USAGE_CONFIGMAP = "PD_GATEWAY_USAGE_CONFIGMAP"   # where per-key usage is kept
PD_DATA_TOKEN_ = "PD_DATA_TOKEN_"


def route_token_env(deployment: str) -> str:
    """The variable holding a served deployment's data token (a route's tokenEnv): named after the
    deployment, so another deployment joining the gateway does not rename the others'."""
    return PD_DATA_TOKEN_ + hashlib.sha256(deployment.encode()).hexdigest()[:12].upper()
