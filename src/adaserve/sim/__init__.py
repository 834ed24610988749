"""GPU-scale discrete-event simulation of the serving loop (``adaserve simulate``).

- ``loop``: the event loop; calls the engine's policy objects and calibrator
- ``acceptance``: synthetic beam trees and target acceptance from a pair's statistics
- ``kernels``: the acceptance model's per-iteration loops, compiled (numba)
- ``roofline``: GPU spec + model config -> ``HardwareModel``
- ``presets``: A100-80GB / H100 / H200 with Llama-3.1-70B+3.2-1B and Qwen2.5-32B+0.5B
- ``cli``: the bench's workload and report options on a simulator backend

No torch here (the optional tokenizer for prompt lengths aside). See docs/simulator.md.
"""
