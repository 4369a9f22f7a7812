"""Chat messages to one prompt: now ``p2pswarm.models.chat_template``, which the agent's
`p2pswarm chat` turns and this API's OpenAI endpoint share; the names stay here for the
code that still imports them from the HTTP side."""

from __future__ import annotations

from p2pswarm.models.chat_template import (
    ROLES,
    ChatRefused,
    ChatTemplate,
    ChatTemplateFailed,
    chat_messages,
    plain_prompt,
    read_chat_template,
    render_chat,
)

__all__ = ["ROLES", "ChatRefused", "ChatTemplate", "ChatTemplateFailed", "chat_messages",
           "plain_prompt", "read_chat_template", "render_chat"]
