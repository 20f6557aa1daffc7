"""bench/learner_speed.py's op count: hand-counted steps, multi-tensor ops counted as one launch."""

import collections

import torch

from support.bench_scripts import load_bench_script

learner_speed = load_bench_script("learner_speed.py")


def test_each_kernel_running_op_counts_once_and_views_not_at_all():
    a, b, c = torch.randn(4, 3), torch.randn(4, 3), torch.randn(3, 4)

    def step() -> None:
        x = (a + b).t()  # add: 1; t: a view
        torch.mm(x, c.t())  # mm: 1 (the transposes are views)
        x.reshape(-1).sum()  # reshape of a non-contiguous tensor copies: 1; sum: 1

    kernels, events = learner_speed.dispatched_ops(step)
    assert kernels == 4
    assert events >= kernels


def test_a_multi_tensor_op_counts_as_one_launch_whatever_its_cpu_loop():
    tensors = [torch.randn(5) for _ in range(7)]

    def step() -> None:
        torch._foreach_mul_(tensors, 2.0)  # on the CPU a loop of 7 mul_; on CUDA one launch
        torch.nn.utils.get_total_norm(tensors)  # _foreach_norm: 1; the norm of the stacked norms: stack + norm

    kernels, _ = learner_speed.dispatched_ops(step)
    assert kernels == 4


def test_kernels_by_name_add_up_to_the_count_and_name_the_op_around_a_copy():
    a, b, c = torch.randn(4, 3), torch.randn(3, 5), torch.randn(5)

    def step() -> None:
        torch.addmm(c, a, b)  # the CPU's addmm copies the bias into its output: one copy_ inside addmm
        (a + a).neg()  # add: 1; neg: 1

    names: collections.Counter = collections.Counter()
    kernels, _ = learner_speed.dispatched_ops(step, names)
    assert sum(names.values()) == kernels == 3
    assert names["aten::copy_ in aten::addmm"] == 1
    assert names["aten::add"] == names["aten::neg"] == 1
