"""pallas_kernels package."""
