"""What every turnstream service shares, grouped by what it does. It imports ``schemas`` and itself, never a
service (tests/test_layout.py), so any service can use any of it without pulling in another service."""
