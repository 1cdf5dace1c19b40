"""What deploying the server needs beyond its answers (frontend process): draining on SIGTERM, the
probes routers read, Ray Serve."""
