"""Chat messages to one prompt: the model's own chat template, or a plain layout.

A model directory may carry a chat template (``chat_template`` in
``tokenizer_config.json``, or a ``chat_template.jinja`` file): a Jinja program that lays
the messages out the way the model was tuned on. It runs in Jinja's sandbox, with the
names Hugging Face's ``apply_chat_template`` gives it. A model without one (the
built-in models have none) gets a plain layout a person can read, the one ``p2pswarm
chat`` uses::

    System: You are terse.
    User: Hello
    Assistant:

The agent renders a `p2pswarm chat` turn and the HTTP API an OpenAI chat request with
the same code, so it lives here, below both. What a chat cannot take (malformed messages,
or messages the template refuses) raises ``ChatRefused``, which the HTTP API answers as
400 bad-request; a template that fails by itself raises ``ChatTemplateFailed`` (500).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2pswarm.errors import SwarmError

ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatRefused(SwarmError):
    """Chat messages that cannot be taken: malformed, or refused by the model's template."""


class ChatTemplateFailed(SwarmError):
    """The model's chat template failed while rendering: the model's fault, not the ask's."""


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    source: str  # the Jinja program
    bos_token: str = ""
    eos_token: str = ""


def chat_messages(value: Any) -> list[dict[str, str]]:
    """``messages`` of a chat request as (role, text) dicts; ChatRefused when malformed.
    Content may be a string or a list of ``{"type": "text", "text": ...}`` parts."""
    if not isinstance(value, list) or not value:
        raise ChatRefused("\"messages\" must be a non-empty list of {\"role\", \"content\"} "
                          "objects")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise ChatRefused(f"messages[{i}] must be an object with role and content")
        role = message.get("role")
        if role not in ROLES:
            raise ChatRefused(f"messages[{i}].role {role!r} must be one of "
                              f"{', '.join(ROLES)}")
        out.append({"role": role, "content": _text(message.get("content"), i)})
    return out


def _text(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise ChatRefused(f"messages[{i}].content: only text parts "
                                  "({\"type\": \"text\", \"text\": ...}) are understood")
            parts.append(part["text"])
        return "".join(parts)
    raise ChatRefused(f"messages[{i}].content must be a string or a list of text parts")


def plain_prompt(messages: Sequence[Mapping[str, str]]) -> str:
    """The layout for a model without a chat template: "Role: content" lines, then the
    assistant's turn to speak. An answer follows "Assistant:" directly (as does any
    content that begins with a space): it is then exactly the text the model went on
    with after "Assistant:", so a kept session's cache still covers it in the next
    turn."""
    lines = [f"{m['role'].capitalize()}:"
             f"{'' if m['role'] == 'assistant' or m['content'][:1] == ' ' else ' '}"
             f"{m['content']}\n" for m in messages]
    return "".join(lines) + "Assistant:"


@functools.lru_cache(maxsize=8)
def _compiled(source: str) -> Any:
    """A chat template compiled once: every turn of a chat renders the same program, and
    compiling a real model's template takes longer than rendering it."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False,
                                                                    indent=indent)
    return env.from_string(source)


def _raise_exception(message: str) -> None:
    raise ChatRefused(f"the model's chat template refused the messages: {message}")


def render_chat(messages: Sequence[Mapping[str, str]], template: ChatTemplate | None) -> str:
    if template is None:
        return plain_prompt(messages)
    from jinja2 import TemplateError

    try:
        text: str = _compiled(template.source).render(
            messages=[dict(m) for m in messages], add_generation_prompt=True,
            bos_token=template.bos_token, eos_token=template.eos_token)
    except TemplateError as exc:
        raise ChatTemplateFailed(f"the model's chat template failed: {exc}") from None
    # the tokenizer adds bos itself when it encodes the prompt: do not have it twice
    if template.bos_token and text.startswith(template.bos_token):
        text = text[len(template.bos_token):]
    return text


def read_chat_template(model_dir: str | Path) -> ChatTemplate | None:
    """The chat template of a model directory, or None when it has none."""
    from p2pswarm.models.model_dir import model_file, model_file_if_any

    directory = Path(model_dir)
    config_path = model_file_if_any(directory, "tokenizer_config.json")
    try:
        config = json.loads(config_path.read_text()) if config_path is not None else {}
    except (OSError, ValueError):
        config = {}
    source = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(source, list):  # named templates: take the default one
        source = next((t.get("template") for t in source
                       if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(source, str):
        try:
            source = model_file(directory, "chat_template.jinja").read_text()
        except OSError:
            return None
    return ChatTemplate(source, _token(config.get("bos_token")), _token(config.get("eos_token")))


def _token(value: Any) -> str:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


__all__ = ["ChatRefused", "ChatTemplate", "ChatTemplateFailed", "chat_messages", "plain_prompt",
           "read_chat_template", "render_chat"]
