"""vLLM's OpenAI server protocol, the part a P-D router and pd_engine.vllm_standin rely on: the
request fields of `vllm.entrypoints.openai.protocol.ChatCompletionRequest` and `CompletionRequest`
with vLLM's names, types and defaults (extra fields allowed and kept, as vLLM does), its validators
that answer 400, and the replies' shapes (`kv_transfer_params` at the top level of a reply, the
usage chunk of a stream). `make test-vllm` checks the fields and their defaults against the classes of
the vLLM releases it installs (hack/vllm/check_protocol.py)."""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StreamOptions(BaseModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    n: int | None = 1
    seed: int | None = None
    stop: str | list[str] | None = Field(default_factory=list)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM's own
    min_tokens: int = 0
    ignore_eos: bool = False
    return_token_ids: bool | None = None
    kv_transfer_params: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Request:
        if self.stream_options and not self.stream:
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return self

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(_Request):
    messages: list[dict[str, Any]]
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = "none"
    parallel_tool_calls: bool | None = True

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true.")
        if isinstance(self.tool_choice, dict) and not self.tools:
            raise ValueError("When using `tool_choice`, `tools` must be set.")
        return self

    def asked(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None

    @model_validator(mode="after")
    def _prompt_given(self) -> CompletionRequest:
        if self.prompt is None or self.prompt == "" or self.prompt == []:
            raise ValueError("Either prompt or prompt_embeds must be provided and non-empty.")
        return self

    def asked(self) -> int | None:
        return self.max_tokens


def new_id(prefix: str, request_id: str | None = None) -> str:
    return f"{prefix}-{request_id or uuid.uuid4().hex}"


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
            "prompt_tokens_details": None}


def chat_choice(index: int, text: str, finish: str, stop_reason: str | None, token_ids: list[int] | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                                        "audio": None, "function_call": None, "tool_calls": [],
                                        "reasoning_content": None},
            "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason, "token_ids": token_ids}


def completion_choice(index: int, text: str, finish: str, stop_reason: str | None,
                      token_ids: list[int] | None) -> dict:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason,
            "token_ids": token_ids, "prompt_logprobs": None, "prompt_token_ids": None}


def reply(chat: bool, rid: str, model: str, choices: list[dict], prompt: int, completion: int,
          kv_transfer_params: dict | None, prompt_token_ids: list[int] | None = None) -> dict:
    """A non-streamed reply as vLLM serialises it (model_dump: null fields present)."""
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "service_tier": None, "system_fingerprint": None,
            "usage": usage(prompt, completion), "prompt_logprobs": None, "prompt_token_ids": prompt_token_ids,
            "kv_transfer_params": kv_transfer_params}


def chunk(chat: bool, rid: str, model: str, index: int, text: str | None, finish: str | None = None,
          role: bool = False) -> dict:
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": text}
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish,
                  "stop_reason": None}
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice]}


def usage_chunk(chat: bool, rid: str, model: str, prompt: int, completion: int) -> dict:
    """The last chunk of a stream with `stream_options.include_usage`: no choices, the usage."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [], "usage": {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                                                     "completion_tokens": completion}}


def error(message: str, status: int = 400) -> dict:
    return {"error": {"message": message, "type": "BadRequestError" if status == 400 else "InternalServerError",
                      "param": None, "code": status}}


def models(name: str, root: str, max_model_len: int) -> dict:
    created = int(time.time())
    return {"object": "list", "data": [{
        "id": name, "object": "model", "created": created, "owned_by": "vllm", "root": root, "parent": None,
        "max_model_len": max_model_len,
        "permission": [{"id": new_id("modelperm"), "object": "model_permission", "created": created,
                        "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                        "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                        "organization": "*", "group": None, "is_blocking": False}]}]}
