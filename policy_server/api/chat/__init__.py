"""The OpenAI chat-completions shape, ``POST /v1/chat/completions``: the route, the JSON answer and the SSE stream."""
