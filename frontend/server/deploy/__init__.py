"""Ways to deploy the server beyond `coreserve serve` (frontend process): Ray Serve."""
