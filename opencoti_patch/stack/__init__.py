"""Layer 2: the patch stack - upstream pins and sources, the Tree, the series model, apply/rebase, capture."""
