"""posttrainllm's command line: one small typer module per command."""
