"""A stand-in for vLLM's KV connector base, used when vllm is not importable (the project does not
depend on vllm). It follows the published signatures of
vllm/distributed/kv_transfer/kv_connector/v1/base.py in vLLM 0.33.0 (KVConnectorBase_V1,
KVConnectorRole, KVConnectorMetadata): the same method names, arguments and defaults for the
methods pd_engine.vllm_connector uses, and the same abstract methods. tests/vllm checks the
connector against vLLM's own class."""
from __future__ import annotations

import enum
import inspect
from abc import ABC, abstractmethod
from typing import Any

VLLM_VERSION = "0.33.0"


def base_init_args(base: type, vllm_config: Any, role: Any, kv_cache_config: Any) -> tuple[Any, ...]:
    """The arguments `base.__init__` takes: `(vllm_config, role)` in vLLM before 0.11.2,
    `(vllm_config, role, kv_cache_config)` since (a third parameter, with or without a default)."""
    params = [p for p in inspect.signature(base.__init__).parameters.values()  # type: ignore[misc]
              if p.name != "self" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return (vllm_config, role, kv_cache_config) if len(params) >= 3 else (vllm_config, role)


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata(ABC):  # noqa: B024 - as vLLM's
    pass


class KVConnectorBase_V1(ABC):  # noqa: N801 - vLLM's name
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        self._connector_metadata: KVConnectorMetadata | None = None
        self._vllm_config = vllm_config
        if vllm_config.kv_transfer_config is None:
            raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._kv_cache_config = kv_cache_config
        self._role = role

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    # ---- worker side ----
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._connector_metadata is not None
        return self._connector_metadata

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def register_kv_caches(self, kv_caches: dict[str, Any]):
        return

    @abstractmethod
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None: ...

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None: ...

    @abstractmethod
    def wait_for_save(self): ...

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def shutdown(self):
        return None

    # ---- scheduler side ----
    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]: ...

    @abstractmethod
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int): ...

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata: ...

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None
