"""jkv package."""
