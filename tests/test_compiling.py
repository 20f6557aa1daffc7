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
    # a short scan and imagination: the compile time grows with the unrolled steps
    kw = {"net": DreamerNet(**DREAMER_TINY["net"]), "behavior": BehaviorSettings(horizon=2)}
    buffer, env = ReplayBuffer(200, cfg.num_envs, seed=0), make_vector_env(cfg)
    Collector(env, RandomAgent(spec, seed=0), buffer, seeds=0, spec=spec).collect(60)
    env.close()
    batch = {k: v.to(device) for k, v in SequenceSampler(4).sample(buffer, 3).items()}

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


def _mismatches(compiled: dict, eager: dict, rtol: float, atol: float) -> list[str]:
    """One line per tensor of ``compiled`` not close to ``eager`` (``torch.isclose``'s rule), with the
    values' size and the largest difference: every mismatch of a step at once, not the first."""
    lines = []
    for key, want in eager.items():
        got = compiled[key]
        if not torch.allclose(got, want, rtol=rtol, atol=atol):
            diff = (got - want).abs().max().item()
            lines.append(f"{key}: max |diff| {diff:.3g}, max |eager| {want.abs().max().item():.3g}")
    return lines


def _compare(family: str, device: str, compile: CompileSettings) -> None:
    """Losses and gradients of the compiled step against the eager step (the compiled graph draws
    its random numbers with torch's eager generator: ``fallback_random``)."""
    import torch._inductor.config as inductor_config

    build, step = FAMILIES[family](device)
    eager, compiled = build(CompileSettings()), build(compile)
    results = []
    with inductor_config.patch(fallback_random=True):  # torch's own patch: restored exactly afterwards
        for model in (eager, compiled):
            torch.manual_seed(1)
            losses = step(model)
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
            results.append(({k: v.detach() for k, v in losses.items()}, grads))
    (eager_losses, eager_grads), (compiled_losses, compiled_grads) = results
    assert eager_losses.keys() == compiled_losses.keys()
    assert eager_grads.keys() == compiled_grads.keys() and eager_grads
    wrong = _mismatches(compiled_losses, eager_losses, rtol=1e-4, atol=1e-5)
    wrong += _mismatches(compiled_grads, eager_grads, rtol=1e-3, atol=1e-5)
    assert not wrong, f"{len(wrong)} of {len(eager_losses) + len(eager_grads)} tensors differ:\n" + "\n".join(wrong)
    assert sum(compiled._losses_fn.calls.values() if family == "dreamer" else compiled._unroll_loss.calls.values())


@pytest.mark.slow  # torch.compile of a whole (tiny) step: tens of seconds on a loaded 2-core CPU
@pytest.mark.skipif(NO_CXX, reason="torch.compile on CPU needs a C++ compiler")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_compiled_step_gives_the_eager_losses_and_gradients_on_cpu(family):
    _compare(family, "cpu", CompileSettings(mode="step"))


# H100, torch 2.11 (bench/RESULTS.md, fourth GPU run): with reduce-overhead the compiled Dreamer step's
# world-model loss differs (0.42 of 5.74) while the same compiled step without graphs agrees; its random
# draws are the suspect. compile.mode graph (tests/test_graph_capture.py) is the replay that gives eager.
GRAPHS_DRAW_OTHER_NUMBERS = pytest.mark.xfail(reason="reduce-overhead: other random draws than eager (unverified)")


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=GRAPHS_DRAW_OTHER_NUMBERS) if f == "dreamer" else f for f in sorted(FAMILIES)]
)
def test_cuda_graph_step_gives_the_eager_losses_and_gradients(family):
    _compare(family, "cuda", CompileSettings(mode="step", cuda_graphs=True))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_compiled_dreamer_step_without_graphs_gives_the_eager_losses_on_cuda():
    """The compiled step on CUDA without graph capture: tells a CUDA-graph mismatch of the Dreamer
    step (graph replay) from one of inductor's CUDA kernels."""
    _compare("dreamer", "cuda", CompileSettings(mode="step", cuda_graphs=False))


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
def test_cuda_graph_steps_repeat_without_recompiling(monkeypatch):
    """Three Dreamer steps under CUDA graphs: one compiled shape, the losses finite each step."""
    build, step = _dreamer("cuda")
    model = build(CompileSettings(mode="step", cuda_graphs=True))
    for _ in range(3):
        losses = step(model)
        assert all(torch.isfinite(v).all() for v in losses.values())
    assert len(model._losses_fn.shapes) == 1 and model._losses_fn.calls == {"compiled": 3, "eager": 0}


# -- the search's simulation loop as one graph ---------------------------------------------------------
def _search_inputs(device: str, batch: int = 5, seed: int = 0):
    from support.muzero_helpers import small

    torch.manual_seed(seed)
    model = small().model.to(device).eval()
    with torch.no_grad():
        # heads away from their zero init: children's scores not tied, so that the compiled search's
        # float rounding cannot break a tie the other way
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
        root = model.initial_inference(torch.randn(batch, 4, device=device))
    return model, root


@pytest.mark.parametrize(
    "compile",
    [
        False,
        pytest.param(
            True,
            marks=[
                pytest.mark.slow,  # a compile of the simulation: 20-40 s on a 2-core CPU
                pytest.mark.skipif(NO_CXX, reason="torch.compile on CPU needs a C++ compiler"),
            ],
        ),
    ],
)
def test_simulation_loop_without_capture_is_the_eager_search_and_resets_between_searches(compile):
    """The loop a CUDA graph records (``SimulationGraph``, run eagerly here; with ``compile`` the
    compiled simulations) searches as :func:`muzero_policy` does, and a second search with other
    roots through the same (reset) trees too."""
    from lightning_wm.search import Root, SearchSettings, muzero_policy
    from lightning_wm.search.captured import SimulationGraph
    from lightning_wm.search.rules import PuctRule

    model, root = _search_inputs("cpu")
    _, other = _search_inputs("cpu", seed=1)
    settings = SearchSettings(num_simulations=9, unvisited_q="mean")
    state, logits, value = root["state"], root["policy_logits"], root["value"]
    prior = torch.softmax(logits, -1)
    legal = torch.ones_like(logits, dtype=torch.bool)
    graph = SimulationGraph(
        model.recurrent_fn,
        state,
        prior,
        value,
        9,
        0.97,
        PuctRule(1.25, 19652.0, 9, legal, True),
        capture=False,
        compile=compile,
    )
    for roots in (root, other, root):
        with torch.no_grad():
            search_root = Root(roots["state"], roots["policy_logits"], roots["value"])
            expected = muzero_policy(model.recurrent_fn, search_root, settings, discount=0.97, explore=False)
            visits, q, root_value, depth = graph(
                roots["state"], torch.softmax(roots["policy_logits"], -1), roots["value"]
            )
        assert torch.equal(visits, expected.visit_counts) and torch.equal(depth, expected.max_depth)
        torch.testing.assert_close(q, expected.q_values)
        torch.testing.assert_close(root_value, expected.root_value)


def test_searches_off_cuda_are_never_captured():
    from lightning_wm.search.captured import capturable

    assert not capturable(torch.device("cpu"), None)
    assert not capturable(torch.device("cuda", 0), torch.ones(1, 2, dtype=torch.bool))
    assert capturable(torch.device("cuda", 0), None)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize(("explore", "compile"), [(False, False), (True, False), (False, True)])
def test_captured_search_gives_the_eager_search_on_cuda(explore, compile):
    """The captured simulation loop against the eager one: the same visits and values, for
    several searches through one graph (and the graph cached: one capture)."""
    from lightning_wm.search import Root, SearchSettings, captured, muzero_policy

    model, root = _search_inputs("cuda", batch=64)
    captured._GRAPHS.clear()
    for seed in range(3):
        _, roots = _search_inputs("cuda", batch=64, seed=seed)
        roots = {k: roots[k] for k in ("state", "policy_logits", "value")}
        outs = []
        for graphs in (False, True):
            generator = torch.Generator(device="cuda").manual_seed(seed)
            with torch.no_grad():
                settings = SearchSettings(num_simulations=12, cuda_graphs=graphs, compile=compile and graphs)
                search_root = Root(roots["state"], roots["policy_logits"], roots["value"])
                outs.append(
                    muzero_policy(
                        model.recurrent_fn, search_root, settings, discount=0.997, explore=explore, generator=generator
                    )
                )
        eager, graphed = outs
        assert torch.equal(eager.visit_counts, graphed.visit_counts)
        torch.testing.assert_close(graphed.root_value, eager.root_value)
        torch.testing.assert_close(graphed.q_values, eager.q_values)
        assert torch.equal(eager.action, graphed.action)
    assert len(captured._GRAPHS) == 1 and next(iter(captured._GRAPHS.values())) is not None


def test_a_run_resumes_with_the_speed_settings_changed():
    """``compile``, ``cuda_graphs`` and ``optim.implementation`` change how fast a step runs, not
    what it computes: a checkpoint from before them (``compile: false``, no keys) or with other
    values resumes; an architecture setting beside them is still named."""
    from lightning_wm.checkpoints import hparam_differences

    saved = {"compile": False, "net": {"deter": 16}, "search": {"compile": False}, "optim": {"lr": 1e-3}}
    current = {
        "compile": {"mode": "step", "cuda_graphs": True, "max_shapes": 2},
        "net": {"deter": 16},
        "search": {"compile": True, "cuda_graphs": True},
        "optim": {"lr": 1e-3, "implementation": "fused"},
    }
    assert hparam_differences(saved, current) == {}
    assert hparam_differences(saved, {**current, "net": {"deter": 32}}) == {"net.deter": (16, 32)}
