"""The OpenAI Responses shape, ``POST /v1/responses``: an adapter onto the chat turn (shapes, output items, events)."""
