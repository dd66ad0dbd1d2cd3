"""train-eagle's options, their allowed values and the chat text's own defaults."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_sparsever.offline.common import TrainingError

TRAIN_POSITIONS = ("generated", "all")
FEATURE_SCALES = ("rms", "none")
TEXTS = ("calibration", "chat")
DEFAULT_MAX_INTERMEDIATE = 2048  # the head's MLP width: the target's, at most this
# text="chat"'s own defaults, the measured run (bench/results/README.md): its pool of prompts is large,
# so one answer per prompt and fewer passes; generating the answers is the largest part of the hour.
CHAT_DEFAULTS = {"num_prompts": 150, "samples_per_prompt": 1, "max_new_tokens": 320, "epochs": 3,
                 "time_budget_min": 65.0}


class TrainEagleError(TrainingError):
    """train-eagle cannot run as asked (names the flag and the allowed values)."""


@dataclass
class TrainEagleOptions:
    aux_layers: tuple[int, ...] | None = None  # None: (2, L/2, L), spread on small targets
    # The head's size: on a CPU's hour, a smaller head's cheaper steps teach it more (bench/results/README.md).
    draft_vocab: int | None = 8192  # the N most frequent tokens of the training text; None: all
    intermediate_size: int | None = None  # the head's MLP width; None: the target's, at most 2048
    ttt_steps: int = 3
    text: str = "calibration"  # or "chat": answers to chat, math and code prompts (CHAT_CATEGORIES)
    samples_per_prompt: int = 4  # continuations sampled per training prompt (the data set is small)
    train_positions: str = "all"  # or "generated": the generated tokens only (the prompts are teacher-forced)
    code_tokens: int = 0  # Python source chunks added to the training text (data/python_source.py)
    code_heldout_tokens: int = 4096  # held-out Python source, from other files (with code_tokens > 0)
    num_prompts: int | None = None
    num_heldout_prompts: int = 8
    max_prompt_tokens: int = 256
    max_new_tokens: int = 384
    min_new_tokens: int = 0
    temperature: float = 0.7
    seed: int = 0
    epochs: int = 5
    lr: float = 2e-3
    weight_decay: float = 0.0
    feature_scale: str = "none"  # or "rms": streams scaled per dimension while training (module docstring)
    time_budget_min: float = 55.0  # the whole job; training stops early to stay inside it
    generator: str = "vllm"
    generation_dtype: str = "auto"  # see training_text.generation_dtype_here
    regenerate: bool = False
    output_dir: str | None = None  # None: <model>/eagle3_head
    show_progress: bool = True
    prompt_rows: list[dict[str, Any]] | None = field(default=None, repr=False)

    @classmethod
    def for_text(cls, text: str = "calibration", **given: Any) -> TrainEagleOptions:
        """Options for `text` (one of TEXTS): the text's own defaults where `given` leaves a field unset."""
        return cls(text=text, **{**(CHAT_DEFAULTS if text == "chat" else {}), **given})
