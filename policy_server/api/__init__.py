"""The policy server's HTTP surface, one subpackage per API shape (``chat/``, ``responses/``, ``messages/``), the
trainer's lease protocol (``lease.py``), the ops, admin and feedback routes, and what they share (keys, the JSON
body, the OpenAI field and error shapes, the response models)."""
