"""Request flow around the core: input processing, engine loop, output processing."""
