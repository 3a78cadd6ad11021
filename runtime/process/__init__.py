"""Starting services as subprocesses and supervising a run's stages."""
