"""A chat turn from the CLI (`p2pswarm chat`): the conversation so far becomes one prompt
through the model's chat template (the one the OpenAI endpoint uses), or the plain layout
for a model without one; the oldest turns go when the conversation outgrows the load's
context. The turn is generated with ``remember``: each turn resends the conversation, and
its stages continue the session they kept from the turn before, prefilling only what is
new."""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from p2pswarm.agent.serving.records import LoadRecord, WeightsOrigin
from p2pswarm.agent.weights import Manifest
from p2pswarm.errors import ConfigError, PlacementError
from p2pswarm.models.chat_template import (
    ROLES,
    ChatTemplate,
    read_chat_template,
    render_chat,
)
from p2pswarm.wire.control import ChatTurn

if TYPE_CHECKING:
    from p2pswarm.agent.serving import Serving


class ChatPrompts:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self._templates: dict[str, ChatTemplate | None] = {}

    async def template(self, record: LoadRecord) -> ChatTemplate | None:
        """The load's chat template, from its model directory (None for built-ins)."""
        plan_id = record.plan_id
        if plan_id in self._templates:
            return self._templates[plan_id]
        template = None
        origin = WeightsOrigin.of(record.model)
        if origin.kind == "files":
            manifest = Manifest.from_dict({**record.model, "config": {}, "tensors": []})
            if any(f.name == "tokenizer_config.json" for f in manifest.files):
                serving = self.serving
                await serving.tokenizer(record)  # fetches the side files this fellow lacks
                local = serving.offers.local_dir(manifest) \
                    if origin.offered_by(serving.agent.node_id.hex()) else None
                if local is not None:
                    directory = local
                else:
                    cache = serving.weights_cache()
                    directory = str(await serving.run(lambda: cache.model_dir(manifest)))
                template = await trio.to_thread.run_sync(read_chat_template, directory)
        self._templates[plan_id] = template
        return template

    async def prompt(self, record: LoadRecord, messages: tuple[ChatTurn, ...],
                     max_tokens: int) -> str:
        """The prompt for ``messages``, the oldest turns dropped until it leaves room for
        ``max_tokens`` in the load's context (system messages and the last turn stay)."""
        for i, turn in enumerate(messages):  # the typed request bounds a role, not its name
            if turn.role not in ROLES:
                raise ConfigError(f"messages[{i}].role {turn.role!r} must be one of "
                                  f"{', '.join(ROLES)}")
        template = await self.template(record)
        tokenizer = await self.serving.tokenizer(record)
        context, bound = record.generation_tokens()
        kept = list(messages)
        while True:  # the template renders the turns as the OpenAI endpoint takes them
            prompt = render_chat([{"role": t.role, "content": t.content} for t in kept],
                                 template)
            if not context or len(tokenizer.encode(prompt)) + max_tokens - 1 <= context:
                return prompt
            turns = [i for i, t in enumerate(kept) if t.role not in ("system", "developer")]
            if len(turns) <= 1:
                raise PlacementError(f"the last message and {max_tokens} new tokens exceed "
                                     f"{bound}")
            del kept[turns[0]]


__all__ = ["ChatPrompts"]
