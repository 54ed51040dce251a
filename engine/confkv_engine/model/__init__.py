"""The model room: Llama-family decoder, weights, GGUF and Hugging Face loaders, tokenizers.

Owns nothing mutable at serving time. Imports only torch, numpy and the tokenizer libraries; nothing
else of the engine (the attention backend is a protocol it calls, ``llama.AttentionBackend``).
"""
