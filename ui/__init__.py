"""The Gradio chat UI (`vlmserve ui`)."""
