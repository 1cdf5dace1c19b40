"""Model definitions and weight loading (engine-core process)."""
