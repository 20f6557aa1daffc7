"""World Models controller (C), trained by CMA-ES.

The policy reads the features of a world model's state: ``f = [z, h]`` (V's latent of the
current frame and M's LSTM output), or ``[h, z]`` of a Dreamer RSSM; or V's ``z`` alone, or the
raw observation vector when no model is given (useful baselines):

* linear: ``y = W f + b`` — ``(F + 1) * O`` parameters (867 for ``z=32, h=256``, 3 actions);
* one hidden layer (``hidden > 0``): ``y = W2 tanh(W1 f + b1) + b2``.

Continuous actions are ``tanh(y)`` mapped linearly onto the action bounds (``[-1, 1]``
stays as is), or, per dimension with ``action_map``, clipped to them (``clip``: the paper's
CarRacing brake ``clip(tanh(y), 0, 1)``, off at zero weights); discrete actions are ``argmax(y)``.

One training step is one CMA-ES generation (manual optimization, the ``cma`` package): ask a
population, evaluate every member's mean return over ``es.episodes_per_member`` episodes, tell
CMA-ES the fitness ``return - es.l2_decay * mean(theta^2)`` (HumbleRL's L2 weight decay).
All members are evaluated together: one pool of ``population * episodes`` envs (real, or the
:class:`~lightning_wm.dream_env.DreamEnv`), one batched forward per step through V, M and
the per-member policy weights (gathered per env, applied with ``einsum``). In the real env the
world model filters the frames (``observe_step``); in the dream it is stepped
(:class:`~lightning_wm.dream_env.DreamEnv`, any :class:`~lightning_wm.world_model.WorldModel`:
V+M or a Dreamer RSSM, dreams starting from states of recorded episodes). Under DDP the
population is split across ranks and the fitness gathered with ``all_gather``; rank 0's
solutions are broadcast so every rank tells the same CMA-ES the same thing.

Both solutions HumbleRL saves are kept: the CMA-ES *mean* (``params``, the favourite) and the
*best* member ever evaluated (``best_params``, by the told fitness); ``use`` picks the one that
acts (``evaluate --model.init_args.use best``). Checkpoints hold both and the pickled CMA-ES (a
``uint8`` tensor under ``"cma_es"``), including its random generator, so ``fit --ckpt_path
last`` continues the same search.
"""

from __future__ import annotations

import math
import pickle
import warnings
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from lightning_wm.actions import ActionCodec
from lightning_wm.agents.base import RLModule
from lightning_wm.agents.dreamer import Dreamer
from lightning_wm.agents.worldmodels.controller_net import (
    controller_forward,
    controller_num_params,
    widen_controller_params,
)
from lightning_wm.agents.worldmodels.figures import fitness_figure
from lightning_wm.agents.worldmodels.memory import Memory
from lightning_wm.agents.worldmodels.settings import ControllerDreamSettings, ESSettings
from lightning_wm.agents.worldmodels.vision import Vision
from lightning_wm.agents.worldmodels.vm_model import VisionMemoryModel
from lightning_wm.checkpoints import CheckpointError, load_checkpoint, load_module
from lightning_wm.data.episodes import EpisodeStore
from lightning_wm.dream_env import DreamEnv, start_states
from lightning_wm.envs import EnvConfig, EnvSpec
from lightning_wm.logging import log_figure
from lightning_wm.population_envs import PopulationEnvs
from lightning_wm.protocols import GenerationTask
from lightning_wm.seeding import derive_seed
from lightning_wm.settings import as_settings
from lightning_wm.tree import tree_map
from lightning_wm.world_model import WorldModel

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # cma warns that matplotlib is missing
    import cma


# ---------------------------------------------------------------------------------------
# the policy, batched over population members
# ---------------------------------------------------------------------------------------


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


def l2_penalty(solutions: Tensor, l2_decay: float) -> Tensor:
    """HumbleRL's (and estool's) weight decay of a population: ``l2_decay * mean(theta^2)`` per
    member, ``solutions [M, P] -> [M]``; subtracted from each member's mean return."""
    return l2_decay * solutions.double().square().mean(-1)


def _check_controller_settings(
    vision_ckpt: str | None,
    memory_ckpt: str | None,
    dreamer_ckpt: str | None,
    train_in: str,
    dream: ControllerDreamSettings,
    use: str,
    explore_noise: float,
) -> None:
    """One clear error for a controller setting that cannot work (see :class:`Controller`)."""
    if memory_ckpt and not vision_ckpt:
        raise ValueError("memory_ckpt needs vision_ckpt: M runs on V's latents")
    if dreamer_ckpt and (vision_ckpt or memory_ckpt):
        raise ValueError("give either dreamer_ckpt (Dreamer's RSSM) or vision_ckpt/memory_ckpt (V+M), not both")
    if train_in not in ("real", "dream"):
        raise ValueError(f"train_in must be 'real' or 'dream', got {train_in!r}")
    if train_in == "dream" and not ((dreamer_ckpt or (vision_ckpt and memory_ckpt)) and dream.dir):
        raise ValueError(
            "train_in='dream' needs a world model (vision_ckpt and memory_ckpt, or dreamer_ckpt) and "
            "dream.dir (recorded episodes whose states start dreams)"
        )
    if use not in ("mean", "best"):
        raise ValueError(f"use must be 'mean' or 'best', got {use!r}")
    if dream.ensemble and not memory_ckpt:
        raise ValueError("dream.ensemble needs memory_ckpt (and vision_ckpt): its members dream beside M")
    if not 0.0 <= explore_noise <= 1.0:
        raise ValueError(f"explore_noise is a probability, got {explore_noise}")


def _clip_dims(action_map: tuple[str, ...], actions: ActionCodec) -> Tensor:
    """``bool [A]``: the action dimensions ``action_map`` clips (see :class:`Controller`)."""
    if not action_map:
        return torch.zeros(actions.dim, dtype=torch.bool)
    if actions.discrete or len(action_map) != actions.dim or not set(action_map) <= {"linear", "clip"}:
        raise ValueError(
            f"action_map needs one of 'linear'/'clip' per continuous action dimension ({actions.dim}), "
            f"got {list(action_map)}"
        )
    return torch.tensor([m == "clip" for m in action_map])


class Controller(RLModule):
    """World Models' controller, evolved by CMA-ES.

    Args:
        env_spec: the real env's spec (linked by the CLI from ``GenerationDataModule.spec``).
        vision_ckpt: V's checkpoint; without it (and without ``dreamer_ckpt``) the controller
            reads the observation vector.
        memory_ckpt: M's checkpoint (needs ``vision_ckpt``); without it the features are ``z`` only.
        dreamer_ckpt: a Dreamer checkpoint whose RSSM is the world model instead of V+M
            (features ``[h, z]``; the dream is the RSSM's prior). Its env must be this env.
        hidden: units of an optional tanh hidden layer (0: linear, as in the paper).
        es: the evolution strategy (:class:`~lightning_wm.agents.worldmodels.settings.ESSettings`).
        train_in: evaluate the population in the ``real`` env or inside the world model's ``dream``.
        dream: the dream (:class:`~lightning_wm.agents.worldmodels.settings.ControllerDreamSettings`).
        max_episode_steps: cap on the steps of one fitness episode (None: the env's own limit).
        sample_z: V+M: the real frames give a ``z`` sampled from V's posterior (reference)
            instead of its mean.
        explore_noise: when acting with ``explore=True`` (``record``'s default), each action is
            replaced by a random one with this probability: varied episodes of a trained
            controller for M's next round (the paper's iterative training). Validation,
            ``evaluate`` and the fitness never explore.
        use: the weights that act (validation, ``evaluate``, ``record``): the CMA-ES ``mean``
            (default: averaged over the population, steadier under noisy fitness) or the
            ``best`` member ever evaluated (HumbleRL's ``_best`` weights). Not a model setting:
            a checkpoint holds both, so ``evaluate`` may pick either whatever fit used.
        action_map: per action dimension, how ``tanh(y)`` becomes the env action: ``linear``
            onto the bounds, or ``clip`` (clipped to them); empty: all ``linear``. The paper's
            CarRacing controller is ``[linear, linear, clip]``: steer ``tanh``, gas
            ``(tanh + 1) / 2``, brake ``clip(tanh, 0, 1)``.
        init_params_ckpt: a Controller checkpoint whose CMA-ES mean starts this search instead
            of zeros (same features and action size; the step size starts at ``es.sigma0``
            again), e.g. the last round's controller in the paper's iterative training. A linear
            controller on fewer features (V's ``z`` alone) starts a linear one on ``[z, h]``
            with zero weights on ``h``: it acts as the V-only controller did, and CMA-ES learns
            what ``h`` adds. Not a model setting (not saved).
    """

    def __init__(
        self,
        env_spec: EnvSpec | None = None,
        vision_ckpt: str | None = None,
        memory_ckpt: str | None = None,
        dreamer_ckpt: str | None = None,
        hidden: int = 0,
        es: ESSettings = ESSettings(),
        train_in: Literal["real", "dream"] = "real",
        dream: ControllerDreamSettings = ControllerDreamSettings(),
        max_episode_steps: int | None = None,
        sample_z: bool = False,
        explore_noise: float = 0.0,
        use: Literal["mean", "best"] = "mean",
        action_map: tuple[Literal["linear", "clip"], ...] = (),
        init_params_ckpt: str | None = None,
    ) -> None:
        super().__init__(env_spec)
        es = self.es = as_settings(ESSettings, es, "es")
        dream = self.dream = as_settings(ControllerDreamSettings, dream, "dream")
        if env_spec is None:
            raise ValueError("Controller needs the env spec (the CLI links it from the datamodule's env)")
        _check_controller_settings(vision_ckpt, memory_ckpt, dreamer_ckpt, train_in, dream, use, explore_noise)
        # `use` only picks which saved weights act and `init_params_ckpt` only where the search
        # starts: neither is a setting a checkpoint must agree with
        self.save_settings(ignore=["use", "init_params_ckpt"])
        self.automatic_optimization = False
        self.hidden, self.use, self.train_in = hidden, use, train_in
        self.max_episode_steps, self.explore_noise = max_episode_steps, explore_noise
        # numpy, not a torch.Generator: the module must pickle into spawned processes (DDP ranks)
        self._noise = np.random.default_rng(derive_seed(es.seed, "policy"))

        self._load_models(vision_ckpt, memory_ckpt, dreamer_ckpt, sample_z)
        # the ensemble's further Ms: frozen copies of their own checkpoints, loaded again from
        # dream.ensemble at construction and left out of the state dict (state_dict below), so a
        # controller trained in an ensemble's dream evaluates and records with V and M alone
        if dream.ensemble:
            self.memory_ensemble = nn.ModuleList(load_module(Memory, path) for path in dream.ensemble).train()
        if vision_ckpt and not env_spec.is_pixels:
            raise ValueError(f"vision_ckpt given but {env_spec.env_id} observes vectors; set env.pixels: true")
        if self.world_model is not None:
            in_dim = int(self.world_model.features(self.world_model.zero_state(1)).shape[-1])
        elif self.vision is not None:
            in_dim = self.vision.latent_dim
        else:
            if env_spec.is_pixels:
                raise ValueError("pixel observations need a trained V: set model.init_args.vision_ckpt")
            in_dim = int(np.prod(env_spec.obs_shape))
        self.in_dim, self.out_dim = in_dim, env_spec.action_dim
        self.num_params = controller_num_params(in_dim, self.out_dim, hidden)
        # the CMA-ES mean; a Parameter (never given a gradient) so DDP has something to wrap
        start = np.zeros(self.num_params) if init_params_ckpt is None else self._start_params(init_params_ckpt)
        self.params = nn.Parameter(torch.as_tensor(start, dtype=torch.float32))
        # the best member evaluated so far and its (told) fitness
        self.register_buffer("best_params", torch.zeros(self.num_params))
        self.register_buffer("best_fitness", torch.tensor(float("-inf")))
        self.actions = ActionCodec(env_spec)  # the controller's output -> env actions
        self.register_buffer("clip_dims", _clip_dims(action_map, self.actions), persistent=False)
        self.cmaes = cma.CMAEvolutionStrategy(
            start,
            es.sigma0,
            {"popsize": es.popsize, "seed": np.nan, "randn": _Randn(derive_seed(es.seed, "cmaes")), "verbose": -9},
        )
        # per generation: the population's best, mean, worst return and the best told fitness
        # ([G, 4], in the checkpoint so a resumed search draws its whole curve)
        self.fitness_history: list[list[float]] = []
        self._pool: PopulationEnvs | None = None
        self._dream: DreamEnv | None = None
        self._dream_bank: Any = None

    def _load_models(
        self, vision_ckpt: str | None, memory_ckpt: str | None, dreamer_ckpt: str | None, sample_z: bool
    ) -> None:
        """The frozen world model (V+M or Dreamer's RSSM), or V alone, from their checkpoints;
        kept in train mode like the rest (no dropout or batch norm in them)."""
        self.world_model: WorldModel | None = None
        self.vision: Vision | None = None
        if dreamer_ckpt:
            self.world_model = load_module(Dreamer, dreamer_ckpt, env_spec=self.env_spec).wm.train()
        elif memory_ckpt:
            self.world_model = VisionMemoryModel(
                load_module(Vision, vision_ckpt),
                load_module(Memory, memory_ckpt),
                temperature=self.dream.temperature,
                sample_z=sample_z,
            ).train()
        elif vision_ckpt:
            self.vision = load_module(Vision, vision_ckpt).train()

    def _start_params(self, path: str) -> np.ndarray:
        """The CMA-ES mean ``[P]`` saved in the controller checkpoint at ``path``."""
        params = load_checkpoint(path)["state_dict"].get("params")
        if params is None:
            raise CheckpointError(f"init_params_ckpt {path!r} is not a Controller checkpoint (it holds no 'params')")
        params = params.double().numpy()
        old_in = params.size // self.out_dim - 1  # the features of a linear controller of this size
        linear_on_fewer = 0 < old_in < self.in_dim and params.size == controller_num_params(old_in, self.out_dim)
        if self.hidden <= 0 and linear_on_fewer:  # e.g. z alone into [z, h]
            return widen_controller_params(params, old_in, self.in_dim, self.out_dim)
        if params.size != self.num_params:
            raise ValueError(
                f"init_params_ckpt {path!r} holds {params.size} controller weights, this controller "
                f"has {self.num_params} (features {self.in_dim}, actions {self.out_dim}, hidden "
                f"{self.hidden}): start from a controller on the same V, M and env (or a linear one on V alone)"
            )
        return params

    # -- policy -----------------------------------------------------------------------
    @property
    def acting_params(self) -> Tensor:
        """The weights ``act`` uses (``use``): the CMA-ES mean or the best member, ``[P]``."""
        return (self.params if self.use == "mean" else self.best_params).detach()

    def initial_state(self, batch_size: int) -> dict[str, Any] | None:
        """Before an episode's first frame: the world model's zero state, no previous action,
        ``first`` set (the next ``observe_step`` starts from the frame alone); None without a model."""
        if self.world_model is None:
            return None
        return {
            "model": self.world_model.zero_state(batch_size, self.device),
            "action": self.world_model.actions.zeros(batch_size, self.device),
            "first": torch.ones(batch_size, dtype=torch.bool, device=self.device),
        }

    def _latent(self, obs: Tensor) -> Tensor:
        if self.vision is None:
            return obs.float().flatten(1)
        return self.vision.encode(obs)[0]

    def _act(self, params: Tensor, features: Tensor) -> Tensor:
        """Env actions ``[B]`` int64 / ``[B, A]`` float from the features ``[B, F]``."""
        y = controller_forward(params, features, self.in_dim, self.out_dim, self.hidden)
        if self.actions.discrete:
            return self.actions.decode(y)
        u = torch.tanh(y)
        return torch.where(self.clip_dims, self.actions.clip(u), self.actions.from_unit(u))

    @torch.no_grad()
    def policy_step(self, obs: Tensor, state: dict[str, Any] | None, params: Tensor) -> tuple[Tensor, Any]:
        """One real-env step for a batch: ``obs [B, ...]``, the acting state, ``params [B, P]``
        or ``[P]`` -> ``(action, next state)``. The world model first filters the frame after
        the previous action (V+M: M reads ``[z, a]``, V encodes the frame), then the
        controller acts on the features (``[z, h]`` for V+M)."""
        if self.world_model is None:
            return self._act(params, self._latent(obs)), state
        wm = self.world_model
        model_state = wm.observe_step(state["model"], state["action"], obs, state["first"])
        action = self._act(params, wm.features(model_state))
        return action, {
            "model": model_state,
            "action": wm.actions.encode(action),
            "first": torch.zeros_like(state["first"]),
        }

    def act(self, obs: Tensor, state: Any, explore: bool = False) -> tuple[Tensor, Any, dict[str, Tensor]]:
        """Act with the weights ``use`` names: deterministic, or with ``explore`` each action
        replaced by a uniformly random one with probability ``explore_noise``."""
        if self.world_model is not None and state is None:
            state = self.initial_state(obs.shape[0])
        action, state = self.policy_step(obs, state, self.acting_params)
        if explore and self.explore_noise > 0:
            n = action.shape[0]
            swap = torch.from_numpy(self._noise.random(n) < self.explore_noise).to(action.device)
            if self.actions.discrete:
                noise = torch.from_numpy(self._noise.integers(self.actions.dim, size=n)).to(action.device)
            else:
                unit = torch.from_numpy(self._noise.uniform(-1.0, 1.0, (n, self.actions.dim)).astype(np.float32))
                noise = self.actions.from_unit(unit.to(action.device))
                noise = noise.to(action.device).reshape(action.shape)
                swap = swap.view(n, *([1] * (action.dim() - 1)))
            action = torch.where(swap, noise, action)
            if state is not None:  # M reads the action that was taken
                state = {**state, "action": self.world_model.actions.encode(action)}
        return action, state, {}

    # -- fitness ----------------------------------------------------------------------
    def _real_pool(self, n: int, config: EnvConfig | None) -> PopulationEnvs:
        if config is None:
            raise ValueError(
                "the controller evaluates its population in a real env: fit it with GenerationDataModule "
                "(whose batches name the env) or pass config=EnvConfig(...)"
            )
        cfg = EnvConfig(**{**vars(config), "num_envs": 1, "seed": 0})
        if self.max_episode_steps is not None:
            cfg.max_episode_steps = self.max_episode_steps
        if self._pool is None or len(self._pool) != n or self._pool.config != cfg:
            if self._pool is not None:
                self._pool.close()
            self._pool = PopulationEnvs(cfg, n, workers=self.es.env_workers)
        return self._pool

    @property
    def dream_model(self) -> WorldModel | None:
        """The dream's dynamics: the world model, or V+M with ``dream.ensemble`` (a view that
        shares their modules, built once and kept out of the state dict)."""
        if "memory_ensemble" not in self._modules:
            return self.world_model
        if "_dream_model" not in self.__dict__:
            vm = self.world_model
            assert isinstance(vm, VisionMemoryModel)
            self.__dict__["_dream_model"] = VisionMemoryModel(
                vm.vision,
                vm.memory,
                temperature=vm.temperature,
                sample_z=vm.sample_z,
                ensemble=list(self.memory_ensemble),
                ensemble_next=self.dream.ensemble_next,
                ensemble_done=self.dream.ensemble_done,
                ensemble_penalty=self.dream.ensemble_penalty,
            )
        return self.__dict__["_dream_model"]

    def dream_starts_bank(self) -> Any:
        """The dream's start states ``[N, ...]``: the world model's filtered states of the
        episodes in ``dream.dir`` (``dream.starts``: first rows or all rows), computed once."""
        if self._dream_bank is None:
            if self.world_model is None or not self.dream.dir:
                raise ValueError("dreams need a world model and dream.dir")
            store = EpisodeStore(self.dream.dir)
            if not store.paths():
                raise FileNotFoundError(
                    f"dream start store {self.dream.dir!r} holds no episodes; record (and, for "
                    "V+M, convert) episodes first"
                )
            self._dream_bank = start_states(
                self.dream_model,
                store.episodes(),
                where=self.dream.starts,
                max_starts=self.dream.max_starts,
                seed=derive_seed(self.es.seed, "dream"),
            )
        return self._dream_bank

    def _dream_env(self, n: int) -> DreamEnv:
        if self._dream is None or self._dream.num_envs != n:
            self._dream = DreamEnv(
                self.dream_model,
                self.env_spec.action_space,
                self.dream_starts_bank(),
                num_envs=n,
                max_episode_steps=self.max_episode_steps or self.dream.max_steps,
                done_mode=self.dream.done_mode,
                done_threshold=self.dream.done_threshold,
                reward=self.dream.reward,
            )
        return self._dream

    @torch.no_grad()
    def evaluate_population(
        self,
        solutions: Tensor,
        episodes: int,
        seed: int,
        where: str | None = None,
        config: EnvConfig | None = None,
        per_episode: bool = False,
    ) -> Tensor:
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
                feats, reward, terminated, truncated = env.step_tensor(self._act(params[member], feats))
                returns += torch.where(active, reward.double(), torch.zeros_like(returns))
                active &= ~(terminated | truncated)
            return self._reduce(returns.view(m, episodes), per_episode)
        pool = self._real_pool(n, config)
        obs = pool.reset([seed + (i % episodes) for i in range(n)])
        state = self.initial_state(n)
        while bool(active.any()):
            index = active.nonzero().squeeze(-1)
            idx = index.cpu().numpy()
            sub = tree_map(lambda x: x[index], state)
            action, sub = self.policy_step(torch.as_tensor(obs[idx]).to(self.device), sub, params[member[index]])
            state = tree_map(lambda full, part: full.index_copy(0, index, part), state, sub)
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
        solutions = np.asarray(self.cmaes.ask())
        if world > 1:
            solutions = trainer.strategy.broadcast(solutions, src=0)
        per_rank = math.ceil(self.es.popsize / world)
        order = np.arange(per_rank * world) % self.es.popsize  # padded with repeats, dropped below
        mine = torch.as_tensor(solutions[order[rank * per_rank : (rank + 1) * per_rank]], dtype=torch.float32)
        seed = derive_seed(self.es.seed, "fitness", index=generation)  # the same on every rank (common random numbers)
        returns = self.evaluate_population(mine, self.es.episodes_per_member, seed, config=batch.env)
        gathered = self.all_gather(returns).reshape(-1)[: self.es.popsize].double().cpu().numpy()
        penalty = l2_penalty(torch.as_tensor(solutions), self.es.l2_decay).numpy()
        fitness = gathered - penalty
        self.cmaes.tell(list(solutions), list(-fitness))  # cma minimises
        with torch.no_grad():
            self.params.copy_(torch.as_tensor(np.asarray(self.cmaes.result.xfavorite), dtype=torch.float32))
            best = int(fitness.argmax())
            if fitness[best] >= float(self.best_fitness):  # ties: the newer member
                self.best_params.copy_(torch.as_tensor(solutions[best], dtype=torch.float32))
                self.best_fitness.fill_(float(fitness[best]))
        self.log_dict(
            {
                "fitness/best": float(gathered.max()),
                "fitness/mean": float(gathered.mean()),
                "fitness/worst": float(gathered.min()),
                "fitness/l2_penalty": float(penalty.mean()),
                "fitness/best_ever": float(self.best_fitness),
                "cma/sigma": float(self.cmaes.sigma),
            },
            on_step=True,
            prog_bar=False,
            rank_zero_only=True,
        )
        self.fitness_history.append(
            [float(gathered.max()), float(gathered.mean()), float(gathered.min()), float(self.best_fitness)]
        )
        self.log("fitness", float(gathered.mean()), prog_bar=True, rank_zero_only=True)
        self.optimizers().step()  # a no-op step that advances global_step (one per generation)

    def on_validation_epoch_end(self) -> None:
        """The fitness curve so far as a TensorBoard figure, ``fitness/by_generation``."""
        if self.fitness_history and self.trainer.is_global_zero and not self.trainer.sanity_checking:
            log_figure(self, "fitness/by_generation", lambda: fitness_figure(self.fitness_history))

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
    _UNSAVED = "memory_ensemble."
    # a run resumes with more or fewer episodes per fitness, or env workers (the search state stays)
    resume_may_change = ("es.episodes_per_member", "es.env_workers")
    unsaved_state_prefixes = (_UNSAVED,)  # check_compatible accepts older checkpoints that hold them

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The module's state without the ensemble's Ms (they come from their own checkpoints)."""
        out = super().state_dict(*args, **kwargs)
        unsaved = kwargs.get("prefix", "") + self._UNSAVED
        for key in [k for k in out if k.startswith(unsaved)]:
            del out[key]
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Loads a state saved with or without ensemble Ms: the ensemble this controller was
        built with keeps the weights of its own checkpoints."""
        state = {k: v for k, v in state_dict.items() if not k.startswith(self._UNSAVED)}
        if "memory_ensemble" in self._modules:
            state.update({self._UNSAVED + k: v for k, v in self.memory_ensemble.state_dict().items()})
        return super().load_state_dict(state, strict=strict, assign=assign)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["cma_es"] = torch.frombuffer(bytearray(pickle.dumps(self.cmaes)), dtype=torch.uint8)
        checkpoint["fitness_history"] = torch.tensor(self.fitness_history, dtype=torch.float64).reshape(-1, 4)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "cma_es" in checkpoint:
            es = pickle.loads(checkpoint["cma_es"].cpu().numpy().tobytes())
            if es.N != self.num_params:
                raise ValueError(f"checkpoint's CMA-ES has {es.N} parameters, this controller {self.num_params}")
            self.cmaes = es
        if "fitness_history" in checkpoint:
            self.fitness_history = checkpoint["fitness_history"].tolist()
