"""An encoder to inject into IMPALA from YAML (``class_path``): its first argument is the env spec."""

import torch
from torch import nn

from lightning_wm.envs import EnvSpec


class SumEncoder(nn.Module):
    """Vector observations ``[N, D]`` -> ``[N, width]``: one linear layer and a tanh (no ``out_dim``:
    IMPALA measures the feature size)."""

    def __init__(self, spec: EnvSpec, width: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(spec.obs_shape[0], width)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(obs.float()))
