"""The OpenAI-compatible proxy that records every main-line turn, and the weight reloader."""
