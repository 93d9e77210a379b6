"""OpenAI-compatible HTTP frontend (`moebus openai`): protocol translation and the server."""
