"""Q4_0 kernels. ``q4_0`` is the torch reference; fast paths share its signatures."""
