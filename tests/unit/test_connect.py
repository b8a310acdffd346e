"""`kubectl pdd connect` (pure parts): each client's configuration parses in its own format and
carries the three things; failed checks are explained in the terms users meet."""
from __future__ import annotations

import json
import shlex
import tomllib

import pytest

from pd_operator.connect import explain, render

ROOT, KEY, MODEL = "http://gw.example:8000", "sk-team-a-0123456789", "llama-8b"


def _json_after_comments(text: str) -> dict:
    """The JSON document a snippet ends with (after its comment and command lines)."""
    return json.loads(text[text.index("\n{") + 1:])


def test_codex_config_toml():
    text = render("codex", ROOT, KEY, MODEL)
    cfg = tomllib.loads(text)
    provider = cfg["model_providers"][cfg["model_provider"]]
    assert cfg["model"] == MODEL and provider["base_url"] == ROOT + "/v1"
    assert provider["env_key"] == "PD_API_KEY" and f"export PD_API_KEY={KEY}" in text
    assert provider["wire_api"] == "responses"   # the only wire API Codex speaks since 0.95


def test_cline_settings():
    text = render("cline", ROOT, KEY, MODEL)
    s = _json_after_comments(text)["providers"]["openai-compatible"]["settings"]
    assert s == {"provider": "openai-compatible", "baseUrl": ROOT + "/v1", "apiKey": KEY, "model": MODEL, "headers": {}}
    cmd = shlex.split(next(line for line in text.splitlines() if line.startswith("cline auth")))
    assert cmd[cmd.index("--baseurl") + 1] == ROOT + "/v1" and cmd[cmd.index("--apikey") + 1] == KEY


def test_claude_code_settings_have_no_v1():
    env = _json_after_comments(render("claude-code", ROOT + "/", KEY, MODEL))["env"]
    assert env["ANTHROPIC_BASE_URL"] == ROOT and env["ANTHROPIC_AUTH_TOKEN"] == KEY and env["ANTHROPIC_MODEL"] == MODEL


@pytest.mark.parametrize("client, base_line", [("openai", f"OPENAI_BASE_URL={ROOT}/v1"),
                                               ("anthropic", f"ANTHROPIC_BASE_URL={ROOT}\n")])
def test_env_blocks(client, base_line):
    assert base_line in render(client, ROOT, KEY, MODEL) and KEY in render(client, ROOT, KEY, MODEL)


def test_curl_line_is_one_shell_command():
    argv = shlex.split(render("curl", ROOT, KEY, MODEL))
    assert argv[0] == "curl" and f"{ROOT}/v1/chat/completions" in argv
    assert json.loads(argv[argv.index("-d") + 1])["model"] == MODEL
    assert f"Authorization: Bearer {KEY}" in argv


@pytest.mark.parametrize("status, body, url, says", [
    (401, {"error": {"message": "invalid API key"}}, ROOT + "/v1/chat/completions", "key was refused"),
    (404, {"error": {"message": "/v1/v1/chat/completions doubles /v1"}}, ROOT + "/v1/v1/chat/completions",
     "doubles /v1"),
    (404, {"error": {"message": "no route"}}, ROOT + "/chat/completions", "end in /v1"),
    (404, {"error": {"message": "model 'x' not found; this gateway serves 'a'"}}, ROOT + "/v1/chat/completions",
     "status.models"),
    (403, {"error": {"message": "model not allowed for this key"}}, ROOT, "spec.keys"),
    (200, {"object": "list"}, ROOT, "reading choices"),
    (502, "<html>bad gateway</html>", ROOT, "not JSON"),
])
def test_failures_are_explained(status, body, url, says):
    raw = body if isinstance(body, str) else json.dumps(body)
    assert says in explain(status, raw, url, "Secret keys, key 'team-a'", MODEL)
