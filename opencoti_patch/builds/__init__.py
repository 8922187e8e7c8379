"""Layer 4 (toolkit): reproducible builds - configure/build (builder), the stamp, manifest and install
(stamp), the logits harness (harness: its one builder, for any harness source), the CI workflow (workflow)."""
