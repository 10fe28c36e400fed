"""Llama2 shapes: a plain list turned into a name -> shape map (`SHAPES`), and reading a shape from a
local Hugging Face checkpoint's config.json.

The real Llama2 shapes come from the released config.json files of meta-llama/Llama-2-{7b,13b,70b}-hf
(Touvron et al. 2023, table 1). Pure data: this module imports nothing from trainprof, so the recipe
(which validates against it) and the model builder can both use it without a cycle.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# bytes per element of each model dtype
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True, kw_only=True)
class LlamaShape:
    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int = 32000
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


_SHAPE_LIST: list[dict[str, Any]] = [
    # Llama-2-7b-hf config.json
    dict(name="llama2-7b", hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32, num_kv_heads=32),
    # Llama-2-13b-hf config.json
    dict(name="llama2-13b", hidden_size=5120, intermediate_size=13824, num_layers=40, num_heads=40, num_kv_heads=40),
    # Llama-2-70b-hf config.json: grouped-query attention with 8 key/value heads
    dict(name="llama2-70b", hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8),
    # ~1.1B Llama2-shaped model for single-GPU checks (TinyLlama-1.1B dims, multi-head attention)
    dict(name="llama2-1b", hidden_size=2048, intermediate_size=5632, num_layers=22, num_heads=32, num_kv_heads=32,
         max_position_embeddings=2048),
    # CPU shapes: same architecture, small enough for tests and laptops
    dict(name="llama2-tiny", hidden_size=128, intermediate_size=352, num_layers=2, num_heads=4, num_kv_heads=4,
         vocab_size=1024, max_position_embeddings=1024),
    dict(name="llama2-small", hidden_size=512, intermediate_size=1408, num_layers=4, num_heads=8, num_kv_heads=8,
         vocab_size=8192, max_position_embeddings=2048),
]
SHAPES: dict[str, LlamaShape] = {s["name"]: LlamaShape(**s) for s in _SHAPE_LIST}

DIM_KEYS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "vocab_size",
             "max_position_embeddings")



def shape_from_checkpoint(path: str) -> LlamaShape:
    cfg = json.loads((Path(path) / "config.json").read_text())
    return LlamaShape(
        name=Path(path).name,
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
        vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
    )
