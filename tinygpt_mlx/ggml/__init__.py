"""GGUF files (llama.cpp, ollama) run through mlx-lm's model classes: `load_gguf_model`,
`tokenizer_from_metadata`, the architecture table in `arch.py`."""
