"""Who may read what: erasure by destroying keys, owner-only files, secrets made on first use, and which bind
addresses reach only this machine."""
