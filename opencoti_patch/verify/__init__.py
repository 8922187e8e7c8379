"""Layer 5 (toolkit): proving the series - verify-identical (identical: default-off, reproducible,
byte-identical where untouched), the check stage (check: each patch builds and passes its tests), and the
random-weight models the behaviour check runs (synth_gguf)."""
