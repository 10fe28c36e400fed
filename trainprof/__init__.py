"""trainprof: where the time of an LLM training step goes, measured on real engines."""

__version__ = "0.1.0"

__all__ = ["Profiler", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import trainprof` (CLI start-up, recipe validation) does not import torch.
    if name == "Profiler":
        from trainprof.profiler import Profiler

        return Profiler
    raise AttributeError(name)
