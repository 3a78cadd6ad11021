"""Rules several services must apply the same way: what clients wrap around a message, the majority of votes,
the served version under a gate, evaluation sets, and the simulated users with their questions."""
