"""The state a model carries from one window of a batch row to the row's next window, held by the
trainer across steps (a family's CarriedState, models/spec.py; data.row_streams serves the rows).

This rank's rows are those of its micro-batches (streaming.RowStreamSource): micro-batch i of a
step holds the same global rows every step, so one state per micro-batch index, on the device,
follows its rows from step to step. The states are saved with this rank's data position in the
checkpoint (`state_dict`) and a resume loads them back, so a resumed run continues as the run
that did not stop (tested bitwise); a resume at another dp size, dp rank or accumulation is refused,
the rows' states belonging to the old layout.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch import nn

    from megatron_taper.models.spec import CarriedState


class CarriedRows:
    def __init__(self, spec: CarriedState, module: nn.Module, accumulation: int, dp: int, dp_rank: int,
                 device: torch.device):
        self.spec, self.module, self.device = spec, module, device
        self.layout = {"dp": dp, "dp_rank": dp_rank, "accumulation": accumulation}
        self.states: list[torch.Tensor | None] = [None] * accumulation  # None: no window seen yet
        self.continues: list[torch.Tensor] = []

    def split(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """The tokens of a step's (tokens, continues) micro-batches; keeps the continues flags."""
        self.continues = [continues for _, continues in micro_batches]
        return [tokens for tokens, _ in micro_batches]

    def before(self, i: int) -> None:
        self.spec.put(self.module, self.states[i], self.continues[i].to(self.device, non_blocking=True))

    def after(self, i: int) -> None:
        self.states[i] = self.spec.take(self.module)

    def state_dict(self) -> dict:
        return {**self.layout, "states": [None if s is None else s.detach().cpu() for s in self.states]}

    def load_state_dict(self, state: dict | None) -> None:
        saved = {key: state.get(key) for key in self.layout} if state else None
        if saved != self.layout:
            raise ValueError(f"cannot resume the carried state (model.bridge.carry_state): the checkpoint holds "
                             f"{'none' if state is None else 'the rows of ' + str(saved)}, this rank's rows are "
                             f"{self.layout}; resume with the same dp size and train.micro_batch, or set the "
                             f"option false")
        self.states = [None if s is None else s.to(self.device) for s in state["states"]]
