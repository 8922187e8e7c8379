"""Layer 4: quality gates of the sparse stack - eval, loadtest, bench."""
