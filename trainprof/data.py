"""Training data: synthetic tokens (a learnable repeating pattern) or a local .txt/.jsonl file.

Nothing is downloaded: the file source needs a local tokenizer directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset

from trainprof.recipe import Recipe


class SyntheticTokens(IterableDataset):
    """An endless stream of windows over one random token pattern that repeats every `pattern_len`
    tokens. The pattern is the same on every rank (seeded by the recipe), the window offsets differ
    per rank, so the task is learnable (the loss falls) and ranks see different samples."""

    def __init__(self, *, vocab_size: int, seq_len: int, pattern_len: int, seed: int, rank: int) -> None:
        self.seq_len = seq_len
        gen = torch.Generator().manual_seed(seed)
        self.pattern = torch.randint(0, vocab_size, (pattern_len,), generator=gen)
        self.offset_seed = seed * 1000 + rank

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        worker = torch.utils.data.get_worker_info()
        gen = torch.Generator().manual_seed(self.offset_seed + (worker.id * 7919 if worker else 0))
        reps = self.seq_len // len(self.pattern) + 2
        tiled = self.pattern.repeat(reps)
        while True:
            start = int(torch.randint(0, len(self.pattern), (1,), generator=gen))
            ids = tiled[start : start + self.seq_len].clone()
            yield {"input_ids": ids, "labels": ids}


class TokenBlocks(IterableDataset):
    """Fixed-length blocks of a tokenized local text file, this rank's share, cycled with a per-epoch
    shuffle."""

    def __init__(self, blocks: torch.Tensor, *, seed: int) -> None:
        self.blocks = blocks
        self.seed = seed

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        epoch = 0
        while True:
            order = torch.randperm(len(self.blocks), generator=torch.Generator().manual_seed(self.seed + epoch))
            for i in order.tolist():
                ids = self.blocks[i]
                yield {"input_ids": ids, "labels": ids}
            epoch += 1


def read_texts(path: str | Path) -> list[str]:
    """The documents of a .txt file (one) or a .jsonl file (the "text" field of each line)."""
    path = Path(path)
    if path.suffix == ".txt":
        return [path.read_text()]
    texts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            texts.append(json.loads(line)["text"])
        except (json.JSONDecodeError, KeyError, TypeError):
            from trainprof.recipe import RecipeError

            raise RecipeError(
                f"recipe key 'data.path': {path} line {n} is not a JSON object with a \"text\" field; fix that line"
            ) from None
    return texts


def file_blocks(recipe: Recipe, *, rank: int, world_size: int) -> torch.Tensor:
    """Tokenize the recipe's local file with its local tokenizer; this rank's seq_len blocks."""
    from transformers import AutoTokenizer

    from trainprof.recipe import RecipeError

    d = recipe.data
    tokenizer = AutoTokenizer.from_pretrained(d.tokenizer or recipe.model.checkpoint, local_files_only=True)
    ids: list[int] = []
    for text in read_texts(d.path):
        ids.extend(tokenizer(text)["input_ids"])
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
    n_blocks = len(ids) // d.seq_len
    if n_blocks < world_size:
        raise RecipeError(
            f"recipe key 'data.path': {d.path} gives {len(ids)} tokens, fewer than one block of data.seq_len="
            f"{d.seq_len} per rank; use a longer file or a smaller data.seq_len"
        )
    blocks = torch.tensor(ids[: n_blocks * d.seq_len]).view(n_blocks, d.seq_len)
    return blocks[rank::world_size]


def build_loader(recipe: Recipe, *, vocab_size: int, rank: int, world_size: int) -> DataLoader:
    """The recipe's per-rank DataLoader of {input_ids, labels} micro batches."""
    d, t = recipe.data, recipe.train
    if d.source == "synthetic":
        dataset: IterableDataset = SyntheticTokens(
            vocab_size=vocab_size, seq_len=d.seq_len, pattern_len=d.synthetic_pattern_len, seed=t.seed, rank=rank
        )
    else:
        dataset = TokenBlocks(file_blocks(recipe, rank=rank, world_size=world_size), seed=t.seed + rank)
    return DataLoader(
        dataset,
        batch_size=t.micro_batch_size,
        num_workers=d.num_workers,
        persistent_workers=d.num_workers > 0,
    )
