"""ActionCodec: env actions <-> model actions, checked against hand-computed values."""

import gymnasium as gym
import numpy as np
import pytest
import torch

from lightning_wm.actions import ActionCodec

BOX = gym.spaces.Box(np.array([-2.0, 0.0], np.float32), np.array([2.0, 1.0], np.float32))


def test_discrete_indices_become_one_hot_and_back():
    codec = ActionCodec(gym.spaces.Discrete(3))
    assert codec.dim == 3 and codec.discrete
    encoded = codec.encode(torch.tensor([[2, 0], [1, 1]]))
    assert encoded.shape == (2, 2, 3) and encoded.dtype == torch.float32
    assert encoded[0, 0].tolist() == [0, 0, 1] and encoded[1, 0].tolist() == [0, 1, 0]
    assert torch.equal(codec.encode(encoded), encoded)  # already one-hot: taken as is
    assert codec.decode(torch.tensor([[0.1, 2.0, -1.0]])).tolist() == [1]
    assert codec.clip(np.array([2.0, 1.0])).dtype == np.int64
    with pytest.raises(ValueError, match=r"\[\.\.\., 3\]"):
        codec.encode(torch.zeros(4, 2))


def test_continuous_values_are_clipped_to_the_bounds():
    codec = ActionCodec(BOX)
    assert codec.dim == 2 and not codec.discrete and not codec.normalize
    out = codec.clip(np.array([[3.0, -1.0], [0.5, 0.5]]))
    assert out.dtype == np.float32 and out.tolist() == [[2.0, 0.0], [0.5, 0.5]]
    assert codec.clip(torch.tensor([[-5.0, 5.0]])).tolist() == [[-2.0, 1.0]]
    assert codec.encode(torch.tensor([[1.0, 2.0]])).tolist() == [[1.0, 1.0]]
    assert codec.decode(torch.tensor([[1.0, 0.25]])).tolist() == [[1.0, 0.25]]


def test_normalized_continuous_actions_map_the_bounds_onto_the_unit_box():
    codec = ActionCodec(BOX, normalize=True)
    # [-2, 2] x [0, 1]: 1.0 -> 0.5, 0.25 -> -0.5; outside the bounds clamps to +-1
    assert codec.encode(torch.tensor([[1.0, 0.25], [9.0, -9.0]])).tolist() == [[0.5, -0.5], [1.0, -1.0]]
    assert codec.decode(torch.tensor([[0.5, -0.5], [-1.0, 1.0]])).tolist() == [[1.0, 0.25], [-2.0, 1.0]]
    x = torch.rand(5, 2) * 2 - 1
    torch.testing.assert_close(codec.encode(codec.decode(x)), x)
    assert codec.zeros(4).shape == (4, 2)
    with pytest.raises(ValueError, match="finite"):
        ActionCodec(gym.spaces.Box(-np.inf, np.inf, (2,)), normalize=True)


def test_multi_dimensional_boxes_flatten_for_the_model_and_keep_their_shape_in_the_env():
    codec = ActionCodec(gym.spaces.Box(-1.0, 1.0, (2, 3)), normalize=True)
    assert codec.dim == 6
    action = torch.rand(4, 2, 3) * 2 - 1
    assert codec.encode(action).shape == (4, 6)
    decoded = codec.decode(codec.encode(action))
    assert decoded.shape == (4, 2, 3)
    torch.testing.assert_close(decoded, action)
    assert codec.clip(np.full((4, 2, 3), 7.0)).shape == (4, 2, 3)


def test_bounds_are_buffers_that_do_not_reach_checkpoints():
    module = torch.nn.Module()
    module.actions = ActionCodec(BOX, normalize=True)
    assert module.state_dict() == {} and list(module.buffers())
    with pytest.raises(ValueError, match="Discrete or Box"):
        ActionCodec(gym.spaces.MultiBinary(3))
