"""Training a native TinyGPT (PyTorch on CPU, exported to the MLX `.tinygpt` format).

torch is optional (`pip install 'posttrainllm[train]'`); it is imported only when training.
`run(TrainArgs(...))` trains or resumes and writes the `.tinygpt` file.
"""

from .loop import TrainArgs, lr_at, run  # noqa: F401
