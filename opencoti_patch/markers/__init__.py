"""Layer 3 (toolkit): UPSTREAM_SYNC markers - syntax, lexers, audit, fix, resolve (reads stack/'s patch
model)."""
