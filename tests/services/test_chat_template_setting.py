"""The gateway's `chat_template` setting (vLLM's ``--chat-template``): a file's template, or one given
inline, replaces the checkpoint's for every chat the gateway renders: admission's and ``llm.tokenize``'s
(tiny model with the real Qwen3 tokenizer; a real stack: compose/single-node.yml, real nats-server). A
template that cannot be read or does not compile stops the gateway at start, naming the setting."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from schemas.api import ChatMessage, GenerateRequest, TokenizeRequest
from services.gateway.admission import Admission, ModelInfo
from services.gateway.chat_template import chat_template_text, gateway_tokenizer
from services.launch import LocalStack
from shared.model.tokenizer import Tokenizer
from shared.settings import GatewaySettings, SettingsError
from services_helpers import frontend_address, post_json, start_stack

# Each message as "<|im_start|>role|content<|im_end|>" on a line of its own, after a marker line:
# Qwen3's own puts the role on the line of <|im_start|> and the content on the next.
TEMPLATE = """CUSTOM
{% for m in messages %}
<|im_start|>{{ m.role }}|{{ m.content }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant|{% endif %}"""
CHAT = [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital of France?"}]
RENDERED = "CUSTOM\n<|im_start|>system|You answer in one word.<|im_end|>\n<|im_start|>user|Capital of France?<|im_end|>\n<|im_start|>assistant|"


def test_the_setting_names_a_file_or_holds_the_template_itself(tmp_path: Path):
    """vLLM's rule: a value that opens is a file; one that does not but holds '{', '}' or a newline is the
    template; any other is a path that failed (a typo must not become a template rendering its own name)."""
    path = tmp_path / "custom.jinja"
    path.write_text(TEMPLATE)
    assert chat_template_text(str(path)) == TEMPLATE
    assert chat_template_text(TEMPLATE) == TEMPLATE
    assert chat_template_text("{{ messages[0].content }}") == "{{ messages[0].content }}"
    assert chat_template_text("") is None  # the checkpoint's own
    # No such file; a directory; a NUL (possible from a TOML file: open() raises ValueError, not OSError).
    for mistyped in (str(tmp_path / "cutsom.jinja"), str(tmp_path), "custom\0.jinja"):
        with pytest.raises(SettingsError, match=rf"chat_template={re.escape(repr(mistyped))} is neither a readable file \(.+\) nor a template"):
            chat_template_text(mistyped)
    assert chat_template_text("{{ '\0' }}{{ messages[0].content }}") == "{{ '\0' }}{{ messages[0].content }}"


@pytest.mark.parametrize("form", ["file", "inline"])
def test_admission_and_tokenize_render_chats_with_the_settings_template(tiny_model: Path, tmp_path: Path, form: str):
    path = tmp_path / "custom.jinja"
    path.write_text(TEMPLATE)
    settings = GatewaySettings(model=str(tiny_model), model_name="tiny", chat_template=str(path) if form == "file" else TEMPLATE)
    admission = Admission(settings, ModelInfo.load(settings), gateway_tokenizer(settings))
    checkpoints = Tokenizer.from_dir(tiny_model)
    messages = [ChatMessage(**m) for m in CHAT]
    want = checkpoints.encode(RENDERED, add_special_tokens=False)
    assert admission.prompt_ids(TokenizeRequest(messages=messages)) == want  # llm.tokenize's path
    assert admission.admit(GenerateRequest(messages=messages, max_tokens=1), "gw").job.input_ids == want  # llm.generate's
    assert want != Admission(settings, ModelInfo.load(settings), checkpoints).prompt_ids(TokenizeRequest(messages=messages))


def test_the_gateway_refuses_at_start_a_template_it_cannot_read_or_compile(tmp_path: Path, tiny_model: Path):
    """A usage error (exit 2) naming the setting (and the template's line), before NATS is dialled; it
    used to be no setting at all (MOEBUS_GATEWAY_CHAT_TEMPLATE was refused as a typo). A good one starts."""
    broken = tmp_path / "broken.jinja"
    broken.write_text(TEMPLATE.replace("{% endfor %}", "{% endif %}"))  # line 4 closes the for loop of line 2 with endif
    good = tmp_path / "good.jinja"
    good.write_text(TEMPLATE)
    unreachable = {"MOEBUS_NATS_URL": "nats://127.0.0.1:1", "MOEBUS_CONNECT_TIMEOUT_S": "0.5"}
    cases = [
        (str(broken), 2, rf"gateway settings: chat_template='{broken}': .* does not compile: line 4: Encountered unknown tag 'endif'"),
        (str(tmp_path / "missing.jinja"), 2, rf"gateway settings: chat_template='{tmp_path}/missing.jinja' is neither a readable file "
                                             r"\(No such file or directory\) nor a template"),
        ("{% for m in messages %}{{ m.content }}", 2, r"gateway settings: chat_template='\{% for m in messages %\}\{\{ m.content \}\}': .* "
                                                     r"does not compile: line 1: Unexpected end of template"),
        (str(good), 1, "no NATS server answered"),  # past the tokenizer, as far as dialling NATS
        (TEMPLATE, 1, "no NATS server answered"),
    ]
    procs = [subprocess.Popen([sys.executable, "-m", "services.cli", "gateway", "--model", str(tiny_model)],
                              env={**os.environ, **unreachable, "MOEBUS_GATEWAY_CHAT_TEMPLATE": value},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for value, _, _ in cases]
    for proc, (value, code, message) in zip(procs, cases):
        output, _ = proc.communicate(timeout=120)
        assert proc.returncode == code and re.search(message, output) and "Traceback" not in output, (value, output)


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    path = tmp_path_factory.mktemp("template") / "custom.jinja"
    path.write_text(TEMPLATE)
    stack = start_stack(tiny_model, tmp_path_factory.mktemp("stack-logs"), "single-node.yml", env={"MOEBUS_GATEWAY_CHAT_TEMPLATE": str(path)})
    try:
        yield stack
    finally:
        stack.stop()


@pytest.mark.slow
def test_a_stacks_chats_follow_the_gateways_template(stack: LocalStack, tokenizer: Tokenizer):
    """/tokenize's ids of a chat are the custom template's text, and a chat completion is fed as many."""
    frontend = frontend_address(stack)
    want = tokenizer.encode(RENDERED, add_special_tokens=False)
    status, tokenized = post_json(frontend, "/tokenize", {"messages": CHAT})
    assert status == 200, tokenized
    assert tokenized["tokens"] == want
    status, completion = post_json(frontend, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "temperature": 0})
    assert status == 200, completion
    assert completion["usage"]["prompt_tokens"] == len(want)
    assert len(want) != len(tokenizer.encode(tokenizer.apply_chat_template(CHAT), add_special_tokens=False))  # not the checkpoint's count
