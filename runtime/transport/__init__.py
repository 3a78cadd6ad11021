"""HTTP and Redis plumbing shared by the services: the engine connection pool, the lean uvicorn server, SSE
splitting, and a pipelined Redis client for the proxy's turn numbers."""
