"""``compile.mode: graph``: Dreamer's whole gradient step recorded as a CUDA graph and replayed.

On the CPU the recording protocol runs without a graph (warm-up calls, static input buffers, the
branch-free form of the step), which must give the eager step's losses and weights; the CUDA tests
(skipped without CUDA) compare the replayed graph with the eager step."""

from __future__ import annotations

import pytest
import torch

from lightning_wm.graph_capture import CapturedStep, make_capturable, plain_optimizer_state, static_control_flow

from support.presets import DREAMER_TINY

CUDA = torch.cuda.is_available()


def test_the_protocol_warms_up_records_once_and_copies_inputs_into_static_buffers():
    seen = []

    def step(batch):
        seen.append((static_control_flow(), batch["x"].data_ptr()))
        return {"double": batch["x"] * 2}

    captured = CapturedStep(step, warmup=2, max_shapes=1)
    outs = [captured({"x": torch.full((3,), float(i))}) for i in range(5)]
    assert [o["double"][0].item() for o in outs] == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert [flag for flag, _ in seen] == [False, False, True, True, True]  # eager warm-up, then static
    assert len({ptr for _, ptr in seen[2:]}) == 1  # one static buffer from the recording on
    assert captured.calls == {"eager": 2, "recorded": 0, "replayed": 3}
    assert captured({"x": torch.ones(4)})["double"].tolist() == [2.0] * 4  # another shape: eager
    assert captured.calls["eager"] == 3 and static_control_flow() is False


def test_a_key_change_records_a_new_graph_within_max_shapes():
    captured = CapturedStep(lambda b: b * 1, warmup=0, max_shapes=2)
    for key in (15, 15, 10, 5):
        captured(torch.ones(2), key=key)
    assert len(captured.graphs) == 2 and captured.calls == {"eager": 1, "recorded": 0, "replayed": 3}


def test_checkpointed_optimizer_state_is_plain():
    state = {"state": {}, "param_groups": [{"lr": torch.tensor(0.5), "capturable": True, "params": [0]}]}
    plain = plain_optimizer_state(state)
    assert plain["param_groups"][0]["lr"] == 0.5 and isinstance(plain["param_groups"][0]["lr"], float)
    assert plain["param_groups"][0]["capturable"] is False and state["param_groups"][0]["capturable"] is True


def test_cpu_optimizers_stay_as_they_are():
    opt = torch.optim.Adam([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    make_capturable([opt])
    assert opt.param_groups[0]["lr"] == 0.1 and not opt.param_groups[0]["capturable"]


def _dreamer_pair(device: str):
    from lightning_wm.agents.dreamer import BehaviorSettings, Dreamer, DreamerNet
    from lightning_wm.envs import EnvConfig, env_spec

    spec = env_spec(EnvConfig("CartPole-v1"))
    models = []
    for mode in ("none", "graph"):
        torch.manual_seed(0)
        model = Dreamer(
            spec, net=DreamerNet(**DREAMER_TINY["net"]), behavior=BehaviorSettings(horizon=3), compile={"mode": mode}
        )
        models.append(model.to(device))
    return models


def _batch(device: str, seed: int, B: int = 3, L: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    is_first = torch.rand(B, L, generator=g) < 0.2
    is_first[:, 0] = True
    batch = {
        "obs": torch.randn(B, L, 4, generator=g),
        "action": torch.randint(0, 2, (B, L), generator=g),
        "reward": torch.ones(B, L),
        "is_first": is_first,
        "is_last": torch.zeros(B, L, dtype=torch.bool),
        "is_terminal": torch.rand(B, L, generator=g) < 0.1,
    }
    return {k: v.to(device) for k, v in batch.items()}


def _compare_steps(device: str, steps: int) -> None:
    eager, recorded = _dreamer_pair(device)
    opts = [eager.configure_optimizers(), recorded.configure_optimizers()]
    for i in range(steps):
        batch = _batch(device, i)
        results = []
        for model, opt in zip((eager, recorded), opts):
            torch.manual_seed(100 + i)
            losses, logs = model.gradient_step(batch, opt, recorded=model.compile_settings.mode == "graph")
            results.append({k: v.detach().float().cpu() for k, v in {**losses, **logs}.items() if v.numel() == 1})
        for key, want in results[0].items():
            assert torch.allclose(results[1][key], want, rtol=1e-4, atol=1e-5), (i, key, results[1][key], want)
    for (name, p), q in zip(eager.named_parameters(), recorded.parameters()):
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-5), name
    assert recorded._captured.calls == {"eager": 2, "recorded": int(device == "cuda"), "replayed": steps - 2}
    assert torch.equal(eager.ret_high, recorded.ret_high) or torch.allclose(eager.ret_high, recorded.ret_high)


def test_the_recorded_form_of_the_dreamer_step_gives_the_eager_steps_on_cpu():
    _compare_steps("cpu", steps=5)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
def test_the_replayed_dreamer_step_gives_the_eager_steps_on_cuda():
    _compare_steps("cuda", steps=5)


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device"))]
)
def test_a_replayed_step_reads_the_learning_rate_written_outside_the_graph(monkeypatch, device):
    """On CUDA the replayed graph must read the rate written in place before it (off CUDA the
    same protocol without a graph)."""
    from lightning_wm.optim import OptimSettings

    _, model = _dreamer_pair(device)
    opts = model.configure_optimizers()
    for i in range(3):  # two warm-up steps, then the recording
        model.gradient_step(_batch(device, i), opts, recorded=True)
    before = [p.detach().clone() for p in model.wm.parameters()]
    monkeypatch.setattr(OptimSettings, "lr_factor_at", lambda self, step: 0.0)  # a schedule at zero
    model.gradient_step(_batch(device, 3), opts, recorded=True)
    assert model._captured.calls["replayed"] == 2
    assert all(torch.equal(a, b) for a, b in zip(before, model.wm.parameters()))
    monkeypatch.undo()
    model.gradient_step(_batch(device, 4), opts, recorded=True)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.wm.parameters()))


def test_a_fit_counts_every_recorded_step(monkeypatch):
    """In a fit the recorded form (here without a graph, on the CPU) steps the optimizers outside
    Lightning: its step count must still advance once per gradient step."""
    from functools import partialmethod
    from pathlib import Path

    from lightning_wm.agents.dreamer import Dreamer
    from lightning_wm.cli import main

    from support.presets import REPLAY_DATA_TINY, data_overrides, model_overrides

    monkeypatch.setattr(Dreamer, "gradient_step", partialmethod(Dreamer.gradient_step, recorded=True))
    config = Path(__file__).resolve().parents[1] / "configs/dreamer/cartpole.yaml"
    args = ["--config", str(config), *model_overrides(DREAMER_TINY), *data_overrides(REPLAY_DATA_TINY)]
    quiet = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
    quiet += ["--trainer.accelerator", "cpu"]  # the protocol without a graph, also on a GPU machine
    cli = main(["fit", *args, *quiet, "--trainer.max_steps", "5", "--trainer.val_check_interval", "5"])
    assert cli.trainer.global_step == 5
    assert cli.model._captured.calls == {"eager": 2, "recorded": 0, "replayed": 3}


def test_ddp_is_refused_with_one_line():
    from types import SimpleNamespace

    _, model = _dreamer_pair("cpu")
    model._attached_trainer = lambda: SimpleNamespace(world_size=2)
    with pytest.raises(ValueError, match="compile.mode graph records the step on one device; with DDP use"):
        model.gradient_step(_batch("cpu", 0), model.configure_optimizers(), recorded=True)
