"""The Anthropic Messages shape, ``POST /v1/messages``: an adapter onto the chat turn (shapes, events)."""
