"""Training the default model on the shapes world, and scoring it."""
