"""Data formats below every other layer: kernels, transports and the MoE layer all read them."""
