"""Judge workers: eval votes (did the turn work?) and hint votes (hindsight hints), OpenClaw-RL's semantics."""
