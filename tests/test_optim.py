"""Optimizers and DI-engine's gradient clipping (lightning_wm.optim), against hand-checked values."""

import math

import pytest
import torch

from lightning_wm.optim import (
    GradClipper,
    OptimSettings,
    build_optimizer,
    clip_grad_norms_,
    clip_groups,
    optimizer_beta,
)


def _param(grad):
    p = torch.nn.Parameter(torch.zeros(len(grad)))
    p.grad = torch.tensor(grad, dtype=torch.float32)
    return p


def test_build_optimizer_kinds_and_constants():
    p = [torch.nn.Parameter(torch.zeros(2))]
    adam = build_optimizer(p, OptimSettings("adam", 1e-3, betas=(0.8, 0.99), eps=1e-5))
    assert isinstance(adam, torch.optim.Adam) and adam.defaults["lr"] == 1e-3 and adam.defaults["eps"] == 1e-5
    assert optimizer_beta(adam) == 0.99
    rms = build_optimizer(p, OptimSettings("rmsprop", 4.8e-4, eps=0.01, alpha=0.9, momentum=0.5))
    assert isinstance(rms, torch.optim.RMSprop)
    assert (rms.defaults["alpha"], rms.defaults["eps"], rms.defaults["momentum"]) == (0.9, 0.01, 0.5)
    assert optimizer_beta(rms) == 0.9
    sgd = build_optimizer(p, OptimSettings("sgd", 0.1, momentum=0.9, weight_decay=1e-4))
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9
    with pytest.raises(ValueError, match="optim name must be one of"):
        OptimSettings("adagrad")


@pytest.mark.parametrize("name", ["adam", "rmsprop", "sgd"])
def test_optimizer_implementations_take_the_same_steps(name):
    """``implementation`` picks torch's kernels (a loop, multi-tensor foreach, fused); three steps
    of each agree to float rounding, and ``auto`` passes torch no choice at all."""
    kinds = ["auto", "for_loop", "foreach"] + (["fused"] if name != "rmsprop" else [])
    finals = []
    for kind in kinds:
        params = [torch.nn.Parameter(torch.linspace(-1, 1, 6).reshape(2, 3)), torch.nn.Parameter(torch.ones(4))]
        opt = build_optimizer(params, OptimSettings(name, 0.1, momentum=0.5, weight_decay=0.01, implementation=kind))
        assert opt.defaults.get("fused") == (True if kind == "fused" else opt.defaults.get("fused"))
        for step in range(3):
            for p in params:
                p.grad = torch.sin(p.detach() * (step + 1))
            opt.step()
        finals.append([p.detach().clone() for p in params])
    for other in finals[1:]:
        for a, b in zip(finals[0], other):
            torch.testing.assert_close(a, b)
    assert build_optimizer([torch.nn.Parameter(torch.ones(1))], OptimSettings("adam")).defaults["foreach"] is None
    with pytest.raises(ValueError, match="implementation 'fused' exists for adam and sgd"):
        OptimSettings("rmsprop", implementation="fused")
    with pytest.raises(ValueError, match="optim implementation must be one of"):
        OptimSettings(implementation="fast")


def test_clip_value_and_clip_norm():
    p = _param([3.0, -4.0])
    out = GradClipper("clip_value", clip_value=0.5)([p])
    assert p.grad.tolist() == [0.5, -0.5] and out["clipped"] == 1 and out["grad_norm"] == 5.0
    p = _param([3.0, -4.0])
    out = GradClipper("clip_norm", clip_value=0.5)([p])
    assert torch.allclose(p.grad, torch.tensor([0.3, -0.4]), atol=1e-6) and out["clipped"] == 1
    p = _param([0.03, -0.04])
    out = GradClipper("clip_norm", clip_value=0.5)([p])
    assert torch.allclose(p.grad, torch.tensor([0.03, -0.04])) and out["clipped"] == 0
    p = _param([3.0, -4.0])
    GradClipper(None)([p])
    assert p.grad.tolist() == [3.0, -4.0]


def _grouped_params(seed: int, scales: tuple[float, ...]) -> list[list[torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for scale in scales:
        group = [torch.nn.Parameter(torch.zeros(shape)) for shape in ((7, 3), (5,), (4, 4, 2))]
        for p in group:
            p.grad = torch.randn(p.shape, generator=gen) * scale
        groups.append(group)
    return groups


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clip_grad_norms_clips_each_group_as_torch_clips_it_alone(norm_type):
    bounds = [1.0, 1000.0, 0.5]  # the first and last groups are clipped, the middle one not
    ours, theirs = _grouped_params(0, (3.0, 1.0, 2.0)), _grouped_params(0, (3.0, 1.0, 2.0))
    norms = clip_grad_norms_(ours, bounds, norm_type)
    expected = torch.stack([torch.nn.utils.clip_grad_norm_(g, b, norm_type) for g, b in zip(theirs, bounds)])
    assert torch.equal(norms, expected)
    for group, reference in zip(ours, theirs):
        for p, q in zip(group, reference):
            assert torch.equal(p.grad, q.grad)
    assert norms[0] > 1.0 and norms[1] < 1000.0  # the test clips and leaves alone


def test_clip_groups_joins_clip_norm_clippers_and_keeps_the_others_apart():
    norm_clippers = [GradClipper("clip_norm", 1.0), GradClipper("clip_norm", 2.0)]
    joined, alone = _grouped_params(1, (3.0, 3.0)), _grouped_params(1, (3.0, 3.0))
    norms = clip_groups(norm_clippers, joined)
    expected = [c(g)["grad_norm"] for c, g in zip(norm_clippers, alone)]
    assert torch.equal(torch.stack(norms), torch.stack(expected))
    assert all(torch.equal(p.grad, q.grad) for g, h in zip(joined, alone) for p, q in zip(g, h))
    mixed = [GradClipper("clip_norm", 1.0), GradClipper("clip_value", 0.1)]
    groups = _grouped_params(2, (3.0, 3.0))
    clip_groups(mixed, groups)
    assert max(p.grad.abs().max() for p in groups[1]) <= 0.1  # the value clipper applied to its group
    with pytest.raises(ValueError, match="2 groups and 1 bounds"):
        clip_grad_norms_(groups, [1.0])


def test_clip_momentum_norm_hand_values():
    """beta 0.5, warm-up 2 updates, clip_coef 1. Three gradients g0 = [3, 4] make v_hat = g0^2
    exactly (bias-corrected), so the third passes (its norm 5 equals the limit). A spike
    10 g0 then gives v = 0.5 * 0.875 g0^2 + 0.5 * 100 g0^2, v_hat = v / (1 - 0.5^4) =
    53.8 g0^2: its norm 50 is scaled down to 5 sqrt(53.8) = 36.674."""
    clipper = GradClipper("clip_momentum_norm", clip_coef=1.0, clip_momentum_timestep=2, beta=0.5)
    for _ in range(3):
        p = _param([3.0, 4.0])
        assert clipper([p])["clipped"] == 0
        assert p.grad.tolist() == [3.0, 4.0]
    p = _param([30.0, 40.0])
    out = clipper([p])
    assert out["clipped"] == 1 and out["grad_norm"] == 50.0
    assert torch.allclose(p.grad.norm(), torch.tensor(5 * math.sqrt(53.8)), rtol=1e-6)
    assert torch.allclose(p.grad / p.grad.norm(), torch.tensor([0.6, 0.8]))  # direction kept


def test_clip_momentum_norm_waits_for_its_estimate():
    clipper = GradClipper("clip_momentum_norm", clip_coef=1.0, clip_momentum_timestep=2, beta=0.5)
    clipper([_param([3.0, 4.0])])
    p = _param([30.0, 40.0])  # second update: the estimate is still too young, nothing clipped
    assert clipper([p])["clipped"] == 0 and p.grad.tolist() == [30.0, 40.0]


def test_clip_momentum_per_element_keeps_sign():
    """v_hat = g^2 of the steady gradient [1, -1, 2]; a spike [5, -5, 2] is clamped elementwise
    to clip_coef sqrt(v_hat) of the updated estimate, keeping each element's sign."""
    clipper = GradClipper("clip_momentum", clip_coef=1.0, clip_momentum_timestep=1, beta=0.5)
    clipper([_param([1.0, -1.0, 2.0])])
    p = _param([5.0, -5.0, 2.0])
    assert clipper([p])["clipped"] == 1
    # v = 0.5 * 0.5 * [1, 1, 4] + 0.5 * [25, 25, 4] = [12.75, 12.75, 3]; v_hat = v / 0.75
    limit = math.sqrt(12.75 / 0.75)
    assert torch.allclose(p.grad, torch.tensor([limit, -limit, 2.0]))


def test_clip_momentum_keeps_an_estimate_per_parameter():
    """A parameter without a gradient keeps its estimate and count (beta 0.5, warm-up 1, coef 1):
    a sees [2], [2], [6] (v = 2, 3, 19.5 after 3 updates), b sees [1], nothing, [6] (v = 0.5, 0.5,
    18.25 after 2), so the spike is clamped to each one's own bias-corrected RMS; an old state
    with one count for all parameters still loads."""
    clipper = GradClipper("clip_momentum", clip_coef=1.0, clip_momentum_timestep=1, beta=0.5)
    a, b = _param([2.0]), _param([1.0])
    clipper([a, b])
    a, idle = _param([2.0]), torch.nn.Parameter(torch.zeros(1))  # no gradient this call
    clipper([a, idle])
    assert clipper.counts == [2, 1] and clipper.square_avg[1].tolist() == [0.5]
    a, b = _param([6.0]), _param([6.0])
    assert clipper([a, b])["clipped"] == 1
    assert torch.allclose(a.grad, torch.tensor([math.sqrt(19.5 / 0.875)]))
    assert torch.allclose(b.grad, torch.tensor([math.sqrt(18.25 / 0.75)]))
    restored = GradClipper("clip_momentum", clip_coef=1.0, clip_momentum_timestep=1, beta=0.5)
    restored.load_state_dict(clipper.state_dict())
    assert restored.counts == [3, 2] and restored.state_dict()["count"] == 3
    old = GradClipper("clip_momentum")
    old.load_state_dict({"count": 7, "square_avg": [torch.ones(1), torch.ones(2)]})
    assert old.counts == [7, 7] and old.count == 7 and set(old.state_dict()) == {"count", "square_avg"}


def test_clipper_state_round_trip_and_errors():
    a = GradClipper("clip_momentum_norm", clip_momentum_timestep=0, beta=0.9)
    for g in ([1.0, 2.0], [2.0, 1.0]):
        a([_param(g)])
    b = GradClipper("clip_momentum_norm", clip_momentum_timestep=0, beta=0.9)
    b.load_state_dict(a.state_dict())
    pa, pb = _param([9.0, 9.0]), _param([9.0, 9.0])
    a([pa]), b([pb])
    assert torch.equal(pa.grad, pb.grad) and b.count == 3
    with pytest.raises(ValueError, match="grad_clip_type must be"):
        GradClipper("clip_everything")
    with pytest.raises(ValueError, match="clip_value must be > 0"):
        GradClipper("clip_norm", clip_value=0.0)
    with pytest.raises(RuntimeError, match="same parameters"):
        a([_param([1.0]), _param([1.0])])


def test_lr_factor_warms_up_then_anneals_linearly_to_zero() -> None:
    from lightning_wm.optim import lr_factor

    assert lr_factor(0) == 1.0 and lr_factor(10_000) == 1.0
    assert [lr_factor(s, warmup_steps=4) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert [lr_factor(s, anneal_steps=4) for s in range(6)] == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    # both: the warm-up factor times the annealing factor (step 1 of 4 / 8: 0.5 * 0.875)
    assert lr_factor(1, warmup_steps=4, anneal_steps=8) == 0.5 * 0.875


def test_with_lr_schedule_steps_the_optimizers_learning_rate() -> None:
    from lightning_wm.optim import with_lr_schedule

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    assert with_lr_schedule(opt, OptimSettings("sgd", 1.0)) is opt  # neither: the optimizer alone
    config = with_lr_schedule(opt, OptimSettings("sgd", 1.0, lr_warmup_steps=2, lr_anneal_steps=4))
    schedule = config["lr_scheduler"]["scheduler"]
    assert config["lr_scheduler"]["interval"] == "step"
    seen = []
    for _ in range(5):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step()
    assert seen == [0.5, 0.75, 0.5, 0.25, 0.0]


def test_split_lr_schedule_takes_with_lr_schedules_result_apart() -> None:
    from lightning_wm.optim import split_lr_schedule, with_lr_schedule

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    assert split_lr_schedule(with_lr_schedule(opt, OptimSettings("sgd", 1.0))) == (opt, None)
    config = with_lr_schedule(opt, OptimSettings("sgd", 1.0, lr_warmup_steps=2))
    optimizer, schedule = split_lr_schedule(config)
    assert optimizer is opt and schedule is config["lr_scheduler"]
    assert isinstance(schedule["scheduler"], torch.optim.lr_scheduler.LambdaLR)


def test_lr_end_anneals_to_it_and_holds_it() -> None:
    """With ``lr_end`` the anneal goes linearly from ``lr`` to ``lr_end`` at ``lr_anneal_steps`` and
    stays there: 1.0 to 0.5 over 4 steps is 1.0, 0.875, 0.75, 0.625, then 0.5 for good."""
    from lightning_wm.optim import lr_factor, with_lr_schedule

    assert [lr_factor(s, anneal_steps=4, end_factor=0.5) for s in range(7)] == [1.0, 0.875, 0.75, 0.625, 0.5, 0.5, 0.5]
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = with_lr_schedule(opt, OptimSettings("sgd", 1.0, lr_anneal_steps=4, lr_end=0.5))["lr_scheduler"]
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule["scheduler"].step()
    assert seen == [1.0, 0.875, 0.75, 0.625, 0.5, 0.5]


def test_lr_end_is_the_anneal_to_zero_over_a_longer_run_to_the_bit() -> None:
    """The IMPALA MinAtar config halves its rate over the run: ``lr_end = lr / 2`` at 31,250 steps
    gives the same float at every step as the anneal to 0 at 62,500 it replaced (its records keep
    their meaning)."""
    from lightning_wm.optim import lr_factor

    settings = OptimSettings(lr=0.002, lr_anneal_steps=31250, lr_end=0.001)
    for step in range(0, 31251, 7):
        assert 0.002 * lr_factor(step, 0, 31250, settings.lr_end_factor) == 0.002 * lr_factor(step, 0, 62500)


def test_lr_end_out_of_range_or_without_an_anneal_is_refused() -> None:
    with pytest.raises(ValueError, match="lr_end must be in"):
        OptimSettings(lr=0.001, lr_anneal_steps=10, lr_end=0.002)
    with pytest.raises(ValueError, match="lr_end must be in"):
        OptimSettings(lr=0.001, lr_anneal_steps=10, lr_end=-1.0)
    with pytest.raises(ValueError, match="needs lr_anneal_steps"):
        OptimSettings(lr=0.001, lr_end=0.0005)


def test_muzero_lr_anneal_steps_reaches_zero_and_bad_values_are_refused() -> None:
    from lightning_wm.agents.muzero import MuZero
    from lightning_wm.envs import EnvConfig, env_spec

    spec = env_spec(EnvConfig("CartPole-v1"))
    net = {"latent_dim": 8, "hidden": 8, "layers": 1, "head_hidden": 8, "support_size": 5}
    model = MuZero(spec, net=net, optim={"lr": 0.1, "lr_anneal_steps": 10})
    config = model.configure_optimizers()
    opt, schedule = config["optimizer"], config["lr_scheduler"]["scheduler"]
    for _ in range(10):
        opt.step()
        schedule.step()
    assert opt.param_groups[0]["lr"] == 0.0
    with pytest.raises(ValueError, match="lr_anneal_steps"):
        MuZero(spec, optim={"lr_anneal_steps": 0})


def test_impala_lr_anneal_steps_reaches_zero() -> None:
    from lightning_wm.agents.impala import IMPALA
    from lightning_wm.envs import EnvConfig, env_spec

    model = IMPALA(env_spec(EnvConfig("CartPole-v1")), optim=OptimSettings(lr=0.1, lr_anneal_steps=4))
    config = model.configure_optimizers()
    opt, schedule = config["optimizer"], config["lr_scheduler"]["scheduler"]
    seen = []
    for _ in range(5):
        seen.append(round(opt.param_groups[0]["lr"], 6))
        opt.step()
        schedule.step()
    assert seen == [0.1, 0.075, 0.05, 0.025, 0.0]


def test_anneal_outlasted_only_when_the_run_goes_past_the_anneal() -> None:
    from lightning_wm.optim import anneal_outlasted

    assert anneal_outlasted(None, 10_000) is None  # a constant learning rate
    assert anneal_outlasted(3000, 3000) is None and anneal_outlasted(3000, 2000) is None
    assert "every step after 3000 changes nothing" in anneal_outlasted(3000, 6000)
    assert "6000 optimizer steps" in anneal_outlasted(3000, 6000)
    assert "no step limit" in anneal_outlasted(3000, -1)
    assert anneal_outlasted(3000, 6000, end_factor=0.5) is None  # the rate holds at lr_end: still learning


def test_fit_warns_when_max_steps_outlasts_lr_anneal_steps() -> None:
    """Raising only the trainer's max_steps on an annealing config (IMPALA's, say) would leave the
    rest of the run at learning rate 0: the module says so when fit starts, for an agent nested
    inside another (Dyna's policy) too, and stays quiet when the two agree."""
    import types
    import warnings

    from lightning_wm.agents.impala import IMPALA
    from lightning_wm.envs import EnvConfig, env_spec

    model = IMPALA(env_spec(EnvConfig("CartPole-v1")), optim=OptimSettings(lr_anneal_steps=3000))
    model._trainer = types.SimpleNamespace(max_steps=6000)
    with pytest.warns(UserWarning, match="IMPALA: the learning rate anneals to 0 at lr_anneal_steps=3000"):
        model.on_fit_start()
    from lightning_wm.agents.base import RLModule

    host = RLModule()  # any agent holding the annealing one
    host.inner = model
    host._trainer = types.SimpleNamespace(max_steps=-1)
    with pytest.warns(UserWarning, match="no step limit"):
        host.on_fit_start()
    model._trainer = types.SimpleNamespace(max_steps=3000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.on_fit_start()
