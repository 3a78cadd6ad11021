"""The pairer: each recorded turn joined with its next state (the user's next message or the tools' results)."""
