"""pd_engine.vllm_protocol against the installed vLLM's own request classes: every field the
stand-in and pd-gateway rely on exists in vLLM's ChatCompletionRequest / CompletionRequest with
vLLM's default, and both allow extra fields. Run in a venv with vLLM (make test-vllm); exits 1 on
a difference, naming it."""
from __future__ import annotations

import importlib
import importlib.metadata
import sys

from pd_engine import vllm_protocol as ours

# fields vLLM added inside the range: absent before the first release tested with them (0.23.0)
ADDED = {"return_token_ids": (0, 23, 0)}
# defaults vLLM changed inside the range: (the first release tested with the new default, the old one)
CHANGED = {"parallel_tool_calls": ((0, 23, 0), False)}


def vllm_classes():
    try:
        chat = importlib.import_module("vllm.entrypoints.openai.chat_completion.protocol").ChatCompletionRequest
        comp = importlib.import_module("vllm.entrypoints.openai.completion.protocol").CompletionRequest
    except ModuleNotFoundError:   # before 0.2x the classes lived in one module
        p = importlib.import_module("vllm.entrypoints.openai.protocol")
        chat, comp = p.ChatCompletionRequest, p.CompletionRequest
    return chat, comp


def main() -> int:
    version = tuple(int(x) for x in importlib.metadata.version("vllm").split(".")[:3])
    problems = []
    for mine, theirs in zip((ours.ChatCompletionRequest, ours.CompletionRequest), vllm_classes()):
        if theirs.model_config.get("extra") != "allow":
            problems.append(f"{theirs.__name__}: extra fields are {theirs.model_config.get('extra')}, not allowed")
        for name, info in mine.model_fields.items():
            t = theirs.model_fields.get(name)
            if t is None:
                if version >= ADDED.get(name, (0, 0, 0)):
                    problems.append(f"{theirs.__name__}.{name}: not a field of vLLM {version}")
                continue
            want = info.get_default(call_default_factory=True)
            before, old = CHANGED.get(name, ((0, 0, 0), None))
            if version < before:
                want = old
            got = t.get_default(call_default_factory=True)
            if got != want:
                problems.append(f"{theirs.__name__}.{name}: vLLM's default {got!r}, pd_engine's {want!r}")
        print(f"{mine.__name__}: {len(mine.model_fields)} fields checked against vLLM {'.'.join(map(str, version))}")
    for p in problems:
        print("DIFFERS:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
