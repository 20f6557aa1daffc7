"""Batched Monte-Carlo tree search over a learned model (MuZero; Gumbel MuZero at the root).

* :mod:`.policies` — the search as policy functions in mctx's manner: :func:`muzero_policy`
  (PUCT) and :func:`gumbel_muzero_policy` from a :class:`Root` over one :class:`SearchSettings`,
  returning a :class:`PolicyOutput`;
* :mod:`.forest` — the trees in flat tensors (and the discount), selection, expansion, backup;
* :mod:`.captured` — the PUCT simulation loop as one CUDA graph per search shape;
* :mod:`.rules` — PUCT and Gumbel MuZero's selection;
* :mod:`.draws` — noise and the sampled action (one optional generator);
* :mod:`.settings` — :class:`SearchSettings` (the agents' ``search`` group), :class:`TemperatureSchedule`.

The whole forest lives in a few tensors on the device of the root inputs: ``B`` trees (one per
environment) of ``num_simulations + 1`` nodes each. A simulation scores the children of every
node of all ``B`` trees at once, finds each tree's leaf by pointer doubling (no loop over tree
levels, no host synchronisation in the simulation loop), expands one new node per tree with one
batched ``recurrent_fn`` call and backs the values up all ``B`` paths at once. Nothing here knows
the networks.

Tree conventions (what the per-node reference search in the tests implements too):

* Every expanded node counts its own evaluation as its first visit: the root starts with visit
  count 1 and value sum ``root_value``; a new leaf with 1 and its predicted value. So
  ``N(s) = 1 + sum_a N(s, a)`` everywhere, the root's value is the mean of its network value and
  the returns backed up through it, and the first selection at the root already uses the prior.
* ``Q(s, a) = r(s, a) + discount * V(child)`` with ``V = value_sum / visits``; a backup adds
  ``G_L = v(leaf)``, ``G_d = r_{d+1} + discount * G_{d+1}`` to the node at depth ``d`` and
  updates the min-max statistics with ``r(node) + discount * V(node)`` of every node on the path
  (the MuZero pseudocode's ``MinMaxStats``; no known bounds; values are left as they are until
  the maximum exceeds the minimum).
* PUCT (MuZero): ``score(a) = Q_norm(s, a) + P(s, a) sqrt(N(s)) / (1 + N(s, a))
  * (pb_c_init + log((N(s) + pb_c_base + 1) / pb_c_base))``; ties go to the lowest action index.
  An unvisited child's ``Q_norm`` is set by ``unvisited_q``: ``"zero"`` (the MuZero
  pseudocode: the bottom of the normalised range, so where all values are alike the search stays
  with the first action it tried) or ``"mean"`` (the mean ``Q`` of the node's visited children,
  the node's own value ``V(s)`` before any, normalised the same way: EfficientZero's and
  LightZero's rule, close to mctx's ``qtransform_by_parent_and_siblings``), so an untried action
  counts as an average one and the prior decides.
* Legal-action masks apply at the root only (inside the tree the model has no notion of
  legality, as in MuZero). Dirichlet noise is mixed into the root prior over the legal actions.
* Gumbel MuZero (Danihelka et al., 2022): at the root, Gumbel-top-k over ``g + logits``
  with ``k = max_num_considered_actions`` and sequential halving over the simulation budget,
  ranking by ``g + logits + sigma(q)``; inside the tree the deterministic rule
  ``argmax(pi'(a) - N(s, a) / (1 + sum_b N(s, b)))`` with ``pi' = softmax(logits + sigma(q))``,
  ``q`` completed with the mixed value for unvisited actions and rescaled to ``[0, 1]`` over
  the node's actions, ``sigma(q) = (c_visit + max_b N(s, b)) * c_scale * q``. The policy target
  is ``pi'`` at the root.
"""

from lightning_wm.search.draws import dirichlet_noise, sample_gamma, sample_gumbel, select_action
from lightning_wm.search.policies import PolicyOutput, RecurrentFn, Root, gumbel_muzero_policy, muzero_policy
from lightning_wm.search.rules import considered_visit_sequence
from lightning_wm.search.settings import SearchSettings, TemperatureSchedule

__all__ = [
    "RecurrentFn",
    "Root",
    "PolicyOutput",
    "SearchSettings",
    "TemperatureSchedule",
    "muzero_policy",
    "gumbel_muzero_policy",
    "considered_visit_sequence",
    "dirichlet_noise",
    "sample_gamma",
    "sample_gumbel",
    "select_action",
]
