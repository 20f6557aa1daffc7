"""The ``compile`` settings group of the learners: one graph per input shape at most
``max_shapes``, eager beyond; the compiled whole step (``mode: step``) of Dreamer, MuZero and
IMPALA gives the eager losses and gradients (CPU always; CUDA graphs on CUDA, skipped without)."""

from __future__ import annotations

import copy
import pickle
import shutil

import pytest
import torch

from lightning_wm import compiling
from lightning_wm.compiling import CompileSettings, ShapeCompiled, as_compile_settings

from support.presets import DREAMER_TINY, IMPALA_TINY

NO_CXX = not any(shutil.which(c) for c in ("c++", "g++", "clang++"))
CUDA = torch.cuda.is_available()


def test_settings_check_their_range_and_read_the_older_switch():
    assert as_compile_settings(True).mode == "cells" and as_compile_settings(False).mode == "none"
    assert as_compile_settings({"mode": "step"}) == CompileSettings(mode="step")
    assert as_compile_settings(None) == CompileSettings()
    with pytest.raises(ValueError, match="compile.mode must be one of"):
        CompileSettings(mode="all")
    with pytest.raises(ValueError, match="max_shapes must be >= 1"):
        CompileSettings(max_shapes=0)


def test_shapes_beyond_max_shapes_run_eagerly_and_none_recompiles(monkeypatch):
    """The first ``max_shapes`` shapes go to the compiled callable (built once per device kind),
    every other shape to the eager function; a seen shape is compiled again never."""
    built: list[dict] = []

    def fake_compile(fn, **kwargs):
        built.append(kwargs)
        return lambda *a, **k: ("compiled", fn(*a, **k))

    monkeypatch.setattr(compiling.torch, "compile", fake_compile)
    wrapped = ShapeCompiled(lambda batch: batch["x"].sum(), max_shapes=2)
    x3, x4, x5 = torch.ones(3), torch.ones(4), torch.ones(5)
    assert wrapped({"x": x3}) == ("compiled", 3.0)
    assert wrapped({"x": x4})[0] == "compiled"
    assert wrapped({"x": x5}) == 5.0  # a third shape: eager
    assert wrapped({"x": x3})[0] == "compiled"
    assert wrapped({"x": x3.double()}) == 3.0  # another dtype is another shape
    assert wrapped.calls == {"compiled": 3, "eager": 2}
    assert built == [{"dynamic": False, "mode": None}]  # no CUDA graphs on the CPU
    clone = copy.deepcopy(wrapped)
    assert clone.shapes == set() and clone({"x": x5})[0] == "compiled"
    restored = pickle.loads(pickle.dumps(ShapeCompiled(sum, 1)))
    assert restored.shapes == set() and restored([1, 2]) is not None


def test_muzero_and_impala_refuse_cells():
    from lightning_wm.agents.impala import IMPALA
    from lightning_wm.agents.muzero import MuZero
    from lightning_wm.envs import EnvConfig, env_spec

    spec = env_spec(EnvConfig("CartPole-v1"))
    with pytest.raises(ValueError, match="MuZero's compile.mode is none or step"):
        MuZero(spec, compile={"mode": "cells"})
    with pytest.raises(ValueError, match="IMPALA's compile.mode is none or step"):
        IMPALA(spec, compile=CompileSettings(mode="cells"))


# -- compiled == eager ----------------------------------------------------------------------------------
def _dreamer(device: str):
    from lightning_wm.agents.dreamer import BehaviorSettings, Dreamer, DreamerNet
    from lightning_wm.data.collector import Collector
    from lightning_wm.data.replay import ReplayBuffer
    from lightning_wm.data.samplers import SequenceSampler
    from lightning_wm.envs import EnvConfig, env_spec, make_vector_env
    from lightning_wm.policies import RandomAgent

    cfg = EnvConfig("CartPole-v1", num_envs=2, seed=0)
    spec = env_spec(cfg)
    kw = {"net": DreamerNet(**DREAMER_TINY["net"]), "behavior": BehaviorSettings(**DREAMER_TINY["behavior"])}
    buffer, env = ReplayBuffer(200, cfg.num_envs, seed=0), make_vector_env(cfg)
    Collector(env, RandomAgent(spec, seed=0), buffer, seeds=0, spec=spec).collect(60)
    env.close()
    batch = {k: v.to(device) for k, v in SequenceSampler(8).sample(buffer, 3).items()}

    def build(compile):
        torch.manual_seed(0)
        return Dreamer(spec, **kw, compile=compile).to(device)

    def step(model):
        optimizers = model.configure_optimizers()
        losses, _ = model.gradient_step(batch, optimizers)
        return losses

    return build, step


def _muzero(device: str):
    from support.muzero_helpers import filled_datamodule, quiet, small

    batch = None

    def build(compile):
        torch.manual_seed(0)
        return quiet(small(compile=compile)).to(device)

    def step(model):
        nonlocal batch
        if batch is None:  # rows acted by the first (eager) model, the same batch for both
            torch.manual_seed(2)
            batch = {k: v.to(device) for k, v in filled_datamodule(model, rows=30).sample_batch().items()}
        loss = model.training_step(batch, 0)["loss"]
        loss.backward()
        return {"loss": loss}

    return build, step


def _impala(device: str):
    from lightning_wm.agents.impala import IMPALA
    from lightning_wm.envs import EnvConfig, env_spec
    from lightning_wm.nn.actor_critic import ActorCriticSettings

    spec = env_spec(EnvConfig("CartPole-v1"))
    B, T = 3, 5
    g = torch.Generator().manual_seed(0)
    batch = {
        "obs": torch.randn(B, T + 1, 4, generator=g), "action": torch.randint(0, 2, (B, T + 1), generator=g),
        "reward": torch.ones(B, T + 1), "logits": torch.randn(B, T + 1, 2, generator=g),
        "is_first": torch.zeros(B, T + 1, dtype=torch.bool), "is_last": torch.zeros(B, T + 1, dtype=torch.bool),
        "is_terminal": torch.zeros(B, T + 1, dtype=torch.bool),
    }  # fmt: skip
    batch["is_first"][:, 0] = True
    batch["is_last"][0, 3] = batch["is_terminal"][0, 3] = batch["is_first"][0, 4] = True
    batch = {k: v.to(device) for k, v in batch.items()}

    def build(compile):
        torch.manual_seed(0)
        model = IMPALA(spec, net=ActorCriticSettings(**IMPALA_TINY["net"]), compile=compile).to(device)
        model.log = model.log_dict = lambda *a, **k: None
        return model

    def step(model):
        loss = model.training_step(batch, 0)["loss"]
        loss.backward()
        return {"loss": loss}

    return build, step


FAMILIES = {"dreamer": _dreamer, "muzero": _muzero, "impala": _impala}


def _compare(family: str, device: str, compile: CompileSettings, monkeypatch) -> None:
    """Losses and gradients of the compiled step against the eager step (the compiled graph draws
    its random numbers with torch's eager generator: ``fallback_random``)."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "fallback_random", True)
    build, step = FAMILIES[family](device)
    eager, compiled = build(CompileSettings()), build(compile)
    results = []
    for model in (eager, compiled):
        torch.manual_seed(1)
        losses = step(model)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append(({k: v.detach() for k, v in losses.items()}, grads))
    (eager_losses, eager_grads), (compiled_losses, compiled_grads) = results
    assert eager_losses.keys() == compiled_losses.keys()
    for key in eager_losses:
        torch.testing.assert_close(compiled_losses[key], eager_losses[key], rtol=1e-4, atol=1e-5, msg=key)
    assert eager_grads.keys() == compiled_grads.keys() and eager_grads
    for name in eager_grads:
        torch.testing.assert_close(compiled_grads[name], eager_grads[name], rtol=1e-3, atol=1e-5, msg=name)
    assert sum(compiled._losses_fn.calls.values() if family == "dreamer" else compiled._unroll_loss.calls.values())


@pytest.mark.slow  # torch.compile of a whole (tiny) step: tens of seconds on a loaded 2-core CPU
@pytest.mark.skipif(NO_CXX, reason="torch.compile on CPU needs a C++ compiler")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_compiled_step_gives_the_eager_losses_and_gradients_on_cpu(family, monkeypatch):
    _compare(family, "cpu", CompileSettings(mode="step"), monkeypatch)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cuda_graph_step_gives_the_eager_losses_and_gradients(family, monkeypatch):
    _compare(family, "cuda", CompileSettings(mode="step", cuda_graphs=True), monkeypatch)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
def test_cuda_graph_steps_repeat_without_recompiling(monkeypatch):
    """Three Dreamer steps under CUDA graphs: one compiled shape, the losses finite each step."""
    build, step = _dreamer("cuda")
    model = build(CompileSettings(mode="step", cuda_graphs=True))
    for _ in range(3):
        losses = step(model)
        assert all(torch.isfinite(v).all() for v in losses.values())
    assert len(model._losses_fn.shapes) == 1 and model._losses_fn.calls == {"compiled": 3, "eager": 0}
