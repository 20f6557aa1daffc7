"""Does M's reward respond to the actions the way the env's does? From recorded states, M's mean
predicted reward over ``--steps`` dreamed steps under each constant action of a list, beside the
recorded actions' statistics, and a controller's mean action along its own dreams: a controller
that exploits M drives where M's reward is wrong (CarRacing: full brake "pays" in an M whose data
never braked hard).

    python bench/dream_action_response.py --vision V.ckpt --memory M.ckpt --latents DIR \\
        --controller C.ckpt --actions "0,1,0" "0,0,1" "0,0,0"

The controller acts as in training (its own action mapping, the env's bounds from the store).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from lightning_wm.agents.worldmodels.controller import Controller
from lightning_wm.agents.worldmodels.vm_model import VisionMemoryModel
from lightning_wm.checkpoints import load_module
from lightning_wm.data.offline import EpisodeDataModule


def start_states(model: VisionMemoryModel, directory: Path, episodes: int, at: int) -> dict[str, torch.Tensor]:
    """The filtered V+M state at row ``at`` of the first ``episodes`` recorded episodes, ``[N, ...]``."""
    states = []
    for path in sorted(directory.glob("*.npz"))[:episodes]:
        episode = np.load(path)
        rows = model.posterior_states({k: episode[k][: at + 1] for k in ("mu", "logvar", "action")})
        states.append({k: v[at : at + 1] for k, v in rows.items()})
    return {k: torch.cat([s[k] for s in states]) for k in states[0]}


@torch.no_grad()
def mean_dream_reward(model: VisionMemoryModel, state: dict, act, steps: int, seed: int) -> tuple[float, torch.Tensor]:
    """``act(state) -> [N, A]`` for ``steps`` dreamed steps: (mean predicted reward, mean action ``[A]``)."""
    generator = torch.Generator().manual_seed(seed)
    state = {k: v.clone() for k, v in state.items()}
    rewards, actions = [], []
    for _ in range(steps):
        action = act(state)
        reward, state, _ = model.step(state, action, generator=generator)
        rewards.append(reward)
        actions.append(action)
    return float(torch.stack(rewards).mean()), torch.stack(actions).mean((0, 1))


def _floats(text: str) -> torch.Tensor:
    return torch.tensor([float(x) for x in text.split(",")])


def load_controller(path: str, vision: str, memory: str, latents: Path) -> Controller:
    """The controller at ``path`` on these V and M, for the env the latent store was recorded in."""
    spec = EpisodeDataModule(directory=str(latents)).spec
    return load_module(Controller, path, env_spec=spec, vision_ckpt=vision, memory_ckpt=memory, train_in="real")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vision", required=True)
    parser.add_argument("--memory", required=True)
    parser.add_argument("--latents", type=Path, required=True, help="the latent store M was trained on")
    parser.add_argument("--controller", help="a controller's checkpoint on V and M's features")
    parser.add_argument("--actions", nargs="+", default=["0,1,0", "0,0.3,0", "0,0,1", "0,0,0", "0,1,1"])
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--at", type=int, default=100, help="the row of each episode the dreams start from")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    controller = load_controller(args.controller, args.vision, args.memory, args.latents) if args.controller else None
    model = VisionMemoryModel.from_checkpoints(args.vision, args.memory)  # M's own temperature, 1.0
    state = start_states(model, args.latents, args.episodes, args.at)
    recorded = np.concatenate([np.load(p)["action"] for p in sorted(args.latents.glob("*.npz"))])
    print(f"recorded actions: mean {np.round(recorded.mean(0), 3)}, std {np.round(recorded.std(0), 3)}")
    print(f"| constant action | M's mean reward over {args.steps} dreamed steps |\n| --- | ---: |")
    for text in args.actions:
        action = _floats(text).expand(len(state["z"]), -1)
        print(f"| {text} | {mean_dream_reward(model, state, lambda s, a=action: a, args.steps, 0)[0]:.3f} |")
    if controller:
        params = controller.params.detach()
        reward, mean = mean_dream_reward(
            model, state, lambda s: controller._act(params, model.features(s)), args.steps, 0
        )
        print(f"| the controller | {reward:.3f} (its mean action {np.round(mean.numpy(), 3)}) |")


if __name__ == "__main__":
    main()
