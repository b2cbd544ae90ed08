"""OpenAI-compatible HTTP server: protocol (schemas), serving (endpoint logic), app (routes), scheduler, metrics."""
