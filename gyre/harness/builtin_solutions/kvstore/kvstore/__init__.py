from .store import Store

__all__ = ["Store"]
