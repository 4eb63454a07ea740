"""Hot ops of the engine, each with a PyTorch implementation that runs anywhere (CPU or CUDA) and is the
reference for future CUDA kernels (docs/kernels.md §1)."""
