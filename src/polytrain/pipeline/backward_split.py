"""A stage's backward in two halves, I (input gradient) then W (weight gradients), computing each
gradient once: Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), section 2.

[Note: weight gradients from the consumers] The input gradient is what the previous stage waits
for; the weight gradients only the optimizer needs. `backward_input` walks the stage's graph
from its output (or loss) once and finds, for every parameter, its *intermediates*: the first
nodes above it that also lie on a path from the output to the stage's input (for a linear
layer, the ``addmm`` that consumes both the layer's input and its weight). It hooks them, runs
``torch.autograd.grad`` with respect to the input only (the graph is kept) and the hooks record
the gradient reaching each intermediate. `backward_weight` later starts from those recorded
gradients (``GradientEdge`` outputs) and asks for the parameters only, one call per group of
parameters that share intermediates, so it runs just the weight-gradient half of each
consumer (the ``mm`` for the weight) and never walks the activation-gradient path again.
This is the split of `torch.distributed.pipelining`'s ``stage_backward_input`` /
``stage_backward_weight``.

Two cases need care. A parameter used twice on the input's path (shared weights) has two
intermediates, and the later one reaches the earlier one: while W runs, a pre-hook pins each
intermediate's gradient to the recorded value, so the path between them is not counted twice.
A parameter whose gradient does not flow through the input's path (every parameter of a stage
whose input needs no gradient, i.e. the first stage) has no intermediate: W computes it with a
plain ``backward`` from the output, restricted to those parameters. The gradients are a full
``backward``'s (`tests/unit/test_backward_split.py` checks both cases and that W leaves the
activation-gradient path alone).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["PendingWeights", "backward_input", "backward_weight"]

Grads = tuple[torch.Tensor | None, ...]


@dataclass
class _Group:
    """Parameters that share intermediates, and the gradients I recorded at them."""

    params: list[torch.Tensor]
    intermediates: list[Node]
    grads: dict[Node, Grads] = field(default_factory=dict)


@dataclass
class PendingWeights:
    """What W needs of one stage's micro-batch after its I: the groups, the parameters
    without intermediates, and the output to run their plain backward from."""

    root: torch.Tensor
    root_grad: torch.Tensor | None
    groups: list[_Group]
    rest: list[torch.Tensor]


def _parents(root: Node) -> dict[Node, list[Node]]:
    """Every node of ``root``'s graph -> the nodes that take its gradient from (its users)."""
    parents: dict[Node, list[Node]] = {root: []}
    queue = deque([root])
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                queue.append(child)
            parents[child].append(node)
    return parents


def _above(start: Iterable[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """``start`` and every node a path from the root to ``start`` passes through."""
    seen = set(start)
    queue = deque(seen)
    while queue:
        for parent in parents[queue.popleft()]:
            if parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return seen


def _intermediates(node: Node, on_path: set[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """The first nodes on ``on_path`` above a parameter's node ``node``."""
    found: set[Node] = set()
    seen = {node}
    queue = deque([node])
    while queue:
        for parent in parents[queue.popleft()]:
            if parent in on_path:
                found.add(parent)
            elif parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return found


def _groups(
    params: Sequence[torch.Tensor], on_path: set[Node], parents: dict[Node, list[Node]]
) -> tuple[list[_Group], list[torch.Tensor]]:
    """Parameters grouped by shared intermediates; those without any (and used) apart."""
    by_node: dict[Node, _Group] = {}
    rest: list[torch.Tensor] = []
    for param in params:
        node = get_gradient_edge(param).node
        if node not in parents:  # not used by this micro-batch's graph: no gradient
            continue
        found = _intermediates(node, on_path, parents)
        if not found:
            rest.append(param)
            continue
        group = _Group([param], sorted(found, key=id))
        for other in {id(g): g for n in found if (g := by_node.get(n)) is not None}.values():
            group.params += other.params
            group.intermediates += [n for n in other.intermediates if n not in found]
        for n in group.intermediates:
            by_node[n] = group
    unique = {id(g): g for g in by_node.values()}
    return list(unique.values()), rest


def backward_input(
    root: torch.Tensor,
    root_grad: torch.Tensor | None,
    x: torch.Tensor | None,
    params: Sequence[torch.Tensor],
) -> tuple[torch.Tensor | None, PendingWeights]:
    """I: the gradient of ``x`` (None when it needs none), keeping what W needs; see
    [Note: weight gradients from the consumers]."""
    if x is None or not x.requires_grad or root.grad_fn is None:
        return None, PendingWeights(root, root_grad, [], list(params))
    parents = _parents(root.grad_fn)
    x_node = get_gradient_edge(x).node
    if x_node not in parents:  # the output does not depend on the input
        return torch.zeros_like(x), PendingWeights(root, root_grad, [], list(params))
    groups, rest = _groups(params, _above([x_node], parents), parents)
    handles = []
    for group in groups:
        for node in group.intermediates:

            def record(grads: Grads, group: _Group = group, node: Node = node) -> None:
                group.grads[node] = grads

            handles.append(node.register_prehook(record))
    try:
        (input_grad,) = torch.autograd.grad(
            root, [x], grad_outputs=root_grad, retain_graph=True, materialize_grads=True
        )
    finally:
        for handle in handles:
            handle.remove()
    return input_grad, PendingWeights(root, root_grad, groups, rest)


def backward_weight(pending: PendingWeights) -> None:
    """W: accumulate the weight gradients of an I's micro-batch into ``.grad``."""
    for group in pending.groups:
        edges: list[GradientEdge] = []
        grads: list[torch.Tensor] = []
        for node in group.intermediates:
            for i, g in enumerate(group.grads.get(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        if not edges:  # no gradient reached them: these parameters get none, as in backward
            continue
        pins = []
        if len(group.intermediates) > 1:  # a later intermediate reaches an earlier one
            for node in group.intermediates:
                saved = group.grads.get(node)
                if saved is not None:
                    pins.append(node.register_prehook(lambda _, saved=saved: saved))
        try:
            weight_grads = torch.autograd.grad(
                edges, group.params, grad_outputs=grads, retain_graph=True, allow_unused=True
            )
        finally:
            for pin in pins:
                pin.remove()
        for param, g in zip(group.params, weight_grads, strict=True):
            if g is not None:
                param.grad = g if param.grad is None else param.grad.add_(g)
    if pending.rest and pending.root.requires_grad:
        torch.autograd.backward(pending.root, grad_tensors=pending.root_grad, inputs=pending.rest)
