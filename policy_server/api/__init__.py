"""The policy server's HTTP surface: OpenAI chat routes, admin routes, key checks and the OpenAI shapes."""
