"""World Models controller (C), trained by CMA-ES.

The policy reads the features ``f = [z, h]`` (V's latent of the current frame and M's LSTM
output; or the raw observation vector when no V is given, a useful baseline):

* linear: ``y = W f + b`` — ``(F + 1) * O`` parameters (867 for ``z=32, h=256``, 3 actions);
* one hidden layer (``hidden > 0``): ``y = W2 tanh(W1 f + b1) + b2``.

Continuous actions are ``tanh(y)`` mapped linearly onto the action bounds (``[-1, 1]``
stays as is); discrete actions are ``argmax(y)``.

One training step is one CMA-ES generation (manual optimization, the ``cma`` package): ask a
population, evaluate every member's mean return over ``episodes_per_member`` episodes, tell.
All members are evaluated together: one pool of ``population * episodes`` envs (real, or the
:class:`~lightning_wm.dream_env.DreamEnv`), one batched forward per step through V, M and
the per-member policy weights (gathered per env, applied with ``einsum``). Under DDP the
population is split across ranks and the fitness gathered with ``all_gather``; rank 0's
solutions are broadcast so every rank tells the same CMA-ES the same thing.

Checkpoints hold the pickled CMA-ES (a ``uint8`` tensor under ``"cma_es"``), including its
random generator, so ``fit --ckpt_path last`` continues the same search.
"""

from __future__ import annotations

import math
import pickle
import warnings
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from lightning_wm.agents.base import RLModule
from lightning_wm.envs import EnvConfig, EnvPool, EnvSpec
from lightning_wm.protocols import GenerationTask

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # cma warns that matplotlib is missing
    import cma


# ---------------------------------------------------------------------------------------
# the policy, batched over population members
# ---------------------------------------------------------------------------------------


def controller_num_params(in_dim: int, out_dim: int, hidden: int = 0) -> int:
    """Parameters of the controller: ``(in+1)*out`` linear, ``(in+1)*hidden + (hidden+1)*out`` with a hidden layer."""
    if hidden <= 0:
        return (in_dim + 1) * out_dim
    return (in_dim + 1) * hidden + (hidden + 1) * out_dim


def controller_forward(params: Tensor, features: Tensor, in_dim: int, out_dim: int, hidden: int = 0) -> Tensor:
    """The controller's pre-activation output, with one parameter vector per batch entry.

    Args:
        params: ``[B, P]`` flat parameters (layout: ``W [O, F]`` row-major, then ``b [O]``;
            with a hidden layer ``W1 [H, F], b1 [H], W2 [O, H], b2 [O]``); ``[P]`` is broadcast.
        features: ``[B, F]``.
    Returns:
        ``[B, O]``.
    """
    if params.dim() == 1:
        params = params.unsqueeze(0).expand(features.shape[0], -1)
    b = features.shape[0]
    if params.shape[-1] != controller_num_params(in_dim, out_dim, hidden):
        raise ValueError(f"expected {controller_num_params(in_dim, out_dim, hidden)} parameters, got {params.shape[-1]}")
    x, offset = features, 0
    layers = [(in_dim, out_dim)] if hidden <= 0 else [(in_dim, hidden), (hidden, out_dim)]
    for i, (fan_in, fan_out) in enumerate(layers):
        w = params[:, offset : offset + fan_out * fan_in].reshape(b, fan_out, fan_in)
        offset += fan_out * fan_in
        bias = params[:, offset : offset + fan_out]
        offset += fan_out
        x = torch.einsum("bf,bof->bo", x, w) + bias
        if i < len(layers) - 1:
            x = torch.tanh(x)
    return x


class _Randn:
    """CMA-ES's normal sampler with its own (picklable) numpy generator, so a pickled CMA-ES
    continues with exactly the samples it would have drawn."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def __call__(self, *shape: int) -> np.ndarray:
        return self.rng.standard_normal(shape)


# ---------------------------------------------------------------------------------------
# the LightningModule
# ---------------------------------------------------------------------------------------


class Controller(RLModule):
    """World Models' controller, evolved by CMA-ES.

    Args:
        env_spec: the real env's spec (linked by the CLI from ``GenerationDataModule.spec``).
        vision_ckpt: V's checkpoint; without it the controller reads the observation vector.
        memory_ckpt: M's checkpoint (needs ``vision_ckpt``); without it the features are ``z`` only.
        hidden: units of an optional tanh hidden layer (0: linear, as in the paper).
        popsize: CMA-ES population (64 in the paper).
        episodes_per_member: episodes averaged into one member's fitness (16).
        sigma0: initial CMA-ES step size (0.1).
        train_in: evaluate the population in the ``real`` env or inside the ``dream``.
        dream_dir: store of real episodes (pixel or latent) whose first frames start dreams.
        dream_temperature, dream_max_steps, dream_done_threshold, dream_reward: DreamEnv settings.
        max_episode_steps: cap on the steps of one fitness episode (None: the env's own limit).
        sample_z: in the real env, feed ``z`` sampled from V's posterior (reference) instead of its mean.
        act_with: weights ``act()`` uses: the CMA-ES ``mean`` (favourite) or the ``best`` member
            of the latest generation.
        env_workers: subprocesses that step the population's real envs (0: in this process);
            2 on a 2-core machine renders pixel frames on both cores.
        seed: seed of CMA-ES's sampler and of the fitness episodes.
    """

    def __init__(
        self,
        env_spec: EnvSpec | None = None,
        vision_ckpt: str | None = None,
        memory_ckpt: str | None = None,
        hidden: int = 0,
        popsize: int = 64,
        episodes_per_member: int = 16,
        sigma0: float = 0.1,
        train_in: Literal["real", "dream"] = "real",
        dream_dir: str | None = None,
        dream_temperature: float = 1.0,
        dream_max_steps: int = 1000,
        dream_done_threshold: float = 0.5,
        dream_reward: Literal["head", "survival"] = "head",
        max_episode_steps: int | None = None,
        sample_z: bool = False,
        act_with: Literal["mean", "best"] = "mean",
        env_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(env_spec)
        if env_spec is None:
            raise ValueError("Controller needs the env spec (the CLI links it from the datamodule's env)")
        if memory_ckpt and not vision_ckpt:
            raise ValueError("memory_ckpt needs vision_ckpt: M runs on V's latents")
        if train_in not in ("real", "dream"):
            raise ValueError(f"train_in must be 'real' or 'dream', got {train_in!r}")
        if train_in == "dream" and not (vision_ckpt and memory_ckpt and dream_dir):
            raise ValueError("train_in='dream' needs vision_ckpt, memory_ckpt and dream_dir (episodes to start dreams)")
        if act_with not in ("mean", "best"):
            raise ValueError(f"act_with must be 'mean' or 'best', got {act_with!r}")
        if env_workers < 0:
            raise ValueError(f"env_workers must be >= 0, got {env_workers}")
        if popsize < 2 or episodes_per_member < 1:
            raise ValueError(f"popsize must be >= 2 and episodes_per_member >= 1 (got {popsize}, {episodes_per_member})")
        self.save_hyperparameters(ignore=["env_spec"])
        self.automatic_optimization = False
        self.hidden, self.popsize, self.episodes_per_member, self.sigma0 = hidden, popsize, episodes_per_member, sigma0
        self.train_in, self.dream_dir = train_in, dream_dir
        self.dream_temperature, self.dream_max_steps = dream_temperature, dream_max_steps
        self.dream_done_threshold, self.dream_reward = dream_done_threshold, dream_reward
        self.max_episode_steps, self.sample_z, self.act_with, self.seed = max_episode_steps, sample_z, act_with, seed
        self.env_workers = env_workers

        from lightning_wm.agents.memory import Memory, load_checkpoint_module
        from lightning_wm.agents.vision import Vision

        # frozen V and M; kept in train mode like the rest (they hold no dropout or batch norm)
        self.vision = load_checkpoint_module(Vision, vision_ckpt).train() if vision_ckpt else None
        self.memory = load_checkpoint_module(Memory, memory_ckpt).train() if memory_ckpt else None
        if self.vision is not None:
            if not env_spec.is_pixels:
                raise ValueError(f"vision_ckpt given but {env_spec.env_id} observes vectors; set env.pixels: true")
            in_dim = self.vision.z_size + (self.memory.hidden_size if self.memory is not None else 0)
            if self.memory is not None and self.memory.z_size != self.vision.z_size:
                raise ValueError(f"V's z_size {self.vision.z_size} differs from M's {self.memory.z_size}")
        else:
            if env_spec.is_pixels:
                raise ValueError("pixel observations need a trained V: set model.init_args.vision_ckpt")
            in_dim = int(np.prod(env_spec.obs_shape))
        self.in_dim, self.out_dim = in_dim, env_spec.action_dim
        self.num_params = controller_num_params(in_dim, self.out_dim, hidden)
        # the weights act() uses; a Parameter (never given a gradient) so DDP has something to wrap
        self.params = nn.Parameter(torch.zeros(self.num_params))
        if not env_spec.discrete:
            self.register_buffer("action_low", torch.as_tensor(env_spec.action_low), persistent=False)
            self.register_buffer("action_high", torch.as_tensor(env_spec.action_high), persistent=False)
        self.es = cma.CMAEvolutionStrategy(
            np.zeros(self.num_params), sigma0,
            {"popsize": popsize, "seed": np.nan, "randn": _Randn(seed), "verbose": -9},
        )
        self._pool: EnvPool | None = None
        self._dream: Any = None

    # -- policy -----------------------------------------------------------------------
    def initial_state(self, batch_size: int) -> tuple[Tensor, Tensor] | None:
        """M's zero LSTM state ``(h, c)`` ``[B, H]`` each, or None without M."""
        if self.memory is None:
            return None
        return self.memory.initial_state(batch_size, self.device)

    def _latent(self, obs: Tensor) -> Tensor:
        if self.vision is None:
            return obs.float().flatten(1)
        mu, logvar = self.vision.encode(obs)
        return self.vision.sample(mu, logvar) if self.sample_z else mu

    def _actions(self, params: Tensor, features: Tensor) -> tuple[Tensor, Tensor]:
        """-> ``(env action [B] int64 | [B, A] float, M's action input [B, A] float)``."""
        y = controller_forward(params, features, self.in_dim, self.out_dim, self.hidden)
        if self.env_spec.discrete:
            action = y.argmax(-1)
            return action, torch.nn.functional.one_hot(action, self.out_dim).float()
        u = torch.tanh(y)
        action = self.action_low + (u + 1) * 0.5 * (self.action_high - self.action_low)
        return action, action

    @torch.no_grad()
    def policy_step(self, obs: Tensor, state: tuple[Tensor, Tensor] | None, params: Tensor) -> tuple[Tensor, Any]:
        """One real-env step for a batch: ``obs [B, ...]``, M's state, ``params [B, P]`` or ``[P]``
        -> ``(action, next state)``. Features are ``[z, h]``; M then reads ``[z, a]``."""
        z = self._latent(obs)
        if self.memory is None:
            return self._actions(params, z)[0], state
        h, c = state
        action, action_in = self._actions(params, torch.cat([z, h], -1))
        _, next_state = self.memory.step(z, action_in, (h, c))
        return action, next_state

    def act(self, obs: Tensor, state: Any, explore: bool = False) -> tuple[Tensor, Any, dict[str, Tensor]]:
        """Act with the current weights (``act_with``); deterministic (``explore`` is ignored)."""
        if self.memory is not None and state is None:
            state = self.initial_state(obs.shape[0])
        action, state = self.policy_step(obs, state, self.params.detach())
        return action, state, {}

    # -- fitness ----------------------------------------------------------------------
    def _real_pool(self, n: int, config: EnvConfig | None) -> EnvPool:
        if config is None:
            raise ValueError("the controller evaluates its population in a real env: fit it with GenerationDataModule "
                             "(whose batches name the env) or pass config=EnvConfig(...)")
        cfg = EnvConfig(**{**vars(config), "num_envs": 1, "seed": 0})
        if self.max_episode_steps is not None:
            cfg.max_episode_steps = self.max_episode_steps
        if self._pool is None or len(self._pool) != n or self._pool.config != cfg:
            if self._pool is not None:
                self._pool.close()
            self._pool = EnvPool(cfg, n, workers=self.env_workers)
        return self._pool

    def _dream_env(self, n: int) -> Any:
        if self._dream is None or self._dream.num_envs != n:
            from lightning_wm.agents.vm_model import VisionMemoryModel
            from lightning_wm.dream_env import dream_env_from_model

            model = VisionMemoryModel(self.vision, self.memory, temperature=self.dream_temperature)
            self._dream = dream_env_from_model(
                model, self.dream_dir, self.env_spec.action_space, num_envs=n,
                max_episode_steps=self.max_episode_steps or self.dream_max_steps,
                done_threshold=self.dream_done_threshold, reward=self.dream_reward)
        return self._dream

    @torch.no_grad()
    def evaluate_population(self, solutions: Tensor, episodes: int, seed: int, where: str | None = None,
                            config: EnvConfig | None = None, per_episode: bool = False) -> Tensor:
        """Mean return of each of ``solutions [M, P]`` over ``episodes`` episodes.

        All members play the same ``episodes`` start seeds (common random numbers); env
        ``i`` belongs to member ``i // episodes``; every episode runs to its end.
        ``where``: ``real`` or ``dream`` (default ``train_in``); ``config``: the real env
        (needed for ``real``). Returns ``[M]`` float32 on this module's device, or
        every return ``[M, episodes]`` with ``per_episode``.
        """
        where = where or self.train_in
        m = solutions.shape[0]
        n = m * episodes
        member = torch.arange(n, device=self.device) // episodes
        params = solutions.to(self.device, torch.float32)
        returns = torch.zeros(n, dtype=torch.float64, device=self.device)
        active = torch.ones(n, dtype=torch.bool, device=self.device)
        if where == "dream":
            env = self._dream_env(n)
            feats = env.reset_tensor(seed)
            while bool(active.any()):
                y = self._actions(params[member], feats)[0]
                feats, reward, terminated, truncated = env.step_tensor(y)
                returns += torch.where(active, reward.double(), torch.zeros_like(returns))
                active &= ~(terminated | truncated)
            return self._reduce(returns.view(m, episodes), per_episode)
        pool = self._real_pool(n, config)
        obs = pool.reset([seed + (i % episodes) for i in range(n)])
        state = self.initial_state(n)
        while bool(active.any()):
            index = active.nonzero().squeeze(-1)
            sub = None if state is None else (state[0][index], state[1][index])
            action, sub = self.policy_step(torch.as_tensor(obs[index.cpu().numpy()]).to(self.device), sub,
                                           params[member[index]])
            if state is not None:
                state[0][index], state[1][index] = sub
            idx = index.cpu().numpy()
            o, r, done = pool.step(idx, action.cpu().numpy())
            obs[idx] = o
            returns[index] += torch.as_tensor(r, device=self.device)
            active[index] = ~torch.as_tensor(done, device=self.device)
        return self._reduce(returns.view(m, episodes), per_episode)

    @staticmethod
    def _reduce(returns: Tensor, per_episode: bool) -> Tensor:
        return (returns if per_episode else returns.mean(1)).float()

    # -- one generation ---------------------------------------------------------------
    def training_step(self, batch: GenerationTask, batch_idx: int) -> None:
        """One CMA-ES generation; ``batch`` names the real env the population is evaluated in."""
        trainer = self.trainer
        world, rank = trainer.world_size, trainer.global_rank
        generation = int(self.global_step)
        # every rank asks (cma needs ask before tell); rank 0's solutions are used everywhere
        solutions = np.asarray(self.es.ask())
        if world > 1:
            solutions = trainer.strategy.broadcast(solutions, src=0)
        per_rank = math.ceil(self.popsize / world)
        order = np.arange(per_rank * world) % self.popsize  # padded with repeats, dropped below
        mine = torch.as_tensor(solutions[order[rank * per_rank : (rank + 1) * per_rank]], dtype=torch.float32)
        seed = self.seed + 1_000_003 * (generation + 1)
        fitness = self.evaluate_population(mine, self.episodes_per_member, seed, config=batch.env)
        gathered = self.all_gather(fitness).reshape(-1)[: self.popsize].double().cpu().numpy()
        self.es.tell(list(solutions), list(-gathered))  # cma minimises
        best = int(gathered.argmax())
        chosen = self.es.result.xfavorite if self.act_with == "mean" else solutions[best]
        with torch.no_grad():
            self.params.copy_(torch.as_tensor(np.asarray(chosen), dtype=torch.float32))
        self.log_dict({
            "fitness/best": float(gathered.max()),
            "fitness/mean": float(gathered.mean()),
            "fitness/worst": float(gathered.min()),
            "cma/sigma": float(self.es.sigma),
        }, on_step=True, prog_bar=False, rank_zero_only=True)
        self.log("fitness", float(gathered.mean()), prog_bar=True, rank_zero_only=True)
        self.optimizers().step()  # a no-op step that advances global_step (one per generation)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # CMA-ES updates the weights; this optimizer only lets Lightning count generations.
        return torch.optim.SGD([self.params], lr=0.0)

    def close_envs(self) -> None:
        """Close the real envs (and their worker processes) and drop the dream env."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        self._dream = None

    def on_fit_end(self) -> None:
        self.close_envs()

    # -- checkpoints ------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["cma_es"] = torch.frombuffer(bytearray(pickle.dumps(self.es)), dtype=torch.uint8)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "cma_es" in checkpoint:
            es = pickle.loads(checkpoint["cma_es"].cpu().numpy().tobytes())
            if es.N != self.num_params:
                raise ValueError(f"checkpoint's CMA-ES has {es.N} parameters, this controller {self.num_params}")
            self.es = es
