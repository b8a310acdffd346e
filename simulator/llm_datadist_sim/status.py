"""LLMStatusCode and LLMException as the real llm_datadist defines them."""
from __future__ import annotations

from enum import Enum


class LLMStatusCode(Enum):
    # Declared in the real module's order. Values are the C++ codes where they are
    # documented; the rest get unique placeholders in the same 0x5010Bxxx space (unconfirmed).
    LLM_SUCCESS = 0x0
    LLM_FAILED = 0x5010B000
    LLM_PARAM_INVALID = 0x5010B005
    LLM_WAIT_PROCESS_TIMEOUT = 0x5010B001
    LLM_KV_CACHE_NOT_EXIST = 0x5010B002
    LLM_REPEAT_REQUEST = 0x5010B003
    LLM_REQUEST_ALREADY_COMPLETED = 0x5010B004
    LLM_ENGINE_FINALIZED = 0x5010B006
    LLM_NOT_YET_LINK = 0x5010B007
    LLM_ALREADY_LINK = 0x5010B008
    LLM_LINK_FAILED = 0x5010B009
    LLM_UNLINK_FAILED = 0x5010B00A
    LLM_NOTIFY_PROMPT_UNLINK_FAILED = 0x5010B00B
    LLM_CLUSTER_NUM_EXCEED_LIMIT = 0x5010B00C
    LLM_PROCESSING_LINK = 0x5010B00D
    LLM_DEVICE_OUT_OF_MEMORY = 0x5010B00E
    LLM_PREFIX_ALREADY_EXIST = 0x5010B00F
    LLM_PREFIX_NOT_EXIST = 0x5010B010
    LLM_SEQ_LENOVERLIMIT = 0x5010B011
    LLM_NO_FREE_BLOCK = 0x5010B012
    LLM_BLOCKS_OUT_OF_MEMORY = 0x5010B013
    LLM_EXIST_LINK = 0x5010B018
    LLM_FEATURE_NOT_ENABLED = 0x5010B019
    LLM_TIMEOUT = 0x5010B01A
    LLM_LINK_BUSY = 0x5010B01B
    LLM_OUT_OF_MEMORY = 0x5010B01C
    LLM_DEVICE_MEM_ERROR = 0x5010B01D
    LLM_SUSPECT_REMOTE_ERROR = 0x5010B01E
    LLM_UNKNOWN_ERROR = 0x5010B0FF


class LLMException(RuntimeError):
    def __init__(self, message: str = "", status_code: LLMStatusCode = LLMStatusCode.LLM_FAILED):
        super().__init__(message)
        self._status_code = status_code

    @property
    def status_code(self) -> LLMStatusCode:
        return self._status_code

    def __str__(self) -> str:
        return f"{super().__str__()} (status_code={self._status_code.name})"


def raise_if(cond: bool, code: LLMStatusCode, message: str) -> None:
    if cond:
        raise LLMException(message, code)
