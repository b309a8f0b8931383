"""Ways into the engine: the offline LLM class, the OpenAI server, the CLI."""
