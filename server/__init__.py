"""OpenAI-compatible HTTP server and command line."""
