"""World Models' losses as pure functions (Ha & Schmidhuber, 2018).

* :func:`vae_loss` — V: reconstruction (squared error summed over a frame's pixels) plus the
  KL divergence from the standard normal prior, floored per frame at ``kl_tolerance * Z`` nats
  (the reference's free bits: 0.5 * 32 = 16);
* :func:`mdn_rnn_loss` — M: the negative log-likelihood of the next latent under the predicted
  Gaussian mixture (per latent dimension), plus weighted reward (squared error) and done
  (binary cross-entropy) terms, over the valid rows of a window.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_wm.nn.mdn import gaussian_kl_standard

__all__ = ["vae_loss", "mdn_rnn_loss"]


def vae_loss(recon: Tensor, target: Tensor, mu: Tensor, logvar: Tensor, kl_tolerance: float) -> dict[str, Tensor]:
    """``recon + max(KL, kl_tolerance * Z)``, both per frame, mean over frames.

    Args:
        recon, target: ``[B, C, H, W]`` images on the same scale (pixels in ``[-0.5, 0.5]``).
        mu, logvar: ``[B, Z]`` posterior parameters.
        kl_tolerance: free bits per latent dimension: each frame's KL is floored at
            ``kl_tolerance * Z`` nats, so no gradient pushes it below that.
    Returns:
        ``loss`` = ``recon`` + ``kl_floored``; ``recon``: squared error summed over pixels,
        mean over frames; ``kl``: the raw KL, mean over frames; ``kl_floored``; ``mse``: mean
        squared error per pixel value (on the ``[0, 1]`` scale).
    """
    sq = (recon - target).square()
    recon_loss = sq.flatten(1).sum(-1).mean()
    kl = gaussian_kl_standard(mu, logvar)  # [B]
    kl_floored = kl.clamp(min=kl_tolerance * mu.shape[-1])
    return {
        "loss": recon_loss + kl_floored.mean(),
        "recon": recon_loss,
        "kl": kl.mean(),
        "kl_floored": kl_floored.mean(),
        "mse": sq.mean(),
    }


def mdn_rnn_loss(
    log_prob: Tensor,
    reward: Tensor,
    reward_target: Tensor,
    done_logit: Tensor,
    done_target: Tensor,
    valid: Tensor,
    latent_dim: int,
    reward_weight: float = 1.0,
    done_weight: float = 1.0,
    done_pos_weight: float = 1.0,
) -> dict[str, Tensor]:
    """M's loss over the predictions made at ``t`` for ``t+1``, each ``[B, T]``.

    ``loss = nll + reward_weight * reward_loss + done_weight * done_loss``, each term a mean
    over the rows where ``valid``:

    * ``nll = -log p(z_{t+1}) / Z``: nats per latent dimension;
    * ``reward_loss = (r_hat - r_{t+1})^2``;
    * ``done_loss``: binary cross-entropy of ``done_logit`` against ``done_target`` with the
      positive (terminal) class weighted ``done_pos_weight``; ``done_acc``: the share of rows
      whose sign of ``done_logit`` matches the target.

    Args:
        log_prob: ``log p(z_{t+1})`` under the predicted mixture, summed over the ``Z = latent_dim``
            dimensions (:func:`~lightning_wm.nn.mdn.mdn_log_prob`).
        reward, reward_target: predicted and received reward on arriving at ``t+1``.
        done_logit, done_target: logit that the episode terminated at ``t+1``; float 0/1 target.
        valid: bool, the rows scored (``t+1`` in the same episode, past the burn-in).
    Returns:
        ``loss``, ``nll``, ``reward_loss``, ``done_loss``, ``done_acc`` (0-dim tensors).
    """
    weight = valid.float()
    count = weight.sum().clamp(min=1.0)
    nll = -(log_prob * weight).sum() / count / latent_dim
    reward_loss = ((reward - reward_target).square() * weight).sum() / count
    pos_weight = torch.tensor(done_pos_weight, device=done_logit.device)
    done_loss = (
        F.binary_cross_entropy_with_logits(done_logit, done_target, reduction="none", pos_weight=pos_weight) * weight
    ).sum() / count
    done_acc = (((done_logit > 0).float() == done_target).float() * weight).sum() / count
    loss = nll + reward_weight * reward_loss + done_weight * done_loss
    return {"loss": loss, "nll": nll, "reward_loss": reward_loss, "done_loss": done_loss, "done_acc": done_acc}


def episode_forward_mean(reward: Tensor, is_first: Tensor, horizon: int) -> Tensor:
    """The mean of the next ``horizon`` rewards of the same episode, ``[B, L]``.

    Row ``t`` becomes ``mean(reward[t : t + n])`` with ``n <= horizon`` the rows up to the end of
    the window or the next episode's first row (``is_first``), whichever comes first. Over an
    episode its sum differs from the rewards' only near the end (each reward is counted once,
    spread over the ``horizon`` rows before it): a target for a reward head whose per-step
    reward is mostly noise (CarRacing's tile bonus), with the same total.

    Args:
        reward: ``[B, L]``; is_first: bool ``[B, L]``; horizon: ``>= 1`` (1: ``reward`` itself).
    """
    length = reward.shape[1]
    total, count = reward.clone(), torch.ones_like(reward)
    alive = torch.ones_like(is_first, dtype=torch.bool)
    for j in range(1, min(horizon, length)):
        alive[:, : length - j] &= ~is_first[:, j:]
        ahead = alive[:, : length - j]
        total[:, : length - j] += torch.where(ahead, reward[:, j:], torch.zeros_like(reward[:, j:]))
        count[:, : length - j] += ahead.to(reward.dtype)
    return total / count
