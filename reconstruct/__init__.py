"""reconstruct package."""
