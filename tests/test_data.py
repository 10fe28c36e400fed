"""Data sources: the synthetic stream is learnable and per-rank; a local file trains with a local tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from trainprof.data import SyntheticTokens, build_loader
from trainprof.recipe import RecipeError, load_recipe

from conftest import QUICKSTART, QUIET, run_trainprof


def test_synthetic_is_a_repeating_pattern_with_per_rank_offsets():
    a = SyntheticTokens(vocab_size=100, seq_len=40, pattern_len=16, seed=1, rank=0)
    b = SyntheticTokens(vocab_size=100, seq_len=40, pattern_len=16, seed=1, rank=1)
    assert torch.equal(a.pattern, b.pattern)
    for sample in (next(iter(a))["input_ids"], next(iter(b))["input_ids"]):
        assert torch.equal(sample[16:32], sample[:16])  # period 16 on every rank
    starts_a = [s["input_ids"][0].item() for s, _ in zip(iter(a), range(20))]
    starts_b = [s["input_ids"][0].item() for s, _ in zip(iter(b), range(20))]
    assert starts_a != starts_b  # ranks see different windows


def make_local_tokenizer(path):
    """A word-level tokenizer built here (no download) and saved the way transformers loads it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    words = [f"w{i}" for i in range(50)]
    tok.train_from_iterator([" ".join(words)], trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>").save_pretrained(path)
    return words


@pytest.fixture
def corpus(tmp_path):
    words = make_local_tokenizer(tmp_path / "tok")
    lines = [json.dumps({"text": " ".join(words[i % 10 : i % 10 + 20])}) for i in range(200)]
    (tmp_path / "corpus.jsonl").write_text("\n".join(lines))
    return tmp_path


def test_file_loader_blocks(corpus):
    recipe = load_recipe(QUICKSTART, ["data.source=file", f"data.path={corpus / 'corpus.jsonl'}",
                                      f"data.tokenizer={corpus / 'tok'}", "data.seq_len=32", "train.micro_batch_size=2"])
    batch = next(iter(build_loader(recipe, vocab_size=1024, rank=0, world_size=2)))
    assert batch["input_ids"].shape == (2, 32)
    assert int(batch["input_ids"].max()) < 52


def test_bad_jsonl_line_names_the_line(tmp_path, corpus):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "w1 w2"}\nnot json\n')
    recipe = load_recipe(QUICKSTART, ["data.source=file", f"data.path={bad}", f"data.tokenizer={corpus / 'tok'}"])
    with pytest.raises(RecipeError, match="line 2 is not a JSON object"):
        build_loader(recipe, vocab_size=1024, rank=0, world_size=1)


@pytest.mark.slow
def test_file_data_trains_under_torchrun(tmp_path, corpus):
    _, profile = run_trainprof(tmp_path, 2, "data.source=file", f"data.path={corpus / 'corpus.jsonl'}",
                               f"data.tokenizer={corpus / 'tok'}", "zero_stage=2", *QUIET)
    assert profile["steps"][-1]["loss"] < profile["steps"][0]["loss"]
