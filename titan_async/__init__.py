"""titan-async: bubble-free asynchronous pipeline-parallel pretraining on torchtitan."""

__version__ = "0.1.0"
