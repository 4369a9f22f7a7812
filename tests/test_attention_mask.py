"""The attention mask of a prefill that continues a cache: which keys each new token sees,
built once per forward and shared by the layers, and the same logits as a fresh prefill."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from p2pswarm.models.llama import Attention, StageModel
from p2pswarm.runtime import Stage, StageSpec
from p2pswarm.shapes.model_config import ModelConfig

TINY = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6}


def test_new_tokens_see_the_cache_and_the_new_tokens_up_to_themselves() -> None:
    attention = Attention(ModelConfig.from_hf(TINY))
    q = torch.zeros(1, 4, 3, 8)
    mask = attention._mask(3, 5, q, None)  # 3 new tokens after 2 cached
    seen = mask == 0
    assert mask.dtype == q.dtype and torch.isinf(mask[~seen]).all()
    assert seen.tolist() == [[True, True, True, False, False],
                             [True, True, True, True, False],
                             [True, True, True, True, True]]
    windowed = Attention(ModelConfig.from_hf({**TINY, "model_type": "mistral",
                                              "sliding_window": 2}))
    assert (windowed._mask(3, 5, q, None) == 0).tolist() == [
        [False, True, True, False, False],
        [False, False, True, True, False],
        [False, False, False, True, True]]


def test_a_continued_prefill_builds_one_mask_for_all_its_layers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[torch.Tensor] = []
    original = Attention._mask

    def counting(self: Attention, T: int, L: int, q: torch.Tensor, masks: Any) -> torch.Tensor:
        fresh = masks is None or (T, L, self.window, self.softcap is not None) not in masks
        mask = original(self, T, L, q, masks)
        if fresh:
            built.append(mask)
        return mask

    monkeypatch.setattr(Attention, "_mask", counting)
    torch.manual_seed(0)
    model = StageModel(ModelConfig.from_hf(TINY), 0, 4)
    stage = Stage(model, StageSpec(0, 4, max_context_tokens=64))
    ids = list(range(1, 40))
    stage.prefill("chat", ids[:30])
    assert built == []  # a fresh prefill is causal: no mask at all
    continued = stage.prefill("chat", ids[30:], all_logits=True)
    assert len(built) == 1  # four layers, one mask
    fresh = Stage(model, StageSpec(0, 4, max_context_tokens=64))
    whole = fresh.prefill("all", ids, all_logits=True)[30:]
    assert (continued - whole).abs().max().item() <= 1e-5

