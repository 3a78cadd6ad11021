"""One validated configuration for every service, and the loader behind every extension point."""
