"""addon package."""
