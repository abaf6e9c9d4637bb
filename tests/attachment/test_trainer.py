"""Hugging Face ``Trainer`` trains a model with a plan attached exactly as it trains the
original: variable-length padded batches, ``num_items_in_batch`` reaching the model's
loss, evaluation, bf16, and ``save_model`` with tied weights."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

import chkpt_opt

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

VOCAB = 256


class _Lengths(torch.utils.data.Dataset):
    """Token sequences of 8 to 47 tokens (fixed seed)."""

    def __init__(self, count: int = 12) -> None:
        gen = torch.Generator().manual_seed(1)
        lengths = torch.randint(8, 48, (count,), generator=gen).tolist()
        self.items = [torch.randint(1, VOCAB, (n,), generator=gen) for n in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.items[i]}


def _pad_to_longest(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    longest = max(len(item["input_ids"]) for item in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for k, item in enumerate(items):
        ids[k, : len(item["input_ids"])] = item["input_ids"]
        mask[k, : len(item["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _gpt2() -> Any:
    """GPT-2 ties its input embedding to its output projection."""
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _train(model: Any, folder: Path, **args: Any) -> tuple[Any, list[float], float]:
    arguments = transformers.TrainingArguments(
        str(folder),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        num_train_epochs=1,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        **args,
    )
    trainer = transformers.Trainer(
        model=model,
        args=arguments,
        train_dataset=_Lengths(),
        eval_dataset=_Lengths(8),
        data_collator=_pad_to_longest,
    )
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return trainer, losses, trainer.evaluate()["eval_loss"]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_trainer_trains_and_evaluates_it_as_the_original(bf16: bool, tmp_path: Path) -> None:
    original = _gpt2()
    model = chkpt_opt.optimize(copy.deepcopy(original), budget=10**9, time_limit_s=5)
    _, expected_losses, expected_eval = _train(original, tmp_path / "original", bf16=bf16)
    trainer, losses, eval_loss = _train(model, tmp_path / "optimized", bf16=bf16)
    assert losses == expected_losses and len(losses) == 3
    assert eval_loss == expected_eval
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), original.parameters()))
    attachment = chkpt_opt.attachment_of(model)
    # Trainer drops the logits before the backward pass: the plan made with them held still
    # fits, so it keeps serving (no second capture or solve), and its capture with symbolic
    # sizes serves the shorter third batch; evaluation ran the model's own forward.
    assert attachment.outputs_held is False
    assert (attachment.stats.captures, attachment.stats.solves) == (1, 1)
    trainer.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "config.json").exists()
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "saved"))
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    saved = dict(model.state_dict())
    assert all(torch.equal(saved[name], value) for name, value in loaded.state_dict().items())
