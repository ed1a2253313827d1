"""Node service tests (package, so its conftest and helpers do not shadow the top-level ones)."""
