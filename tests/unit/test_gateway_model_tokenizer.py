"""spec.model.tokenizer on the token path: the gateway tokenizes a route's prompts with the model's
own tokenizer.json, lays a chat out with its chat template (in a sandbox), counts usage with it, and
decodes the engine's ids with it; a template that refuses the messages is a 400."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pd_gateway import tokenizer as gwtok
from tests.unit import test_gateway_hardening
from tests.unit.test_gateway_hardening import CHAT, MODEL, FakeAgents, Served

TEMPLATE = ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
            "<|{{ m.role }}|>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
TEXT = ["the cache moves from prefill to decode over a link", "tokens follow at the pace of each step",
        "engines share the load and switch roles", "<|user|> <|assistant|> <|system|>"]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT * 20, trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel
                                                           .alphabet(), special_tokens=["<s>"]))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


serve = test_gateway_hardening.serve   # the fixture: a gateway on a loopback port in front of FakeAgents


@pytest.fixture
def serve_with(serve, tokenizer_json):
    async def make(template: str | None, bos: str = "") -> tuple[Served, gwtok.HuggingFace]:
        tok = gwtok.load(str(tokenizer_json), template, bos_token=bos)
        assert isinstance(tok, gwtok.HuggingFace)
        agents = FakeAgents()
        agents.reply_ids = tok.encode("engines share the load")
        return await serve(agents, tokenizer=tok, max_context_tokens=4000), tok
    return make


async def test_usage_and_the_prompt_are_the_models_tokenizers(serve_with):
    s, tok = await serve_with(TEMPLATE)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cache moves"}]
    r = await s.post(CHAT, {"model": MODEL, "messages": msgs, "max_tokens": 4})
    assert r.status_code == 200, r.text
    rendered = "<|system|>be brief\n<|user|>the cache moves\n<|assistant|>"
    want = tok.tok.encode(rendered, add_special_tokens=False).ids
    assert s.agents.bodies["/v1/prefill"][0]["token_ids"] == want
    reply = r.json()
    assert reply["usage"]["prompt_tokens"] == len(want)
    assert reply["choices"][0]["message"]["content"] == tok.tok.decode(tok.encode("engines share the load")[:4])


async def test_without_a_template_a_chat_is_the_flat_layout_and_counted_by_the_file(serve_with):
    s, tok = await serve_with(None)
    r = await s.post(CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "a link"}], "max_tokens": 2})
    want = tok.tok.encode("user: a link", add_special_tokens=True).ids
    assert r.json()["usage"]["prompt_tokens"] == len(want)
    assert s.agents.bodies["/v1/prefill"][0]["token_ids"] == want


async def test_a_template_that_refuses_the_messages_is_a_400(serve_with):
    s, _ = await serve_with(TEMPLATE)
    r = await s.post(CHAT, {"model": MODEL, "messages": [{"role": "tool", "content": "x"}], "max_tokens": 2})
    assert r.status_code == 400 and "no tools here" in r.json()["error"]["message"]
    assert s.agents.engine_calls == 0


async def test_the_template_runs_in_a_sandbox(tokenizer_json):
    tok = gwtok.load(str(tokenizer_json), "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    from pd_gateway import wire
    body = wire.ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(gwtok.PromptRefused, match="SecurityError"):
        tok.prompt(body)


def test_a_tokenizer_that_cannot_be_read_stops_the_gateway_naming_it(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text(json.dumps({"not": "a tokenizer"}))
    with pytest.raises(SystemExit, match="tokenizer.json"):
        gwtok.load(str(bad))
    assert isinstance(gwtok.load(None), gwtok.Cl100k)
    assert isinstance(gwtok.load(str(bad), strict=False), gwtok.Unloadable)   # a PDGateway's route


async def test_a_routes_tokenizer_that_cannot_be_read_answers_503_for_its_model_alone(serve, tmp_path):
    tok = gwtok.load(str(tmp_path / "missing.json"), strict=False)
    s = await serve(tokenizer=tok)
    r = await s.post(CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    assert r.status_code == 503 and "missing.json" in r.json()["error"]["message"]
    assert s.agents.engine_calls == 0


async def test_the_template_gets_the_models_special_tokens_and_any_error_it_raises_is_a_400(serve_with):
    s, tok = await serve_with("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}", bos="<s>")
    r = await s.post(CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "a link"}], "max_tokens": 2})
    assert s.agents.bodies["/v1/prefill"][0]["token_ids"] == tok.tok.encode("<s>a link",
                                                                            add_special_tokens=False).ids
    s, _ = await serve_with("{{ messages + 1 }}")
    r = await s.post(CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]


async def test_a_completion_prompt_gets_the_tokenizers_special_tokens_beside_a_template(serve_with):
    s, tok = await serve_with(TEMPLATE)
    r = await s.post("/v1/completions", {"model": MODEL, "prompt": "a link", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert s.agents.bodies["/v1/prefill"][0]["token_ids"] == tok.tok.encode("a link", add_special_tokens=True).ids


def test_a_prompt_is_refused_from_its_length_only_where_the_tokenizer_bounds_it(tokenizer_json):
    """Byte-level BPE bounds the characters a token stands for; WordPiece (a long word is one
    [UNK]) or a pre-tokenizer that drops whitespace does not: no refusal from the length there."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    bounded = gwtok.load(str(tokenizer_json))
    assert isinstance(bounded, gwtok.HuggingFace) and bounded.max_token_chars() < gwtok.UNBOUNDED
    wp = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wp.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tokenizer_json.parent / "wordpiece.json"
    wp.save(str(path))
    unbounded = gwtok.load(str(path))
    assert unbounded.max_token_chars() == gwtok.UNBOUNDED
    assert len(unbounded.encode("x" * 10_000 + " " * 10_000)) <= 2   # what the bound would have got wrong
