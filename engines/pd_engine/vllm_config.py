"""What the operator puts on a vLLM(-Ascend) engine container: `pd_contract.vllm`, re-exported for
engine images that import it from here."""
from pd_contract.vllm import CONNECTOR, CONNECTOR_MODULE, kv_transfer_config, render_vllm_args

__all__ = ["CONNECTOR", "CONNECTOR_MODULE", "kv_transfer_config", "render_vllm_args"]
