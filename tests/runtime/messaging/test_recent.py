from runtime.messaging.recent import RecentKeys


def test_remembers_up_to_capacity_and_forgets_the_oldest() -> None:
    keys = RecentKeys(capacity=3)
    for k in "abcd":
        keys.add(k)
    assert "a" not in keys and all(k in keys for k in "bcd")
    keys.add("b")  # re-adding refreshes it
    keys.add("e")
    assert "c" not in keys and "b" in keys and "e" in keys
