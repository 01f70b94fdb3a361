"""What the Python tests share: the reference in plain torch ops, the bounds,
the cases, transformers-shaped blocks and models, safetensors files, and the
programs some tests run in a process of their own (serve_vllm_run.py,
real_load_memory.py)."""
