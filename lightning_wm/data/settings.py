"""The setting groups of the datamodules (frozen dataclasses; in YAML nested mappings under
``data.init_args``, e.g. ``acting: {num_actors: 2}``; listed by ``--data.help CLASS``).

* :class:`ActingSettings` — how rows are made: in the learner's process or by actors.
* :class:`EvalSettings` — the validation (and ``evaluate``) episodes.
* :class:`ReplaySettings` — the replay buffer of :class:`~lightning_wm.data.modules.ReplayDataModule`.
* :class:`UnrollReplaySettings` — the optional small replay of unrolls of
  :class:`~lightning_wm.data.modules.UnrollDataModule`.
* :class:`ModelReplaySettings` — real rows kept for a world model trained beside the policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_wm.envs import EnvConfig
from lightning_wm.settings import check_at_least, check_one_of, check_positive

__all__ = ["ActingSettings", "EvalSettings", "ReplaySettings", "UnrollReplaySettings", "ModelReplaySettings"]


@dataclass(frozen=True)
class ActingSettings:
    """How an online datamodule's rows are made (:mod:`lightning_wm.data.acting`).

    Attributes:
        num_actors: 0 acts in the learner's process inside the data fetch (deterministic: a
            seeded run gives the same rows and weights every time); ``N`` runs N actor
            processes (``backend: local``) or Ray actors (``ray``), each with a CPU copy of the
            policy, that make rows while the learner trains.
        policy: where the actors' policy runs. ``copies``: each actor process (or Ray actor) acts
            with its own CPU copy of the module, refreshed every ``publish_every`` steps.
            ``central``: no copy leaves the learner: the N actors are env groups of
            ``envs_per_actor`` envs (stepped in worker processes with ``env.vectorization:
            async``, in the group's thread with ``sync``) and the live module on the learner's
            device acts for all groups in one batched call per round (rows carry the learner's
            version at act time); local backend only.
        central_groups: with ``policy: central``, where the env groups run. ``threads``: a thread
            each in the learner's process (their envs in worker processes with ``env.vectorization:
            async``), acting with the live module on the learner's device (the choice for a GPU
            learner; starts at once). ``processes``: a spawned process each that steps its envs and
            builds its rows and chunks itself, answered by one inference process acting with a CPU
            acting copy that takes the learner's weights every ``publish_every`` steps through shared
            memory (SEED RL's split: neither the groups nor the policy share the learner's
            interpreter; the fastest central mode on a CPU learner with 32 envs or more per group).
        central_inference: where central acting's policy runs; it follows ``central_groups``
            (``thread`` for threads, ``process`` for processes) and only that value is accepted. The
            policy in a thread of the learner beside groups in processes was removed: it won in no
            measurement (``bench/actors_log.md``).
        deadline_ms: with ``policy: central``, how long a round of action requests waits, after
            the first group asks, for the other groups before the module acts for those that
            asked (a slow group never stalls the rest).
        backend: ``local`` (spawned processes) or ``ray`` (``pip install -e ".[ray]"``).
        ray_address: ``None`` starts a local Ray instance; ``auto`` or ``host:port`` joins a cluster.
        envs_per_actor: envs in each actor's vector env (default ``env.num_envs``); the replay
            then has ``num_actors * envs_per_actor`` streams.
        chunk_length: env steps per chunk an actor sends (``chunk_length * envs_per_actor``
            rows); default 64 for replay; an unroll datamodule's chunks are its unrolls
            (``unroll_length``), so there it must stay unset.
        publish_every: optimizer steps between the weight versions sent to the actors (``policy:
            copies``) or to the inference process (``central_groups: processes``); group threads
            always act with the live weights.
        timeout_s: an actor silent this long is reported as hung.
        queue_size: chunks that may wait for the learner before the actors block (local
            backend, ``policy: copies``; default 2 per actor); with ``policy: central`` the chunks
            made ahead of the learner, queued or in the making, all groups together, the groups
            taking turns (default one per group). Fewer keep the policy lag lower when the
            learner is the slower side: each waiting chunk was made by older weights.
        splits: in process (``num_actors: 0``) and in each actor with ``policy: copies``, the envs
            in this many equal parts stepped in turn, one part's env step running while the policy
            acts for the next and while the learner trains (Sample Factory's double-buffered
            sampling): pays with ``env.vectorization: async`` or ``env.backend: envpool``; must
            divide ``env.num_envs`` (in process) or ``envs_per_actor``. Same rows from the same
            actions; a sampling policy draws in another order than with 1.
        ratio_slack: rows of tolerance of the replay ratio with actors (replay only; default
            one chunk per actor): see :class:`~lightning_wm.data.batches.replay_feed.ReplayFeed`.
        fetch_ahead: ``True`` (Lightning's default): the next batch is made, i.e. acted for or
            taken from the actors, while the step before it has not run yet, one weight version
            older than the step that trains on it. ``False``: each batch is made just before its
            own step (Lightning still fetches one ahead, but only a placeholder), so rows are one
            version fresher: in process the batch is acted by the weights it trains, with actors
            the policy lag drops by one version (an on-policy learner clips fewer importance
            ratios). No speed is lost either way: the data loader runs in the learner's process.
    """

    num_actors: int = 0
    policy: Literal["copies", "central"] = "copies"
    central_groups: Literal["threads", "processes"] = "threads"
    central_inference: Literal["thread", "process"] | None = None
    deadline_ms: float = 5.0
    backend: Literal["local", "ray"] = "local"
    ray_address: str | None = None
    envs_per_actor: int | None = None
    chunk_length: int | None = None
    publish_every: int = 1
    timeout_s: float = 60.0
    queue_size: int | None = None
    ratio_slack: int | None = None
    splits: int = 1
    fetch_ahead: bool = True

    def __post_init__(self) -> None:
        check_at_least("acting.num_actors", self.num_actors, 0)
        check_at_least("acting.envs_per_actor", self.envs_per_actor, 1)
        check_at_least("acting.chunk_length", self.chunk_length, 1)
        check_at_least("acting.publish_every", self.publish_every, 1)
        check_at_least("acting.queue_size", self.queue_size, 1)
        check_at_least("acting.ratio_slack", self.ratio_slack, 0)
        check_at_least("acting.splits", self.splits, 1)
        check_one_of("acting.backend", self.backend, ("local", "ray"))
        check_positive("acting.timeout_s", self.timeout_s)
        check_one_of("acting.policy", self.policy, ("copies", "central"))
        check_one_of("acting.central_groups", self.central_groups, ("threads", "processes"))
        if self.central_inference not in (None, "thread", "process"):
            raise ValueError(f"acting.central_inference must be 'thread' or 'process', got {self.central_inference!r}")
        if self.central_inference == "process" and self.central_groups != "processes":
            raise ValueError(
                "acting.central_inference: process serves env groups in processes: set acting.central_groups: "
                "processes (groups as threads call the policy in the learner's process)"
            )
        if self.central_inference == "thread" and self.central_groups == "processes":
            raise ValueError(
                "acting.central_inference: thread beside central_groups: processes was removed (it won in no "
                "measurement, bench/actors_log.md): use central_groups: processes alone (the policy in a process of "
                "its own, CPU learner) or central_groups: threads (GPU learner)"
            )
        check_at_least("acting.deadline_ms", self.deadline_ms, 0)
        if self.splits > 1 and self.num_actors > 0 and self.policy == "central":
            raise ValueError(
                f"acting.splits={self.splits} applies in process and to actors with policy: copies; central groups "
                "already overlap their env steps with the other groups' (leave splits at 1)"
            )
        if self.policy == "central" and self.backend != "local":
            raise ValueError(
                "acting.policy: central runs with backend local (env groups in the learner's process, their "
                "envs in worker processes); use policy: copies for Ray actors"
            )


@dataclass(frozen=True)
class EvalSettings:
    """The validation episodes (``val/return``), played with ``explore=False`` in fresh envs.

    Attributes:
        episodes: episodes per validation (and the default of ``evaluate``).
        envs: envs those episodes run in together (at most ``episodes`` are built); each env
            plays a fixed share of the episodes.
        env: play them in this env instead of the training ``env``, e.g. the real
            ``CartPole-v1`` while ``env`` is a dream (``lightning_wm/Dream-v0``); its action
            space and observation shape must be ``env``'s.
    """

    episodes: int = 5
    envs: int = 5
    env: EnvConfig | None = None

    def __post_init__(self) -> None:
        check_at_least("eval.episodes", self.episodes, 1)
        check_at_least("eval.envs", self.envs, 1)


def _check_priorities(group: str, alpha: float, beta: float) -> None:
    if alpha < 0 or beta < 0:
        raise ValueError(f"{group}.alpha and {group}.beta must be >= 0, got {alpha}, {beta}")


@dataclass(frozen=True)
class ReplaySettings:
    """The replay buffer (:class:`~lightning_wm.data.replay.ReplayBuffer`).

    Attributes:
        capacity: rows kept, all env streams together (each of the ``S`` streams keeps
            ``capacity // S``; a stream per env, or per actor env).
        prioritized: proportional prioritized replay (Schaul et al.): positions are drawn in
            proportion to ``priority ** alpha`` and batches carry importance weights
            ``weight [B]``; the learner's ``training_step`` returns new priorities as
            ``{"loss": ..., "priority": [B]}`` (written back by the ``ReplayFeedback``
            callback). A learner that returns priorities to a uniform buffer is an error.
        alpha: priority exponent (0: uniform).
        beta: importance-weight exponent.
        storage_dir: memory-map the buffer here (one folder per DDP rank), for buffers larger than RAM.
        save: save the buffer beside every checkpoint (``BufferCheckpoint``), so that
            ``fit --ckpt_path last`` resumes with the same rows.
    """

    capacity: int = 100_000
    prioritized: bool = False
    alpha: float = 0.6
    beta: float = 0.4
    storage_dir: str | None = None
    save: bool = False

    def __post_init__(self) -> None:
        check_at_least("replay.capacity", self.capacity, 1)
        _check_priorities("replay", self.alpha, self.beta)


@dataclass(frozen=True)
class UnrollReplaySettings:
    """The optional small replay of unrolls (:class:`~lightning_wm.data.batches.unroll_batcher.UnrollBatcher`).

    Attributes:
        capacity: unrolls kept; 0 uses each unroll once, oldest first; ``> 0`` keeps the newest
            ``capacity`` unrolls (at least ``batch_size``) and draws each batch among those used
            fewer than ``max_use`` times.
        max_use: uses of an unroll at most (with replay).
        use_all: with actors, take new unrolls only when fewer than ``batch_size`` kept ones
            have uses left, so that each is used ``max_use`` times (``capacity`` must hold the
            leftovers and one actor's chunk) and the updates per frame acted are fixed whatever
            the speeds of actors and learner (actors wait on the learner); false takes up to one
            chunk per actor every batch without waiting, so fresh unrolls keep coming and a slow
            learner uses each fewer times. In process every unroll is used ``max_use`` times.
        prioritized: draw replayed unrolls in proportion to ``priority ** alpha`` (needs
            ``capacity > 0``); batches then carry ``weight [B]`` (exponent ``beta``) and the
            learner's ``"priority"`` outputs come back through the ``ReplayFeedback`` callback.
        alpha: priority exponent.
        beta: importance-weight exponent.
    """

    capacity: int = 0
    max_use: int = 1
    use_all: bool = False
    prioritized: bool = False
    alpha: float = 0.6
    beta: float = 0.4

    def __post_init__(self) -> None:
        check_at_least("replay.capacity", self.capacity, 0)
        check_at_least("replay.max_use", self.max_use, 1)
        _check_priorities("replay", self.alpha, self.beta)
        if self.prioritized and self.capacity == 0:
            raise ValueError(
                "replay.prioritized draws from a replay: set replay.capacity > 0 (unrolls kept), or prioritized: false"
            )
        if self.use_all and self.capacity == 0:
            raise ValueError("replay.use_all paces a replay: set replay.capacity > 0 (unrolls kept), or use_all: false")


@dataclass(frozen=True)
class ModelReplaySettings:
    """Real rows kept for a world model trained beside the policy (Dyna).

    Attributes:
        capacity: rows kept, all envs together; 0: none. With ``> 0`` every batch carries
            ``"model"``: sequences ``[batch_size, sequence_length, ...]`` of these rows (once
            each env holds ``sequence_length`` of them); imagined rollouts start from them.
            Acting in process only (``acting.num_actors: 0``).
        batch_size: sequences per ``"model"`` batch.
        sequence_length: rows per sequence.
        save: save these rows beside every checkpoint (``BufferCheckpoint``, as ``replay.save``),
            so that ``fit --ckpt_path last`` resumes the world model's training on the same rows.
    """

    capacity: int = 0
    batch_size: int = 16
    sequence_length: int = 32
    save: bool = False

    def __post_init__(self) -> None:
        check_at_least("model_replay.capacity", self.capacity, 0)
        check_at_least("model_replay.batch_size", self.batch_size, 1)
        check_at_least("model_replay.sequence_length", self.sequence_length, 1)
