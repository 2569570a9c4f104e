from nexrl.distributed.execute import ModuleDiedError, execute, execute_async, resolve

__all__ = ["ModuleDiedError", "execute", "execute_async", "resolve"]
