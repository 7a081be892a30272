

# ---------------------------------------------------------------- --validate's statistics and choice

def test_mape_and_spearman_on_hand_checked_numbers():
    from minimind_parallel.planning.agreement import mape, ranks, spearman
    assert mape([110, 90], [100, 100]) == pytest.approx(10.0)
    assert ranks([3.0, 1.0, 2.0, 2.0]) == [4.0, 1.0, 2.5, 2.5]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    # one swap of neighbours among 4: 1 - 6 * 2 / (4 * 15) = 0.8
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)


def test_validate_takes_the_top_k_and_k_others_at_random():
    from minimind_parallel.tasks.plan import validation_layouts
    result = plan(WORK, GPU_PROFILES["H100"], device="cpu", budget_bytes=2**40)
    chosen = validation_layouts(result, 3, seed=1)
    assert chosen[:3] == result.fitting[:3] and len(chosen) == 6
    assert all(e in result.fitting[3:] for e in chosen[3:]) and len({id(e) for e in chosen}) == 6
    assert validation_layouts(result, 3, seed=1) == chosen
