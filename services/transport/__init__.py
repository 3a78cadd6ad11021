"""HTTP plumbing shared by the services: the engine connection pool, the lean uvicorn server, SSE splitting."""
