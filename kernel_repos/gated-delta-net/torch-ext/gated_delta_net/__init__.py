"""hubfuse gated delta rule (placeholder during development)."""
