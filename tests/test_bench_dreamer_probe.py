"""bench/dreamer_probe.py: the real discounted returns it sets the critic against, and its figures
on a tiny Dreamer's windows."""

import math

import pytest
import torch

from lightning_wm.agents.dreamer import Dreamer
from lightning_wm.envs import EnvConfig, env_spec

from support.bench_scripts import load_bench_script
from support.presets import DREAMER_TINY

probe = load_bench_script("dreamer_probe.py")


def test_discounted_returns_chain_within_an_episode_and_stop_at_its_last_row():
    value = torch.tensor([[10.0, 20.0, 30.0, 40.0, 50.0]])
    reward = torch.tensor([[0.0, 1.0, 0.0, 2.0, 4.0]])
    none = torch.zeros(1, 5, dtype=torch.bool)
    g = probe.discounted_returns(value, reward, none, none, 0.5)
    # G4 = V4 = 50; G3 = 4 + 25 = 29; G2 = 2 + 14.5 = 16.5; G1 = 0 + 8.25; G0 = 1 + 4.125
    assert g.tolist() == [[5.125, 8.25, 16.5, 29.0, 50.0]]
    terminal = torch.tensor([[False, False, True, False, False]])
    last = terminal.clone()
    g = probe.discounted_returns(value, reward, terminal, last, 0.5)
    # row 2 ends its episode: G2 = 0, G1 = r2 + γ·0 = 0, G0 = 1; rows 3.. a new episode
    assert g.tolist() == [[1.0, 0.0, 0.0, 29.0, 50.0]]
    truncated = torch.tensor([[False, True, False, False, False]])
    g = probe.discounted_returns(value, reward, none, truncated, 0.5)
    assert g[0, 1] == 20.0 and g[0, 0] == 1.0 + 0.5 * 20.0, "a truncated episode bootstraps with the critic"


def test_the_figures_on_a_tiny_dreamers_windows():
    torch.manual_seed(0)
    model = Dreamer(env_spec(EnvConfig(id="CartPole-v1")), **DREAMER_TINY).eval()
    is_first = torch.zeros(4, 12, dtype=torch.bool)
    is_first[:, 0] = is_first[1, 6] = True
    is_last = torch.roll(is_first, -1, 1)
    batch = {
        "obs": torch.randn(4, 12, 4),
        "action": torch.randint(0, 2, (4, 12)),
        "reward": torch.where(is_first, 0.0, 1.0),
        "is_first": is_first,
        "is_last": is_last,
        "is_terminal": is_last.clone(),
    }
    figures = probe.probe(model, batch)
    assert figures["rows"] == 48
    assert figures["rewarded rows"] == pytest.approx(float((batch["reward"] != 0).float().mean()))
    assert figures["posterior: real on rewarded rows"] == 1.0
    assert 0.0 <= figures["prior: rewards seen (>= half)"] <= 1.0
    assert 0.0 < figures["actor entropy, of uniform"] <= 1.0 + 1e-6
    shares = [float(x) for x in figures["replay's actions, share per action"].split(" / ")]
    assert len(shares) == 2 and sum(shares) == pytest.approx(1.0, abs=0.01)
    assert all(isinstance(v, str) or v == v for v in figures.values()), "no NaN"


def test_auc_is_the_share_of_positive_negative_pairs_in_order():
    score = torch.tensor([0.9, 0.1, 0.5, 0.5, 0.2])
    positive = torch.tensor([True, False, True, False, False])
    # pairs (pos, neg): 0.9 beats 0.1, 0.5, 0.2; 0.5 beats 0.1, 0.2 and ties 0.5: (3 + 2 + 0.5) / 6
    assert probe.auc(score, positive) == pytest.approx(5.5 / 6)
    assert math.isnan(probe.auc(score, torch.zeros(5, dtype=torch.bool))), "no positive row: undefined"
