"""How a route's prompts become token ids, and the engines' output ids text: the model's own
tokenizer (spec.model.tokenizer: a Hugging Face `tokenizers` file, tokenizer.json, and optionally a
Jinja2 chat template as tokenizer_config.json's `chat_template`), else cl100k (pd_contract.tokens,
the reference engine's) with a line `role: content` per message."""
from __future__ import annotations

import logging
import os
from typing import Any, Protocol

from pd_contract import tokens

from . import wire

log = logging.getLogger("pd_gateway")


class Detokenizer(Protocol):
    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class ModelTokenizer(Protocol):
    name: str

    def templated(self, body: wire.ApiRequest) -> bool: ...

    def prompt(self, body: wire.ApiRequest) -> str:
        """The request's text as the model reads it (a chat laid out by the chat template)."""
        ...

    def encode(self, text: str, templated: bool = False) -> list[int]: ...

    def max_token_chars(self) -> int:
        """The most characters of a prompt one token can stand for: a prompt of n characters is at
        least n / this many tokens, known before it is tokenized."""
        ...

    def boundary(self) -> list[int]:
        """What an empty prompt is: the document boundary the model starts from."""
        ...

    def detokenizer(self) -> Detokenizer: ...


class Cl100k:
    name = "cl100k_base"

    def templated(self, body: wire.ApiRequest) -> bool:
        return False

    def prompt(self, body: wire.ApiRequest) -> str:
        return body.text()

    def encode(self, text: str, templated: bool = False) -> list[int]:
        return tokens.encode(text)

    def max_token_chars(self) -> int:
        return _cl100k_longest()

    def boundary(self) -> list[int]:
        return [tokens.ENDOFTEXT]

    def detokenizer(self) -> Detokenizer:
        return tokens.Detokenizer()


class _Stream:
    """Text as ids arrive, with tokenizers' DecodeStream: a character split across ids is sent once whole."""

    def __init__(self, tok: Any):
        from tokenizers.decoders import DecodeStream
        self.tok, self.stream = tok, DecodeStream(skip_special_tokens=False)

    def push(self, token_id: int) -> str:
        try:
            return self.stream.step(self.tok, int(token_id)) or ""
        except Exception:  # noqa: BLE001 - an id outside the vocabulary: nothing to show for it
            return ""

    def flush(self) -> str:
        return ""


class HuggingFace:
    """A tokenizer.json; with a chat template, a chat is rendered by it (in a sandbox: the template is
    the deployment author's, the messages the client's) with the model's bos_token and eos_token,
    and its special tokens are the template's."""

    def __init__(self, path: str, chat_template: str | None = None, bos_token: str = "", eos_token: str = ""):
        from tokenizers import Tokenizer
        self.tok = Tokenizer.from_file(path)
        self.name = path
        self.specials = {"bos_token": bos_token, "eos_token": eos_token}
        self._longest: int | None = None
        self.template = None
        if chat_template:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise TemplateError(message)
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            self.template = env.from_string(chat_template)

    def templated(self, body: wire.ApiRequest) -> bool:
        """Whether the request's prompt is the chat template's (which writes the special tokens)."""
        return self.template is not None and body.chat_messages() is not None

    def prompt(self, body: wire.ApiRequest) -> str:
        messages = body.chat_messages()
        if self.template is None or messages is None:
            return body.text()
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, **self.specials)
        except Exception as e:  # noqa: BLE001 - whatever the author's template raises is about these messages
            raise PromptRefused(f"{type(e).__name__}: {e}") from e

    def encode(self, text: str, templated: bool = False) -> list[int]:
        # a chat template writes the special tokens itself; any other prompt gets the tokenizer's
        return list(self.tok.encode(text, add_special_tokens=not templated).ids)

    def max_token_chars(self) -> int:
        if self._longest is None:
            self._longest = _longest_hf(self.tok)
        return self._longest

    def boundary(self) -> list[int]:
        return list(self.tok.encode("", add_special_tokens=True).ids) or [0]

    def detokenizer(self) -> Detokenizer:
        return _Stream(self.tok)


# normalizers that never drop text (a composition takes at most three characters into one)
_KEEPING_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend"}
UNBOUNDED = 1 << 30


def _longest_hf(tok: Any) -> int:
    """The most prompt characters one token stands for, where a tokenizer's parts say so: byte-level
    BPE (each vocabulary character one byte), pre-tokenizers that split without dropping,
    normalizers that drop nothing (4x: Hangul composes three characters into one), no added token
    that swallows whitespace. Any other tokenizer (WordPiece's [UNK] for a long word, a normalizer
    that strips, a pre-tokenizer that drops whitespace) is not bounded: UNBOUNDED, no refusal from
    the length alone."""
    import json as _json
    try:
        cfg = _json.loads(tok.to_str())
    except Exception:  # noqa: BLE001 - a tokenizer that cannot say what it is: not bounded
        return UNBOUNDED
    pre = cfg.get("pre_tokenizer") or {}
    pres = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    norm = cfg.get("normalizer") or {}
    norms = norm.get("normalizers", []) if norm.get("type") == "Sequence" else ([norm] if norm else [])
    byte_level = any(p.get("type") == "ByteLevel" for p in pres)
    keeps = all(p.get("type") == "ByteLevel" or (p.get("type") == "Split" and p.get("behavior") != "Removed")
                for p in pres)
    if (cfg.get("model") or {}).get("type") != "BPE" or not byte_level or not keeps \
            or any(n.get("type") not in _KEEPING_NORMALIZERS for n in norms) \
            or any(t.get("lstrip") or t.get("rstrip") for t in cfg.get("added_tokens") or []):
        return UNBOUNDED
    return 4 * max((len(t) for t in tok.get_vocab(with_added_tokens=True)), default=1)


class PromptTooLong(Exception):
    """A prompt that no tokenization could fit in the context, refused before it is tokenized."""

    def __init__(self, context: int, at_least: int, chars: int):
        super().__init__(f"{chars} characters: at least {at_least} tokens, over the context of {context}")
        self.context, self.at_least, self.chars = context, at_least, chars


_longest_cl100k: int | None = None


def _cl100k_longest() -> int:
    global _longest_cl100k
    if _longest_cl100k is None:
        _longest_cl100k = max(len(b) for b in tokens.encoding().token_byte_values())
    return _longest_cl100k


class PromptRefused(Exception):
    """The chat template refused the messages (raise_exception, or anything it raised): a 400."""


class Unavailable(Exception):
    """The route's tokenizer could not be loaded: its model answers 503, the others are served."""


class Unloadable:
    """A route whose tokenizer.json could not be loaded (a PDGateway serves other models beside it)."""

    def __init__(self, name: str, why: str):
        self.name, self.why = name, why

    def templated(self, body: wire.ApiRequest) -> bool:
        return False

    def prompt(self, body: wire.ApiRequest) -> str:
        raise Unavailable(f"the model's tokenizer {self.name!r} (spec.model.tokenizer) could not be loaded: {self.why}")

    def encode(self, text: str, templated: bool = False) -> list[int]:
        raise Unavailable(self.why)

    def max_token_chars(self) -> int:
        return UNBOUNDED

    def boundary(self) -> list[int]:
        return [0]

    def detokenizer(self) -> Detokenizer:
        return tokens.Detokenizer()


def load(path: str | None, chat_template: str | None = None, root: str | None = None, bos_token: str = "",
         eos_token: str = "", strict: bool = True) -> ModelTokenizer:
    """The route's tokenizer: the file's, else cl100k. `root`: where mount paths resolve when the
    process has no mount namespace of its own (PD_LOCAL_ROOT, the local cluster's process runtime).
    A file that cannot be read stops a gateway of one model at start, naming it (`strict`: a wrong
    tokenizer would count every request wrong); in a gateway of several models (a PDGateway) that
    model answers 503 saying why, and the others are served."""
    if not path:
        return Cl100k()
    where = os.path.join(root, path.lstrip("/")) if root else path
    try:
        return HuggingFace(where, chat_template, bos_token, eos_token)
    except Exception as e:
        if strict:
            raise SystemExit(f"pd_gateway: the tokenizer {path!r} (spec.model.tokenizer) cannot be loaded: {e}") \
                from None
        log.error("the tokenizer %r (spec.model.tokenizer) cannot be loaded: %s; its model answers 503", path, e)
        return Unloadable(path, str(e))
