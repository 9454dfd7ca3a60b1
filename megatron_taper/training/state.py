"""TrainState: the training loop's own counters, as the checkpoint stores them (trainer.pt), beside
the parts' states (the recovery policy's skipped steps, the data position, carried rows)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken (non-finite steps the optimizer skipped included)
    tokens_seen: int = 0
    batches: int = 0  # steps' worth of batches drawn, skipped windows included (fault/rollback.py)

    def advance(self, tokens: int) -> None:
        """One step done, of `tokens` tokens."""
        self.step += 1
        self.tokens_seen += tokens

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "data_skipped": self.batches - self.step}

    def load_state_dict(self, state: dict, seq_len: int) -> None:
        """From a loaded checkpoint's trainer state (with the "config" it was written with)."""
        self.step = state["step"]
        saved = state["config"]["train"]  # checkpoints before tokens_seen was saved: all steps at their batch
        self.tokens_seen = state.get("tokens_seen", self.step * saved["global_batch"] * seq_len)
        self.batches = self.step + state.get("data_skipped", 0)
