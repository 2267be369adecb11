"""The doors into the engine: the OpenAI-compatible HTTP server and scripted batch generation."""
