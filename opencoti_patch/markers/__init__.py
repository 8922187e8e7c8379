"""Layer 2: UPSTREAM_SYNC markers - syntax, lexers, audit, fix."""
