"""CPU dev engine speaking SGLang 0.5.23's HTTP protocol on a real transformers model (``hindsight-dev-engine``).

Modules by role: settings (config), cli (entry point), app (HTTP routes, auth, error mapping), service
(requests -> jobs -> SGLang JSON, control plane), openai_chat (/v1/chat/completions), protocol (validation and
response shapes), model_runner (forward passes, KV cache, n samples), sampling (logit processing), grammar
(xgrammar constrained decoding), control (pause/abort/update gating).
"""
