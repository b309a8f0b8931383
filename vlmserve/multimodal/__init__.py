"""Media loading, hashing and processing."""
