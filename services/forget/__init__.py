"""``turnstream forget``: erase people's sessions from everything turnstream keeps, and prove it."""
