"""The OpenAI-compatible proxy that records every main-line turn, the pairer, and the weight reloader."""
