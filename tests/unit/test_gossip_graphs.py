"""Peer graphs and mixing matrices (pure code, milliseconds)."""

from __future__ import annotations

import pytest

from polytrain.gossip.graphs import (
    graph_for_round,
    is_doubly_stochastic,
    mixing_matrix,
    round_plan,
    torus_shape,
)


def _mix(m: list[list[float]], values: list[float]) -> list[float]:
    return [sum(m[i][j] * values[j] for j in range(len(m))) for i in range(len(m))]


def test_ring_neighbours_and_uniform_weights() -> None:
    g = graph_for_round("ring", 5, 0)
    assert g.out[0] == (1, 4) and g.out[2] == (1, 3)
    m = mixing_matrix(g)
    assert m[0][0] == pytest.approx(1 / 3) and m[0][1] == pytest.approx(1 / 3)
    assert m[0][2] == 0.0
    assert is_doubly_stochastic(m)


def test_ring_of_two_has_one_neighbour_each() -> None:
    g = graph_for_round("ring", 2, 0)
    assert g.out == ((1,), (0,))
    assert mixing_matrix(g) == [[0.5, 0.5], [0.5, 0.5]]


def test_torus_shape_is_the_most_square_factorization() -> None:
    assert torus_shape(4) == (2, 2)
    assert torus_shape(12) == (3, 4)
    assert torus_shape(16) == (4, 4)
    assert torus_shape(7) is None
    assert torus_shape(2) is None
    with pytest.raises(ValueError, match="r x c"):
        graph_for_round("torus", 7, 0)


def test_torus_neighbours_wrap_around() -> None:
    g = graph_for_round("torus", 9, 0)  # 3 x 3
    assert g.out[0] == (1, 2, 3, 6)
    assert g.out[4] == (1, 3, 5, 7)
    assert is_doubly_stochastic(mixing_matrix(g))


def test_exponential_graph_is_directed_with_power_of_two_hops() -> None:
    g = graph_for_round("exponential", 8, 0)
    assert g.directed
    assert g.out[0] == (1, 2, 4)
    assert g.out[6] == (0, 2, 7)
    m = mixing_matrix(g)
    assert m[1][0] == pytest.approx(0.25)
    # Circulant: every in-degree equals every out-degree, so push-sum weights are not needed.
    assert is_doubly_stochastic(m)


def test_complete_graph_mixes_to_the_exact_average_in_one_round() -> None:
    m = mixing_matrix(graph_for_round("complete", 4, 0))
    values = [1.0, 2.0, 3.0, 10.0]
    assert _mix(m, values) == pytest.approx([4.0] * 4)


def test_random_peers_agree_across_ranks_and_change_each_round() -> None:
    a = graph_for_round("random", 8, 3, peers=2, seed=7)
    b = graph_for_round("random", 8, 3, peers=2, seed=7)  # another rank computing alone
    assert a == b
    assert all(len(out) == 2 and i not in out for i, out in enumerate(a.out))
    rounds = {graph_for_round("random", 8, t, peers=2, seed=7).out for t in range(10)}
    assert len(rounds) > 1
    assert graph_for_round("random", 8, 3, peers=2, seed=8) != a


def test_random_peers_use_push_sum_weights() -> None:
    for t in range(20):
        m = mixing_matrix(graph_for_round("random", 6, t, peers=2, seed=0))
        for j in range(6):  # every column sums to 1: the total of x (and of w) is preserved
            assert sum(m[i][j] for i in range(6)) == pytest.approx(1.0)
    # Some round has uneven in-degrees, so the rows do not all sum to 1.
    assert any(
        not is_doubly_stochastic(mixing_matrix(graph_for_round("random", 6, t, peers=2)))
        for t in range(20)
    )


def test_push_sum_converges_to_the_average() -> None:
    n = 6
    x = [float(i * i) for i in range(n)]
    w = [1.0] * n
    target = sum(x) / n
    for t in range(60):
        m = mixing_matrix(graph_for_round("random", n, t, peers=1, seed=3))
        x, w = _mix(m, x), _mix(m, w)
    assert [xi / wi for xi, wi in zip(x, w, strict=True)] == pytest.approx([target] * n, rel=1e-6)


@pytest.mark.parametrize("topology", ["ring", "torus", "exponential", "complete"])
def test_repeated_mixing_reaches_consensus(topology: str) -> None:
    m = mixing_matrix(graph_for_round(topology, 8, 0))
    x = [float(i) for i in range(8)]
    for _ in range(200):
        x = _mix(m, x)
    assert x == pytest.approx([3.5] * 8, abs=1e-6)


def test_round_plans_are_consistent_between_senders_and_receivers() -> None:
    for topology in ("ring", "torus", "exponential", "random"):
        m = mixing_matrix(graph_for_round(topology, 6, 1, peers=2))
        plans = [round_plan(m, i) for i in range(6)]
        for i, plan in enumerate(plans):
            for peer, share in plan.send:
                assert i in plans[peer].recv
                assert share == m[peer][i]
            assert plan.keep + sum(s for _, s in plan.send) == pytest.approx(1.0)


def test_bad_graph_arguments_raise() -> None:
    with pytest.raises(ValueError, match="peers < 4"):
        graph_for_round("random", 4, 0, peers=4)
    with pytest.raises(ValueError, match="unknown topology"):
        graph_for_round("star", 4, 0)
