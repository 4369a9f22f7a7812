"""A tiny Llama over the byte tokenizer's 259 ids, and the bundled text as its data: the
model and data the training tests build again and again."""

from __future__ import annotations

from typing import Any

from p2pswarm.models.tokenizer import ByteTokenizer
from p2pswarm.training.data import TokenData, load_tokens
from p2pswarm.training.job import DataConfig


def byte_llama(*, hidden_size: int, layers: int, positions: int, tied: bool
               ) -> dict[str, Any]:
    """A Hugging Face config: four heads over two key-value heads (grouped-query attention),
    an MLP twice as wide as the hidden state."""
    return {"model_type": "llama", "vocab_size": 259, "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size, "num_hidden_layers": layers,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": hidden_size // 4,
            "max_position_embeddings": positions, "tie_word_embeddings": tied}


def byte_token_data() -> TokenData:
    """The bundled text as byte tokens, 5 % held out, in windows of 32."""
    return TokenData.split(load_tokens(DataConfig(), ByteTokenizer()), 0.05, 32)
