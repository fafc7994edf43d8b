"""The OpenAI-compatible routes: `requests` parses, `answers` builds JSON and SSE, `tools` handles tool calls."""
