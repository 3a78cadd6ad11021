"""``turnstream engine``: the real SGLang server, launched with the flags this machine needs (see launch.py)."""
