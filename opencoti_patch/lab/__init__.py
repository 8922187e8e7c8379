"""Layer 6: the sparse-attention lab - what the series' block selection costs and keeps: the eval gates,
the selector tools on real prose, the decode benchmark, serving under load, layers on two devices.

It imports the toolkit (layers 1-5) and the toolkit never imports it; its commands are one group,
``opencoti-patch lab`` (``lab/cli/``, layer 8)."""
