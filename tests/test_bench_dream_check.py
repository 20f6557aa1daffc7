"""bench/worldmodels_dream_check.py: the mixture mean it rolls M forward with, and its open loop."""

import pytest
import torch

from lightning_wm.agents.worldmodels.memory import Memory

from support.bench_scripts import load_bench_script

check = load_bench_script("worldmodels_dream_check.py")


@pytest.mark.parametrize("mixture", ["per_dim", "joint"])
def test_mixture_mean_is_the_weighted_mean_of_the_components(mixture: str) -> None:
    torch.manual_seed(0)
    net = {"latent_dim": 3, "hidden": 8, "num_mixtures": 2, "mixture": mixture}
    memory = Memory(net=net, action_dim=2, discrete=True)
    heads = memory.heads(torch.randn(4, 8))
    mean = check.mixture_mean(memory, heads)
    assert mean.shape == (4, 3)
    for b in range(4):
        for d in range(3):
            if mixture == "per_dim":  # weights per dimension
                w = torch.softmax(heads["logit_pi"][b, d], -1)
                expected = sum(w[k] * heads["mu"][b, d, k, 0] for k in range(2))
            else:  # one weight per component for the whole vector
                w = torch.softmax(heads["logit_pi"][b], -1)
                expected = sum(w[k] * heads["mu"][b, k, d] for k in range(2))
            assert float(mean[b, d]) == pytest.approx(float(expected), abs=1e-6)


def test_open_loop_feeds_its_own_predictions_after_the_warm_up() -> None:
    torch.manual_seed(0)
    memory = Memory(net={"latent_dim": 3, "hidden": 8, "num_mixtures": 2}, action_dim=2, discrete=True).eval()
    mu = torch.randn(10, 3)
    action_in = memory.action_input(torch.randint(0, 2, (9,)))
    with torch.no_grad():
        predicted = check.open_loop(memory, check.warm_up(memory, mu, action_in, 2), mu[2:3], action_in[2:5])
        # by hand: warm up on rows 0-1, then step from row 2 with its own mixture means
        state = memory.initial_state(1, torch.device("cpu"))
        for t in range(2):
            _, state = memory.step(mu[t : t + 1], action_in[t : t + 1], state)
        z = mu[2:3]
        for h in range(3):
            out, state = memory.step(z, action_in[2 + h : 3 + h], state)
            z = check.mixture_mean(memory, memory.heads(out))
            assert torch.equal(predicted[h], z)
    assert len(predicted) == 3
