"""The OpenAI and Anthropic wire formats (pure): requests as the gateway reads them, replies,
stream chunks and error objects as clients parse them.

Token counts are the tokenizer's (pd_contract.tokens) over a request's text as the chat
template lays it out (`ApiRequest.text`: a line "role: content" per message): `usage` counts
the prompt's tokens and the tokens the decoder produced, and the reply text is the decoder's
tokens decoded."""
from __future__ import annotations

import hashlib
import json
import time
import uuid
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

DEFAULT_MAX_TOKENS = 256
DEFAULT_COMPLETION_TOKENS = 16    # the legacy completions API's default max_tokens
WORDS = ("the", "cache", "moves", "from", "prefill", "to", "decode", "over", "a", "link", "and", "tokens",
         "follow", "at", "the", "pace", "of", "each", "step", "while", "engines", "share", "load")


def seed(prompt: str) -> bytes:
    """A request's prompt digested once, so that each piece costs the same however long the
    prompt is (the requests validate their text is encodable; surrogatepass keeps this total)."""
    return hashlib.sha256(prompt.encode("utf-8", "surrogatepass")).digest()


def piece(seed: bytes, i: int) -> str:
    """Placeholder text for the i-th output token when the decoder sent no token id (an engine
    that only models timing): a word, deterministic for a prompt (its seed). A token that
    carries its id is decoded instead (pd_contract.tokens)."""
    h = int.from_bytes(hashlib.sha256(seed + i.to_bytes(8, "big")).digest()[:4], "big")
    word = WORDS[h % len(WORDS)]
    return word if i == 0 else " " + word


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(v), type(v).__name__)


def _unicode(s: str) -> str:
    """JSON may carry a lone surrogate ("\\ud800"): not text, and it could not be encoded later."""
    try:
        s.encode()
    except UnicodeEncodeError as e:
        raise ValueError(f"contains a lone surrogate ({s[e.start]!r} at character {e.start}), "
                         "which is not valid Unicode") from None
    return s


def _content(v: Any) -> Any:
    """Message content: a string, or a list of parts (objects; a part's `text` is a string)."""
    if v is None:
        return v
    if isinstance(v, str):
        return _unicode(v)
    if not isinstance(v, list):
        raise ValueError(f"must be a string or an array of content parts, not {_json_type(v)}")
    for i, part in enumerate(v):
        if not isinstance(part, dict):
            raise ValueError(f"part {i} must be an object, not {_json_type(part)}")
        if "text" in part:
            if not isinstance(part["text"], str):
                raise ValueError(f"part {i}: text must be a string, not {_json_type(part['text'])}")
            try:
                _unicode(part["text"])
            except ValueError as e:
                raise ValueError(f"part {i}: text {e}") from None
    return v


def _prompt(v: Any) -> Any:
    if isinstance(v, str):
        return _unicode(v)
    if isinstance(v, list) and all(isinstance(p, str) for p in v):
        for p in v:
            _unicode(p)
        return v
    raise ValueError("must be a string or an array of strings")


Text = Annotated[StrictStr, AfterValidator(_unicode)]
Content = Annotated[Any, AfterValidator(_content)]


def _text(content: Any) -> str:
    """Message content (validated): a string, or a list of parts of which the text ones count."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content)
    return ""


class _Lenient(BaseModel):
    # Clients send many optional fields (tools, stop, ...): accepted and ignored. The fields
    # read here have their JSON type checked strictly ("5" is not a number).
    model_config = ConfigDict(extra="allow")


# sampling as the APIs take it: null is the default; top_p 0 keeps only the likeliest token
Temperature = Annotated[StrictFloat, Field(ge=0, le=2, allow_inf_nan=False)]
TopP = Annotated[StrictFloat, Field(ge=0, le=1, allow_inf_nan=False)]
Seed = Annotated[StrictInt, Field(ge=-(2**63), lt=2**63)]      # OpenAI's: a signed 64-bit integer
SEEDS = 2**63                                                    # the engines take 0..2**63-1


MAX_CHOICES = 16        # n: a request's choices (each is a generation of its own)
MAX_STOPS = 16          # stop sequences per request
MAX_STOP_CHARS = 256
# what the token path does not implement: a request that asks for one is refused naming it, never
# answered as if it had not asked (tools need the model's tool-call format, logprobs the engines'
# logits, response_format a constrained decoder; engines that serve their own API, vLLM's, take them)
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "logprobs", "top_logprobs", "response_format")


def _asks(field: str, v: Any) -> bool:
    """Whether a field's value asks for something (its defaults and explicit "off" do not)."""
    if v is None or v is False:
        return False
    if field in ("tools", "functions"):
        return v != []
    if field in ("tool_choice", "function_call"):
        return v not in ("none", {"type": "none"})
    if field == "top_logprobs":
        return v != 0
    if field == "response_format":
        return not (isinstance(v, dict) and v.get("type") == "text")
    return True


def _stops(v: Any) -> Any:
    if v is None:
        return v
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ValueError("must be a string or an array of strings")
    if len(items) > MAX_STOPS:
        raise ValueError(f"at most {MAX_STOPS} stop sequences")
    for s in items:
        if not 0 < len(s) <= MAX_STOP_CHARS:
            raise ValueError(f"each stop sequence must have 1 to {MAX_STOP_CHARS} characters")
        _unicode(s)
    return v


Stops = Annotated[Any, AfterValidator(_stops)]
Choices = Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)]


class Message(_Lenient):
    role: Text = ""
    content: Content = None


class ApiRequest(_Lenient):
    """What the three APIs' requests have in common, as the gateway reads them."""
    model: Text
    stream: StrictBool | None = False
    temperature: Temperature | None = None
    top_p: TopP | None = None
    # vLLM's extension: each choice also carries the output's token ids (non-streamed replies)
    return_token_ids: StrictBool | None = None

    # the field that holds the prompt, named in a context_length_exceeded error
    PROMPT_PARAM: ClassVar[str] = "messages"

    def text(self) -> str:
        raise NotImplementedError

    def asked_tokens(self) -> int | None:
        """The output tokens the client asked for, None if it named no number."""
        raise NotImplementedError

    def default_tokens(self) -> int:
        """The output tokens when the client names no number (the API's default)."""
        return DEFAULT_MAX_TOKENS

    def sampling(self, default_seed: int) -> dict:
        """How the engines choose tokens: the API's defaults (temperature 1, top_p 1) for what
        is not set, and `default_seed` (0..2**63-1) unless the request has a seed, so the
        prefill and the decoder draw alike."""
        temperature = 1.0 if self.temperature is None else float(self.temperature)
        top_p = 1.0 if self.top_p is None else float(self.top_p)
        if top_p == 0:
            temperature, top_p = 0.0, 1.0
        # only the APIs that define a seed (chat, completions) read one; elsewhere it is an unknown field
        seed = getattr(self, "seed", None) if "seed" in type(self).model_fields else None
        return {"temperature": temperature, "top_p": top_p,
                "seed": default_seed if seed is None else seed % SEEDS}

    def include_usage(self) -> bool:
        opts = getattr(self, "stream_options", None)
        return bool(opts.get("include_usage")) if isinstance(opts, dict) else False

    def token_fields(self) -> dict[str, int]:
        """The fields that ask for output tokens, as sent (bounded by the model's context)."""
        return {f: v for f in ("max_tokens", "max_completion_tokens") if isinstance(v := getattr(self, f, None), int)}

    def unsupported(self) -> str | None:
        """The first field the token path does not implement that this request asks for."""
        extra = self.model_extra or {}
        for f in UNSUPPORTED:
            if _asks(f, getattr(self, f) if f in type(self).model_fields else extra.get(f)):
                return f
        return None

    def chat_messages(self) -> list[dict] | None:
        """A chat's messages as a chat template takes them ({role, content} with the text), None
        for an API whose prompt is not a chat."""
        return None

    def stops(self) -> list[str]:
        """The stop sequences (the text ends before the first one met)."""
        v = getattr(self, "stop", None)
        return [v] if isinstance(v, str) else list(v or [])

    def choices(self) -> int:
        return int(getattr(self, "n", None) or 1)


class ChatRequest(ApiRequest):
    messages: list[Message] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    stream_options: dict | None = None
    seed: Seed | None = None
    stop: Stops = None
    n: Choices | None = None

    def text(self) -> str:
        return "\n".join(f"{m.role}: {_text(m.content)}" for m in self.messages)

    def chat_messages(self) -> list[dict] | None:
        return [{"role": m.role, "content": _text(m.content)} for m in self.messages]

    def asked_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(ApiRequest):
    prompt: Annotated[Any, AfterValidator(_prompt)]
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    stream_options: dict | None = None
    seed: Seed | None = None
    stop: Stops = None
    n: Choices | None = None

    PROMPT_PARAM: ClassVar[str] = "prompt"

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else "\n".join(self.prompt)

    def asked_tokens(self) -> int | None:
        return self.max_tokens

    def default_tokens(self) -> int:
        return DEFAULT_COMPLETION_TOKENS


class MessagesRequest(ApiRequest):
    """Anthropic Messages API."""
    messages: list[Message] = Field(min_length=1)
    max_tokens: StrictInt = Field(ge=1)
    system: Content = None
    temperature: Annotated[StrictFloat, Field(ge=0, le=1, allow_inf_nan=False)] | None = None   # Anthropic's range
    stop_sequences: Stops = None

    def stops(self) -> list[str]:
        return list(self.stop_sequences or [])

    def text(self) -> str:
        head = [f"system: {_text(self.system)}"] if self.system else []
        return "\n".join(head + [f"{m.role}: {_text(m.content)}" for m in self.messages])

    def chat_messages(self) -> list[dict] | None:
        head = [{"role": "system", "content": _text(self.system)}] if self.system else []
        return head + [{"role": m.role, "content": _text(m.content)} for m in self.messages]

    def asked_tokens(self) -> int | None:
        return self.max_tokens


def _input(v: Any) -> Any:
    """Responses API input: a string, or a list of items (messages with a role and content; other
    items, like a tool's output, count by their text fields)."""
    if isinstance(v, str):
        return _unicode(v)
    if not isinstance(v, list) or not v:
        raise ValueError("must be a string or a non-empty array of input items")
    for i, item in enumerate(v):
        if not isinstance(item, dict):
            raise ValueError(f"item {i} must be an object, not {_json_type(item)}")
        try:
            _content(item.get("content"))
            _content(item.get("output"))   # a tool's output: a string or content parts (an image tool's)
            if "text" in item:
                if not isinstance(item["text"], str):
                    raise ValueError(f"text must be a string, not {_json_type(item['text'])}")
                _unicode(item["text"])
        except ValueError as e:
            raise ValueError(f"item {i}: {e}") from None
    return v


class ResponsesRequest(ApiRequest):
    """OpenAI Responses API (what Codex speaks): `input`, `instructions`, `max_output_tokens`."""
    input: Annotated[Any, AfterValidator(_input)]
    instructions: Text | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)

    PROMPT_PARAM: ClassVar[str] = "input"

    def text(self) -> str:
        def one(it: dict) -> str:
            body = _text(it.get("content")) or _text(it.get("output")) or it.get("text", "")
            return f"{it.get('role', it.get('type', ''))}: {body}"
        items = [self.input] if isinstance(self.input, str) else [one(it) for it in self.input]
        return "\n".join(([self.instructions] if self.instructions else []) + items)

    def asked_tokens(self) -> int | None:
        return self.max_output_tokens

    def token_fields(self) -> dict[str, int]:
        return {"max_output_tokens": self.max_output_tokens} if self.max_output_tokens else {}


# ---- errors -------------------------------------------------------------------------------

def openai_error(message: str, etype: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": etype, "param": param, "code": code}}


def prompt_too_long(api: str, context: int, at_least: int, chars: int) -> str:
    """Why a prompt is refused from its length alone, before it is tokenized."""
    if api == "anthropic":
        return f"prompt is too long: at least {at_least} tokens ({chars} characters) > {context} maximum"
    what = {"completions": "prompt", "responses": "input"}.get(api, "messages")
    return (f"This model's maximum context length is {context} tokens. However, your {what} is {chars} characters, "
            f"at least {at_least} tokens. Please reduce the length of the {what}.")


def context_exceeded(api: str, context: int, prompt: int, output: int | None) -> str:
    """Why a request does not fit the model's context, in the words of the API's own error:
    `output` is what the client asked for, None if it named no number (then the prompt alone
    left no room). `api`: chat, completions, responses or anthropic."""
    if api == "anthropic":
        if output is None or prompt > context:
            return f"prompt is too long: {prompt} tokens > {context} maximum"
        return (f"input length and `max_tokens` exceed context limit: {prompt} + {output} > {context}, "
                f"decrease input length or `max_tokens` and try again")
    what = {"completions": "prompt", "responses": "input"}.get(api, "messages")
    part = "output" if api == "responses" else "completion"
    head = f"This model's maximum context length is {context} tokens. "
    if output is None:
        room = f", which leaves no room for the {part}" if prompt == context else ""
        return head + f"However, your {what} resulted in {prompt} tokens{room}. Please reduce the length of the {what}."
    return head + (f"However, you requested {prompt + output} tokens ({prompt} in the {what}, {output} in the {part}). "
                   f"Please reduce the length of the {what} or {part}.")


ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                   429: "rate_limit_error", 400: "invalid_request_error", 413: "request_too_large",
                   529: "overloaded_error", 503: "overloaded_error"}


def anthropic_error(status: int, message: str) -> dict:
    etype = ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": etype, "message": message}}


def path_hint(path: str) -> str:
    """What a client most likely got wrong when it asked for an unknown path."""
    known = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/v1/messages")
    if path.startswith("/v1/v1/"):
        return (f"{path} doubles /v1: the base URL already ends in /v1, so the client added another. "
                f"Use a base URL ending in /v1 for OpenAI clients (they append /chat/completions) "
                f"and without /v1 for Anthropic clients (they append /v1/messages)")
    for k in known:
        if path == k[3:] or path.rstrip("/") == k[3:]:
            return f"{path} is missing /v1: the base URL must end in /v1 for OpenAI clients (so {k} is called)"
    return f"unknown path {path}; this gateway serves {', '.join(known)}"


# ---- replies ---------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_reply(rid: str, model: str, texts: list[tuple[str, str]], prompt: int, completion: int) -> dict:
    """`texts`: (text, finish_reason) per choice."""
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish} for i, (text, finish) in enumerate(texts)],
            "usage": usage(prompt, completion)}


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None = None, usage_: dict | None = None,
               choices: bool = True, index: int = 0) -> dict:
    out = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
           "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}] if choices
           else []}
    if usage_ is not None:
        out["usage"] = usage_
    return out


def completion_reply(rid: str, model: str, texts: list[tuple[str, str]], prompt: int, completion: int) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": finish}
                        for i, (text, finish) in enumerate(texts)],
            "usage": usage(prompt, completion)}


def completion_chunk(rid: str, model: str, text: str, finish: str | None = None, usage_: dict | None = None,
                     choices: bool = True, index: int = 0) -> dict:
    out = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
           "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish}] if choices
           else []}
    if usage_ is not None:
        out["usage"] = usage_
    return out


def models_reply(*models: str) -> dict:
    return {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "pd-operator"}
                                       for m in models]}


def message_reply(rid: str, model: str, text: str, prompt: int, completion: int, stop: str,
                  stop_sequence: str | None = None) -> dict:
    return {"id": rid, "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": text}], "stop_reason": stop, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": prompt, "output_tokens": completion}}


def anthropic_stop(finish: str, stop: str | None) -> str:
    """An OpenAI finish_reason (and the stop sequence met) as Anthropic's stop_reason."""
    return "stop_sequence" if stop is not None else "max_tokens" if finish == "length" else "end_turn"


def sse(data: dict | str, event: str | None = None) -> bytes:
    body = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return ((f"event: {event}\n" if event else "") + f"data: {body}\n\n").encode()


# ---- the Responses API -----------------------------------------------------------------------

def responses_usage(prompt: int, completion: int) -> dict:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}


def _message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def response_object(rid: str, model: str, status: str, output: list, usage_: dict | None = None,
                    error: dict | None = None) -> dict:
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": status, "model": model,
            "output": output, "usage": usage_, "error": error, "incomplete_details": None}


def responses_reply(rid: str, model: str, text: str, prompt: int, completion: int) -> dict:
    item = _message_item("msg_" + rid.rpartition("-")[2], text, "completed")
    return response_object(rid, model, "completed", [item], responses_usage(prompt, completion))


class ResponsesStream:
    """The Responses API's stream events for one answer: created, the message item and its text
    part opened, text deltas, then everything done and `response.completed` (or `response.failed`)."""

    def __init__(self, rid: str, model: str):
        self.rid, self.model = rid, model
        self.item_id = "msg_" + rid.rpartition("-")[2]
        self.seq = 0
        self.text: list[str] = []

    def _event(self, etype: str, **fields: Any) -> bytes:
        self.seq += 1
        return sse({"type": etype, "sequence_number": self.seq, **fields}, etype)

    def start(self) -> bytes:
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return (self._event("response.created", response=response_object(self.rid, self.model, "in_progress", []))
                + self._event("response.output_item.added", output_index=0,
                              item=_message_item(self.item_id, "", "in_progress"))
                + self._event("response.content_part.added", **where,
                              part={"type": "output_text", "text": "", "annotations": []}))

    def delta(self, text: str) -> bytes:
        self.text.append(text)
        return self._event("response.output_text.delta", item_id=self.item_id, output_index=0, content_index=0,
                           delta=text)

    def finish(self, prompt: int, completion: int) -> bytes:
        text = "".join(self.text)
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        item = _message_item(self.item_id, text, "completed")
        return (self._event("response.output_text.done", **where, text=text)
                + self._event("response.content_part.done", **where,
                              part={"type": "output_text", "text": text, "annotations": []})
                + self._event("response.output_item.done", output_index=0, item=item)
                + self._event("response.completed", response=response_object(
                    self.rid, self.model, "completed", [item], responses_usage(prompt, completion))))

    def failed(self, code: str, message: str) -> bytes:
        return self._event("response.failed", response=response_object(
            self.rid, self.model, "failed", [], error={"code": code, "message": message}))
