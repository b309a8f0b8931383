"""Model execution: persistent batch, model runner, sampler."""
