"""Gradio chat UI (a later issue)."""
