"""Layer 2 (toolkit): the patch stack - upstream pins and sources, the Tree, the series model,
apply/rebase, capture, status."""
