"""Layer 4 (toolkit): reproducible builds - configure/build/stamp/manifest (builder), the logits harness
(harness: its one builder, for any harness source), the CI workflow (workflow)."""
