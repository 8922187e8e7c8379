"""Layer 3: configure/build/stamp, verify-identical, the logits harness, test models."""
