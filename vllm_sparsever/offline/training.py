"""The training loop the offline jobs share (`train-exits`' heads, `train-eagle`'s head): AdamW, a
warm-up then cosine learning rate, a seeded order per epoch, and a deadline that stops it early."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch


class TrainingRun(NamedTuple):
    steps: int  # optimizer steps done
    planned_steps: int
    stopped_by_budget: bool  # the deadline came first
    epoch_means: list[float]  # per epoch, the mean of what each step reported (weighted)


@dataclass
class TrainingResult:
    """What every training job reports; each job's result adds its own evaluation."""

    model_dir: str
    output_dir: Path
    train_tokens: int
    heldout_tokens: int
    steps: int
    planned_steps: int
    stopped_by_budget: bool
    seconds: dict[str, float]

    def summary_head(self, what: str) -> list[str]:
        """The summary's first lines: what was written where, the tokens and steps, the time spent."""
        return [
            f"{what} for {self.model_dir} -> {self.output_dir}",
            f"tokens: train {self.train_tokens}, held-out {self.heldout_tokens}; steps "
            f"{self.steps}/{self.planned_steps}" + (" (stopped by --time-budget)" if self.stopped_by_budget else ""),
            "seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in self.seconds.items()),
        ]


def lr_at(step: int, total: int, base: float) -> float:
    """Linear warm-up over 5% of the steps, then cosine down to 10% of `base`."""
    warm = max(1, total // 20)
    if step < warm:
        return base * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_loop(params: list[torch.nn.Parameter], batches: Callable[[torch.Generator], Iterable[Any]],
               step: Callable[[Any], tuple[float, int]], *, steps_per_epoch: int, epochs: int, lr: float,
               weight_decay: float, seed: int, deadline: float, show_progress: bool, metric: str = "loss",
               clip_grad_norm: float | None = None) -> TrainingRun:
    """`epochs` passes over `batches(generator)` (called once per epoch: it draws that epoch's order
    from the seeded generator). `step(batch)` computes the loss, calls backward and returns (the
    value to report, its weight in the epoch's mean); the loop sets the learning rate, clears and
    clips the gradients and steps the optimizer. Stops before a step that would start after
    `deadline` (time.monotonic())."""
    from tqdm.auto import tqdm

    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    planned = steps_per_epoch * epochs
    generator = torch.Generator().manual_seed(seed)
    done, stopped, epoch_means = 0, False, []
    bar = tqdm(total=planned, desc="train", disable=not show_progress)
    for _epoch in range(epochs):
        total, count = 0.0, 0
        order: Iterator[Any] = iter(batches(generator))
        for batch in order:
            if time.monotonic() >= deadline:
                stopped = True
                break
            rate = lr_at(done, planned, lr)
            for group in optimizer.param_groups:
                group["lr"] = rate
            optimizer.zero_grad(set_to_none=True)
            value, weight = step(batch)
            if clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
            optimizer.step()
            total += value * weight
            count += weight
            done += 1
            bar.update(1)
            bar.set_postfix({metric: f"{value:.3f}", "lr": f"{rate:.1e}"})
        if count:
            epoch_means.append(total / count)
        if stopped:
            break
    bar.close()
    return TrainingRun(done, planned, stopped, epoch_means)
