"""Talking to SGLang: the shared client, the chat template rendered as the engine renders it, and the models
turnstream can fetch by itself."""
