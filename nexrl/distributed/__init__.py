from nexrl.distributed.execute import execute, execute_async, resolve

__all__ = ["execute", "execute_async", "resolve"]
