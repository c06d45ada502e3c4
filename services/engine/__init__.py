"""In-process engine: the scheduler and the worker's runner in one process, for offline batch
inference (`Engine(model_id).generate(prompts)`) and as the baseline the broker path is
measured against (`textgen bench --compare-inprocess`)."""

from services.engine.engine import Engine, Output

__all__ = ["Engine", "Output"]
