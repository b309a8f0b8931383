"""Reasoning models: where a thinking model's reasoning begins and ends, read from its
text (the OpenAI layer's `reasoning_content`) and from its tokens (the engine core's
grammar, which starts after the reasoning, and its thinking budget)."""
