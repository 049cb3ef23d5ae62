"""The optimizers: the `[optimizer]` section (`section`), Muon with batched Newton-Schulz, error
feedback, their torchtitan optimizer container, and learning-rate schedulers (`lr_schedule`)."""

from titan_async.optim.container import RoutedOptimizersContainer
from titan_async.optim.error_feedback import ErrorFeedback
from titan_async.optim.group_table import param_group_rows, write_param_group_table
from titan_async.optim.muon import Muon

__all__ = ["ErrorFeedback", "Muon", "RoutedOptimizersContainer", "param_group_rows", "write_param_group_table"]
