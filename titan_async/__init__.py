"""titan-async: bubble-free asynchronous pipeline-parallel pretraining on torchtitan."""

import os

# torch asks NVML, not the CUDA runtime, whether a GPU is there (read at each call, so any time
# before the first one will do): a process that has initialised the CUDA runtime cannot fork
# workers that use CUDA, and the launcher checks the run before it forks them.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

__version__ = "0.1.0"
