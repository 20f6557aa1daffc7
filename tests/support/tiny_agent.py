"""A deliberately small RLModule for pipeline tests of the foundation (not a real algorithm).

It regresses the next reward from (observation, action) over replayed sequences and acts
greedily on that prediction with epsilon-random exploration: enough to exercise collection,
streaming, logging, checkpoints and DDP without depending on an agent family.
"""

from typing import Any

import torch

from lightning_wm.agents.base import RLModule
from lightning_wm.envs import EnvSpec
from lightning_wm.nn.blocks import MLP


class TinyAgent(RLModule):
    def __init__(self, env_spec: EnvSpec | None = None, hidden: int = 16, lr: float = 1e-2, epsilon: float = 0.3):
        super().__init__(env_spec)
        assert env_spec is not None and env_spec.discrete and not env_spec.is_pixels
        self.save_hyperparameters(ignore=["env_spec"])
        self.net = MLP(env_spec.obs_shape[0], env_spec.action_dim, hidden=hidden, layers=1, norm=False)
        self.epsilon, self.lr = epsilon, lr

    def act(self, obs: torch.Tensor, state: Any, explore: bool):
        greedy = self.net(obs.float()).argmax(-1)
        if explore:
            random = torch.randint_like(greedy, self.env_spec.action_dim)
            greedy = torch.where(torch.rand(greedy.shape, device=obs.device) < self.epsilon, random, greedy)
        return greedy, state, {}

    def training_step(self, batch, batch_idx):
        obs, action = batch["obs"][:, :-1].float(), batch["action"][:, :-1]
        target = batch["reward"][:, 1:]
        valid = ~batch["is_last"][:, :-1]
        pred = self.net(obs).gather(-1, action.unsqueeze(-1)).squeeze(-1)
        loss = ((pred - target) ** 2 * valid).sum() / valid.sum().clamp(min=1)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class PriorityProbe(TinyAgent):
    """TinyAgent on single rows that gives every sampled row priority 0, except the first row it
    ever saw (priority 1000), and keeps each batch's ``(index, generation)`` in ``seen``."""

    def __init__(self, env_spec: EnvSpec | None = None, hidden: int = 16, lr: float = 1e-2, epsilon: float = 0.3):
        super().__init__(env_spec, hidden, lr, epsilon)
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.favourite: tuple[int, int] | None = None

    def training_step(self, batch, batch_idx):
        index, generation = batch["index"].cpu(), batch["generation"].cpu()
        self.seen.append((index.clone(), generation.clone()))
        if self.favourite is None:
            self.favourite = (int(index[0]), int(generation[0]))
        favourite = (index == self.favourite[0]) & (generation == self.favourite[1])
        pred = self.net(batch["obs"].float()).gather(-1, batch["action"].unsqueeze(-1)).squeeze(-1)
        loss = ((pred - batch["reward"]) ** 2 * batch["weight"]).mean()
        return {"loss": loss, "priority": torch.where(favourite, 1000.0, 0.0)}
