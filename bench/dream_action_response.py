"""Does M's reward respond to the actions the way the env's does? From recorded states, M's mean
predicted reward over ``--steps`` dreamed steps under each constant action of a list, beside the
recorded actions' statistics, and a controller's mean action along its own dreams: a controller
that exploits M drives where M's reward is wrong (CarRacing: full brake "pays" in an M whose data
never braked hard).

    python bench/dream_action_response.py --vision V.ckpt --memory M.ckpt --latents DIR \\
        --controller C.ckpt --actions "0,1,0" "0,0,1" "0,0,0"
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from lightning_wm.agents.worldmodels.controller_net import controller_forward
from lightning_wm.agents.worldmodels.vm_model import VisionMemoryModel


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


def linear_controller(params: torch.Tensor, action_map: list[str], low: torch.Tensor, high: torch.Tensor):
    """``features [N, F] -> actions [N, A]`` of a linear controller: ``u = tanh(W f + b)``, then per
    dimension ``linear`` (``u`` onto ``[low, high]``) or ``clip`` (``u`` clipped to it), as the
    Controller's ``action_map`` does."""
    clip = torch.tensor([m == "clip" for m in action_map])

    def act(features: torch.Tensor) -> torch.Tensor:
        u = torch.tanh(controller_forward(params, features, features.shape[-1], len(action_map)))
        return torch.where(clip, torch.maximum(torch.minimum(u, high), low), low + (u + 1) / 2 * (high - low))

    return act


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vision", required=True)
    parser.add_argument("--memory", required=True)
    parser.add_argument("--latents", type=Path, required=True, help="the latent store M was trained on")
    parser.add_argument("--controller", help="a linear controller's checkpoint on [z, h] (its `params`)")
    parser.add_argument("--action-map", default="linear,linear,clip", help="the controller's action_map")
    parser.add_argument("--low", default="-1,0,0", help="the action space's lower bounds (CarRacing's)")
    parser.add_argument("--high", default="1,1,1", help="the action space's upper bounds")
    parser.add_argument("--actions", nargs="+", default=["0,1,0", "0,0.3,0", "0,0,1", "0,0,0", "0,1,1"])
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--at", type=int, default=100, help="the row of each episode the dreams start from")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = VisionMemoryModel.from_checkpoints(args.vision, args.memory, "cpu")
    state = start_states(model, args.latents, args.episodes, args.at)
    recorded = np.concatenate([np.load(p)["action"] for p in sorted(args.latents.glob("*.npz"))])
    print(f"recorded actions: mean {np.round(recorded.mean(0), 3)}, std {np.round(recorded.std(0), 3)}")
    print(f"| constant action | M's mean reward over {args.steps} dreamed steps |\n| --- | ---: |")
    for text in args.actions:
        action = _floats(text).expand(len(state["z"]), -1)
        print(f"| {text} | {mean_dream_reward(model, state, lambda s, a=action: a, args.steps, 0)[0]:.3f} |")
    if args.controller:
        params = torch.load(args.controller, map_location="cpu", weights_only=False)["state_dict"]["params"]
        act = linear_controller(params, args.action_map.split(","), _floats(args.low), _floats(args.high))
        reward, mean = mean_dream_reward(model, state, lambda s: act(model.features(s)), args.steps, 0)
        print(f"| the controller | {reward:.3f} (its mean action {np.round(mean.numpy(), 3)}) |")


if __name__ == "__main__":
    main()
